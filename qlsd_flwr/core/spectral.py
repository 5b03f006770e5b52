"""``gamma = auto``'s ``λ_max(M^{1/2} ∇²U M^{1/2})`` from Hessian-vector products: :func:`lambda_max`, the Lanczos
method γ takes (issue 37), and :func:`rough_lambda_max`, the power iteration the θ* descent takes for its step.

Framework-free numpy; the products come from the engine's ``hvp`` (the clients' own, each client's part held to
scale by :mod:`qlsd_flwr.robust.products`) or from central differences of its gradients. :mod:`qlsd_flwr.core.curvature`
re-exports both.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.linalg import eigh_tridiagonal

from qlsd_flwr.core import rng
from qlsd_flwr.core.lowrank import fd_step
from qlsd_flwr.core.metric import Metric


def lambda_max(grad_fn, theta: np.ndarray, metric: Metric, seed: int, iters: int = 60,
               tol: float = 1e-2, hvp=None, start=None, start_saw_all: bool = True) -> tuple[float, int]:
    """``λ_max(M^{1/2} ∇²U(θ) M^{1/2})`` by the Lanczos method on Hessian-vector products; returns ``(λ, exchanges)``.

    ``∇²U u`` comes from ``hvp`` (the engine's: the clients' own products, :mod:`qlsd_flwr.robust.products` holding
    each client's part to scale), or by default from the central difference ``(∇U(θ + εu) − ∇U(θ − εu)) / 2ε``, each
    ``∇U`` one exchange with every client (``grad_fn``). One product per exchange: ``B v_j`` for the Lanczos vector
    ``v_j`` (``B = M^{1/2} ∇²U M^{1/2}``, in ``M``'s whitened coordinates), orthogonalised against every vector so far
    (twice), so that the tridiagonal ``T_j`` holds the Krylov space's Rayleigh–Ritz values; it stops when the top Ritz
    pair ``(θ_j, y_j)`` has residual ``‖B y_j − θ_j y_j‖ = β_j |s_j|`` at most ``tol θ_j`` (then an eigenvalue of ``B``
    lies within ``tol θ_j`` of ``θ_j``), or after ``iters`` products (fewer where ``d`` is large: :func:`lanczos_vectors`).

    Why not the power iteration it replaced (until 2026-12-04): from a random start the power iteration's quotient
    creeps up a dense top of the spectrum, and its stopping rule (a change under 1 %) read ``λ_max`` 1.1–7.8 % low on
    the main job's metrics (K-FAC, K-FAC with ``metric-block``), making γ as much too large; Lanczos's top Ritz value
    reached it to 0.03 % in as many products or fewer (``python benchmarks/bench_lowrank_exchanges.py --lanczos``).

    The value returned is the Rayleigh quotient ``yᵀ B y`` of one more product, at the top Ritz vector ``y`` (none is
    needed when ``y`` is the one vector so far), or the start's ``v₀ᵀ B v₀`` where that is larger: each client's part
    of either product is held as every product is (:mod:`qlsd_flwr.robust.products`), so the bound one client can put
    on γ is the same as the power iteration's; ``T``'s off-diagonal entries, which no rule holds, only choose ``y``,
    and the start, which holds a random direction, floors what steering ``y`` can do. For honest clients it is ``θ_j``
    (a Ritz value is at least every quotient in its Krylov space).

    ``start``, a unit vector in ``M``'s whitened coordinates (``metric-rank``'s top uncorrected Ritz vector), replaces
    the random start (stream ``(seed, INIT, −2, 0)``): when it is an eigenvector to ``tol`` one product ends it. With
    ``start_saw_all`` false (a start from a Krylov space kept off ``metric-block``'s directions, which did not see the
    whole space, so its eigenpair need not be the top) the start is the sum of that vector and the random one, each of
    unit length: the iteration sees every direction and converges to the top, helped by the start's own.
    The largest *signed* eigenvalue: the top Ritz value is, even when the dominant eigenvalue (by size) is negative;
    a value ≤ 0 (a saddle, a maximum, or false products) is the caller's to name."""
    hvp = _central(grad_fn) if hvp is None else hvp

    def product(v):
        return _product(hvp, theta, metric, v)

    d = theta.shape[0]
    if start is None:
        v = _random_start(seed, d)
    else:
        v = np.asarray(start, np.float64) / np.linalg.norm(start)
        if not start_saw_all:
            r = _random_start(seed, d)
            v = v + r / np.linalg.norm(r)
    v = v / np.linalg.norm(v)
    V = np.empty((max(1, min(int(iters), lanczos_vectors(d), d)), d))  # the Lanczos vectors, as rows
    alpha: list[float] = []
    beta: list[float] = []
    for j in range(V.shape[0]):
        V[j] = v
        w = product(v)
        if not np.all(np.isfinite(w)):  # nothing to learn from it: the largest quotient of a held product so far
            return (max(alpha) if alpha else 0.0), j + 1  # (not a Ritz value: T's off-diagonal entries are held by
            # no rule, and a client could inflate them before sending a non-finite product)
        a = float(v @ w)
        alpha.append(a)
        if j == 0:  # the residual of v itself, ‖Bv − a v‖ (a Ritz start ends here when it is an eigenvector)
            res = math.sqrt(max(float(w @ w) - a * a, 0.0))
            theta_top, s = a, np.ones(1)
        w = w - V[:j + 1].T @ (V[:j + 1] @ w)
        w = w - V[:j + 1].T @ (V[:j + 1] @ w)
        b = float(np.linalg.norm(w))
        if j > 0:
            t, S = eigh_tridiagonal(np.array(alpha), np.array(beta))
            theta_top, s = float(t[-1]), S[:, -1]
            res = b * abs(float(s[-1]))
        if res <= tol * abs(theta_top) or b <= 1e-12 * max(abs(theta_top), 1e-300):
            break
        beta.append(b)
        v = w / b
    if len(alpha) == 1:  # the quotient of the one product made: nothing more to ask
        return alpha[0], 1
    y = s @ V[:len(alpha)]
    y = y / np.linalg.norm(y)
    w = product(y)
    q = float(y @ w)
    return (max(q, alpha[0]) if math.isfinite(q) else max(alpha)), len(alpha) + 1


def _random_start(seed: int, d: int) -> np.ndarray:
    """Both iterations' random start, stream ``(seed, INIT, −2, 0)``."""
    return rng.normal(seed, rng.Stream.INIT, -2 & 0xFFFFFFFF, 0, d)


def _product(hvp, theta: np.ndarray, metric: Metric, v: np.ndarray) -> np.ndarray:
    """``B v = (M^½)ᵀ ∇²U M^½ v``: one exchange of products, at a step ``ε`` scaled to ``M^½ v``'s largest entry."""
    u = metric.apply_root(v)
    eps = fd_step(theta) / max(float(np.max(np.abs(u))), 1e-300)
    return metric.apply_root_t(hvp(theta, u, eps))


def _central(grad_fn):
    """``∇²U u`` as the central difference ``(∇U(θ + εu) − ∇U(θ − εu)) / 2ε`` of ``grad_fn``: two exchanges."""
    def hvp(th, u, eps):
        return (grad_fn(th + eps * u) - grad_fn(th - eps * u)) / (2.0 * eps)
    return hvp


def rough_lambda_max(grad_fn, theta: np.ndarray, metric: Metric, seed: int, iters: int = 20, tol: float = 5e-2,
                     hvp=None) -> tuple[float, int]:
    """The θ* descent's ``λ_max``, for its step ``1/λ``: the power iteration (the products as :func:`lambda_max`'s),
    stopped when its Rayleigh quotient changes by less than ``tol`` (at least 4 products) or after ``iters``;
    returns ``(λ, products)``. A step of ``1/λ`` with ``λ`` a few % low stays well inside gradient descent's stable
    ``2/λ_max``, so the descent keeps this cheaper estimate (5–6 products a stage on the main job) where ``γ``,
    whose bias grows with it, takes :func:`lambda_max`'s. The start is random (stream ``(seed, INIT, −2, 0)``). The
    largest *signed* eigenvalue: when the dominant one (by size) is negative, a second power iteration on
    ``∇²U − μ I`` (``μ`` the dominant one) finds the largest, which may be ≤ 0."""
    hvp = _central(grad_fn) if hvp is None else hvp
    lam, it = _power(hvp, theta, metric, seed, iters, tol, 0.0)
    if lam < 0:  # the dominant eigenvalue is negative: the largest is μ + λ_max(H − μ I) (H − μ I is PSD)
        shifted, more = _power(hvp, theta, metric, seed, iters, tol, lam)
        return lam + shifted, it + more
    return lam, it


def _power(hvp, theta: np.ndarray, metric: Metric, seed: int, iters: int, tol: float, shift: float):
    """The power iteration of :func:`rough_lambda_max` on ``M^½ (∇²U − shift·M⁻¹) M^½``, i.e. ``M^½ ∇²U M^½ − shift I``."""
    v = _random_start(seed, theta.shape[0])
    v = v / np.linalg.norm(v)
    lam, it = 0.0, 0
    for it in range(1, iters + 1):
        w = _product(hvp, theta, metric, v) - shift * v  # shifted (exactly itself at shift 0: v is finite)
        new = float(v @ w)
        nw = float(np.linalg.norm(w))
        if not np.isfinite(nw) or nw == 0.0:
            break
        v = w / nw
        done = it > 3 and abs(new - lam) <= tol * abs(new)
        lam = new if new < 0 and not shift else max(new, 0.0)
        if done:
            break
    return lam, it


#: the Lanczos basis of :func:`lambda_max` is held whole on the server (``d`` float64 numbers a vector): at most
#: this many bytes of it, and at least :data:`LANCZOS_MIN` vectors (``d = 7,850``: 4,274 vectors, so ``iters`` decides)
LANCZOS_BYTES = 256 * 2**20
LANCZOS_MIN = 8


def lanczos_vectors(d: int) -> int:
    """How many Lanczos vectors :func:`lambda_max` keeps for ``d`` coordinates (:data:`LANCZOS_BYTES`)."""
    return max(LANCZOS_MIN, LANCZOS_BYTES // (8 * max(int(d), 1)))
