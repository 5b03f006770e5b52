"""``metric-block = k``: K-FAC made exact on its top ``k`` input directions, from one small report a client.

K-FAC (:class:`~qlsd_flwr.core.kron.Kron`) takes the curvature of one dense softmax layer as ``G ⊗ Ā``, with
``Ā`` the average of ``A_j = diag p_j − p_j p_jᵀ`` over all points. On the main job it is 28× too large along the
bottom of the whitened spectrum, and those directions lie on ``G``'s top input directions (the mean image with the
bias: 54–70 % of each of the 5 lowest eigenvectors on the top one, 84–97 % on the top 5), coupled across outputs:
most points are fitted confidently there, so their ``A_j`` are far below the average. ``metric-rank`` corrects that
from 512 Hessian-vector products (1.29e9 bits up, 1.45e9 down on the main job). Here the server sends ``Q_k``,
the top ``k`` eigenvectors of ``G = Σ_i G_i`` (``k F̃`` numbers), and each client reports its exact curvature on
``S = span(Q_k) ⊗ R^K``, couplings included:

    ``B_i = Σ_j (Q_kᵀ x̃_j)(Q_kᵀ x̃_j)ᵀ ⊗ A_j``   (``m × m``, ``m = kK``; as its square root in 12-bit rows)

(``k = 50`` on the main job: 8.0e7 bits up, 2.5e7 down, 16× and 58× fewer than the products, for a whitened
condition number of 11.7 against their 9.7: ``benchmarks/RESULTS.md``, "A base metric without products").

**The metric.** K-FAC's root ``R = M^½`` maps ``S`` to itself (``S`` is spanned by its eigenvectors
``q_f ⊗ a_a``), with ``R P = P D`` for ``P = Q_k ⊗ Q_A`` and ``D`` K-FAC's ``den^{−½}`` there. So along
``u = P v`` the whitened curvature is ``vᵀ D H_S D v`` with ``H_S = Pᵀ ∇²U P`` (the clients' blocks plus the
prior's part), and the correction ``(U, t)`` from ``D H_S D = V diag(t) Vᵀ``, ``U = P V``, makes ``M`` exactly
``H_S^{−1}`` on ``S`` and K-FAC's elsewhere. ``Q_k`` travels as float32 rows; the server works in the orthonormal
basis of what the clients received (a QR factor, 1e-7 from ``Q_k``).

**Kept in its structure** (:class:`Blocked`, 2026-12-06): the root is ``S = R (I + P C P^T)`` with
``C = V diag(t^{−½} − 1) Vᵀ`` (``m × m``), so a step applies K-FAC's factors and one ``m × m`` product. Until then the
same correction was ``metric-rank``'s :class:`~qlsd_flwr.core.metric.Corrected` form, ``U = P V`` and ``W = R U`` as
``d × m`` dense arrays: on the main job (``m = 1,000``, ``d = 7,850``) each product read 2 × 63 MB, and the server's
step took half of every round. The two are the same metric in exact arithmetic (tested to rounding); the chain's
last bits differ, and its checkpoints and the metric's bytes carry ``Q̂``, ``V`` and ``t`` (kind 5) instead of ``U``.

**One client's reach** (issue 38's rule for dense reports): each block is held per datum to
:data:`~qlsd_flwr.robust.reports.REPORT_CAP` times the clients' lower median of ``tr B_i / N_i``, then to
``prior + Σ_l B_l ⪯ (1 + FACTOR_SHARE N_i/N_{−i}) (prior + Σ_{l≠i} B_l)`` in every direction of ``S``
(:func:`~qlsd_flwr.robust.reports.cap_leave_one_out`): one client shrinks ``M`` along any direction of ``S`` by at
most that factor, as with a dense report. Both rules need at least ``POOL_MIN`` (3) blocks: fewer clients do not stand
for the honest ones (the leave-one-out rule's own condition; K-FAC's per-datum cap applies with any number).
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.compression import root
from qlsd_flwr.core.kron import Kron
from qlsd_flwr.core.lowrank import RITZ_FLOOR, T_MAX
from qlsd_flwr.core.metric import FromFactors, Kronecker, Metric, MetricError, _rows
from qlsd_flwr.robust.claims import POOL_MIN
from qlsd_flwr.robust.reports import REPORT_MAX, ReportError, cap_leave_one_out, cap_reports, share_allowance

#: the curvature kind of a client's block report (:func:`block_report`)
KRON_BLOCK = "kronecker-block"
#: the largest block ``m = kK``: a report of ``m(m+1)/2`` float32 numbers (8 MB), the server's ``m × m`` per client
MAX_DIM = 2000


def pack(Q: np.ndarray, d: int) -> np.ndarray:
    """``Q`` (``(F̃, k)``, orthonormal columns) as rows of length ``d = F̃ K``, as the curvature exchange's
    ``vectors`` carry it: its ``k`` columns one after another, the last row padded with zeros."""
    flat = np.ascontiguousarray(np.asarray(Q, dtype=np.float64).T).ravel()
    rows = -(-flat.size // d)
    return np.concatenate([flat, np.zeros(rows * d - flat.size)]).reshape(rows, d)


def unpack(V: np.ndarray, F: int) -> np.ndarray:
    """The ``(F̃, k)`` columns :func:`pack` made, from the rows as received (the zero padding dropped), or
    ``ValueError`` saying why (a client's side: the server's message)."""
    V = np.asarray(V, dtype=np.float64)
    if V.ndim != 2 or V.size % F or not np.all(np.isfinite(V)):
        raise ValueError(f"curvature: 'vectors' is not a whole number of finite input directions of length {F}")
    cols = V.reshape(-1, F)
    keep = np.flatnonzero(np.any(cols != 0, axis=1))
    k = int(keep[-1]) + 1 if keep.size else 0
    if k == 0 or np.any(~np.any(cols[:k] != 0, axis=1)):
        raise ValueError("curvature: 'vectors' holds no input direction, or a zero one among them")
    return np.ascontiguousarray(cols[:k].T)


def block_report(Xa: np.ndarray, P: np.ndarray, Q: np.ndarray) -> bytes:
    """A client's ``B_i = Σ_j z_j z_jᵀ ⊗ (diag p_j − p_j p_jᵀ)``, ``z_j = Qᵀ x̃_j``, as it travels: its square root
    in 12-bit rows (:func:`qlsd_flwr.compression.root.encode`; in 16-bit rows 1.1e8 bits for the main job's 20 clients
    at θ* against 3.2e8 as a float32 triangle; positive semi-definite whatever arrives). ``Xa``: the inputs with the bias's 1
    (``(n, F̃)``); ``P``: the softmax outputs (``(n, K)``); ``Q``: ``(F̃, k)``. The coordinates are ``(f, a)``,
    ``f`` major."""
    Xa, P = np.asarray(Xa, dtype=np.float64), np.asarray(P, dtype=np.float64)
    Z = Xa @ np.asarray(Q, dtype=np.float64)  # (n, k)
    n, k, K = Z.shape[0], Z.shape[1], P.shape[1]
    Y = (Z[:, :, None] * P[:, None, :]).reshape(n, k * K)
    B = -(Y.T @ Y)
    for a in range(K):  # the diag p_j part, on the (·, a), (·, a) entries
        B[a::K, a::K] += (Z * P[:, a:a + 1]).T @ Z
    return root.encode(0.5 * B + 0.5 * B.T)


def local_block(pot, theta: np.ndarray, V: np.ndarray) -> bytes:
    """Client ``i``'s :func:`block_report` at ``θ`` for the input directions the server sent as rows ``V``
    (:func:`pack`); ``ValueError`` for a potential without ``kron_inputs`` (one dense softmax layer)."""
    if not hasattr(pot, "kron_inputs"):
        raise ValueError("metric-block needs a potential with kron_inputs(theta) (one dense softmax layer: the "
                         "logistic tasks, TorchPotential of a single nn.Linear); use metric-block = 0")
    Xa, P = pot.kron_inputs(theta)
    F, K = np.shape(Xa)[1], np.shape(P)[1]
    Q = unpack(V, F)
    if Q.shape[1] > F or Q.shape[1] * K > MAX_DIM:  # before any m × m array: the server's message sets m
        raise ValueError(f"curvature: 'vectors' holds {Q.shape[1]} input directions, a block of {Q.shape[1] * K} "
                         f"dimensions; at most {F} directions and {MAX_DIM} dimensions")
    return block_report(Xa, P, Q)


def check_block(h, m: int) -> np.ndarray:
    """A client's block report as the symmetric positive semi-definite ``(m, m)`` float64 matrix its root gives
    (:func:`qlsd_flwr.compression.root.decode`), or :class:`ReportError`: not a root of an ``m × m`` matrix, not
    finite, or too large."""
    try:
        B = root.decode(h, m)
    except ValueError as exc:
        raise ReportError(str(exc)) from None
    if B.size and float(np.max(np.abs(B))) > REPORT_MAX:
        raise ReportError(f"values above {REPORT_MAX:g}")
    return B


def basis(kron, Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(Q̂, T⁻¹ ⊗ I_K)``: the orthonormal basis of the columns the clients received (``Q = Q̂ T``, QR), and what
    takes a block ``B`` in ``Q``'s coordinates to ``Q̂``'s, as ``(T⁻¹ ⊗ I)ᵀ B (T⁻¹ ⊗ I)``."""
    Qh, T = orthonormal(Q)
    K = kron.qa.shape[0]
    return Qh, np.kron(np.linalg.inv(T), np.eye(K))


