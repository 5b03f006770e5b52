r"""``compression-basis = block``: the clients quantise their messages in K-FAC's whitened coordinates on
``metric-block``'s directions, at the cost of a few thousand numbers a client instead of the whole metric.

Quantised in θ's coordinates, QSGD's error is set by each message's norm and the step multiplies it by ``M``, so it
biases the chain in the flat directions (docs/METRIC.md); quantised in the metric's own coordinates (``compression-basis
= metric``, ``Sᵀ H_i`` with ``M = S Sᵀ``) it takes ``M``'s shape, as the Langevin noise does, but every client must then
hold ``M``: on the main job its K-FAC factors, block and low-rank correction are 13.7 MB a client. Any invertible
``B`` serves as the basis, provided the server undoes it exactly: a client sends ``C(B H_i − η_i)``, the server's ``g``
estimates ``B ∇U`` and its step applies ``M B⁻¹ g``, which is ``M ∇U``'s estimate whatever ``B`` (only the
quantisation's noise, ``M B⁻¹ ε``, depends on it). Here

    ``B = a (I − P Pᵀ) + P diag(s) Pᵀ``,   ``P = Q̂ ⊗ Q_A`` (in θ's order),

with ``Q̂`` ``metric-block``'s ``k`` input directions (the top eigenvectors of K-FAC's input factor, which the clients
already received for their block reports), ``Q_A`` K-FAC's ``K × K`` output factor, ``s`` K-FAC's ``M^{1/2}`` along each
column of ``P`` (``den^{−1/2}``, the quotient ``Σ_f (q̂ᵀ q_f)² den_f^{−1/2}``), and ``a = den_min^{−1/2}`` elsewhere:
the widest scale K-FAC gives, the prior's on inputs the data never touch. Its inverse is exact,
``B⁻¹ = a⁻¹ (I − P Pᵀ) + P diag(1/s) Pᵀ``, and both cost two thin products. On the main job ``k K = 1,000`` numbers
``s``, ``Q_A``'s 100 and ``Q̂``'s 78,500 travel once to each client (79,601 float64 numbers, 0.64 MB; the layout's
permutation only where it is not the identity, :func:`perm_out`), unless it holds ``Q̂`` already: ``Q̂`` is the orthonormal basis (:func:`~qlsd_flwr.core.kron_block.
orthonormal`) of the directions each client received for its block report, so a client whose report the server
took is sent the rest alone (:class:`BasisRef`: ``Q_A``, ``s``, ``a`` and ``Q̂``'s column sums, 1,201 numbers, 9.6 kB;
72 kB until ``perm`` was left out where it is the identity) and orthonormalises its own copy, the very computation on the very numbers.

**Measured** (``benchmarks/RESULTS.md``, "The uplink in K-FAC's block basis"): with its broadcast at 128 levels the main
job's predictive at 1.19× the HMC halves' total variation, against 1.80× with its messages in θ's coordinates and 1.11×
in the full metric's; 1.30× with the broadcast at 64 levels, the main job's since.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core.kron import Kron
from qlsd_flwr.core.kron_block import orthonormal, unpack
from qlsd_flwr.core.metric import Metric, MetricError, _rows, encode

#: ``s`` and ``a`` read from bytes may span at most this factor (K-FAC's own scales span ``den``'s range, 948× on the
#: main job; a hostile server's huge spread would only make a client's message badly scaled, never undefined)
SPREAD_MAX = 1e12


def perm_out(perm: np.ndarray) -> np.ndarray:
    """The layout's permutation as it travels: empty where it is the identity (a softmax regression's θ is already its
    ``(F̃, K)`` matrix: 7,850 float64 numbers a client, 1.0e7 of the main job's downlink, that carry nothing), else
    its ``d`` numbers."""
    perm = np.asarray(perm)
    return np.zeros(0) if np.array_equal(perm, np.arange(perm.size)) else perm.astype(np.float64)


def perm_in(perm: np.ndarray, d: int) -> np.ndarray:
    """:func:`perm_out`'s array back as a permutation of ``0..d−1`` (the identity for an empty one); its check is the
    caller's."""
    return np.arange(d) if perm.shape == (0,) else perm


