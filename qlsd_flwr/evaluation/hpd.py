"""HPD thresholds with Monte Carlo error bars, and what Langevin's step does to them.

The paper's logistic-regression metric (§4, S5.2) is the relative 99 % HPD error
``|η_α − η_α^ref| / η_α^ref``, where ``η_α`` is the ``(1 − α)`` quantile of ``U(θ)`` under the
samples (:func:`qlsd_flwr.evaluation.metrics.hpd_error`). To use it in a test or a table one needs

* its Monte Carlo error: :func:`quantile_mcse` (delta method: the variance of the empirical
  CDF at the quantile, from batch means over each chain, divided by the density there);
* the bias that any unadjusted Langevin sampler has at step ``γ`` even with exact gradients:
  :func:`ula_hpd_shift_laplace`, exact for a Gaussian target and a first-order prediction
  under the Laplace approximation otherwise.

ULA on a Gaussian target ``N(θ*, H⁻¹)`` is a Gaussian AR(1) process with stationary law
``N(θ*, (H(I − γH/2))⁻¹)``. In ``H``'s eigenbasis (eigenvalues ``h_k``) the potential above
its minimum is ``U − U* = ½ Σ_k h_k x_k²``: under ``π`` a sum of ``d`` independent ``½χ²₁``;
under ULA each term is scaled by ``1/(1 − γ h_k/2)``. The 99 % quantiles of both weighted sums
are computed by Monte Carlo with common random numbers, so their difference is accurate to
far below the chains' own Monte Carlo error.
"""

from __future__ import annotations

import math

import numpy as np


def map_and_hessian(task, theta0: np.ndarray | None = None, iters: int = 30, eps: float = 1e-5,
                    tol: float = 1e-9) -> tuple[np.ndarray, np.ndarray, float]:
    """``(θ*, H, U(θ*))``: the mode by damped Newton steps with a finite-difference Hessian of
    ``task.grad_potential`` (central differences, step ``eps``; fine for ``d`` up to a few
    hundred). ``H`` is symmetrised."""
    d = task.dim
    th = np.zeros(d) if theta0 is None else np.asarray(theta0, np.float64).copy()

    def hess(x):
        H = np.empty((d, d))
        for k in range(d):
            e = np.zeros(d)
            e[k] = eps
            H[:, k] = (task.grad_potential(x + e) - task.grad_potential(x - e)) / (2 * eps)
        return 0.5 * (H + H.T)

    for _ in range(iters):
        g = task.grad_potential(th)
        if np.linalg.norm(g) <= tol * (1.0 + abs(task.potential(th))):
            break
        step = np.linalg.solve(hess(th), g)
        t, u0 = 1.0, task.potential(th)
        while task.potential(th - t * step) > u0 and t > 1e-6:  # backtracking
            t *= 0.5
        th = th - t * step
    return th, hess(th), float(task.potential(th))


