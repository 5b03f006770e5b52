"""Bayesian multiclass (softmax) logistic regression, in numpy ``float64`` (paper §4, S5.2).

Parameters: ``θ`` is the row-major flattening of a ``(p + 1) × K`` matrix ``W``: rows
``0..p−1`` are the feature weights, row ``p`` the biases, so the logits of ``x ∈ R^p`` are
``[x, 1] · W``. Per example, ``U_ij(θ) = −log softmax([x_ij, 1] W)_{y_ij}
= logsumexp(z) − z_y``, with gradient ``[x, 1]ᵀ (softmax(z) − e_y)``.

The binary case uses the same model with ``K = 2`` (over-parametrised, but the Gaussian
prior makes the posterior proper; with a flat prior it is not).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qlsd_flwr.core.potential import GaussianPrior, Task


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _logsumexp(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=1)
    return m + np.log(np.exp(z - m[:, None]).sum(axis=1))


class LogisticLocal:
    """One client's ``U_i^data(θ) = Σ_j −log p(y_ij | x_ij, θ)`` (a ``LocalPotential``)."""

    def __init__(self, X: np.ndarray, y: np.ndarray, n_classes: int):
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2:
            X = X.reshape(len(X), -1)
        self.Xa = np.ascontiguousarray(np.hstack([X, np.ones((len(X), 1))]))
        self.y = np.asarray(y, dtype=np.int64)
        if len(self.y) != len(X):
            raise ValueError(f"X has {len(X)} rows but y has {len(self.y)}")
        self.n_classes = int(n_classes)
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.n_classes):
            raise ValueError(f"labels must lie in [0, {self.n_classes})")
        self.n_features = X.shape[1]
        self.n_data = int(len(self.y))
        self.dim = (self.n_features + 1) * self.n_classes

    def _W(self, theta: np.ndarray) -> np.ndarray:
        theta = np.asarray(theta, dtype=np.float64)
        if theta.shape != (self.dim,):
            raise ValueError(f"theta must have shape ({self.dim},), got {theta.shape}")
        return theta.reshape(self.n_features + 1, self.n_classes)

    def _rows(self, idx):
        if idx is None:
            return self.Xa, self.y
        idx = np.asarray(idx, dtype=np.int64)
        return self.Xa[idx], self.y[idx]

    def grad_sum(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        Xa, y = self._rows(idx)
        r = _softmax(Xa @ self._W(theta))
        r[np.arange(len(y)), y] -= 1.0
        return (Xa.T @ r).ravel()

    def values(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """The per-example ``U_ij(θ)`` (negative log-likelihoods)."""
        Xa, y = self._rows(idx)
        z = Xa @ self._W(theta)
        return _logsumexp(z) - z[np.arange(len(y)), y]

    def value(self, theta: np.ndarray) -> float:
        return float(self.values(theta).sum())


def logits(theta: np.ndarray, X: np.ndarray, n_classes: int) -> np.ndarray:
    """``[X, 1] · W(θ)`` for one ``θ``."""
    X = np.asarray(X, dtype=np.float64).reshape(len(X), -1)
    W = np.asarray(theta, dtype=np.float64).reshape(X.shape[1] + 1, n_classes)
    return X @ W[:-1] + W[-1]


def predict_proba(theta_samples: np.ndarray, X: np.ndarray, n_classes: int | None = None,
                  chunk: int | None = None) -> np.ndarray:
    """Posterior predictive ``(1/S) Σ_s softmax([X, 1] W(θ_s))``, shape ``(n, K)``.

    ``theta_samples`` is ``(d,)``, ``(S, d)`` or ``(chain, draw, d)``; ``n_classes`` defaults to
    ``d / (p + 1)``.
    """
    X = np.asarray(X, dtype=np.float64).reshape(len(X), -1)
    th = np.asarray(theta_samples, dtype=np.float64)
    th = th.reshape(-1, th.shape[-1])
    p1 = X.shape[1] + 1
    if n_classes is None:
        if th.shape[1] % p1:
            raise ValueError(f"parameter size {th.shape[1]} is not a multiple of p + 1 = {p1}")
        n_classes = th.shape[1] // p1
    out = np.zeros((len(X), n_classes))
    if chunk is None:  # samples per batch: keep the (s, n, K) logits under ~16M floats
        chunk = max(1, int(16_000_000 // max(1, len(X) * n_classes)))
    for s0 in range(0, len(th), chunk):
        W = th[s0:s0 + chunk].reshape(-1, p1, n_classes)  # (s, p+1, K)
        z = np.einsum("np,spk->snk", X, W[:, :-1]) + W[:, -1][:, None, :]
        z -= z.max(axis=2, keepdims=True)
        e = np.exp(z)
        out += (e / e.sum(axis=2, keepdims=True)).sum(axis=0)
    return out / len(th)


def build_logistic_task(dataset: Any = "breast_cancer", b: int = 10, partition: str = "iid",
                        prior_var: float = 2e-2, seed: int = 0, pooled: bool = False,
                        partition_kw: dict | None = None, dataset_kw: dict | None = None) -> Task:
    """A federated Bayesian logistic regression ``Task``.

    ``dataset``: an :class:`~qlsd_flwr.data.datasets.ArrayDataset` or a name for
    :func:`qlsd_flwr.data.datasets.load_dataset` (with ``dataset_kw``). ``partition``: a name for
    :func:`qlsd_flwr.data.partition.make_partition` (with ``partition_kw``), or ``"natural"`` for
    the dataset's own clients (synthetic, FEMNIST; then ``b`` must match or be ``None``).
    ``prior_var`` is the variance of the ``N(0, prior_var·I)`` prior (paper: ``2e−2``;
    ``inf`` = flat). ``pooled=True`` puts all data on one client (SGLD baseline), keeping
    the partition description in ``meta``.
    """
    from qlsd_flwr.data import datasets as _data
    from qlsd_flwr.data import partition as _partition

    ds = dataset if isinstance(dataset, _data.ArrayDataset) else \
        _data.load_dataset(str(dataset), **(dataset_kw or {}))
    if partition == "natural":
        if ds.natural_partition is None:
            raise ValueError(f"dataset {ds.name!r} has no natural client split; pick one of "
                             f"{', '.join(_partition.PARTITIONS)}")
        parts = ds.natural_partition
        if b is not None and b != len(parts):
            raise ValueError(f"dataset {ds.name!r} has {len(parts)} natural clients, got b={b}")
    else:
        parts = _partition.make_partition(partition, ds.y_train, int(b), seed=seed,
                                          **(partition_kw or {}))
    K = ds.n_classes
    if pooled:
        allix = np.sort(np.concatenate(parts))
        clients = [LogisticLocal(ds.X_train[allix], ds.y_train[allix], K)]
    else:
        clients = [LogisticLocal(ds.X_train[ix], ds.y_train[ix], K) for ix in parts]
    d = (ds.n_features + 1) * K
    return Task(
        name="logistic", dim=d, clients=clients, prior=GaussianPrior(var=float(prior_var)),
        theta_star=None, theta0=np.zeros(d),
        meta={
            "dataset": ds.name, "dataset_summary": ds.summary(), "n_classes": K,
            "n_features": ds.n_features, "partition": partition, "seed": seed,
            "partition_description": _partition.describe(parts, ds.y_train),
            "X_test": ds.X_test, "y_test": ds.y_test, "blocks": (d,), "pooled": pooled,
        },
    )
