"""Ablation (issue 15): would a compiled logistic gradient close the gap to JAX?

The vectorised engine's batched logistic oracle is held to numpy's operations (one BLAS call per
product, numpy's ``exp``) so that its chains equal every other engine's bit for bit. This
script swaps ``LogisticLocal.grad_sum_clients`` for the compiled kernel's gradient
(``kernel._logistic_grad_rows``: libm's ``exp``, its own summation order; equal to about 4e-16
relative, not bitwise) and measures the engine's rate both
ways, alternating, on the configurations of ``bench_logistic.py`` (8 chains, one thread). It is
not part of the package: it answers whether that contract is what costs the speed.

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/ablation_compiled_logistic.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numba import njit

from qlsd_flwr.engines.vectorised.kernel import _logistic_grad_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))


@njit(cache=True)
def _grads(Xa, y, offs, W, idx, idx_off, full, out):
    """out[g, a, c] = Σ_rows [x, 1]ᵀ (softmax([x, 1] W[a, c]) − e_y): the vectorised kernel's own
    logistic gradient (``kernel._logistic_grad_rows``) for every (client, set, chain)."""
    G, A, C = out.shape[0], out.shape[1], out.shape[2]
    K = W.shape[3]
    z = np.empty(K)
    for g in range(G):
        N = offs[g + 1] - offs[g]
        n = N if full[g] else (idx_off[g + 1] - idx_off[g]) // C
        for a in range(A):
            for c in range(C):
                sel = idx[idx_off[g] + c * n:idx_off[g] + (c + 1) * n]
                _logistic_grad_rows(Xa, y, offs[g], sel, n, full[g], W[a, c].ravel(), K, z, out[g, a, c])


_cache = {}


def grad_sum_clients_nb(pots, thetas, idxs):
    key = tuple(id(p) for p in pots)
    if key not in _cache:
        Xa = np.ascontiguousarray(np.concatenate([p.Xa for p in pots]))
        y = np.concatenate([p.y for p in pots])
        offs = np.concatenate([[0], np.cumsum([p.n_data for p in pots])]).astype(np.int64)
        _cache[key] = (Xa, y, offs)
    Xa, y, offs = _cache[key]
    th = np.ascontiguousarray(thetas, dtype=np.float64)
    A, C, d = th.shape
    p1, K = pots[0].n_features + 1, pots[0].n_classes
    full = np.array([ix is None for ix in idxs])
    parts = [np.asarray(ix, dtype=np.int64).ravel() for ix in idxs if ix is not None]
    sizes = [0 if ix is None else np.size(ix) for ix in idxs]
    idx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    idx_off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out = np.empty((len(pots), A, C, d))
    _grads(Xa, y, offs, th.reshape(A, C, p1, K), idx, idx_off, full, out)
    return out


def main() -> None:
    import bench_logistic as B

    from qlsd_flwr.tasks import loading
    from qlsd_flwr.tasks.logistic import LogisticLocal

    orig = LogisticLocal.grad_sum_clients
    for ds, b in B.CONFIGS:
        for v in B.VARIANTS:
            cfg = B.make_cfg(ds, b, v, 3000 if ds == "breast_cancer" else 600)
            task = loading.load_task(cfg)
            pots, gen = task.clients, np.random.default_rng(0)
            th = gen.normal(scale=0.1, size=(2, 8, task.dim))
            idxs = [np.sort(np.stack([gen.choice(p.n_data, max(1, p.n_data // 10), replace=False)
                                      for _ in range(8)]), axis=1) for p in pots]
            ref, new = orig(pots, th, idxs), grad_sum_clients_nb(pots, th, idxs)
            rates: dict = {"numpy (bitwise)": [], "numba gradient": []}
            for name, fn in [("numpy (bitwise)", orig), ("numba gradient", grad_sum_clients_nb)] * 2:
                LogisticLocal.grad_sum_clients = staticmethod(fn)
                try:
                    B.engine_warmup(cfg, task, True)
                    rates[name] += [B.engine_rate(cfg, task, True) for _ in range(3)]
                finally:
                    LogisticLocal.grad_sum_clients = orig
            med = {k: float(np.median(x)) for k, x in rates.items()}
            print(f"{ds} b={b} {v}: chain-it/s {med}, numba/numpy "
                  f"{med['numba gradient'] / med['numpy (bitwise)']:.2f}, max relative difference "
                  f"{np.abs(ref - new).max() / np.abs(ref).max():.1e}", flush=True)


if __name__ == "__main__":
    main()
