"""FALD's core (:mod:`qlsd_flwr.core.fald`, issue 23) against its own stationary law on the toy
Gaussian (the round protocol, the engines and the Flower paths: ``tests/test_rivals_protocol.py``).

* With one local step the round is exactly ULA on the whole posterior (its law in closed form:
  the posterior mean, variance ``1/(P(1 − hP/2))``), whatever the common share τ of the noise;
  with data-proportional weights it stays ULA for any ``K`` on this task (the clients' curvatures
  are proportional to their weights); with equal weights on clients of unequal sizes the mean
  moves by ``O(hK)`` (the local-step bias), shrinking linearly with ``h``.
* A long chain's mean and variance match the exact law within their batch-means Monte Carlo
  error (4 standard errors, each coordinate and the pooled variance), at a step where the
  local-step bias is many of those errors wide (the test can tell the two apart).
* VR-FALD* with its reference refreshed (probability q; the refresh round asks every client) matches
  :func:`laws_fald.gaussian_stationary_refresh`, the law of the pair (θ, θ_r), and forgets
  a reference started off the mode, whose fixed-reference law is many standard errors away.
"""

from __future__ import annotations

import numpy as np
import pytest

import laws_fald
from qlsd_flwr.core import fald
from qlsd_flwr.tasks.gaussian import build_gaussian_task

B, D, PV = 4, 3, 5.0


def _stats(task):
    n = np.array([c.n_data for c in task.clients], dtype=float)
    ybar = np.stack([c.y.mean(axis=0) for c in task.clients])
    return n, ybar


def test_one_local_step_is_ula_on_the_posterior_and_more_steps_bias_the_mean_by_o_hk():
    task = build_gaussian_task(b=B, d=D, data_seed=0, prior_var=PV)
    n, ybar = _stats(task)
    P = n.sum() + 1 / PV
    for h in (0.1 / P, 1.0 / P):
        for tau in (0.0, 0.4, 1.0):
            m, v = laws_fald.gaussian_stationary(n, ybar, h, steps=1, tau=tau, prior_var=PV)
            assert np.allclose(m, task.posterior_mean, rtol=1e-12, atol=1e-12)
            assert np.isclose(v, 1 / (P * (1 - h * P / 2)), rtol=1e-12)
        # with w_i = N_i/N the clients' curvatures are proportional to their weights: any K is ULA
        m, v = laws_fald.gaussian_stationary(n, ybar, h, steps=10, tau=0.5, prior_var=PV)
        assert np.allclose(m, task.posterior_mean, rtol=1e-10) and np.isclose(v, 1 / (P * (1 - h * P / 2)))
    sd = np.sqrt(task.posterior_var[0])
    # equal weights (the FALD repository's numpy code) on clients of unequal sizes: the local steps
    # bias the mean by O(hK), linearly in h
    bias = [np.max(np.abs(laws_fald.gaussian_stationary(n, ybar, c / P, 10, 0.5, PV, rule="equal")[0]
                          - task.posterior_mean)) / sd for c in (1e-2, 1e-3)]
    assert bias[0] > 0.1 and 8 < bias[0] / bias[1] < 12, bias


def test_vr_fald_star_at_the_mode_removes_the_local_step_bias():
    # G_i(x) = ∇Ũ_i(x) − ∇Ũ_i(θ*) pulls every client's local steps toward θ*: the stationary mean
    # is the posterior mean for any weights and K (the variance keeps the discretisation's O(h))
    task = build_gaussian_task(b=B, d=D, data_seed=0, prior_var=PV)
    n, ybar = _stats(task)
    P = n.sum() + 1 / PV
    m, v = laws_fald.gaussian_stationary(n, ybar, 0.01 / P, 10, 0.5, PV, rule="equal", anchor=task.posterior_mean)
    assert np.allclose(m, task.posterior_mean, rtol=1e-10)
    m0, _ = laws_fald.gaussian_stationary(n, ybar, 0.01 / P, 10, 0.5, PV, rule="equal")
    assert np.max(np.abs(m0 - task.posterior_mean)) / np.sqrt(task.posterior_var[0]) > 0.1  # FALD's bias
    # refreshed with probability q: with weights N_i/N every client's local map has the same ρ, so the
    # averaged constants Σ_i w_i c_i = h Σ_i N_i ȳ_i whatever θ_r and g_r are (derived in
    # gaussian_stationary's terms): the chain is FALD's, to float rounding, through every refresh
    vr = fald.run(task, 0.05 / P, 5, 300, 0.5, seed=2, theta0=task.posterior_mean, anchor=task.posterior_mean + 1.0,
                  q=0.1)
    plain = fald.run(task, 0.05 / P, 5, 300, 0.5, seed=2, theta0=task.posterior_mean)
    assert np.allclose(vr, plain, rtol=0, atol=1e-10)
    wrong = fald.run(task, 0.05 / P, 5, 300, 0.5, seed=2, theta0=task.posterior_mean, anchor=task.posterior_mean + 1.0,
                     rule="equal", q=0.1)  # with equal weights the reference matters: the check can fail
    assert not np.allclose(wrong, fald.run(task, 0.05 / P, 5, 300, 0.5, seed=2, theta0=task.posterior_mean,
                                           rule="equal"), rtol=0, atol=1e-10)


