"""``metric-rank = k``: the metric corrected along the ``k`` directions where it is most wrong.

A metric built from an approximation of the curvature (K-FAC, a diagonal) leaves the
preconditioned curvature ``B = Rᵀ ∇²U(θ*) R`` (``M = R Rᵀ``) with most eigenvalues near 1 and a few
far from it, and those few set both the step and the mixing: ``γ = c/λ_max(B)``, and the slowest
direction relaxes in about ``1/(γ λ_min(B)) = κ(B)/c`` rounds. On the main job (softmax regression
on MNIST, d = 7,850) K-FAC leaves ``κ(B) ≈ 136``: 145 eigenvalues above 2, 35 below 0.2, the median
at 1.00 (computed offline from the exact Hessian).

The correction finds those directions by a block Krylov method on federated Hessian-vector
products, and maps them to 1 (Rayleigh–Ritz):

1. ``X_0``: a random orthonormal ``d × b`` block (stream ``(seed, INIT, −3, 0)``). For ``j =
   0…q−1``: one exchange asks every client for ``H_i (R X_j)`` (:func:`local_hvp`; the block rides
   in one message each way), the server forms ``B X_j = Rᵀ (P_0 R X_j + Σ_i H_i R X_j)`` and
   orthonormalises it against every block so far (twice, classical Gram–Schmidt, then a QR) into
   ``X_{j+1}``.
2. With ``K = [X_0 … X_{q−1}]`` and the products already in hand, ``T = Kᵀ B K`` gives the Ritz
   pairs ``(t_j, u_j = K s_j)`` and their residuals ``‖B u_j − t_j u_j‖`` at no further exchange.
3. Of the pairs whose residual is within :data:`RITZ_TOL` of ``t_j``, the ``k`` farthest from 1
   (in ``|log t|``) are kept: ``U`` (``d × k``, orthonormal), ``t`` (clipped to
   :data:`RITZ_FLOOR`).
4. The new root is ``S = R (I + U diag(t^{−1/2} − 1) Uᵀ)``, so ``M' = S Sᵀ = R (I + U diag(1/t − 1)
   Uᵀ) Rᵀ``: symmetric positive-definite for any orthonormal ``U`` and positive ``t``, so the
   chain's stationary law stays ``π`` up to ``O(γ)`` whatever the reports were (a wrong report can
   only slow or speed a direction, never bias it; the step ``γ`` is then chosen for ``M'``). Along
   an exact eigenvector ``u_j`` the new ``B' = Sᵀ ∇²U S`` has eigenvalue 1, elsewhere ``B``'s.
5. ``γ = c/λ_max(B')`` needs ``B'``'s top, which the Krylov space already holds: ``S`` maps ``K`` into itself, so
   on ``K`` the corrected pairs have Rayleigh quotient 1 and the others keep ``t_j``. The Lanczos iteration for
   ``γ`` (:func:`qlsd_flwr.core.spectral.lambda_max`) starts at the largest uncorrected Ritz vector and ends after
   one exchange of products when that vector is an eigenvector to 1 % (the product's residual: its Rayleigh
   quotient is ``t_j`` by construction, so agreeing with ``t_j`` would prove nothing); otherwise it iterates on
   (issue 37). Measured on the main job (exact Hessian at the MAP, 16-bit rows; ``python
   benchmarks/bench_lowrank_exchanges.py --gamma``): ``λ_max(B') = 2.25942``, from the Ritz vector 2.25942 in one
   exchange; the power iteration that preceded the Lanczos method stopped after 10 exchanges from a random start at
   2.1305, 5.7 % low, which made ``γ`` 6 % larger than ``c/λ_max``. Where the pair has not converged (a dense bulk
   below the corrected eigenvalues, ``tests/test_lowrank.py``) the power iteration took 4 products and ended 3.8 %
   low (6.8 % from random); the Lanczos method goes on from it to within 1 % of the top, in about 20 products.

Offline on the main job (the exact ``B``; ``benchmarks/bench_lowrank_exchanges.py``, RESULTS): ``b = 16``,
``q = 32`` (512 products) and ``k = 150`` bring ``κ`` from 136 to 9.7, as ``b = 32``, ``q = 20`` did with 640
(9.6); the same 150 directions from a full eigendecomposition, 16. Fewer products leave the bottom of the
spectrum (``λ_min(B) = 0.035``, where K-FAC's curvature is 28× too large) unresolved: ``κ`` 61 with 448
products in blocks of 32, 15 with 384 in blocks of 16.

Every client report is untrusted (:func:`check_block`): the wrong size, a non-finite value or a
value above :data:`qlsd_flwr.robust.reports.REPORT_MAX` is refused (``curvature_rejected``); a report
whose per-datum size ``‖H_i V‖_F / N_i`` exceeds :data:`qlsd_flwr.robust.reports.REPORT_CAP` times the
clients' lower median is scaled down to it (``curvature_scaled``), as the curvature reports are; and each
client's share of ``T`` is held to the leave-one-out rule both ways (:mod:`qlsd_flwr.robust.krylov`, through
:func:`correction`'s ``gram``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qlsd_flwr.compression import fixed
from qlsd_flwr.core import rng
from qlsd_flwr.robust.reports import REPORT_CAP, REPORT_MAX, ReportError, clamped_counts, lower_median

#: vectors per exchange (``b``) and exchanges (``q``) of the block Krylov method: a smaller block reaches a
#: higher polynomial degree for the same products, so the same ``κ`` with 20 % fewer of them (the uplink) and
#: 12 exchanges more (issue 37; ``b = 32``, ``q = 20`` until 2026-12-02). A space of at most ``2 b`` dimensions is
#: taken whole in one exchange.
LOWRANK_BLOCK = 16
LOWRANK_EXCHANGES = 32
#: a Ritz pair is used when its residual ``‖B u − t u‖`` is at most this fraction of ``t``
RITZ_TOL = 0.1
#: the vectors of a block and the clients' products travel as 16-bit fixed point with a float32 scale a row
#: (:mod:`qlsd_flwr.compression.fixed`), on every engine (the numbers are rounded where they are made, so the
#: direct engines use the very values Flower carries): the correction needs the products to a few digits at the
#: bottom of the spectrum, which 16 (and 12) bits keep and 8 do not (κ 9.65 against 63 on the main job; issue 37)
#: Ritz values are clipped to at least this, so that one direction of ``M`` grows at most ``1/RITZ_FLOOR``
#: times over the base metric's
RITZ_FLOOR = 1e-3
#: and to at most this: a correction's bytes with a larger value are refused on reading (``metric_codec``, where a huge
#: ``t`` with directions slightly off orthonormal left ``M`` indefinite), so the server never builds one
T_MAX = 1e12


@dataclass(frozen=True)
class LowRank:
    """The correction ``I + U diag(t^{−1/2} − 1) Uᵀ`` of a metric's root ``R``: ``u`` ``(d, k)`` with
    orthonormal columns (directions in the base metric's whitened coordinates), ``t`` ``(k,)`` the
    preconditioned curvature along each (Ritz values), ``w = R U`` (``(d, k)``). With ``F(p) =
    diag(t^p − 1)``: ``M' g = M g + W F(−1) Wᵀ g``, ``S z = R z + W F(−½) Uᵀ z`` and ``Sᵀ x = Rᵀ x + U
    F(−½) Wᵀ x``, each one application of the base metric plus ``O(dk)``."""

    u: np.ndarray
    t: np.ndarray
    w: np.ndarray

    def add(self, out: np.ndarray, left: np.ndarray, right: np.ndarray, x: np.ndarray, power: float) -> np.ndarray:
        """``out + left diag(t^power − 1) rightᵀ x`` for one vector ``x``."""
        return out + left @ ((self.t ** power - 1.0) * (right.T @ x))


def fd_step(theta: np.ndarray) -> float:
    """The finite-difference step on θ's scale."""
    # central differences: error O(ε²·∇³U) against rounding O(u/ε); ε ≈ u^{1/3} on θ's scale
    return 6e-6 * (1.0 + float(np.max(np.abs(theta))))


def local_hvp(pot, theta: np.ndarray, V: np.ndarray, bits: int = fixed.BITS) -> np.ndarray:
    """Client ``i``'s ``∇²U_i(θ) v`` for each row ``v`` of ``V`` (``(b, d)`` → ``(b, d)``): the
    potential's own ``hvp_batch(θ, V)`` when it has one (exact), otherwise central differences of
    ``grad_sum`` (``grad_sum_batch`` on the ``2b`` points at once where the potential has it), each
    row with its own step ``ε = 6e-6 (1 + max|θ|) / max|v|``. Returned as it travels at width ``bits``
    (:func:`~qlsd_flwr.compression.fixed.rounded`; a row that cannot travel is NaN, which the server refuses)."""
    return fixed.rounded(_local_hvp(pot, theta, V), bits)


def _local_hvp(pot, theta: np.ndarray, V: np.ndarray) -> np.ndarray:
    V = np.asarray(V, dtype=np.float64)
    if hasattr(pot, "hvp_batch"):
        return np.asarray(pot.hvp_batch(theta, V), dtype=np.float64)

    eps = fd_step(theta) / np.maximum(np.max(np.abs(V), axis=1), 1e-300)
    pts = np.concatenate([theta + eps[:, None] * V, theta - eps[:, None] * V])
    if hasattr(pot, "grad_sum_batch"):
        g = pot.grad_sum_batch(pts)
    else:
        g = np.stack([pot.grad_sum(p) for p in pts])
    b = V.shape[0]
    return (g[:b] - g[b:]) / (2.0 * eps[:, None])


def check_block(h, b: int, d: int) -> np.ndarray:
    """A client's block of products as ``(b, d)`` float64, or ``ReportError`` saying why."""

    try:
        a = np.asarray(h, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ReportError(f"not an array of numbers ({type(exc).__name__})") from None
    if a.size != b * d:
        raise ReportError(f"expected {b} × {d} numbers, got {a.size}")
    if not np.all(np.isfinite(a)):
        raise ReportError("non-finite values")
    if a.size and float(np.max(np.abs(a))) > REPORT_MAX:
        raise ReportError(f"values above {REPORT_MAX:g}")
    return a.reshape(b, d)


def summed(parts: dict, b: int, d: int) -> np.ndarray:
    """``Σ_i parts[i]`` in client order, from zeros (the order every engine sums in)."""
    total = np.zeros((b, d))
    for i in sorted(parts):
        total = total + parts[i]
    return total


def held_products(reports: dict, n_data, b: int, d: int, info: dict, log=None) -> dict:
    """The clients' reports ``{i: H_i V}`` (``(b, d)``), each checked (:func:`check_block`) and scaled down to
    :data:`~qlsd_flwr.robust.reports.REPORT_CAP` times the lower median of the per-datum sizes; refused and scaled
    clients are recorded in ``info``."""

    ok = {}
    for i, h in sorted(reports.items()):
        try:
            ok[int(i)] = check_block(h, b, d)
        except ReportError as exc:
            info.setdefault("curvature_rejected", {}).setdefault(str(i), str(exc))
            if log is not None:
                log.warning("client %s: Hessian-vector products refused: %s (curvature_rejected)", i, exc)
    n = clamped_counts(n_data, ok)
    size = {i: float(np.linalg.norm(h)) / n[i] for i, h in ok.items()}
    ref = lower_median(size.values()) if size else 0.0
    held = {}
    for i in sorted(ok):
        h = ok[i]
        if ref > 0 and size[i] > REPORT_CAP * ref:
            h = h * (REPORT_CAP * ref / size[i])
            if i not in info.setdefault("curvature_scaled", []):
                info["curvature_scaled"].append(i)
        held[i] = h
    return held


def correction(products, root, root_t, d: int, rank: int, seed: int, block: int | None = None,
               exchanges: int | None = None, gram=None, start: list | None = None, avoid: np.ndarray | None = None
               ) -> tuple[tuple[np.ndarray, np.ndarray] | None, dict]:
    """The correction of the module docstring. ``products(W)`` is ``∇²U(θ*) W`` for the rows of
    ``W`` (``(b, d)``: one exchange); ``root``/``root_t`` apply ``R``/``Rᵀ`` to one vector. ``gram()``, when given,
    is the projected curvature ``T`` (``(n, n)``, after the last exchange) in place of ``Kᵀ B K`` from the summed
    products: the clients' shares held to the leave-one-out rule (:class:`qlsd_flwr.robust.krylov.KrylovShares`). Returns
    the correction's ``(U, t)`` (``None`` when no Ritz pair converged; :meth:`Metric.corrected
    <qlsd_flwr.core.metric.Metric.corrected>` makes the metric) and the facts for the summary. ``start``, a list, receives
    the top uncorrected Ritz vector when its value is ``≥ 1``: the Lanczos iteration for ``γ`` starts there (step 5).
    ``avoid`` (``d × r``, orthonormal columns): directions already corrected (``metric-block``'s,
    :meth:`qlsd_flwr.core.kron_block.Blocked.directions`); the
    Krylov space is kept orthogonal to them, so the correction found is too and the two make one; where they span
    every direction nothing is left to correct (``None``, no exchange)."""
    free = d - (0 if avoid is None else avoid.shape[1])  # the dimensions the Krylov space may take
    if free < 1:
        return None, {"lowrank_rank": 0, "lowrank_exchanges": 0, "lowrank_block": 0, "lowrank_converged": 0}
    b = int(min(block, free)) if block else (free if free <= 2 * LOWRANK_BLOCK else LOWRANK_BLOCK)
    q = int(max(1, min(exchanges or LOWRANK_EXCHANGES, free // b)))
    X = rng.normal(seed, rng.Stream.INIT, -3 & 0xFFFFFFFF, 0, d * b).reshape(b, d)  # rows: the block
    off = (lambda Y: Y) if avoid is None else (lambda Y: Y - (Y @ avoid) @ avoid.T)  # out of span(avoid)
    X = np.linalg.qr(off(off(X)).T)[0].T
    Ks, BKs = [], []
    for j in range(q):
        HRX = products(np.stack([root(x) for x in X]))
        BX = off(np.stack([root_t(h) for h in HRX]))  # B restricted to the orthogonal complement of ``avoid``
        Ks.append(X)
        BKs.append(BX)
        if j == q - 1:
            break
        K = np.concatenate(Ks)  # (j b, d), orthonormal rows
        W = BX - (BX @ K.T) @ K
        W = W - (W @ K.T) @ K
        X = np.linalg.qr(W.T)[0].T
    K, BK = np.concatenate(Ks), np.concatenate(BKs)
    T = K @ BK.T if gram is None else gram()
    t, S = np.linalg.eigh(0.5 * T + 0.5 * T.T)
    U = S.T @ K  # Ritz vectors as rows
    res = np.linalg.norm(S.T @ BK - t[:, None] * U, axis=1)
    ok = np.flatnonzero((t > 0) & (res <= RITZ_TOL * np.abs(t)))
    far = ok[np.argsort(-np.abs(np.log(t[ok])), kind="stable")][:rank]
    far = np.sort(far)
    info = {"lowrank_rank": int(far.size), "lowrank_exchanges": q, "lowrank_block": b,
            "lowrank_converged": int(ok.size), "lowrank_ritz_min": float(t.min()), "lowrank_ritz_max": float(t.max())}
    if far.size == 0:
        return None, info
    rest = np.setdiff1d(ok, far)
    left = np.setdiff1d(np.arange(t.size), far)  # every Ritz pair left as it is, converged or not: B' keeps its value
    if start is not None and left.size and t[left].max() >= 1.0:  # (the corrected ones go to 1)
        j = left[np.argmax(t[left])]
        start.append(U[j] / np.linalg.norm(U[j]))
    kept = np.concatenate([t[rest], [1.0]])
    # κ over the converged Ritz pairs: before, and of those left uncorrected (with the corrected ones at 1), a
    # lower bound of the corrected κ (directions the Krylov space did not resolve are not in it)
    info["lowrank_kappa_before"] = float(t[ok].max() / t[ok].min())
    info["lowrank_kappa_left"] = float(kept.max() / kept.min())
    # the Ritz vectors are orthonormal up to rounding; one QR makes the correction exactly SPD
    u, r = np.linalg.qr(off(off(U[far])).T)
    u = u * np.sign(np.diag(r))
    return (u, np.clip(t[far], RITZ_FLOOR, T_MAX)), info