class BlockBasis(Metric):
    """The clients' basis ``B`` (module docstring), carried in the metric's tagged encoding (code 6) as the clients'
    "metric": ``apply_root`` and ``apply_root_t`` are ``B`` (symmetric), ``apply`` ``B²``; :meth:`apply_inv` is
    ``B⁻¹``, the server's."""

    kind, code = "block-basis", 6

    def __init__(self, perm: np.ndarray, qh: np.ndarray, qa: np.ndarray, s: np.ndarray, a: float):
        self.perm, self.qh, self.qa, self.s, self.a = perm, qh, qa, s, float(a)

    @staticmethod
    def of(metric: Metric) -> "BlockBasis | None":
        """The basis of ``metric``'s block (a :class:`~qlsd_flwr.core.kron_block.Blocked` metric, or one corrected
        further by ``metric-rank``); ``None`` when it has no block."""
        blk = metric.base
        if getattr(blk, "qh", None) is None or blk.kron is None:
            return None
        kr: Kron = blk.kron
        root = kr.den ** -0.5  # K-FAC's M^{1/2} in its eigenbasis
        return BlockBasis(kr.perm, blk.qh, kr.qa, ((blk.qh.T @ kr.qg) ** 2) @ root, float(root.max()))

    def _map(self, x: np.ndarray, s: np.ndarray, a: float) -> np.ndarray:
        F, K = self.qh.shape[0], self.qa.shape[0]
        y = self.qh.T @ x[self.perm].reshape(F, K) @ self.qa  # Pᵀ x
        out = a * x
        out[self.perm] += (self.qh @ (y * (s - a)) @ self.qa.T).ravel()
        return out

    def apply_root(self, z):
        return _rows(lambda r: self._map(r, self.s, self.a), z)

    def apply_root_t(self, x):
        return self.apply_root(x)

    def apply_inv(self, g):
        """``B⁻¹ g`` for ``g`` of shape ``(d,)`` or ``(C, d)``."""
        return _rows(lambda r: self._map(r, 1.0 / self.s, 1.0 / self.a), g)

    def apply(self, g):
        return self.apply_root(self.apply_root(g))

    def spread(self) -> float:
        v = np.append(self.s, self.a) ** 2
        return float(v.max() / v.min())

    def largest(self) -> float:
        return float(max(self.s.max(), self.a) ** 2)

    def to_json(self):
        return {"kind": self.kind, "inputs": int(self.qh.shape[1]), "outputs": int(self.qa.shape[0]),
                "scale_min": float(min(self.s.min(), self.a)), "scale_max": float(max(self.s.max(), self.a))}

    def arrays(self):
        return {"perm": perm_out(self.perm), "qh": self.qh, "qa": self.qa, "s": self.s, "a": np.array([self.a])}

    @staticmethod
    def checked(parts: dict, d: int) -> "BlockBasis":
        """A :class:`BlockBasis` of dimension ``d`` from its arrays as received, else ``MetricError`` naming what is
        wrong: ``perm`` a permutation of ``0..d−1``, ``Q̂`` (``F × k``) orthonormal, ``Q_A`` (``K × K``, ``F K = d``)
        orthogonal, ``s`` (``k × K``) and ``a`` positive within :data:`SPREAD_MAX` of each other (so ``B⁻¹`` is
        exact to rounding and ``B`` is positive-definite)."""
        perm, qh, qa, s, a = (parts[n] for n in ("perm", "qh", "qa", "s", "a"))
        perm = perm_in(perm, d)
        F = qh.shape[0] if qh.ndim == 2 else 0
        k, K = (qh.shape[1] if qh.ndim == 2 else 0), (qa.shape[0] if qa.ndim == 2 else 0)
        ok = (perm.shape == (d,) and K >= 1 and F * K == d and 1 <= k <= F and qa.shape == (K, K)
              and s.shape == (k, K) and a.shape == (1,) and np.array_equal(np.sort(perm), np.arange(d)))
        if ok:
            v = np.append(s, a)
            # B⁻¹'s form is exact only for orthonormal factors: their error, times the scales' spread, is held to 0.1
            # (as metric-block's V to 0.1 / max t), so that B stays positive-definite and B⁻¹ B within 0.1 of I
            tol = min(1e-8, 0.1 * float(v.min() / v.max())) if np.all(v > 0) else 0.0
            ok = bool(np.all(v > 0) and v.max() <= SPREAD_MAX * v.min()
                      and np.allclose(qh.T @ qh, np.eye(k), rtol=0.0, atol=tol)
                      and np.allclose(qa.T @ qa, np.eye(K), rtol=0.0, atol=tol))
        if not ok:
            raise MetricError(f"metric: not a block basis of d = {d} (a permutation of 0..d−1 or none for the identity, orthonormal input "
                              f"directions, an orthogonal output factor, positive scales within {SPREAD_MAX:g} of "
                              "each other, and their sizes)")
        return BlockBasis(perm.astype(np.int64), qh, qa, s, float(a[0]))