def ula_hpd_shift_laplace(h_eigs: np.ndarray, gamma: float, alpha: float = 0.01,
                          n_mc: int = 400_000, seed: int = 12345) -> tuple[float, float]:
    """``(q_π, q_γ)``: the ``(1 − α)`` quantiles of ``U − U*`` under the Laplace approximation
    ``N(θ*, H⁻¹)`` and under exact-gradient ULA at step ``γ`` on it (see the module docstring).

    ``h_eigs``: the eigenvalues of ``H`` (all ``< 2/γ``). The same χ² draws are used for both
    (common random numbers)."""
    h = np.asarray(h_eigs, np.float64)
    if np.any(gamma * h >= 2):
        raise ValueError("ULA is unstable: gamma * max eigenvalue >= 2")
    w = 1.0 / (1.0 - gamma * h / 2.0)
    rng = np.random.default_rng(seed)
    base, ula = np.empty(n_mc), np.empty(n_mc)
    chunk = max(1, 4_000_000 // len(h))
    for s in range(0, n_mc, chunk):
        z2 = rng.standard_normal((min(chunk, n_mc - s), len(h))) ** 2
        base[s:s + len(z2)] = 0.5 * z2.sum(axis=1)
        ula[s:s + len(z2)] = 0.5 * z2 @ w
    return float(np.quantile(base, 1 - alpha)), float(np.quantile(ula, 1 - alpha))


def _batch_means_var(x: np.ndarray, n_batches: int = 25) -> float:
    """Variance of the grand mean of ``x`` (``(chain, draw)``) by batch means within chains."""
    x = np.asarray(x, np.float64)
    if x.ndim == 1:
        x = x[None]
    n_chain, n = x.shape
    B = max(2, min(n_batches, n // 10))
    m = n // B
    bm = x[:, : B * m].reshape(n_chain, B, m).mean(axis=2).ravel()  # n_chain·B batch means
    # each batch mean has variance ≈ σ²_asy/m, so Var(grand mean of N = n_chain·B·m) ≈ var(bm)/(n_chain·B)
    return float(bm.var(ddof=1) / len(bm))


def quantile_mcse(values: np.ndarray, q: float, n_batches: int = 25) -> tuple[float, float]:
    """``(estimate, standard error)`` of the ``q``-quantile of ``values`` (``(chain, draw)`` or
    ``(draw,)``), autocorrelation included.

    Delta method: ``ξ̂ − ξ ≈ −(F̂(ξ) − q)/f(ξ)``; ``Var F̂(ξ)`` is the variance of the mean of the
    indicator ``1{U ≤ ξ̂}``, estimated by batch means within each chain (``n_batches`` per
    chain), and ``f(ξ)`` by a Gaussian kernel density estimate at ``ξ̂`` (Silverman's bandwidth).
    """
    v = np.asarray(values, np.float64)
    v2 = v if v.ndim == 2 else v[None]
    flat = v2.ravel()
    xi = float(np.quantile(flat, q))
    var_F = _batch_means_var((v2 <= xi).astype(np.float64), n_batches)
    return xi, math.sqrt(var_F) / _density_at(flat, xi)


def _density_at(flat: np.ndarray, x: float) -> float:
    """Gaussian kernel density estimate at ``x`` with Silverman's bandwidth."""
    sd = flat.std(ddof=1)
    iqr = np.subtract(*np.quantile(flat, [0.75, 0.25]))
    bw = 0.9 * min(sd, iqr / 1.34) * len(flat) ** (-0.2)
    return float(np.mean(np.exp(-0.5 * ((flat - x) / bw) ** 2)) / (bw * math.sqrt(2 * math.pi)))


def paired_quantile_diff(values_a: np.ndarray, values_b: np.ndarray, q: float,
                         n_batches: int = 25) -> tuple[float, float]:
    """``(ξ_a − ξ_b, standard error)`` for the ``q``-quantiles of two runs driven by the *same*
    random numbers (common seeds: same participation, minibatches, Langevin noise), draw ``t``
    of chain ``c`` paired with draw ``t`` of chain ``c``. Delta method on the paired series
    ``1{a ≤ ξ_a}/f_a − 1{b ≤ ξ_b}/f_b``, batch means within chains. Far smaller than the
    independent-runs error when the two chains stay close."""
    a = np.asarray(values_a, np.float64)
    b = np.asarray(values_b, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired runs need the same shape, got {a.shape} and {b.shape}")
    a2, b2 = (a, b) if a.ndim == 2 else (a[None], b[None])
    xa, xb = float(np.quantile(a2, q)), float(np.quantile(b2, q))
    D = (a2 <= xa) / _density_at(a2.ravel(), xa) - (b2 <= xb) / _density_at(b2.ravel(), xb)
    return xa - xb, math.sqrt(_batch_means_var(D.astype(np.float64), n_batches))


def hpd_error_with_se(U_samples: np.ndarray, eta_ref: float, se_ref: float = 0.0,
                      alpha: float = 0.01) -> dict:
    """Relative HPD error against a reference threshold, with its Monte Carlo standard error
    (both thresholds' errors, combined in quadrature, divided by ``|η_ref|``)."""
    eta, se = quantile_mcse(U_samples, 1.0 - alpha)
    return {"eta": eta, "eta_se": se, "signed": (eta - eta_ref) / abs(eta_ref),
            "error": abs(eta - eta_ref) / abs(eta_ref),
            "se": math.hypot(se, se_ref) / abs(eta_ref)}


def potential_batch(task, thetas: np.ndarray, chunk: int = 2000) -> np.ndarray:
    """``U(θ)`` for every row of ``thetas`` (``(S, d)``): vectorised for softmax-regression
    clients (:class:`~qlsd_flwr.tasks.logistic.LogisticLocal`), else one ``task.potential``
    call per row. Same terms as :meth:`~qlsd_flwr.core.potential.Task.potential`."""
    from qlsd_flwr.tasks.logistic import LogisticLocal

    th = np.asarray(thetas, np.float64).reshape(-1, task.dim)
    if not all(isinstance(c, LogisticLocal) for c in task.clients):
        return np.array([task.potential(t) for t in th])
    pr = task.prior
    out = np.zeros(len(th)) if pr.is_flat else np.sum((th - pr.mean) ** 2, axis=1) / (2.0 * pr.var)
    for c in task.clients:
        K = c.n_classes
        for s0 in range(0, len(th), chunk):
            W = th[s0:s0 + chunk].reshape(-1, c.n_features + 1, K)
            z = np.einsum("np,spk->snk", c.Xa, W)  # (s, n, K)
            m = z.max(axis=2, keepdims=True)
            lse = m[..., 0] + np.log(np.exp(z - m).sum(axis=2))
            zy = np.take_along_axis(z, np.broadcast_to(c.y[None, :, None], (len(W), len(c.y), 1)),
                                    axis=2)[..., 0]
            out[s0:s0 + chunk] += (lse - zy).sum(axis=1)
    return out


def ula_mean_shift_laplace(h_eigs: np.ndarray, gamma: float) -> float:
    """``E_γ[U] − E_π[U]`` for exact-gradient ULA at step ``γ`` on the Laplace approximation:
    ``½ Σ_k (1/(1 − γh_k/2) − 1)`` (each ``½ h_k x_k²`` has mean ``½`` under ``π``)."""
    h = np.asarray(h_eigs, np.float64)
    return float(0.5 * np.sum(1.0 / (1.0 - gamma * h / 2.0) - 1.0))


def mean_mcse(values: np.ndarray, n_batches: int = 25) -> tuple[float, float]:
    """``(mean, standard error)`` of ``values`` (``(chain, draw)`` or ``(draw,)``) by batch means."""
    v = np.asarray(values, np.float64)
    return float(v.mean()), math.sqrt(_batch_means_var(v, n_batches))
