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

    log_concave = True  # log-sum-exp of an affine map of θ minus an affine one: convex

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

    def support(self) -> np.ndarray:
        """The coordinates the gradient reads (``core.potential.declared_support``): every weight of an input
        that is not 0 in all of this client's examples, and the biases; θ is the ``(F̃, K)`` matrix, row-major."""
        return np.repeat((self.Xa != 0).any(axis=0), self.n_classes)

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

    def curvature_diag(self, theta: np.ndarray) -> np.ndarray:
        """The Hessian's diagonal (exact: for softmax regression the Hessian is the Gauss–Newton
        matrix): ``Σ_j x̃_jf² p_jk (1 − p_jk)`` at coordinate ``(f, k)``."""
        p = _softmax(self.Xa @ self._W(theta))
        return ((self.Xa**2).T @ (p * (1.0 - p))).ravel()

    def kron_factors(self, theta: np.ndarray):
        """K-FAC's factors at ``θ`` (``metric = kronecker``): ``G = Σ_j x̃_j x̃_jᵀ``,
        ``A = Σ_j (diag p_j − p_j p_jᵀ)`` and the layout (θ is already the ``(F̃, K)`` matrix)."""
        p = _softmax(self.Xa @ self._W(theta))
        return self.Xa.T @ self.Xa, np.diag(p.sum(axis=0)) - p.T @ p, np.arange(self.dim)

    def kron_inputs(self, theta: np.ndarray):
        """``(X̃, P)``: the inputs with the bias's 1 and the softmax outputs at ``θ`` (``metric-block``'s report,
        :func:`qlsd_flwr.core.kron_block.block_report`)."""
        return self.Xa, _softmax(self.Xa @ self._W(theta))

    def hvp_batch(self, theta: np.ndarray, V: np.ndarray) -> np.ndarray:
        """``∇²U_i(θ) v`` for each row ``v`` of ``V`` (``(b, d)``; ``metric-rank``), exact: with
        ``Z = X̃ V_r`` (``V_r`` the row as a ``(F̃, K)`` matrix), row ``j`` of the product's inner factor
        is ``(diag p_j − p_j p_jᵀ) z_j``, then ``X̃ᵀ`` of it."""
        V = np.asarray(V, dtype=np.float64)
        p = _softmax(self.Xa @ self._W(theta))  # (n, K)
        Z = np.matmul(self.Xa, V.reshape(-1, self.n_features + 1, self.n_classes))  # (b, n, K)
        AZ = p * Z - p * np.sum(p * Z, axis=-1, keepdims=True)
        return np.matmul(self.Xa.T, AZ).reshape(V.shape[0], self.dim)

    def grad_sum_batch(self, thetas: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """:meth:`grad_sum` of many parameter vectors at once: ``thetas`` ``(C, d)``, ``idx``
        ``(C, n)`` (row ``c``: the minibatch of ``thetas[c]``) or ``None`` (all data) → ``(C, d)``.

        Row ``c`` equals ``grad_sum(thetas[c], idx[c])`` **bit for bit**, because it runs the
        same floating-point operations on the same numbers:

        * the two products are ``np.matmul`` over a stack of ``C`` matrices, and numpy's matmul
          loop makes, for each matrix of the stack, the very BLAS call the one-row ``@`` makes
          (``dgemm``, or ``dgemv`` / its own loop when a size is 1): the same sizes ``(n, p+1, K)``
          and ``(p+1, n, K)``, transposition flags and leading dimensions, which numpy derives from
          the inner two strides, the same here (C-contiguous ``Xa[idx]`` rows, its transpose, a
          C-contiguous ``(p+1, K)`` view of ``θ``, a fresh C-contiguous output). No BLAS call of
          another shape is made, so nothing depends on which kernel BLAS picks for a shape.
          (An ``einsum``, or one ``(C·n, p+1) @ (p+1, K)`` product for the full-data case, would
          call BLAS with other shapes and may sum in another order; it is not used.)
        * the softmax is :func:`_softmax` itself on the ``(C·n, K)`` logits: a row maximum, a
          subtraction, ``exp`` and a row sum over the same contiguous rows of ``K`` numbers
          (elementwise operations and per-row reductions do not depend on the other rows);
          subtracting 1 at the labels is exact bookkeeping of the same kind.

        ``tests/test_batched_oracles.py`` checks the equality on many random cases.
        """
        th = np.asarray(thetas, dtype=np.float64)
        if th.ndim != 2 or th.shape[1] != self.dim:
            raise ValueError(f"thetas must have shape (C, {self.dim}), got {th.shape}")
        C, p1, K = th.shape[0], self.n_features + 1, self.n_classes
        if th.strides[1] != th.itemsize:  # the (p+1, K) views must be C-contiguous, as in _W
            th = np.ascontiguousarray(th)
        W = th.reshape(C, p1, K)
        if idx is None:
            Xa, y = self.Xa, np.tile(self.y, C)  # (N, p+1) broadcast against the stack
            XaT = self.Xa.T
        else:
            idx = np.asarray(idx, dtype=np.int64)
            if idx.ndim != 2 or idx.shape[0] != C:
                raise ValueError(f"idx must have shape ({C}, n), got {idx.shape}")
            Xa, y = self.Xa[idx], self.y[idx].ravel()  # (C, n, p+1) C-contiguous
            XaT = Xa.transpose(0, 2, 1)
        z = np.matmul(Xa, W)  # (C, n, K)
        n = z.shape[1]
        r = _softmax(z.reshape(C * n, K))
        r[np.arange(C * n), y] -= 1.0
        return np.matmul(XaT, r.reshape(C, n, K)).reshape(C, p1 * K)

    @staticmethod
    def grad_sum_clients(pots, thetas: np.ndarray, idxs) -> np.ndarray:
        """:meth:`grad_sum` for several clients of one model at once: ``pots`` ``G`` potentials
        (the same ``p`` and ``K``), ``thetas`` ``(A, C, d)`` (``A`` sets of ``C`` parameter
        vectors, e.g. ``θ`` and the anchor ``ζ``), ``idxs`` one entry per client, ``(C, n_g)``
        index arrays (any ``n_g``) or ``None`` (all its data) → ``(G, A, C, d)`` whose
        ``[g, a, c]`` equals ``pots[g].grad_sum(thetas[a, c], idxs[g][c])`` bit for bit.

        The argument of :meth:`grad_sum_batch` holds: each client's two products are stacked
        ``np.matmul`` calls whose every matrix is one BLAS call of the one-row shapes and strides
        (``(n_g, p+1) @ (p+1, K)`` and ``(p+1, n_g) @ (n_g, K)``; the rows gathered once into
        C-contiguous ``(n_g, p+1)`` blocks shared by the ``A`` sets through a zero stride, the
        products written into C-contiguous blocks). The softmax is :func:`_softmax` once on all
        clients' rows of logits together: its operations are per row, so a row's result does
        not depend on which rows sit beside it.
        """
        G = len(pots)
        th = np.asarray(thetas, dtype=np.float64)
        A, C, d = th.shape
        p1, K = pots[0].n_features + 1, pots[0].n_classes
        if any(pt.n_features + 1 != p1 or pt.n_classes != K for pt in pots) or d != p1 * K:
            raise ValueError("grad_sum_clients: the potentials must share one model of dimension d")
        if th.strides[2] != th.itemsize:
            th = np.ascontiguousarray(th)
        W = th.reshape(A, C, p1, K)
        Xs, ys, ns = [], [], []
        for g, (pt, ix) in enumerate(zip(pots, idxs)):
            if ix is None:
                Xs.append(pt.Xa)  # (N, p+1), shared by every chain through a zero stride
                ys.append(np.broadcast_to(pt.y, (A, C, pt.n_data)))
                ns.append(pt.n_data)
                continue
            ix = np.asarray(ix, dtype=np.int64)
            if ix.ndim != 2 or ix.shape[0] != C:
                raise ValueError(f"idxs[{g}] must have shape ({C}, n), got {ix.shape}")
            Xs.append(pt.Xa[ix])  # (C, n, p+1) C-contiguous
            ys.append(np.broadcast_to(pt.y[ix], (A, C, ix.shape[1])))
            ns.append(ix.shape[1])
        ends = np.cumsum([A * C * n for n in ns])
        z = np.empty((int(ends[-1]) if G else 0, K))
        for g, (Xa, n) in enumerate(zip(Xs, ns)):
            np.matmul(Xa, W, out=z[ends[g] - A * C * n:ends[g]].reshape(A, C, n, K))
        r = _softmax(z)
        r[np.arange(r.shape[0]), np.concatenate([y.ravel() for y in ys])] -= 1.0
        out = np.empty((G, A, C, d))
        for g, (Xa, n) in enumerate(zip(Xs, ns)):
            np.matmul(Xa.swapaxes(-1, -2), r[ends[g] - A * C * n:ends[g]].reshape(A, C, n, K),
                      out=out[g].reshape(A, C, p1, K))
        return out

    def values(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """The per-example ``U_ij(θ)`` (negative log-likelihoods)."""
        Xa, y = self._rows(idx)
        z = Xa @ self._W(theta)
        return _logsumexp(z) - z[np.arange(len(y)), y]

    def value(self, theta: np.ndarray) -> float:
        return float(self.values(theta).sum())

    def pointwise_log_lik(self, theta: np.ndarray) -> np.ndarray:
        """``log p(y_ij | x_ij, θ)`` for every example (the federated LOO's input)."""
        return -self.values(theta)


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