class BasisRef:
    """The clients' basis :class:`BlockBasis` sent by reference (code 7 of the metric's tagged encoding, read only where
    a client reads its ``metric``): every array but ``Q̂``, which the client makes from the rows of directions it
    received for its ``metric-block`` report (:meth:`resolve`), and ``qsum``, ``Q̂``'s column sums, which its copy must
    match. On the main job 9.6 kB a client where the basis is 0.64 MB (module docstring)."""

    kind, code = "block-basis-ref", 7
    #: how far a client's ``Q̂`` may be from the server's, column sum by column sum: the same QR of the same numbers
    #: agrees to rounding (another LAPACK, another machine: about 1e-15); directions from another exchange do not
    QSUM_TOL = 1e-8

    def __init__(self, perm: np.ndarray, qa: np.ndarray, s: np.ndarray, a: float, qsum: np.ndarray):
        self.perm, self.qa, self.s, self.a, self.qsum = perm, qa, s, float(a), qsum

    @staticmethod
    def of(basis: BlockBasis) -> "BasisRef":
        return BasisRef(basis.perm, basis.qa, basis.s, basis.a, basis.qh.sum(axis=0))

    def arrays(self):
        return {"perm": perm_out(self.perm), "qa": self.qa, "s": self.s, "a": np.array([self.a]), "qsum": self.qsum}

    def to_bytes(self) -> bytes:
        return encode(self.code, self.arrays())

    @staticmethod
    def checked(parts: dict, d: int) -> "BasisRef":
        """A :class:`BasisRef` of dimension ``d`` from its arrays as received, held to :meth:`BlockBasis.checked`'s
        rules (with ``k`` orthonormal placeholder directions), ``qsum`` of ``k`` numbers; else ``MetricError``."""
        qa, s, qsum = parts["qa"], parts["s"], parts["qsum"]
        K = qa.shape[0] if qa.ndim == 2 else 0
        k = s.shape[0] if s.ndim == 2 else 0
        if K < 1 or d % K or not 1 <= k <= d // K or qsum.shape != (k,):
            raise MetricError(f"metric: not a block basis reference of d = {d} (an output factor, k × K scales and k "
                              "column sums, k at most d / K)")
        perm = BlockBasis.checked({**parts, "qh": np.eye(d // K, k)}, d).perm
        return BasisRef(perm, qa, s, float(parts["a"][0]), qsum)

    def matches(self, basis) -> bool:
        """Whether ``basis`` (a metric a client holds already: another of its chains built it) is the one this
        refers to: the same arrays, and ``Q̂``'s column sums within :data:`QSUM_TOL`."""
        return (isinstance(basis, BlockBasis) and basis.qh.shape[1] == self.qsum.size
                and all(np.array_equal(getattr(basis, n), getattr(self, n)) for n in ("perm", "qa", "s"))
                and basis.a == self.a and np.allclose(basis.qh.sum(axis=0), self.qsum, rtol=0.0, atol=self.QSUM_TOL))

    def resolve(self, rows: np.ndarray | None, d: int) -> BlockBasis | None:
        """The basis, from the rows of directions this client received for its ``metric-block`` report; ``None``
        where it holds none or other ones (a restarted node, another exchange: the server then sends it whole)."""
        if rows is None:
            return None
        K = self.qa.shape[0]
        try:
            Qh = orthonormal(unpack(rows, d // K))[0]
        except ValueError:
            return None
        if Qh.shape[1] != self.s.shape[0] or not np.allclose(Qh.sum(axis=0), self.qsum, rtol=0.0, atol=self.QSUM_TOL):
            return None
        return BlockBasis.checked({"perm": perm_out(self.perm), "qh": Qh, "qa": self.qa, "s": self.s,
                                   "a": np.array([self.a])}, d)
