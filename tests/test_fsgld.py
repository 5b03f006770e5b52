"""FSGLD's core (:mod:`qlsd_flwr.core.fsgld`, issue 23) against its own stationary law on the toy
Gaussian (the protocol path's tests: ``test_rivals_protocol.py``).

* Exact surrogates make the conducive gradient ``∇U`` whichever client is chosen: the law is
  ULA's on the posterior for any number of local steps ``K``.
* Poor surrogates (half the precision, means shifted) with ``K = 1``: the gradient stays unbiased,
  so the mean is the posterior's exactly, and the variance is widened by the estimator's spread
  (derived: a random-coefficient recursion); with ``K = 5`` the local steps bias the mean.
* Long chains match the exact law within 4 batch-means standard errors, where the
  posterior (or ULA's law) is many standard errors away: the check can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

import laws_fsgld
from qlsd_flwr.core import fsgld
from qlsd_flwr.tasks.gaussian import build_gaussian_task

B, D, PV = 4, 3, 5.0


def _setup():
    task = build_gaussian_task(b=B, d=D, data_seed=0, prior_var=PV)
    n = np.array([c.n_data for c in task.clients], dtype=float)
    ybar = np.stack([c.y.mean(axis=0) for c in task.clients])
    return task, n, ybar, n.sum() + 1 / PV


def test_exact_surrogates_give_ula_and_poor_ones_an_unbiased_mean_with_a_wider_variance():
    task, n, ybar, P = _setup()
    f = np.full(B, 1 / B)
    h = 0.1 / P
    ula = 1 / (P * (1 - h * P / 2))
    for steps in (1, 5):
        m, v = laws_fsgld.gaussian_stationary(n, ybar, *fsgld.gaussian_surrogates(task), f, h, steps, PV)
        assert np.allclose(m, task.posterior_mean, rtol=1e-10) and np.allclose(v, ula, rtol=1e-10)
    poor = fsgld.gaussian_surrogates(task, scale=0.5, shift=0.3)
    m1, v1 = laws_fsgld.gaussian_stationary(n, ybar, *poor, f, h, 1, PV)
    assert np.allclose(m1, task.posterior_mean, rtol=1e-10) and np.all(v1 > 1.5 * ula)
    m5, _ = laws_fsgld.gaussian_stationary(n, ybar, *poor, f, h, 5, PV)
    assert np.max(np.abs(m5 - task.posterior_mean) / np.sqrt(task.posterior_var)) > 0.5


@pytest.mark.parametrize("steps", [1, 5])
def test_a_long_chain_with_poor_surrogates_matches_its_exact_stationary_law(steps):
    task, n, ybar, P = _setup()
    # equal selection probabilities: with f_s = N_s/N and λ_s ∝ N_s every client's recursion would have
    # the same coefficient, and the local steps would not bias the mean
    f = np.full(B, 1 / B)
    h = 0.1 / P
    mu, lam = fsgld.gaussian_surrogates(task, scale=0.5, shift=0.3)
    trace = fsgld.run(task, mu, lam, f, h, steps, 40_000, seed=3, theta0=task.posterior_mean)[200:]
    m, v = laws_fsgld.gaussian_stationary(n, ybar, mu, lam, f, h, steps, PV)
    batches = np.array_split(trace, 40)
    se_mean = np.std([b.mean(axis=0) for b in batches], axis=0, ddof=1) / np.sqrt(len(batches))
    assert np.all(np.abs(trace.mean(axis=0) - m) <= 4 * se_mean), (trace.mean(axis=0), m, se_mean)
    e2 = (trace - m) ** 2
    se_var = np.std([b.mean(axis=0) for b in np.array_split(e2, 40)], axis=0, ddof=1) / np.sqrt(40)
    assert np.all(np.abs(e2.mean(axis=0) - v) <= 4 * se_var), (e2.mean(axis=0), v, se_var)
    # ULA's variance (what exact surrogates would give) is far outside the error: the check can fail
    ula = 1 / (P * (1 - h * P / 2))
    assert np.all(np.abs(v - ula) > 10 * se_var), (v, ula, se_var)
    if steps == 5:  # and the local steps' bias of the mean is far outside it too
        assert np.max(np.abs(m - task.posterior_mean) / se_mean) > 10


def test_bad_surrogates_and_probabilities_are_refused_by_name():
    task, *_ = _setup()
    mu, lam = fsgld.gaussian_surrogates(task)
    with pytest.raises(ValueError, match="precision"):
        fsgld.run(task, mu, -lam, np.full(B, 1 / B), 1e-4, 1, 2)
    with pytest.raises(ValueError, match="selection probabilities"):
        fsgld.run(task, mu, lam, np.full(B, 0.3), 1e-4, 1, 2)
