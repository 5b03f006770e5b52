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
:func:`gaussian_stationary` gives its law exactly; the tests compare the chain with it.

What the FALD repository's re-implementation got wrong, not repeated here: its surrogates
return the *covariance* where the precision is used, and its running mean adds the new average
to the old one (``+=``).

Framework-free numpy; the surrogate fitting for a general potential, the messages, the engines
and the outputs are not built yet (issue 23).
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import rng


def choose(f: np.ndarray, seed: int, k: int) -> int:
    """The client of round ``k``, drawn with probabilities ``f``."""
    u = float(rng.uniform(seed, rng.Stream.PARTICIPATION, k, 0, 1)[0])
    return int(min(np.searchsorted(np.cumsum(f), u * float(np.sum(f)), side="right"), len(f) - 1))


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
    root = np.sqrt(2.0 * h)
    for k in range(rounds):
        s = choose(f, seed, k)
        xi = rng.normal(seed, rng.Stream.NOISE, k, 0, steps * d).reshape(steps, d)
        pot = task.clients[s]
        for j in range(steps):
            g = (pot.grad_sum(theta) - lam[s] * (theta - mu[s])) / f[s] + Lam * theta - LamMu + prior.grad(theta)
            theta = theta - h * g + root * xi[j]
        out[k] = theta
    return out


def gaussian_surrogates(task, scale: float = 1.0, shift: float = 0.0):
    """The toy Gaussian's surrogates: exact (``λ_i = N_i``, ``μ_i = ȳ_i``) at ``scale = 1``,
    ``shift = 0``; otherwise ``λ_i = scale · N_i`` and ``μ_i = ȳ_i + shift`` (a poor fit, for tests)."""
    n = np.array([c.n_data for c in task.clients], dtype=np.float64)
    ybar = np.stack([c.y.mean(axis=0) for c in task.clients])
    return ybar + shift, scale * np.repeat(n[:, None], task.dim, axis=1)


def gaussian_stationary(n, ybar, mu, lam, f, h: float, steps: int, prior_var: float = np.inf):
    r"""The exact stationary law of FSGLD's θ on the toy Gaussian (the prior ``N(0, σ_0²)``):
    ``(mean (d,), variance (d,))``.

    Per coordinate, ``g_s(θ) = a_s θ − c_s`` with ``a_s = (N_s − λ_s)/f_s + Λ + 1/σ_0²`` and
    ``c_s = (N_s ȳ_s − λ_s μ_s)/f_s + Σ_j λ_j μ_j``; ``K`` steps on client ``s`` give
    ``θ' = R_s θ + C_s + ε_s`` with ``r_s = 1 − h a_s``, ``R_s = r_s^K``, ``C_s = h c_s Σ_{m<K} r_s^m``,
    ``Var ε_s = 2h Σ_{m<K} r_s^{2m}``. With ``s`` drawn afresh each round, independent of θ:
    ``m = E[C] / (1 − E[R])`` and ``E[θ²] = (2 E[RC] m + E[C²] + E[Var ε]) / (1 − E[R²])``."""
    n, f = np.asarray(n, dtype=np.float64), np.asarray(f, dtype=np.float64)
    ybar, mu, lam = (np.asarray(v, dtype=np.float64) for v in (ybar, mu, lam))
    prec0 = 0.0 if not np.isfinite(prior_var) else 1.0 / prior_var
    a = (n[:, None] - lam) / f[:, None] + lam.sum(axis=0) + prec0  # (b, d)
    c = (n[:, None] * ybar - lam * mu) / f[:, None] + (lam * mu).sum(axis=0)
    r = 1.0 - h * a
    m_pow = np.arange(steps)[None, None, :]
    R = r**steps
    C = h * c * (r[..., None] ** m_pow).sum(axis=-1)
    V = 2.0 * h * (r[..., None] ** (2 * m_pow)).sum(axis=-1)
    E = lambda x: (f[:, None] * x).sum(axis=0)  # noqa: E731 (the expectation over the chosen client)
    if np.any(E(R**2) >= 1.0):
        raise ValueError(f"FSGLD on this Gaussian has no stationary variance at h = {h}")
    m = E(C) / (1.0 - E(R))
    second = (2.0 * E(R * C) * m + E(C**2) + E(V)) / (1.0 - E(R**2))
    return m, second - m**2
