r"""FSGLD (El Mekkaoui, Mesquita, Blomstedt, Kaski, UAI 2021): federated SGLD with conducive
gradients.

Before sampling, every client ``i`` fits once a diagonal Gaussian surrogate of its likelihood
factor, ``exp(−U_i(θ)) ≈ exp(−Û_i(θ))`` with ``Û_i(θ) = ½ Σ_c λ_{i,c} (θ_c − μ_{i,c})²`` (its mean
``μ_i`` and **precision** ``λ_i``, 2d numbers sent once). Each round ``k`` the server picks one
client ``s`` with probability ``f_s`` (stream ``(seed, PARTICIPATION, k, 0)``), sends it θ, and
the client takes ``K`` Langevin steps with the conducive gradient

    g_s(θ) = (∇U_s(θ) − ∇Û_s(θ)) / f_s + Σ_j ∇Û_j(θ) + ∇U_0(θ),
    θ ← θ − h g_s(θ) + √(2h) ξ_j,     ξ_j from stream (seed, NOISE, k, 0), positions [jd, (j+1)d),

and returns θ. ``E_s[g_s(θ)] = ∇U(θ)`` (the prior ``U_0`` is known to everybody), so with ``K = 1``
the chain is SGLD with an unbiased gradient: π up to ``O(h)``, the variance widened by the
estimator's spread, which the surrogates shrink (exact surrogates make ``g_s = ∇U`` for every
``s``). With ``K > 1`` the steps stay on one client: a local-step bias of ``O(hK)`` unless the
surrogates are exact. For the toy Gaussian each round is a random-coefficient linear recursion and
``tests/laws_fsgld.py``'s ``gaussian_stationary`` gives its law exactly; the tests compare the chain with it.

What the FALD repository's re-implementation got wrong, not repeated here: its surrogates
return the *covariance* where the precision is used, and its running mean adds the new average
to the old one (``+=``).

**On the round protocol** (``variant = fsgld``; :mod:`qlsd_flwr.protocol.local_chains`) each client's
surrogate is its second-order Taylor expansion at the federation's mode θ*, the natural fit a
client can make once without knowing the posterior: ``λ_i`` the diagonal of its curvature at θ*
(its report of ``metric-from = curvature``, :func:`qlsd_flwr.core.curvature.local_curvature`, capped as
the metric's are: :func:`surrogates_from_reports`) and ``μ_i = θ* − ∇U_i(θ*)/λ_i``, so that
``∇Û_i(θ) = λ_i (θ − θ*) + ∇U_i(θ*)`` (:func:`conducive_grad`; a direction of zero curvature keeps the
linear term, and the estimator stays unbiased). The clients' ``∇U_i(θ*)`` are the claims QLSD\* and
VR-FALD\* gather before sampling; on the toy Gaussian the fit is exact. The selection probabilities
are the data shares ``f_i = N_i / Σ_{j kept} N_j``.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import rng


def choose(f: np.ndarray, seed: int, k: int) -> int:
    """The client of round ``k``, drawn with probabilities ``f`` (a client with ``f_i = 0``, one no
    longer kept, is never drawn)."""
    f = np.asarray(f, dtype=np.float64)
    u = float(rng.uniform(seed, rng.Stream.PARTICIPATION, k, 0, 1)[0])
    i = int(np.searchsorted(np.cumsum(f), u * float(np.sum(f)), side="right"))
    return i if i < len(f) and f[i] > 0 else int(np.flatnonzero(f > 0)[-1])  # u·Σf rounded up to Σf


def conducive_grad(grad_s, prior_grad, f_s: float, lam_s, lam_total, theta_star, grad_s_star, data_total_star):
    r"""Client ``s``'s conducive gradient with Taylor surrogates at θ* (module docstring):

        g_s(x) = (∇U_s(x) − ∇U_s(θ*) − λ_s (x − θ*)) / f_s + Λ (x − θ*) + Σ_j ∇U_j(θ*) + ∇U_0(x),

    ``grad_s`` its data gradient ``∇U_s``, ``prior_grad`` ``∇U_0``, ``lam_total`` ``Λ = Σ_j λ_j`` and
    ``data_total_star`` ``Σ_j ∇U_j(θ*)`` over the clients kept. With ``μ_s = θ* − ∇U_s(θ*)/λ_s`` this is
    :func:`run`'s ``g_s``."""
    def g(x):
        return (grad_s(x) - grad_s_star - lam_s * (x - theta_star)) / f_s + lam_total * (x - theta_star) \
            + data_total_star + prior_grad(x)
    return g


