"""A finished run's convergence verdict recomputed from its files (:func:`qlsd_flwr.convergence_report`),
with the rules the run itself applied (:mod:`qlsd_flwr.outputs.convergence`): θ's coordinates from the
``posterior`` group, the held-out predictive from ``heldout_log_likelihood`` where an evaluation wrote
it, the criterion from the run's ``config.json`` beside the file (or the caller's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from qlsd_flwr.outputs import convergence as cv
from qlsd_flwr.outputs.loo import HELDOUT


class ReportError(ValueError):
    """The path is not a run folder or a ``samples.nc`` this package can read; the message names it."""


def _read(nc: Path) -> tuple[np.ndarray, list | None, np.ndarray | None]:
    """``(draws (draw, chain, d), labels, held-out log-likelihood (chain, draw, point) or None)``."""
    import h5netcdf

    try:
        with h5netcdf.File(nc, "r") as f:
            if "posterior" not in f.groups or "theta" not in f["posterior"].variables:
                raise ReportError(f"{nc}: no posterior group with a 'theta' variable (chain, draw, d)")
            post = f["posterior"]
            theta = np.asarray(post["theta"][...], dtype=np.float64)
            if theta.ndim != 3:
                raise ReportError(f"{nc}: posterior 'theta' has shape {theta.shape}; expected (chain, draw, d)")
            names = post.variables.get("theta_dim_0")
            labels = None
            if names is not None and np.asarray(names[...]).dtype.kind in "OUS":
                labels = [str(x) for x in np.asarray(names[...])]
            ll = None
            if HELDOUT in f.groups and "y" in f[HELDOUT].variables:
                ll = np.asarray(f[HELDOUT]["y"][...], dtype=np.float64)
                if ll.ndim != 3 or ll.shape[:2] != theta.shape[:2]:
                    raise ReportError(f"{nc}: group {HELDOUT!r} has shape {ll.shape}; expected (chain, draw, "
                                      f"test point) with {theta.shape[:2]} chains and draws")
    except ReportError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReportError(f"{nc}: not a samples.nc this package can read ({type(exc).__name__}: {exc})") from None
    return np.transpose(theta, (1, 0, 2)), labels, ll


def convergence_report(path: str | os.PathLike, criterion: str | None = None) -> dict:
    """The convergence verdict of a finished run, recomputed from its files.

    Parameters
    ----------
    path : str or path-like
        A run folder (its ``samples.nc`` and, when there, ``config.json``), or a ``samples.nc`` alone
        (chains merged or moved by hand: any file with a ``posterior`` group holding ``theta`` as
        ``(chain, draw, d)``).
    criterion : {"theta", "predictive", "auto"}, optional
        Which quantity the verdict reads. Default: the run's ``convergence-criterion`` from the
        ``config.json`` beside the file (``auto``: the predictive for torch networks), else ``theta``.

    Returns
    -------
    dict
        The report the run writes as ``summary.json``'s ``convergence``: ``verdict`` (``MIXED``,
        ``NOT MIXED`` or ``NOT CHECKED``), ``criterion``, ``message``, θ's worst R-hat and smallest
        bulk/tail ESS (``rhat_max``, ``ess_bulk_min``, ``ess_tail_min``), the coordinates whose R-hat
        is undefined, whether ``‖θ‖`` (and the held-out log-likelihood) still trends, and, where an
        evaluation wrote ``heldout_log_likelihood``, the predictive's R-hat and ESS. The rules:
        R-hat ≤ 1.05, bulk and tail ESS ≥ 100, no undefined R-hat, no trend
        (:mod:`qlsd_flwr.outputs.convergence`).

    Raises
    ------
    ReportError
        The path holds no readable ``samples.nc`` (the message names the file), or ``criterion`` is
        not one of the allowed values.

    Examples
    --------
    >>> import qlsd_flwr                                                    # doctest: +SKIP
    >>> qlsd_flwr.convergence_report("outputs/my-run")["verdict"]          # doctest: +SKIP
    'MIXED'
    """
    p = Path(path)
    nc = p / "samples.nc" if p.is_dir() else p
    if not nc.is_file():
        raise ReportError(f"{nc}: no such file (give a run folder or its samples.nc)")
    raw: dict = {}
    cfg = nc.parent / "config.json"
    if cfg.is_file():
        try:
            raw = dict(json.loads(cfg.read_text()).get("config") or {})
        except (OSError, ValueError, TypeError, AttributeError):
            raw = {}
    if criterion is not None:
        c = str(criterion).strip().lower()
        if c not in ("theta", "predictive", "auto"):
            raise ReportError(f"criterion: {criterion!r}; allowed: theta, predictive, auto")
        raw["convergence-criterion"] = c
    draws, labels, ll = _read(nc)
    rep = cv.theta_report(draws, labels, dispersed=str(raw.get("init", "")) == "dispersed")
    if rep.get("verdict") == "NOT CHECKED":
        return cv.verdict(rep)
    predictive = None
    if ll is not None:
        tr = cv.trend(ll.sum(axis=2))
        rep["loglik_trend_z"] = tr["z_max"]
        rep["stationary"] = bool(rep.get("stationary", True)) and not tr["trending"]
        predictive = cv.predictive(ll)
    return cv.verdict(rep, predictive, cv.criterion_for(raw), raw)
