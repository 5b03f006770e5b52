"""DG-LMC's exact stationary laws on the toy Gaussian: the tests' oracles (issue 36 keeps them beside the
tests, out of the production code). Moved unchanged from :mod:`qlsd_flwr.core.dglmc`, whose numerics they
describe.
"""

from __future__ import annotations

import numpy as np


def gaussian_marginal(n: np.ndarray, ybar: np.ndarray, rho: np.ndarray, prior_var: float = np.inf):
    """θ-marginal of ``π_ρ`` for the toy Gaussian (clients of ``n[i]`` points with mean
    ``ybar[i]``): ``(mean (d,), variance)``, the same variance in every coordinate."""
    w = 1.0 / (1.0 / np.asarray(n, dtype=np.float64) + np.asarray(rho, dtype=np.float64))
    prec = float(w.sum()) + (0.0 if not np.isfinite(prior_var) else 1.0 / prior_var)
    return (w[:, None] * np.asarray(ybar)).sum(axis=0) / prec, 1.0 / prec


def gaussian_stationary(n, ybar, rho, gamma, steps: int, prior_var: float = np.inf, p=None):
    """The exact stationary law of DG-LMC's θ on the toy Gaussian, ULA on ``z`` included:
    ``(mean (d,), variance)``, the variance one number when every coordinate has the same (always
    with ``p = None``), else ``(d,)``.

    Per coordinate the round maps ``x = (θ, z_1, …, z_b)`` to ``A_S x + c_S + noise_S``: the active
    clients ``S`` take their local steps (an inactive client's ``z_i`` stays), then θ is drawn
    exactly. With every client in every round (``p = None``) the stationary mean solves
    ``(I − A) m = c`` and the covariance ``Σ = A Σ Aᵀ + N`` (a discrete Lyapunov equation). With
    client ``i`` active with probability ``p_i`` (one value or one per client; the protocol's
    random scan over the ``z_i``), ``(A_S, c_S, N_S)`` are drawn afresh each round, independent of
    ``x``: ``m = (I − E A)⁻¹ E c`` and the second moment ``M = E[A M Aᵀ] + E[A m cᵀ + c mᵀ Aᵀ] +
    E[c cᵀ] + E N``, solved as a linear system in ``M``, the expectations exact over all ``2^b``
    active sets."""
    n, rho, gamma = (np.broadcast_to(np.asarray(v, dtype=np.float64), np.shape(n)) for v in (n, rho, gamma))
    ybar = np.asarray(ybar, dtype=np.float64)
    b = n.size
    pp = np.ones(b) if p is None else np.broadcast_to(np.asarray(p, dtype=np.float64), (b,))
    q = float(np.sum(1.0 / rho)) + (0.0 if not np.isfinite(prior_var) else 1.0 / prior_var)
    # one local step: z_i ← a_i z_i + (γ_i/ρ_i) θ + γ_i N_i ȳ_i + √(2γ_i) ξ, a_i = 1 − γ_i N_i − γ_i/ρ_i
    a = 1.0 - gamma * n - gamma / rho
    # K steps (θ fixed): z ← a^K z + (Σ_j a^j)(γ/ρ θ + γ N ȳ) + noise of variance 2γ Σ_j a^{2j}
    geo = np.array([np.sum(a[i] ** np.arange(steps)) for i in range(b)])
    geo2 = np.array([np.sum(a[i] ** (2 * np.arange(steps))) for i in range(b)])
    T = np.zeros((b + 1, b + 1))  # then θ ← Σ_i z_i/(ρ_i q) + N(0, 1/q); z kept
    T[1:, 1:] = np.eye(b)
    T[0, 1:] = 1.0 / (rho * q)
    D = b + 1
    EA, EAA, EN = np.zeros((D, D)), np.zeros((D * D, D * D)), np.zeros((D, D))
    sets = [np.ones(b, dtype=bool)] if p is None else \
        [((m >> np.arange(b)) & 1).astype(bool) for m in range(1 << b)]
    parts = []  # (probability, A_S, the active mask) for the constant terms below
    for on in sets:
        prob = float(np.prod(np.where(on, pp, 1.0 - pp)))
        if prob == 0.0:
            continue
        Z = np.eye(D)  # the map of the local steps on x = (θ, z): inactive z_i stay
        for i in np.flatnonzero(on):
            Z[1 + i, 0] = geo[i] * gamma[i] / rho[i]
            Z[1 + i, 1 + i] = a[i] ** steps
        Sz = np.diag(np.concatenate([[0.0], np.where(on, 2.0 * gamma * geo2, 0.0)]))
        A = T @ Z
        N = T @ Sz @ T.T
        N[0, 0] += 1.0 / q
        EA += prob * A
        EAA += prob * np.kron(A, A)
        EN += prob * N
        parts.append((prob, A, on))
    if p is None:
        from scipy.linalg import solve_discrete_lyapunov

        A = parts[0][1]
        cov0 = solve_discrete_lyapunov(A, EN)
    means, var = [], []
    for y in ybar.T:  # per coordinate: the constant term of the round
        cs = [(prob, A, T @ np.concatenate([[0.0], np.where(on, geo * gamma * n * y, 0.0)])) for prob, A, on in parts]
        Ec = sum(prob * c for prob, _, c in cs)
        m = np.linalg.solve(np.eye(D) - EA, Ec)
        means.append(m[0])
        if p is None:
            var.append(cov0[0, 0])
            continue
        rhs = EN + sum(prob * (np.outer(A @ m, c) + np.outer(c, A @ m) + np.outer(c, c)) for prob, A, c in cs)
        M = np.linalg.solve(np.eye(D * D) - EAA, rhs.ravel()).reshape(D, D)
        var.append(M[0, 0] - m[0] ** 2)
    v = np.array(var)
    return np.array(means), float(np.mean(v)) if np.allclose(v, v[0], rtol=1e-9, atol=0) else v
