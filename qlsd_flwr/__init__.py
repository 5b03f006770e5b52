"""qlsd_flwr: the QLSD family of federated Langevin samplers (Vono et al., AISTATS 2022) on Flower."""

import os
import tempfile
from pathlib import Path

from qlsd_flwr.jit import sources_hash

__version__ = "0.1.0"


def _numba_cache_dir() -> str:
    """Where numba caches this package's compiled kernels (``jit.py`` files each under a
    hash of the package's numba modules: numba checks a cached function against its own file
    only, not against the compiled functions it calls in other files, so an edit there would
    otherwise leave a stale kernel in the cache). Inside the package when writable (Ray
    workers then share it), else in the temporary folder."""
    here = Path(__file__).resolve().parent
    name = "numba-" + sources_hash(here)
    cache = here / "__pycache__"
    if os.access(here, os.W_OK) and (not cache.exists() or os.access(cache, os.W_OK)):
        return str(cache / name)
    return str(Path(tempfile.gettempdir()) / "qlsd_flwr" / name)


# before numba is first imported (a user's own NUMBA_CACHE_DIR is respected)
os.environ.setdefault("NUMBA_CACHE_DIR", _numba_cache_dir())


def convergence_report(path, criterion=None):
    """The convergence verdict of a finished run, recomputed from its files, with the run's own rules.

    Parameters
    ----------
    path : str or path-like
        A run folder, or a ``samples.nc`` alone (chains merged or moved by hand).
    criterion : {"theta", "predictive", "auto"}, optional
        Which quantity the verdict reads; default: the run's ``convergence-criterion`` (from the
        ``config.json`` beside the file), else ``theta``.

    Returns
    -------
    dict
        ``summary.json``'s ``convergence`` report: ``verdict`` (``MIXED`` / ``NOT MIXED`` /
        ``NOT CHECKED``), ``criterion``, ``message``, R-hat, bulk and tail ESS, the coordinates with an
        undefined R-hat, the trends, the held-out predictive's R-hat where an evaluation wrote it.
        MIXED needs R-hat ≤ 1.05, bulk and tail ESS ≥ 100, every R-hat defined and no trend.

    Raises
    ------
    qlsd_flwr.evaluation.verdict.ReportError
        No readable ``samples.nc`` at ``path`` (named), or a ``criterion`` not allowed.

    Examples
    --------
    >>> import qlsd_flwr                                                    # doctest: +SKIP
    >>> qlsd_flwr.convergence_report("outputs/my-run")["verdict"]          # doctest: +SKIP
    'MIXED'
    """
    from qlsd_flwr.evaluation.verdict import convergence_report as report

    return report(path, criterion)


def loo(path):
    """The federated leave-one-out of a finished run, as ``arviz.ELPDData`` (``az.compare``'s input).

    Parameters
    ----------
    path : str or path-like
        A run folder, or its ``samples.nc``.

    Returns
    -------
    arviz.ELPDData
        PSIS-LOO over the training points, pointwise (``elpd_loo``, ``se``, ``p_loo``, ``loo_i``,
        ``pareto_k``), from the clients' per-point values (``loo = psis``, the default) or ``az.loo``
        on the file's ``log_likelihood`` (``loo = pointwise``). Equal to ``az.loo`` on the pooled
        pointwise log-likelihood of the same draws, to float rounding.

    Raises
    ------
    qlsd_flwr.outputs.loo.LooError
        The file holds no LOO (``loo = off``, a potential without ``pointwise_log_lik``, or a client
        without a usable reply: ``summary.json``'s ``loo`` says which).

    Examples
    --------
    >>> import arviz as az, qlsd_flwr                                        # doctest: +SKIP
    >>> az.compare({"qlsd-pp": qlsd_flwr.loo("outputs/a"), "lsd-pp": qlsd_flwr.loo("outputs/b")})  # doctest: +SKIP
    """
    from qlsd_flwr.outputs.loo import load

    return load(path)


# predicting with a finished run (qlsd_flwr/evaluation/predict.py): imported when first asked for,
# so that ``import qlsd_flwr`` stays light (numpy only; torch only inside ``load_draw``)
_PREDICT = ("load_samples", "posterior_predictive", "load_draw", "predictive_metrics")


def __getattr__(name: str):
    if name in _PREDICT:
        from qlsd_flwr.evaluation import predict

        return getattr(predict, name)
    raise AttributeError(f"module 'qlsd_flwr' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_PREDICT])
