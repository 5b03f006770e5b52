"""DG-LMC's core (:mod:`qlsd_flwr.core.dglmc`, issue 23) against its own stationary law on the toy
Gaussian. Only the framework-free sampler exists so far: the Flower messages, the engines and the
outputs are not built.

* The exact stationary law of the discretised chain (ULA on ``z``, exact draw of ``θ | z``) is a
  discrete Lyapunov solution; as ``γ → 0`` it tends to the augmented model's θ-marginal, and as
  ``ρ → 0`` that marginal tends to the posterior (both checked in closed form).
* A long chain's mean and variance match that law within their batch-means Monte Carlo error
  (4 standard errors, each coordinate and the pooled variance)."""

from __future__ import annotations

import numpy as np

import laws_dglmc
from qlsd_flwr.core import dglmc
from qlsd_flwr.tasks.gaussian import build_gaussian_task

B, D = 4, 3


def _stats(task):
    n = np.array([c.n_data for c in task.clients], dtype=float)
    ybar = np.stack([c.y.mean(axis=0) for c in task.clients])
    return n, ybar


def test_the_discrete_law_tends_to_the_augmented_marginal_and_that_to_the_posterior():
    task = build_gaussian_task(b=B, d=D, data_seed=0)
    n, ybar = _stats(task)
    rho = np.full(B, 0.05)
    m, v = laws_dglmc.gaussian_marginal(n, ybar, rho)
    for gamma_scale in (1e-3, 1e-4):
        gamma = gamma_scale / (n + 1 / rho)
        md, vd = laws_dglmc.gaussian_stationary(n, ybar, rho, gamma, steps=3)
        assert np.allclose(md, m, rtol=0, atol=50 * gamma_scale * np.sqrt(v)) and abs(vd / v - 1) < 50 * gamma_scale
    m0, v0 = laws_dglmc.gaussian_marginal(n, ybar, np.full(B, 1e-9))
    assert np.allclose(m0, task.posterior_mean, atol=1e-6) and np.isclose(v0, task.posterior_var[0], rtol=1e-6)
    assert v > v0  # the augmentation widens the marginal: ρ must be small against 1/N_i


def test_a_long_chain_matches_its_exact_stationary_law():
    task = build_gaussian_task(b=B, d=D, data_seed=0)
    n, ybar = _stats(task)
    rho = np.full(B, 0.05)
    gamma = 0.5 / (n + 1 / rho)  # a_i = 1 − γ_i (N_i + 1/ρ_i) = 0.5: a coarse step, so its bias shows
    steps, rounds, burn = 3, 20_000, 200
    trace = dglmc.run(task, rho, gamma, steps, rounds, seed=1, theta0=task.posterior_mean)[burn:]
    m, v = laws_dglmc.gaussian_stationary(n, ybar, rho, gamma, steps)
    m_cont, v_cont = laws_dglmc.gaussian_marginal(n, ybar, rho)
    batches = np.array_split(trace, 40)
    se_mean = np.std([b.mean(axis=0) for b in batches], axis=0, ddof=1) / np.sqrt(len(batches))
    assert np.all(np.abs(trace.mean(axis=0) - m) <= 4 * se_mean), (trace.mean(axis=0), m, se_mean)
    e2 = (trace - m) ** 2
    v_hat = e2.mean()
    se_var = np.std([b.mean() for b in np.array_split(e2, 40)], ddof=1) / np.sqrt(40)
    assert abs(v_hat - v) <= 4 * se_var, (v_hat, v, se_var)
    # the step's bias on the variance is visible at this γ, and the test can tell it from zero
    assert abs(v - v_cont) > 4 * se_var, (v, v_cont, se_var)
