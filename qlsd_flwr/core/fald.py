r"""FALD and VR-FALD\* (Plassier, Durmus, Moulines, AISTATS 2023): federated averaging Langevin
dynamics, and its variance-reduced version with control variates at a reference point.

One round ``k → k+1``, ``K`` local steps on every client, full local gradients: each client ``i``
starts from θ_k and takes ``K`` steps

    θ_i ← θ_i − (h/w_i) ∇Ũ_i(θ_i) + √(2h) (√τ ξ_j + √((1 − τ)/w_i) ξ_{i,j}),   j = 0 … K−1,

then the server averages, ``θ_{k+1} = Σ_i w_i θ_i``. Here ``w_i = N_i / N`` (``Σ_i w_i = 1``), ``Ũ_i =
U_i + w_i U_0`` (the prior shared in proportion to the data), ``ξ_j`` the **common** noise of local
step ``j`` (every client draws the same one: stream ``(seed, NOISE, k, 0)``, positions
``[jd, (j+1)d)``) and ``ξ_{i,j}`` client ``i``'s own (stream ``(seed, LOCAL, k, i)``); ``τ ∈ [0, 1]``
is the share of the noise that is common (the papers' privacy knob: ``τ = 1`` sends only shared
noise, ``τ = 0`` only private noise).

**Why this scaling targets π and not a cooled posterior.** With ``K = 1`` the average takes exactly
the unadjusted Langevin step of size ``h`` on ``U = Σ_i Ũ_i``: its drift is ``−h Σ_i ∇Ũ_i(θ)``, its
noise variance ``2h (τ (Σ_i w_i)² + (1 − τ) Σ_i w_i² / w_i) = 2h``. The FALD repository's
deep-learning variant injects one shared ``√(2γ/b) ξ`` with the full-data drift, whose average
targets ``exp(−b U)``, a posterior cooled by the number of clients; the same paper's numpy
version has this module's scaling with ``w_i = 1/b`` (``h = γ/b``). With ``K > 1`` each client
drifts toward its own mode between averages: the stationary law moves by ``O(hK)`` on
heterogeneous clients (the local-step bias, ``O(h(K − 1))``; none on the toy Gaussian with ``w_i = N_i/N``, where
the clients' curvatures are proportional to their weights), besides ULA's ``O(h)``. For the toy Gaussian the
round is a linear Gaussian recursion and :func:`gaussian_stationary` gives its law exactly; the
tests compare the chain with it.

**Partial participation** (client ``i`` active with probability ``p_i``, the set ``A``): the server
takes ``θ_{k+1} = θ_k + Σ_{i∈A} (w_i/p_i)(θ_i − θ_k)`` (the Horvitz–Thompson weights of
``aggregation = unbiased``), and tells every active client ``S_A = Σ_{j∈A} w_j/p_j``, with which it
scales its noise: common ``√τ/S_A``, private ``√((1 − τ) p_i/(w_i S_A))``. Given ``A`` the averaged
noise is then exactly ``√(2h)`` times a standard normal (common part ``Σ_A (w_i/p_i)·√τ/S_A = √τ``,
private variance ``Σ_A (w_i/p_i)² (1 − τ) p_i/(w_i S_A) = 1 − τ``), and with ``K = 1`` the drift
``h Σ_A ∇Ũ_i/p_i`` is unbiased for ``h ∇U``: FALD is then SGLD with the participation's gradient
noise, for any τ. At ``p = 1``, ``S_A = 1`` and the scales are the ones above. A round in which no
client replies leaves θ where it is (counted as skipped). :func:`gaussian_stationary` gives the law
with participation too, exactly (the expectation over every active set).

**The message** a client sends is ``Δ_i = (θ_k − θ_i)/h`` (:func:`message`), which the server
decodes and applies as ``θ_{k+1} = θ_k − h Σ_{i∈A} (w_i/p_i) Δ̂_i``
(:func:`qlsd_flwr.samplers.fald.average_step`); with QSGD it is compressed like a gradient
(unbiased, so the average is; the noise it carries is part of what is compressed, so the
quantisation adds variance of order ``ω`` relative to the Langevin noise).

The round protocol, the Flower apps and the local and Ray engines run it (``variant = fald``,
``vr-fald-star``; :mod:`qlsd_flwr.protocol.server`); :func:`run` is the framework-free reference.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import participation, rng


def weights(n_data, rule: str = "data") -> np.ndarray:
    """``w_i``: ``N_i / N`` (``data``) or ``1/b`` (``equal``, the FALD repository's numpy code)."""
    n = np.asarray(n_data, dtype=np.float64)
    if rule not in ("data", "equal"):
        raise ValueError(f"FALD weights: 'data' or 'equal', got {rule!r}")
    return n / n.sum() if rule == "data" else np.full(n.size, 1.0 / n.size)


def round_shares(n_data, kept, active, p) -> tuple[np.ndarray, float]:
    """``(w, S_A)``: the data shares ``w_i = N_i / Σ_{j kept} N_j`` (0 for a client no longer kept) and
    the active set's ``S_A = Σ_{i∈A} w_i/p_i`` (the server's, each round: :mod:`qlsd_flwr.protocol.server`)."""
    n = np.asarray(n_data, dtype=np.float64)
    on = np.zeros(n.size, dtype=bool)
    on[list(kept)] = True
    w = np.where(on, n, 0.0) / float(np.sum(n[on])) if on.any() else np.zeros(n.size)
    a = np.asarray(list(active), dtype=np.int64)
    return w, float(np.sum(w[a] / np.asarray(p, dtype=np.float64)[a])) if a.size else 0.0


def noise_scales(w: float, tau: float, share: float = 1.0, p: float = 1.0) -> tuple[float, float]:
    """``(a, b)``: the common and the private noise's coefficients of client ``i`` (module docstring):
    ``a = √τ / S_A``, ``b = √((1 − τ) p_i / (w_i S_A))``."""
    return float(np.sqrt(tau) / share), float(np.sqrt((1.0 - tau) * p / (w * share)))


def local_steps(grad_u, theta: np.ndarray, w: float, h: float, tau: float, steps: int, seed: int, k: int,
                i: int, share: float = 1.0, p: float = 1.0, temperature: float = 1.0, metric=None) -> np.ndarray:
    """Client ``i``'s ``K = steps`` local steps from ``θ`` at round ``k`` (``grad_u = ∇Ũ_i``); ``share``
    ``S_A`` and ``p`` ``p_i`` scale the noise (module docstring), ``temperature`` ``T`` multiplies its
    variance (the chain then targets ``π^{1/T}``). ``metric``: a metric ``M``
    (:class:`qlsd_flwr.core.metric.Metric` of any kind, or ``d`` numbers for a diagonal one; ``None``:
    the identity): each step is then ``x − (h/w_i) M ∇Ũ_i(x) + √(2hT) M^{1/2} (noise)``, whose average
    over the clients is the preconditioned Langevin step ``θ − h M ∇U(θ) + √(2hT) M^{1/2} ξ`` (with one
    local step). In the whitened coordinates ``φ = M^{-1/2} x`` it is FALD on ``Ũ_i(M^{1/2} φ)``; with
    a diagonal ``M`` every coordinate is FALD with the step ``h m_j``."""
    d = theta.shape[-1]
    common = rng.normal(seed, rng.Stream.NOISE, k, 0, steps * d).reshape(steps, d)
    own = rng.normal(seed, rng.Stream.LOCAL, k, i, steps * d).reshape(steps, d)
    a, b = noise_scales(w, tau, share, p)
    noise_sd = np.sqrt(2.0 * h * temperature)
    x = np.asarray(theta, dtype=np.float64).copy()
    if metric is None:
        for j in range(steps):
            x = x - (h / w) * grad_u(x) + noise_sd * (a * common[j] + b * own[j])
        return x
    M = as_metric(metric)
    for j in range(steps):
        x = x - (h / w) * M.apply(grad_u(x)) + noise_sd * M.apply_root(a * common[j] + b * own[j])
    return x


def as_metric(metric):
    """A :class:`~qlsd_flwr.core.metric.Metric`, or ``d`` numbers taken as a diagonal one."""
    from qlsd_flwr.core.metric import Diagonal, Metric

    return metric if isinstance(metric, Metric) else Diagonal(metric)


def message(grad_u, theta: np.ndarray, w: float, h: float, tau: float, steps: int, seed: int, k: int, i: int,
            share: float = 1.0, p: float = 1.0, temperature: float = 1.0, metric=None) -> np.ndarray:
    """What client ``i`` sends: ``Δ_i = (θ − θ_i)/h`` after its :func:`local_steps`."""
    theta = np.asarray(theta, dtype=np.float64)
    return (theta - local_steps(grad_u, theta, w, h, tau, steps, seed, k, i, share, p, temperature, metric)) / h


def run(task, h: float, steps: int, rounds: int, tau: float = 0.0, seed: int = 0, theta0=None,
        rule: str = "data", anchor=None, q: float = 0.0, p=None) -> np.ndarray:
    r"""``rounds`` rounds of FALD on ``task`` (its clients' ``grad_sum``; a Gaussian prior or a flat
    one), weights by ``rule`` (:func:`weights`), client ``i`` active with probability ``p_i`` (``p``:
    one value or one per client; ``None``: all, every round). Returns ``θ_1 … θ_K`` ``(rounds, d)``.

    With ``anchor`` (a reference point θ_r, e.g. the mode θ*), **VR-FALD\***: each client's local
    gradient is the control-variate estimate ``G_i(x) = ∇Ũ_i(x) − ∇Ũ_i(θ_r) + w_i ∇U(θ_r)``, whose
    weighted sum over clients is still ``∇U(x)`` at a common point. The control variate pulls every
    client's local steps toward the federation's mode instead of its own: with θ_r = θ* and ``q = 0``
    the stationary mean on the toy Gaussian is exact for any weights and ``K``.

    **The refresh** (``q > 0``), as the round protocol runs it: round ``k`` refreshes with probability
    ``q`` (stream ``(seed, REFRESH, k, 0)``). In that round every client takes part (``p_i = 1`` for
    the round: ``S_A = 1``) and, besides its local steps with the current θ_r, gives ``∇Ũ_i(θ_k)``;
    θ_r becomes θ_k from round ``k + 1`` on, once the sum ``∇U(θ_k)`` is whole (the authors' code also
    installs a new reference one step after it computes it). Any θ_r fixed before the rounds it serves
    keeps ``Σ_i G_i = ∇U`` at a common point, so the refresh changes the local-step bias (a θ_r near
    the chain instead of θ*), never the unbiasedness; :func:`gaussian_stationary_refresh` gives the
    law."""
    d = task.dim
    w = weights([c.n_data for c in task.clients], rule)
    prior = task.prior  # Ũ_i = U_i + w_i U_0: the prior's own gradient (any mean, any prior with one)
    grads = [lambda x, p=pot, wi=w[i]: p.grad_sum(x) + wi * prior.grad(x) for i, pot in enumerate(task.clients)]
    theta = np.zeros(d) if theta0 is None else np.asarray(theta0, dtype=np.float64).copy()
    ref = None if anchor is None else np.asarray(anchor, dtype=np.float64).copy()
    at_ref = None if ref is None else [g(ref) for g in grads]
    pp = np.ones(task.b) if p is None else np.broadcast_to(np.asarray(p, dtype=np.float64), (task.b,))
    out = np.empty((rounds, d))
    for k in range(rounds):
        fresh = ref is not None and refreshes(q, seed, k)
        pk = np.ones(task.b) if fresh else pp  # a refresh round asks every client
        on = np.flatnonzero(np.ones(task.b, dtype=bool) if fresh else participation.active_mask(seed, k, pp))
        share = float(np.sum(w[on] / pk[on]))
        step = np.zeros(d)
        for i in on:  # θ_{k+1} = θ_k + Σ_A (w_i/p_i)(θ_i − θ_k)
            g = grads[i]
            if ref is not None:  # VR-FALD*: G_i(x) = ∇Ũ_i(x) − ∇Ũ_i(θ_r) + w_i ∇U(θ_r)
                total = np.sum(at_ref, axis=0)
                g = (lambda x, g=g, c=w[i] * total - at_ref[i]: g(x) + c)
            step += (w[i] / pk[i]) * (local_steps(g, theta, w[i], h, tau, steps, seed, k, i, share, pk[i]) - theta)
        if fresh:  # θ_r = θ_k from the next round: every client's ∇Ũ_i(θ_k) came with its reply
            ref, at_ref = theta.copy(), [g(theta) for g in grads]
        theta = theta + step
        out[k] = theta
    return out


def refreshes(q: float, seed: int, k: int) -> bool:
    """Whether round ``k`` refreshes VR-FALD*'s reference (probability ``q``; its own stream)."""
    return q > 0 and rng.uniform(seed, rng.Stream.REFRESH, k, 0, 1)[0] < q


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
