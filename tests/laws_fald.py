"""FALD's and VR-FALD*'s exact stationary laws on the toy Gaussian: the tests' oracles (issue 36 keeps them beside the
tests, out of the production code). Moved unchanged from :mod:`qlsd_flwr.core.fald`, whose numerics they
describe.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core.fald import weights


def gaussian_stationary(n, ybar, h: float, steps: int, tau: float = 0.0, prior_var: float = np.inf,
                        rule: str = "data", anchor=None, p=None, kappa=None):
    r"""The exact stationary law of FALD's θ on the toy Gaussian (clients of ``n[i]`` points with
    mean ``ybar[i]``, the prior ``N(0, σ_0²)``): ``(mean (d,), variance)``, the variance one number
    when every coordinate has the same (always with ``p = None``), else ``(d,)``.

    Per coordinate, ``∇Ũ_i(x) = a_i x − N_i ȳ_i`` with ``a_i = N_i + w_i/σ_0²``, so one local step is
    ``x ← ρ_i x + c_i + noise`` with ``ρ_i = 1 − h a_i / w_i`` and ``c_i = h N_i ȳ_i / w_i``. After ``K``
    steps and the server's average over the active set ``A`` (weights ``ω_i = w_i/p_i``, module
    docstring), ``θ' = α θ + β + ε`` with ``α = 1 − Σ_A ω_i (1 − ρ_i^K)``, ``β = Σ_A ω_i c_i Σ_j ρ_i^j``
    and ``Var ε = 2h [τ/S_A² Σ_j (Σ_A ω_i ρ_i^j)² + Σ_A ω_i² (1 − τ) p_i/(w_i S_A) Σ_j ρ_i^{2j}]``
    (``j < K``; an empty ``A`` leaves θ). ``(α, β, ε)`` are drawn afresh each round, independent of θ:
    the stationary mean is ``E β / (1 − E α)`` and the second moment
    ``(2 E[αβ] m + E β² + E Var ε) / (1 − E α²)``, the expectations taken exactly over all ``2^b``
    active sets (``p``: one ``p_i`` or one per client; ``None``: every client in every round, where
    this is the AR(1) ``N(β / (1 − α), Var ε / (1 − α²))``).

    With ``w_i = N_i / N`` and ``p = 1`` every ``ρ_i`` is ``1 − h P`` (``P = N + 1/σ_0²``): the local
    maps are one contraction toward each client's own mode, their average is ULA's, and the law is
    ULA's for every ``K``: no local-step bias on this task. With equal weights the ``ρ_i`` differ on
    clients of unequal sizes and the mean moves by ``O(hK)``.

    With ``anchor`` (VR-FALD\* with a fixed θ_r, ``q = 0``), ``G_i(x) = a_i (x − θ_r) + w_i g_r`` with
    ``g_r = P θ_r − Σ_i N_i ȳ_i``: then ``c_i = h (a_i θ_r − w_i g_r) / w_i``.

    ``kappa``: each client's per-datum precision ``κ_i`` (1: the toy Gaussian); its points then weigh
    ``κ_i N_i`` in every formula above but the weights ``w_i = N_i / N``, so ``a_i / w_i`` differ between
    the clients and the reference of VR-FALD\* matters."""
    n = np.asarray(n, dtype=np.float64)
    ybar = np.asarray(ybar, dtype=np.float64)
    b = n.size
    w = weights(n, rule)
    if kappa is not None:
        n = n * np.broadcast_to(np.asarray(kappa, dtype=np.float64), (b,))
    pp = np.ones(b) if p is None else np.broadcast_to(np.asarray(p, dtype=np.float64), (b,))
    prec0 = 0.0 if not np.isfinite(prior_var) else 1.0 / prior_var
    rho = 1.0 - h * (n + w * prec0) / w
    powers = rho[:, None] ** np.arange(steps)[None, :]  # (b, K): ρ_i^j
    if anchor is None:  # c_i = h N_i ȳ_i / w_i
        c = (h * n / w)[:, None] * ybar
    else:  # c_i = h (a_i θ_r − w_i g_r) / w_i
        a, ref = n + w * prec0, np.asarray(anchor, dtype=np.float64)
        g_r = (n.sum() + prec0) * ref - (n[:, None] * ybar).sum(axis=0)
        c = h * (a[:, None] * ref[None, :] - w[:, None] * g_r[None, :]) / w[:, None]
    moved = (powers.sum(axis=1))[:, None] * c  # (b, d): c_i Σ_j ρ_i^j
    E = {"a": 0.0, "a2": 0.0, "b": 0.0, "ab": 0.0, "b2": 0.0, "v": 0.0}
    sets = [np.ones(b, dtype=bool)] if p is None else \
        [((np.arange(1 << b)[m] >> np.arange(b)) & 1).astype(bool) for m in range(1 << b)]
    for on in sets:
        prob = float(np.prod(np.where(on, pp, 1.0 - pp)))
        if prob == 0.0:
            continue
        if not on.any():  # nobody replies: θ stays
            alpha, beta, var = 1.0, np.zeros(ybar.shape[1]), 0.0
        else:
            om = np.where(on, w / pp, 0.0)
            S = float(om.sum())
            alpha = 1.0 - float(np.sum(om * (1.0 - rho**steps)))
            beta = (om[:, None] * moved).sum(axis=0)
            var = 2.0 * h * (tau / S**2 * float(np.sum((om[:, None] * powers).sum(axis=0) ** 2))
                             + float(np.sum(om**2 * (1.0 - tau) * pp / (w * S) * (powers**2).sum(axis=1))))
        E["a"] += prob * alpha
        E["a2"] += prob * alpha**2
        E["b"] = E["b"] + prob * beta
        E["ab"] = E["ab"] + prob * alpha * beta
        E["b2"] = E["b2"] + prob * beta**2
        E["v"] += prob * var
    if not E["a2"] < 1.0:
        raise ValueError(f"FALD on this Gaussian is unstable at h = {h} (E α² = {E['a2']:.3g} ≥ 1)")
    m = E["b"] / (1.0 - E["a"])
    second = (2.0 * E["ab"] * m + E["b2"] + E["v"]) / (1.0 - E["a2"])
    v = second - m**2
    # one number when every coordinate has the same (always at p = 1); with p < 1 the participation's
    # gradient noise depends on the clients' ȳ_i coordinate by coordinate: (d,)
    return m, float(np.mean(v)) if np.allclose(v, v.flat[0], rtol=1e-9, atol=0) else v


def gaussian_stationary_metric(n, ybar, h: float, steps: int, tau: float, prior_var: float, metric,
                               anchor=None, p=None):
    r"""The exact stationary law of FALD's θ on the toy Gaussian with a metric ``M`` (any SPD ``d × d``
    matrix; :func:`local_steps`): ``(mean (d,), covariance (d, d))``, the active sets' expectation exact
    as in :func:`gaussian_stationary`, of which this is the matrix form (coordinates coupled by ``M``,
    and by the active set they share).

    Client ``i``'s step is ``x ← R_i x + c_i + noise`` with ``R_i = I − (h a_i/w_i) M`` (``a_i = N_i +
    w_i/σ_0²``) and ``c_i = (h/w_i) M N_i ȳ_i`` (VR-FALD\* with ``θ_r``: ``(h/w_i) M (a_i θ_r − w_i g_r)``,
    ``g_r = P θ_r − Σ_i N_i ȳ_i``); the noise ``√(2h) M^{1/2} (a ξ_j + b ξ_{i,j})``. After ``K`` steps and
    the average over ``A`` (weights ``ω_i = w_i/p_i``): ``θ' = A θ + β + ε`` with ``A = I − Σ_A ω_i (I −
    R_i^K)``, ``β = Σ_A ω_i Σ_j R_i^j c_i`` and ``Var ε = 2h Σ_j [τ/S_A² (Σ_A ω_i R_i^j) M (Σ_A ω_i
    R_i^j)ᵀ + Σ_A ω_i² (1 − τ) p_i/(w_i S_A) R_i^j M R_i^{jᵀ}]``. The mean solves ``(I − E A) m = E β``
    and the second moment ``S = E[A S Aᵀ] + E[A m βᵀ + β mᵀ Aᵀ] + E[β βᵀ] + E Var ε``, solved through
    ``vec(A S Aᵀ) = (A ⊗ A) vec(S)``."""
    n = np.asarray(n, dtype=np.float64)
    ybar = np.asarray(ybar, dtype=np.float64)
    M = np.asarray(metric, dtype=np.float64)
    b, d = ybar.shape
    w = weights(n)
    pp = np.ones(b) if p is None else np.broadcast_to(np.asarray(p, dtype=np.float64), (b,))
    prec0 = 0.0 if not np.isfinite(prior_var) else 1.0 / prior_var
    a = n + w * prec0
    eye = np.eye(d)
    R = [eye - (h * a[i] / w[i]) * M for i in range(b)]
    if anchor is None:
        c = [(h / w[i]) * M @ (n[i] * ybar[i]) for i in range(b)]
    else:
        ref = np.asarray(anchor, dtype=np.float64)
        g_r = (n.sum() + prec0) * ref - (n[:, None] * ybar).sum(axis=0)
        c = [(h / w[i]) * M @ (a[i] * ref - w[i] * g_r) for i in range(b)]
    pw = [[np.linalg.matrix_power(R[i], j) for j in range(steps)] for i in range(b)]
    moved = [sum(pw[i]) @ c[i] for i in range(b)]
    EA, EAA, Eb, EN = np.zeros((d, d)), np.zeros((d * d, d * d)), np.zeros(d), np.zeros((d, d))
    parts = []
    for mask in range(1 << b):
        on = ((mask >> np.arange(b)) & 1).astype(bool)
        prob = float(np.prod(np.where(on, pp, 1.0 - pp)))
        if prob == 0.0:
            continue
        if not on.any():
            A, beta, N = eye, np.zeros(d), np.zeros((d, d))
        else:
            om = np.where(on, w / pp, 0.0)
            S = float(om.sum())
            A = eye - sum(om[i] * (eye - pw[i][-1] @ R[i]) for i in np.flatnonzero(on))
            beta = sum(om[i] * moved[i] for i in np.flatnonzero(on))
            N = np.zeros((d, d))
            for j in range(steps):
                common = sum(om[i] * pw[i][j] for i in np.flatnonzero(on))
                N += tau / S**2 * common @ M @ common.T
                N += sum(om[i] ** 2 * (1 - tau) * pp[i] / (w[i] * S) * pw[i][j] @ M @ pw[i][j].T
                         for i in np.flatnonzero(on))
            N *= 2.0 * h
        EA += prob * A
        EAA += prob * np.kron(A, A)
        Eb += prob * beta
        EN += prob * N
        parts.append((prob, A, beta))
    m = np.linalg.solve(eye - EA, Eb)
    rhs = EN + sum(prob * (np.outer(A @ m, beta) + np.outer(beta, A @ m) + np.outer(beta, beta))
                   for prob, A, beta in parts)
    second = np.linalg.solve(np.eye(d * d) - EAA, rhs.ravel()).reshape(d, d)
    return m, second - np.outer(m, m)


def gaussian_stationary_refresh(n, ybar, h: float, steps: int, tau: float, prior_var: float, q: float,
                                p=None, rule: str = "data", kappa=None):
    r"""The exact stationary law of VR-FALD\*'s θ with its reference refreshed (probability ``q > 0``,
    :func:`run`) on a Gaussian whose client ``i`` has ``n[i]`` points of mean ``ybar[i]`` and per-datum
    precision ``κ_i`` (``kappa``; 1: the toy Gaussian): ``(mean (d,), variance (d,))``.

    Per coordinate, ``∇Ũ_i(x) = a_i x − e_i`` (``a_i = κ_i N_i + w_i/σ_0²``, ``e_i = κ_i N_i ȳ_i``), so
    ``G_i(x) = a_i x + (w_i A − a_i) θ_r − w_i E`` (``A = Σ a_i``, ``E = Σ e_i``) and a local step is
    ``x ← ρ_i x + u_i θ_r + h E`` with ``ρ_i = 1 − h a_i/w_i`` and ``u_i = h (a_i/w_i − A)``: the
    reference drops out when every ``a_i/w_i`` is ``A`` (the toy Gaussian with ``w_i = N_i/N``), and
    matters when the clients' curvatures per unit of weight differ. The state ``(θ, θ_r)`` follows
    ``y' = T y + t + ε``: a round that does not refresh (probability ``1 − q``, the active set as the
    participation draws it, weights ``w_i/p_i``) has ``T = [[α, u], [0, 1]]``; a refresh round
    (probability ``q``, every client, weights ``w_i``) ``T = [[α, u], [1, 0]]`` (θ_r becomes the round's
    θ), with ``α = 1 − Σ_A ω_i (1 − ρ_i^K)``, ``u = Σ_A ω_i u_i Σ_j ρ_i^j``, ``t = (h E Σ_A ω_i Σ_j ρ_i^j, 0)``
    and the noise's variance of :func:`gaussian_stationary`. Mean and second moment as there, through
    ``T ⊗ T``."""
    n = np.asarray(n, dtype=np.float64)
    ybar = np.asarray(ybar, dtype=np.float64)
    if not q > 0:
        raise ValueError("gaussian_stationary_refresh: q > 0 (with q = 0 the reference stays: gaussian_stationary)")
    b = n.size
    kap = np.ones(b) if kappa is None else np.broadcast_to(np.asarray(kappa, dtype=np.float64), (b,))
    w = weights(n, rule)
    pp = np.ones(b) if p is None else np.broadcast_to(np.asarray(p, dtype=np.float64), (b,))
    prec0 = 0.0 if not np.isfinite(prior_var) else 1.0 / prior_var
    a = kap * n + w * prec0
    rho = 1.0 - h * a / w
    powers = rho[:, None] ** np.arange(steps)[None, :]
    geo = powers.sum(axis=1)
    u = h * (a / w - a.sum())
    kinds = [(q, np.ones(b, dtype=bool), np.ones(b), True)]  # (probability, active, p that round, refresh)
    for mask in range(1 << b):
        on = ((mask >> np.arange(b)) & 1).astype(bool)
        prob = (1.0 - q) * float(np.prod(np.where(on, pp, 1.0 - pp)))
        if prob > 0:
            kinds.append((prob, on, pp, False))
    means, variances = [], []
    for j in range(ybar.shape[1]):
        E = float(np.sum(kap * n * ybar[:, j]))
        ET, ETT, Et, EN, parts = np.zeros((2, 2)), np.zeros((4, 4)), np.zeros(2), np.zeros((2, 2)), []
        for prob, on, pk, fresh in kinds:
            if not on.any():
                T, t, var = np.array([[1.0, 0.0], [0.0, 1.0]]), np.zeros(2), 0.0
            else:
                om = np.where(on, w / pk, 0.0)
                S = float(om.sum())
                alpha = 1.0 - float(np.sum(om * (1.0 - rho**steps)))
                T = np.array([[alpha, float(np.sum(om * geo * u))], [1.0, 0.0] if fresh else [0.0, 1.0]])
                t = np.array([h * E * float(np.sum(om * geo)), 0.0])
                var = 2.0 * h * (tau / S**2 * float(np.sum((om[:, None] * powers).sum(axis=0) ** 2))
                                 + float(np.sum(om**2 * (1.0 - tau) * pk / (w * S) * (powers**2).sum(axis=1))))
            ET += prob * T
            ETT += prob * np.kron(T, T)
            Et += prob * t
            EN[0, 0] += prob * var
            parts.append((prob, T, t))
        m = np.linalg.solve(np.eye(2) - ET, Et)
        rhs = EN + sum(pr * (np.outer(T @ m, t) + np.outer(t, T @ m) + np.outer(t, t)) for pr, T, t in parts)
        second = np.linalg.solve(np.eye(4) - ETT, rhs.ravel()).reshape(2, 2)
        means.append(m[0])
        variances.append(second[0, 0] - m[0] ** 2)
    return np.array(means), np.array(variances)
