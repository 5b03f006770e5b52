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

Framework-free numpy; the messages, the engines and the outputs are not built yet (issue 23).
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import rng


def weights(n_data, rule: str = "data") -> np.ndarray:
    """``w_i``: ``N_i / N`` (``data``) or ``1/b`` (``equal``, the FALD repository's numpy code)."""
    n = np.asarray(n_data, dtype=np.float64)
    if rule not in ("data", "equal"):
        raise ValueError(f"FALD weights: 'data' or 'equal', got {rule!r}")
    return n / n.sum() if rule == "data" else np.full(n.size, 1.0 / n.size)


def local_steps(grad_u, theta: np.ndarray, w: float, h: float, tau: float, steps: int, seed: int, k: int,
                i: int) -> np.ndarray:
    """Client ``i``'s ``K = steps`` local steps from ``θ`` at round ``k`` (``grad_u = ∇Ũ_i``)."""
    d = theta.shape[-1]
    common = rng.normal(seed, rng.Stream.NOISE, k, 0, steps * d).reshape(steps, d)
    own = rng.normal(seed, rng.Stream.LOCAL, k, i, steps * d).reshape(steps, d)
    root, a, b = np.sqrt(2.0 * h), np.sqrt(tau), np.sqrt((1.0 - tau) / w)
    x = np.asarray(theta, dtype=np.float64).copy()
    for j in range(steps):
        x = x - (h / w) * grad_u(x) + root * (a * common[j] + b * own[j])
    return x


def run(task, h: float, steps: int, rounds: int, tau: float = 0.0, seed: int = 0, theta0=None,
        rule: str = "data", anchor=None, q: float = 0.0) -> np.ndarray:
    r"""``rounds`` rounds of FALD on ``task`` (its clients' ``grad_sum``; a Gaussian prior or a flat
    one), weights by ``rule`` (:func:`weights`). Returns ``θ_1 … θ_K`` ``(rounds, d)``.

    With ``anchor`` (a reference point θ_r, e.g. the mode θ*), **VR-FALD\***: each client's local
    gradient is the control-variate estimate ``G_i(x) = ∇Ũ_i(x) − ∇Ũ_i(θ_r) + w_i ∇U(θ_r)``, whose
    weighted sum over clients is still ``∇U(x)`` at a common point; after each round, with
    probability ``q`` (stream ``(seed, PARTICIPATION, k, 0)``), θ_r becomes the new θ and
    ``∇U(θ_r)`` is gathered again (one more exchange). The control variate pulls every client's
    local steps toward the federation's mode instead of its own: with θ_r = θ* and ``q = 0`` the
    stationary mean on the toy Gaussian is exact for any weights and ``K``."""
    d = task.dim
    w = weights([c.n_data for c in task.clients], rule)
    prior = task.prior  # Ũ_i = U_i + w_i U_0: the prior's own gradient (any mean, any prior with one)
    grads = [lambda x, p=pot, wi=w[i]: p.grad_sum(x) + wi * prior.grad(x) for i, pot in enumerate(task.clients)]
    theta = np.zeros(d) if theta0 is None else np.asarray(theta0, dtype=np.float64).copy()
    ref = None if anchor is None else np.asarray(anchor, dtype=np.float64).copy()
    at_ref = None if ref is None else [g(ref) for g in grads]
    out = np.empty((rounds, d))
    for k in range(rounds):
        nxt = np.zeros(d)
        for i, g in enumerate(grads):
            if ref is not None:  # VR-FALD*: G_i(x) = ∇Ũ_i(x) − ∇Ũ_i(θ_r) + w_i ∇U(θ_r)
                total = np.sum(at_ref, axis=0)
                g = (lambda x, g=g, c=w[i] * total - at_ref[i]: g(x) + c)
            nxt += w[i] * local_steps(g, theta, w[i], h, tau, steps, seed, k, i)
        theta = nxt
        out[k] = theta
        if ref is not None and q > 0 and rng.uniform(seed, rng.Stream.PARTICIPATION, k, 0, 1)[0] < q:
            ref, at_ref = theta.copy(), [g(theta) for g in grads]
    return out


def gaussian_stationary(n, ybar, h: float, steps: int, tau: float = 0.0, prior_var: float = np.inf,
                        rule: str = "data", anchor=None):
    r"""The exact stationary law of FALD's θ on the toy Gaussian (clients of ``n[i]`` points with
    mean ``ybar[i]``, the prior ``N(0, σ_0²)``): ``(mean (d,), variance)``, the same variance in
    every coordinate.

    Per coordinate, ``∇Ũ_i(x) = a_i x − N_i ȳ_i`` with ``a_i = N_i + w_i/σ_0²``, so one local step is
    ``x ← ρ_i x + c_i + noise`` with ``ρ_i = 1 − h a_i / w_i`` and ``c_i = h N_i ȳ_i / w_i``. After ``K``
    steps and the average, ``θ' = A θ + B + ε`` with ``A = Σ_i w_i ρ_i^K``, ``B = Σ_i w_i c_i Σ_j ρ_i^j``
    and ``Var ε = 2h [τ Σ_j (Σ_i w_i ρ_i^j)² + (1 − τ) Σ_i w_i Σ_j ρ_i^{2j}]`` (``j < K``): an AR(1),
    whose stationary law is ``N(B / (1 − A), Var ε / (1 − A²))`` when ``|A| < 1``.

    With ``w_i = N_i / N`` every ``ρ_i`` is ``1 − h P`` (``P = N + 1/σ_0²``): the local maps are one
    contraction toward each client's own mode, their average is ULA's, and the law is ULA's for
    every ``K``: no local-step bias on this task. With equal weights the ``ρ_i`` differ on clients of
    unequal sizes and the mean moves by ``O(hK)``.

    With ``anchor`` (VR-FALD\* with a fixed θ_r, ``q = 0``), ``G_i(x) = a_i (x − θ_r) + w_i g_r`` with
    ``g_r = P θ_r − Σ_i N_i ȳ_i``: then ``c_i = h (a_i θ_r − w_i g_r) / w_i``."""
    n = np.asarray(n, dtype=np.float64)
    ybar = np.asarray(ybar, dtype=np.float64)
    w = weights(n, rule)
    prec0 = 0.0 if not np.isfinite(prior_var) else 1.0 / prior_var
    rho = 1.0 - h * (n + w * prec0) / w
    powers = rho[:, None] ** np.arange(steps)[None, :]  # (b, K): ρ_i^j
    A = float(np.sum(w * rho**steps))
    if not abs(A) < 1.0:
        raise ValueError(f"FALD on this Gaussian is unstable at h = {h} (|A| = {abs(A):.3g} ≥ 1)")
    if anchor is None:  # c_i = h N_i ȳ_i / w_i
        c = (h * n / w)[:, None] * ybar
    else:  # c_i = h (a_i θ_r − w_i g_r) / w_i
        a, ref = n + w * prec0, np.asarray(anchor, dtype=np.float64)
        g_r = (n.sum() + prec0) * ref - (n[:, None] * ybar).sum(axis=0)
        c = h * (a[:, None] * ref[None, :] - w[:, None] * g_r[None, :]) / w[:, None]
    B = ((w * powers.sum(axis=1))[:, None] * c).sum(axis=0)
    var = 2.0 * h * (tau * float(np.sum((w[:, None] * powers).sum(axis=0) ** 2))
                     + (1.0 - tau) * float(np.sum(w * (powers**2).sum(axis=1))))
    return B / (1.0 - A), var / (1.0 - A**2)