def orthonormal(Q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(Q̂, T)`` with ``Q = Q̂ T``, ``Q̂`` orthonormal and ``T`` upper triangular with a positive diagonal (QR, so
    that ``Q̂ = Q`` to rounding and not ``−Q``): the server's block directions, and a client's own copy of them from
    the rows it received (``compression-basis = block``'s basis sent by reference, :class:`~qlsd_flwr.core.
    block_basis.BasisRef`): the same computation on the same numbers."""
    Qh, T = np.linalg.qr(np.asarray(Q, dtype=np.float64))
    sign = np.where(np.diag(T) < 0, -1.0, 1.0)
    return Qh * sign, T * sign[:, None]


def directions(kron, Qh: np.ndarray, V: np.ndarray, outputs: np.ndarray | None = None) -> np.ndarray:
    """``U = P V`` in θ's coordinates (``(d, r)``), for ``P = Q̂ ⊗ Q_A`` (``outputs`` in place of ``Q_A``) and ``V``
    ``(kK, r)`` in ``(f, a)`` order."""
    F, K = kron.den.shape
    k = Qh.shape[1]
    out = kron.qa if outputs is None else outputs
    E = np.einsum("fi,iar,ba->fbr", Qh, V.reshape(k, K, -1), out, optimize=True).reshape(F * K, -1)
    U = np.empty_like(E)
    U[kron.perm] = E
    return U


def correction(kron, Q: np.ndarray, reports: dict[int, np.ndarray], n_data, prior_curv: np.ndarray,
               info: dict) -> "Blocked":
    """K-FAC's metric made exact on the block (:class:`Blocked`) from the clients' checked blocks
    (``{i: (m, m)}`` in the coordinates of ``Q`` as sent), each held to the rules of the module docstring (the
    clients scaled named in ``info['block_scaled']``); ``prior_curv``: the prior's diagonal curvature ``(d,)``."""
    F, K = kron.den.shape
    Qh, Tinv = basis(kron, Q)
    k = Qh.shape[1]
    # the prior's part in the received coordinates (Q ⊗ I_K, f major), where the rules compare the reports
    Pq = directions(kron, np.asarray(Q, dtype=np.float64), np.eye(k * K), outputs=np.eye(K))
    floor = Pq.T @ (Pq * np.asarray(prior_curv, dtype=np.float64)[:, None])
    scaled = cap_reports(reports, n_data, scale=lambda B, n: float(np.trace(B)) / n) if len(reports) >= POOL_MIN else []
    scaled += cap_leave_one_out(reports, floor, share_allowance(n_data, reports))
    H = floor + sum(reports[i] for i in sorted(reports))
    # to Q̂ ⊗ Q_A, K-FAC's eigenvectors, where its root is the diagonal D
    rot = Tinv @ np.kron(np.eye(k), kron.qa)
    Hs = rot.T @ H @ rot
    D = kron.den[F - k:, :].ravel() ** -0.5  # eigh's order: the top k input directions are G's last
    W = D[:, None] * Hs * D[None, :]
    t, V = np.linalg.eigh(0.5 * W + 0.5 * W.T)
    if not np.all(np.isfinite(t)):
        raise MetricError(f"metric-block: the curvature on K-FAC's top {k} input directions is not finite")
    # as metric-rank's Ritz values (core.lowrank.RITZ_FLOOR): one direction of M grows at most 1/RITZ_FLOOR times
    # K-FAC's, where the block is singular (a flat prior: diag p_j − p_j p_jᵀ is zero along the outputs' 1)
    info.update({"block_inputs": k, "block_dim": k * K, "block_t_min": float(t[0]), "block_t_max": float(t[-1]),
                 "block_scaled": sorted(set(scaled)), "block_t_clipped": int(np.count_nonzero(t < RITZ_FLOOR))})
    return Blocked(kron, Qh, V, np.clip(t, RITZ_FLOOR, T_MAX))  # and at most T_MAX, the bytes' bound


class Blocked(FromFactors, Metric):
    """K-FAC's metric made exact on ``S = span(Q̂) ⊗ R^K`` (the module docstring): the root
    ``S = R (I + P V diag(t^{−½} − 1) Vᵀ Pᵀ)``, ``R`` K-FAC's symmetric root, ``P = Q̂ ⊗ Q_A`` in θ's order (``perm``),
    and ``M = S Sᵀ = R (I + P V diag(t^{−1} − 1) Vᵀ Pᵀ) R``: symmetric positive-definite for any orthonormal ``Q̂``
    (``(F̃, k)``), orthogonal ``V`` (``m × m``, ``m = kK``) and positive ``t``. ``metric-rank`` corrects it further
    (:class:`~qlsd_flwr.core.metric.Corrected`), off ``S``."""

    kind, code = "kronecker", 5

    def __init__(self, kron: Kron, qh: np.ndarray, v: np.ndarray, t: np.ndarray):
        self.kron, self.qh, self.v, self.t = kron, qh, v, t
        # C = V diag(f) Vᵀ for the root's f and the metric's, once: a vector then costs one m × m product
        self._c_root = (v * (t ** -0.5 - 1.0)) @ v.T
        self._c_metric = (v * (1.0 / t - 1.0)) @ v.T

    @property
    def has_correction(self) -> bool:
        return True

    def _plus(self, x: np.ndarray, c: np.ndarray) -> np.ndarray:
        """``(I + P C Pᵀ) x``."""
        F, K = self.kron.den.shape
        perm, qa = self.kron.perm, self.kron.qa
        y = c @ (self.qh.T @ x[perm].reshape(F, K) @ qa).ravel()
        out = x.copy()
        out[perm] += (self.qh @ y.reshape(-1, K) @ qa.T).ravel()
        return out

    def apply(self, g):
        k = self.kron
        return _rows(lambda r: k.apply(self._plus(k.apply(r, -0.5), self._c_metric), -0.5), g)

    def apply_root(self, z):
        return _rows(lambda r: self.kron.apply(self._plus(r, self._c_root), -0.5), z)

    def apply_root_t(self, x):
        return _rows(lambda r: self._plus(self.kron.apply(r, -0.5), self._c_root.T), x)

    def factored(self):
        return Kronecker(self.kron), self.t

    def directions(self) -> np.ndarray:
        """``U = P V`` (``d × m``, orthonormal columns): the directions of ``S`` it corrects, in K-FAC's whitened
        coordinates (``metric-rank``'s Krylov space is kept off them)."""
        return directions(self.kron, self.qh, self.v)

    def arrays(self):
        k = self.kron
        return {"qg": k.qg, "qa": k.qa, "den": k.den, "perm": k.perm.astype(np.float64), "qh": self.qh, "v": self.v,
                "t": self.t}

    @staticmethod
    def checked(parts: dict, d: int) -> "Blocked":
        """A :class:`Blocked` of dimension ``d`` from its arrays as received (:meth:`arrays`), else ``MetricError``
        naming what is wrong: K-FAC's factors (:meth:`Kron.checked`), ``Q̂``'s columns not orthonormal input
        directions, a block above :data:`MAX_DIM`, ``t`` outside ``[RITZ_FLOOR, T_MAX]`` (the server clips it below;
        a huge ``t`` leaves ``I + V diag(1/t − 1) Vᵀ`` near 0 along ``v``), or ``V`` not orthogonal of side ``kK`` to
        within ``0.1 / max t`` (so that its error cannot make ``M`` indefinite there)."""
        try:
            kron = Kron.checked(parts["perm"], parts["qg"], parts["qa"], parts["den"], d)
        except ValueError as exc:
            raise MetricError(str(exc)) from None
        F, K = kron.den.shape
        qh, v, t = parts["qh"], parts["v"], parts["t"]
        k = qh.shape[1] if qh.ndim == 2 else 0
        m = k * K
        if not (qh.shape == (F, k) and 1 <= k <= F and 1 <= m <= MAX_DIM and v.shape == (m, m) and t.shape == (m,)
                and np.all(t >= RITZ_FLOOR) and np.all(t <= T_MAX) and np.allclose(qh.T @ qh, np.eye(k), atol=1e-8)
                and np.allclose(v.T @ v, np.eye(m), rtol=0.0, atol=min(1e-8, 0.1 / float(t.max())))):
            raise MetricError(f"metric: not a block-corrected Kronecker metric of d = {d} (input directions not "
                              "orthonormal, a rotation not orthogonal, or values not positive, or their sizes)")
        return Blocked(kron, qh, v, t)