def message(g, theta: np.ndarray, h: float, steps: int, seed: int, k: int, i: int,
            temperature: float = 1.0, metric=None) -> np.ndarray:
    """What the chosen client sends: ``Δ_s = (θ − θ_K)/h`` after ``K = steps`` Langevin steps with the
    conducive gradient ``g`` and the round's noise (stream ``(seed, NOISE, k, 0)``, as :func:`run`):
    FALD's local steps with all of the weight and all of the noise (``w = 1``, ``τ = 1``); ``metric``: a
    diagonal ``m`` preconditions them (:func:`qlsd_flwr.core.fald.local_steps`)."""
    from qlsd_flwr.core import fald

    return fald.message(g, theta, 1.0, h, 1.0, steps, seed, k, i, 1.0, 1.0, temperature, metric)


def surrogates_from_reports(reports: dict, n_data, b: int, d: int) -> tuple[np.ndarray, list[int]]:
    """The precisions ``λ`` ``(b, d)`` from the clients' valid diagonal curvature reports ``{i: (d,)}``,
    each capped per datum as the metric's are (:func:`qlsd_flwr.robust.reports.cap_reports`: one client
    cannot make ``Λ`` and so every client's step stiffer than ``REPORT_CAP × N_i`` honest points
    would). A client without a valid report gets ``λ_i = 0`` (a linear surrogate: still unbiased).
    Returns ``(λ, the clients whose report was scaled down)``."""
    from qlsd_flwr.robust.reports import cap_reports

    reports = {int(i): np.asarray(h, dtype=np.float64) for i, h in reports.items()}
    scaled = cap_reports(reports, n_data)
    lam = np.zeros((b, d))
    for i, h in reports.items():
        lam[i] = h
    return lam, scaled


def run(task, mu: np.ndarray, lam: np.ndarray, f, h: float, steps: int, rounds: int, seed: int = 0,
        theta0=None) -> np.ndarray:
    """``rounds`` rounds of FSGLD on ``task`` (its clients' ``grad_sum``; a Gaussian prior or a flat
    one) with surrogates ``(μ_i, λ_i)`` (``(b, d)`` each) and selection probabilities ``f``.
    Returns ``θ_1 … θ_K`` ``(rounds, d)``."""
    mu, lam = np.asarray(mu, dtype=np.float64), np.asarray(lam, dtype=np.float64)
    f = np.asarray(f, dtype=np.float64)
    if np.any(lam <= 0) or not np.all(np.isfinite(lam)):
        raise ValueError("FSGLD surrogates: every precision λ must be a finite number > 0")
    if np.any(f <= 0) or not np.isclose(f.sum(), 1.0):
        raise ValueError("FSGLD: the selection probabilities f must be > 0 and sum to 1")
    prior = task.prior  # known to everybody: its own gradient (any mean, any prior with one)
    Lam, LamMu = lam.sum(axis=0), (lam * mu).sum(axis=0)  # Σ_j ∇Û_j(θ) = Λ θ − Σ_j λ_j μ_j
    d = task.dim
    theta = np.zeros(d) if theta0 is None else np.asarray(theta0, dtype=np.float64).copy()
    out = np.empty((rounds, d))
    noise_sd = np.sqrt(2.0 * h)
    for k in range(rounds):
        s = choose(f, seed, k)
        xi = rng.normal(seed, rng.Stream.NOISE, k, 0, steps * d).reshape(steps, d)
        pot = task.clients[s]
        for j in range(steps):
            g = (pot.grad_sum(theta) - lam[s] * (theta - mu[s])) / f[s] + Lam * theta - LamMu + prior.grad(theta)
            theta = theta - h * g + noise_sd * xi[j]
        out[k] = theta
    return out


def gaussian_surrogates(task, scale: float = 1.0, shift: float = 0.0):
    """The toy Gaussian's surrogates: exact (``λ_i = N_i``, ``μ_i = ȳ_i``) at ``scale = 1``,
    ``shift = 0``; otherwise ``λ_i = scale · N_i`` and ``μ_i = ȳ_i + shift`` (a poor fit, for tests)."""
    n = np.array([c.n_data for c in task.clients], dtype=np.float64)
    ybar = np.stack([c.y.mean(axis=0) for c in task.clients])
    return ybar + shift, scale * np.repeat(n[:, None], task.dim, axis=1)
