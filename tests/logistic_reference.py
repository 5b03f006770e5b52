"""The committed MALA reference for Bayesian logistic regression on breast cancer.

The target: ``task = logistic`` on scikit-learn's breast cancer data (455 training points,
30 standardised features, 2 classes, so ``d = 62``), prior ``N(0, 2e−2 I)`` (the paper's),
split over ``num-clients = 4`` clients by the registry's default Dirichlet(0.5) split,
``data-seed = 0``. The posterior does not depend on the split, but the cache key does (it
fingerprints every client's arrays), so the key pins the data exactly.

The reference: 8 MALA chains (:func:`qlsd_flwr.evaluation.reference.mala`, step tuned by dual averaging
towards acceptance 0.574), 2,000 warm-up + 25,000 kept iterations each. Stored in
``tests/data/breast_cancer_mala.npz``: the 99 % HPD threshold ``η`` (the 0.99 quantile of
``U`` over all 200,000 draws) and its Monte Carlo standard error (:func:`qlsd_flwr.evaluation.hpd.quantile_mcse`),
the posterior mean and variance of ``θ``, ``U`` at every 5th draw (float32), the acceptance
rates, the cache key (:func:`qlsd_flwr.evaluation.reference_cache.cache_key`), a float-tolerant signature of
the data and settings (:func:`data_signature`) and the settings.

Regenerate (about 2–3 minutes on one core)::

    .venv/bin/python tests/logistic_reference.py

A test that uses the file first recomputes the signature from the current code and data and
fails with this command if the two differ (the data, the split, the prior, the MALA settings or
the sampler's cache version changed). The byte-exact cache key is stored as well
(``load()["bitwise_same_data"]`` says whether it still matches).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.evaluation import reference as R  # noqa: E402
from qlsd_flwr.evaluation import reference_cache as RC  # noqa: E402
from qlsd_flwr.tasks import loading  # noqa: E402

PATH = Path(__file__).resolve().parent / "data" / "breast_cancer_mala.npz"
TASK_CFG = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "data-seed": 0,
            "prior-var": 0.02}
MALA_SETTINGS = {"n_draws": 25_000, "n_warmup": 2_000, "n_chains": 8, "seed": 0}
COMMAND = ".venv/bin/python tests/logistic_reference.py"


def build_task(extra: dict | None = None):
    return loading.load_task(resolve({**TASK_CFG, **(extra or {})}))


def _mala_settings() -> dict:
    s = dict(MALA_SETTINGS)
    return R._settings(n_draws=s["n_draws"], n_warmup=s["n_warmup"], n_chains=s["n_chains"],
                       seed=s["seed"], step_size=None, adapt=True, target_accept=0.574, thin=1,
                       init=None, init_scale=0.1, store_dtype=np.dtype(np.float64).str)


def expected_key(task) -> str:
    """The key :func:`qlsd_flwr.evaluation.reference.mala` files these settings under (code + data, bytes)."""
    return RC.cache_key(task, "mala", _mala_settings())


def data_signature(task) -> dict:
    """What pins the target without depending on the last bit of a float (a CI machine with
    another SIMD width may standardise the features a few ulps differently, which changes
    :func:`expected_key` but not the posterior): exact integers (client sizes, labels, the
    sampler's cache version and settings) and per-client column sums of ``[X, 1]`` and of its
    square (compared with ``rtol = 1e-9``)."""
    import hashlib

    h = hashlib.sha256()
    h.update(json.dumps({"version": RC._CACHE_VERSION, "settings": RC._json_settings(_mala_settings()),
                         "prior_var": float(task.prior.var), "dim": int(task.dim),
                         "n": [int(c.n_data) for c in task.clients]}, sort_keys=True).encode())
    for c in task.clients:
        h.update(np.ascontiguousarray(c.y, dtype=np.int64).tobytes())
    sums = np.concatenate([np.concatenate([c.Xa.sum(axis=0), (c.Xa ** 2).sum(axis=0)])
                           for c in task.clients])
    return {"exact": h.hexdigest(), "sums": sums}


def load(task=None) -> dict:
    """The stored reference; raises ``RuntimeError`` (with the command) if it is missing or was
    made for another target (see :func:`data_signature`)."""
    task = build_task() if task is None else task
    if not PATH.exists():
        raise RuntimeError(f"{PATH} is missing; make it with: {COMMAND}")
    with np.load(PATH, allow_pickle=False) as z:
        ref = {k: z[k] for k in z.files}
    sig = data_signature(task)
    stale = str(ref["sig_exact"]) != sig["exact"] or ref["sig_sums"].shape != sig["sums"].shape \
        or not np.allclose(ref["sig_sums"], sig["sums"], rtol=1e-9, atol=1e-9)
    if stale:
        raise RuntimeError(f"{PATH.name} was made for other data, settings or sampler code; "
                           f"regenerate it with: {COMMAND}")
    ref["bitwise_same_data"] = str(ref["key"]) == expected_key(task)
    return ref


def main() -> None:
    from qlsd_flwr.evaluation import hpd

    t0 = time.perf_counter()
    task = build_task()
    res = R.mala(task, **MALA_SETTINGS, cache=False)
    eta, se = hpd.quantile_mcse(res.potentials, 0.99)
    key = expected_key(task)
    sig = data_signature(task)
    PATH.parent.mkdir(parents=True, exist_ok=True)
    ess_u = res.diagnostics.get("ess_bulk_potential")
    np.savez_compressed(
        PATH, key=np.array(key), sig_exact=np.array(sig["exact"]), sig_sums=sig["sums"], eta99=np.array(eta), eta99_se=np.array(se),
        mean=res.mean, var=res.var, potentials_thin5=res.potentials[:, ::5].astype(np.float32),
        acceptance=res.acceptance, step_size=res.step_size,
        ess_bulk_potential=np.asarray(ess_u if ess_u is not None else np.nan),
        rhat_potential=np.asarray(res.diagnostics.get("rhat_potential", np.nan)),
        settings=np.array(json.dumps({**TASK_CFG, **MALA_SETTINGS})), command=np.array(COMMAND))
    print(f"wrote {PATH} in {time.perf_counter() - t0:.0f} s: eta99 = {eta:.4f} ± {se:.4f}, "
          f"acceptance {np.round(res.acceptance, 3)}, ESS(U) {ess_u}, "
          f"R-hat(U) {res.diagnostics.get('rhat_potential')}")


if __name__ == "__main__":
    main()