@pytest.mark.parametrize("vr", [False, True])
def test_a_long_chain_matches_its_exact_stationary_law(vr):
    task = build_gaussian_task(b=B, d=D, data_seed=0, prior_var=PV)
    n, ybar = _stats(task)
    P = n.sum() + 1 / PV
    h, steps, tau, rounds, burn = 0.05 / P, 5, 0.5, 10_000, 200
    # VR-FALD*: the reference point off the mode, so that its term shows in the law
    anchor = task.posterior_mean + 3 * np.sqrt(task.posterior_var) if vr else None
    trace = fald.run(task, h, steps, rounds, tau=tau, seed=1, theta0=task.posterior_mean, rule="equal",
                     anchor=anchor)[burn:]
    m, v = laws_fald.gaussian_stationary(n, ybar, h, steps, tau, PV, rule="equal", anchor=anchor)
    batches = np.array_split(trace, 40)
    se_mean = np.std([b.mean(axis=0) for b in batches], axis=0, ddof=1) / np.sqrt(len(batches))
    assert np.all(np.abs(trace.mean(axis=0) - m) <= 4 * se_mean), (trace.mean(axis=0), m, se_mean)
    e2 = (trace - m) ** 2
    se_var = np.std([b.mean() for b in np.array_split(e2, 40)], ddof=1) / np.sqrt(40)
    assert abs(e2.mean() - v) <= 4 * se_var, (e2.mean(), v, se_var)
    # the other sampler's law (FALD's local-step bias; VR-FALD*'s at the mode: the posterior mean) is
    # wide of this one against the Monte Carlo error: the check can fail
    other, _ = laws_fald.gaussian_stationary(n, ybar, h, steps, tau, PV, rule="equal",
                                        anchor=None if vr else task.posterior_mean)
    assert np.max(np.abs(m - other) / se_mean) > 10
    # reproducible: a function of the seed
    first = fald.run(task, h, steps, burn + 50, tau=tau, seed=1, theta0=task.posterior_mean, rule="equal",
                     anchor=anchor)
    assert np.array_equal(first[burn:], trace[:50])


def test_vr_fald_star_with_its_reference_refreshed_matches_the_law_of_theta_and_the_reference():
    # equal weights on clients of unequal sizes, so the reference matters (a_i/w_i differ); θ_r starts
    # 20 posterior sd off the mode. With q = 0.3 the chain forgets it: the law of (θ, θ_r) derived in
    # gaussian_stationary_refresh (a refresh round: every client, p_i = 1, θ_r = θ_k from the next round);
    # the law with the reference fixed at its start is more than 8 standard errors away in the mean
    task = build_gaussian_task(b=B, d=D, data_seed=0, prior_var=PV)
    n, ybar = _stats(task)
    P = n.sum() + 1 / PV
    h, q, p = 0.05 / P, 0.3, [0.9, 0.6, 0.8, 0.5]
    off = task.posterior_mean + 20 * np.sqrt(task.posterior_var)
    trace = fald.run(task, h, 3, 10_000, 0.5, seed=1, theta0=task.posterior_mean, rule="equal", anchor=off,
                     q=q, p=p)[200:]
    m, v = laws_fald.gaussian_stationary_refresh(n, ybar, h, 3, 0.5, PV, q, p=p, rule="equal")
    batches = np.array_split(trace, 40)
    se = np.std([b.mean(axis=0) for b in batches], axis=0, ddof=1) / np.sqrt(40)
    assert np.all(np.abs(trace.mean(axis=0) - m) <= 4 * se), (trace.mean(axis=0) - m) / se
    e2 = (trace - m) ** 2
    se_v = np.std([b.mean(axis=0) for b in np.array_split(e2, 40)], axis=0, ddof=1) / np.sqrt(40)
    assert np.all(np.abs(e2.mean(axis=0) - v) <= 4 * se_v), (e2.mean(axis=0) - v) / se_v
    fixed, _ = laws_fald.gaussian_stationary(n, ybar, h, 3, 0.5, PV, rule="equal", anchor=off, p=p)
    assert np.min(np.abs(fixed - m) / se) > 8, np.abs(fixed - m) / se
    # with weights N_i/N every client's a_i/w_i is P: the reference drops out, and the law is the fixed one's
    # but for the refresh rounds' full participation (less participation noise)
    m1, v1 = laws_fald.gaussian_stationary_refresh(n, ybar, h, 3, 0.5, PV, q, p=p)
    m0, v0 = laws_fald.gaussian_stationary(n, ybar, h, 3, 0.5, PV, anchor=off, p=p)
    assert np.allclose(m1, m0, rtol=0, atol=1e-12) and np.all(v1 < v0)
    with pytest.raises(ValueError, match="q > 0"):
        laws_fald.gaussian_stationary_refresh(n, ybar, h, 3, 0.5, PV, 0.0)
