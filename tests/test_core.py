"""Unit tests of the core (:mod:`qlsd_flwr.core`), each against a number that could come out wrong.

* every oracle is unbiased: ``Σ_i E[H_i(θ)]`` (+ the server's prior term) ``= ∇U(θ)``, by Monte
  Carlo over rounds, on a non-linear potential (softmax regression), the tolerance derived from
  the exact variance of sampling ``n_i`` of ``N_i`` points without replacement;
* the control variate vanishes at the mode, ``Σ_i H_i(θ*) = 0``;
* the memory invariant ``η = Σ_i η_i`` after every step, and the client's ``η_i`` equal to the
  server's mirror bit for bit;
* participation frequencies against ``p_i`` (binomial tolerance);
* the server step against the step computed by hand, one chain and chains side by side.
"""

import numpy as np
import pytest

from qlsd_flwr import samplers
from qlsd_flwr.config import resolve
from qlsd_flwr.core import participation, rng
from qlsd_flwr.core import server_step as sampler
from qlsd_flwr.core.oracles import (
    ClientState,
    client_round,
    full_local_grad,
    minibatch,
    oracle,
    set_anchor,
)
from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.protocol.theta_star import resolve_theta_star
from qlsd_flwr.protocol import build
from qlsd_flwr.tasks.logistic import LogisticLocal

Z = 5.0  # standard errors per Monte Carlo check (two-sided p ≈ 6e-7 each)


def logistic_task(b=3, n=(23, 17, 30), n_features=3, n_classes=3, prior_var=4.0, seed=0) -> Task:
    gen = np.random.default_rng(seed)
    clients = []
    for i in range(b):
        X = gen.standard_normal((n[i], n_features)) + i  # heterogeneous clients
        y = gen.integers(0, n_classes, n[i])
        clients.append(LogisticLocal(X, y, n_classes))
    return Task(name="logistic-test", dim=clients[0].dim, clients=clients, prior=GaussianPrior(var=prior_var))


TASK = logistic_task()
THETA = np.random.default_rng(1).standard_normal(TASK.dim) * 0.3


def _mode(task: Task) -> np.ndarray:
    """θ* = argmin U by gradient descent to ‖∇U‖ ≤ 1e-11·(1 + ‖∇U(0)‖) (U is strongly convex)."""
    x = np.zeros(task.dim)
    g0 = np.linalg.norm(task.grad_potential(x))
    for _ in range(100_000):
        g = task.grad_potential(x)
        if np.linalg.norm(g) <= 1e-11 * (1 + g0):
            return x
        x = x - 2e-3 * g
    raise AssertionError("gradient descent did not converge")


MODE = _mode(TASK)


def _cfg(variant: str, prior_on: str, **kw):
    return resolve({"variant": variant, "num-clients": TASK.b, "prior-var": TASK.prior.var, "prior-on": prior_on,
                    "batch-fraction": 0.2, "task": "logistic", "progress": False, **kw})


def _per_point_grads(pot, theta):
    return np.stack([pot.grad_sum(theta, np.array([j])) for j in range(pot.n_data)])


@pytest.mark.parametrize("prior_on", ["server", "clients"])
@pytest.mark.parametrize("variant", ["qlsd", "qlsd-sharp", "qlsd-star", "qlsd-pp"])
def test_every_oracle_is_unbiased(variant, prior_on):
    cfg = _cfg(variant, prior_on)
    # QLSD*: the anchor is the mode (E[H_i] = ∇U_i(θ) − ∇U_i(θ*) sums to ∇U(θ) only there);
    # QLSD++: any anchor ζ (∇U_i(ζ) is added back)
    anchor = MODE if variant == "qlsd-star" else THETA + 0.5 * np.random.default_rng(2).standard_normal(TASK.dim)
    specs = [build.client_spec(cfg, i, c.n_data, TASK.dim, TASK.prior) for i, c in enumerate(TASK.clients)]
    server = build.server_spec(cfg, TASK, anchor if cfg.oracle == "star" else None)
    states = [ClientState() for _ in specs]
    for sp, st, pot in zip(specs, states, TASK.clients):
        if cfg.oracle in ("star", "svrg"):
            set_anchor(sp, pot, st, anchor, 0)
    M = 3000
    total = np.zeros((M, TASK.dim))
    for k in range(M):
        for sp, st, pot in zip(specs, states, TASK.clients):
            total[k] += oracle(sp, pot, st, THETA, minibatch(7, k, sp, pot.n_data))
    pt = sampler.prior_term(server, THETA)
    est = total.mean(axis=0) + (0.0 if pt is None else pt)
    exact = TASK.grad_potential(THETA)
    if variant == "qlsd-star":  # ∇U(θ) − ∇U(θ*), with ∇U(θ*) ≈ 0 to the mode's tolerance
        exact = exact - TASK.grad_potential(MODE)
    # Var of (N/n) Σ_{j∈S} f_j over uniform n-subsets S of N points: N²(1 − n/N) S²_f / n, with
    # S²_f the population variance (ddof 1) of the f_j; f_j = ∇U_ij(θ) [− ∇U_ij(anchor)]
    var = np.zeros(TASK.dim)
    for sp, pot in zip(specs, TASK.clients):
        if sp.oracle == "full":
            continue
        f = _per_point_grads(pot, THETA)
        if sp.oracle in ("star", "svrg"):
            f = f - _per_point_grads(pot, anchor)
        N, n = pot.n_data, sp.batch_size
        var += N**2 * (1 - n / N) * f.var(axis=0, ddof=1) / n
    if variant == "qlsd":  # deterministic: equal up to the order of float additions
        np.testing.assert_allclose(est, exact, rtol=1e-12, atol=1e-12 * np.abs(exact).max())
        return
    se = np.sqrt(var / M)
    assert np.all(se > 0)
    assert np.all(np.abs(est - exact) <= Z * se), np.max(np.abs(est - exact) / se)
    # and the estimator is not trivially exact: its spread is the derived one (within 10 %)
    sd = total.std(axis=0, ddof=1)
    np.testing.assert_allclose(sd, np.sqrt(var), rtol=0.1)


@pytest.mark.parametrize("prior_on", ["server", "clients"])
def test_control_variate_vanishes_at_the_mode(prior_on):
    # QLSD*: each H_i(θ*) is a difference of equal terms (the prior with the same weight on both
    # sides), so exactly 0; QLSD++ at ζ = θ*: Σ_i H_i(θ*) + the server's prior term = ∇U(θ*) = 0
    cfg = _cfg("qlsd-star", prior_on, **{"theta-star": "optimise", "gamma": 2e-3, "opt-rounds": 20000,
                                         "opt-tol": 1e-10})
    g = lambda th: TASK.grad_potential(th)  # noqa: E731
    ts, info = resolve_theta_star(cfg, TASK, np.zeros(TASK.dim), g)
    assert info["opt_rounds"] < 20000  # converged, not stopped
    g0 = np.linalg.norm(g(np.zeros(TASK.dim)))
    assert np.linalg.norm(g(ts)) <= 1e-10 * (1 + g0)
    for variant in ("qlsd-star", "qlsd-pp"):
        c = _cfg(variant, prior_on)
        specs = [build.client_spec(c, i, p.n_data, TASK.dim, TASK.prior) for i, p in enumerate(TASK.clients)]
        server = build.server_spec(c, TASK, ts if c.oracle == "star" else None)
        total = np.zeros(TASK.dim)
        for k in range(5):
            total[:] = 0.0
            for sp, pot in zip(specs, TASK.clients):
                st = ClientState()
                set_anchor(sp, pot, st, ts, 0)
                h = oracle(sp, pot, st, ts, minibatch(3, k, sp, pot.n_data))
                if variant == "qlsd-star":
                    assert np.array_equal(h, np.zeros(TASK.dim))
                total += h
            pt = sampler.prior_term(server, ts)
            total += 0.0 if pt is None else pt
            assert np.linalg.norm(total) <= 1e-9 * (1 + g0)


def test_memory_invariant_and_client_mirror_are_exact():
    cfg = _cfg("qlsd-pp", "server", s="4", p="0.6", l=7)
    d, b = TASK.dim, TASK.b
    specs = [build.client_spec(cfg, i, c.n_data, d, TASK.prior) for i, c in enumerate(TASK.clients)]
    spec = build.server_spec(cfg, TASK, None)
    st = sampler.init_state(spec, THETA)
    clients = [ClientState() for _ in range(b)]
    gamma_small = sampler.ServerSpec(**{**spec.__dict__, "gamma": 1e-4})
    for _ in range(60):
        k = st.k
        if sampler.refresh_anchor(gamma_small, st):
            for sp, cs, pot in zip(specs, clients, TASK.clients):
                set_anchor(sp, pot, cs, st.zeta, st.zeta_version)
        g_hat = {}
        for i in np.flatnonzero(participation.active_mask(5, k, cfg.p)):
            g_hat[int(i)] = client_round(specs[i], TASK.clients[i], clients[i], 5, k, st.theta)[1]
        sampler.server_step(gamma_small, st, 5, *sampler.stack_replies(g_hat, b, d))
        assert np.array_equal(st.eta, st.eta_i.sum(axis=0))  # η = Σ η_i, recomputed exactly
        for i in range(b):  # every client's own η_i is the server's mirror, bit for bit
            mine = clients[i].eta if clients[i].eta is not None else np.zeros(d)
            assert np.array_equal(mine, st.eta_i[i])
    assert np.any(st.eta != 0)


def test_participation_frequencies_match_p():
    p = np.array([0.05, 0.3, 0.5, 0.9, 1.0])
    M = 20000
    mask = participation.active_mask(np.full(M, 3), np.arange(M), p)  # rounds 0..M-1, seed 3
    freq = mask.mean(axis=0)
    se = np.sqrt(p * (1 - p) / M)
    assert np.all(np.abs(freq - p) <= Z * np.maximum(se, 1e-12))
    assert freq[-1] == 1.0
    # independent across clients: the joint frequency of two clients is the product
    both = (mask[:, 1] & mask[:, 2]).mean()
    assert abs(both - 0.15) <= Z * np.sqrt(0.15 * 0.85 / M)
    # the same draws whatever the order of the calls: a function of (seed, round, client)
    assert np.array_equal(participation.active_mask(3, 123, p), mask[123])


def _spec(rule="unbiased", memory=True, prior_on_server=True, oracle_="svrg"):
    return sampler.ServerSpec(b=3, gamma=0.01, p=np.array([0.5, 1.0, 0.25]), rule=rule, memory=memory,
                              alpha=np.array([0.5, 0.25, 1.0]), l=10, kind=samplers.ESTIMATORS[oracle_],
                              prior=GaussianPrior(var=2.0, mean=0.5), prior_on_server=prior_on_server)


def test_server_step_equals_the_step_by_hand():
    spec = _spec()
    theta0 = np.array([1.0, -2.0])
    st = sampler.init_state(spec, theta0)
    st.eta_i[:] = [[0.1, 0.2], [0.3, -0.4], [-0.5, 0.6]]
    st.eta = st.eta_i.sum(axis=0)
    g_hat = np.array([[1.0, 2.0], [3.0, 4.0], [99.0, 99.0]])
    replied = np.array([True, True, False])  # client 2's row must be ignored
    eta_before = st.eta.copy()
    skipped = sampler.server_step(spec, st, 11, g_hat, replied)
    # by hand: g = ĝ_0/0.5 + ĝ_1/1 + η_k + (θ − 0.5)/2; θ' = θ − γ g + √(2γ) Z
    g = np.array([1.0, 2.0]) / 0.5 + np.array([3.0, 4.0]) + eta_before + (theta0 - 0.5) / 2.0
    z = rng.normal(11, rng.Stream.NOISE, 0, 0, 2)
    np.testing.assert_allclose(st.theta, theta0 - 0.01 * g + np.sqrt(0.02) * z, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(st.eta_i, [[0.6, 1.2], [1.05, 0.6], [-0.5, 0.6]], rtol=1e-15)
    assert not skipped and st.k == 1

    # active-fraction with no reply: the rule is undefined, the round is skipped
    st2 = sampler.init_state(_spec(rule="active-fraction"), theta0)
    assert sampler.server_step(_spec(rule="active-fraction"), st2, 11, g_hat, np.zeros(3, bool))
    assert np.array_equal(st2.theta, theta0) and st2.k == 1
    # active-fraction weights: b/|A| = 3/2 for each of the two that replied
    st3 = sampler.init_state(_spec(rule="active-fraction", memory=False, prior_on_server=False), theta0)
    sampler.server_step(_spec(rule="active-fraction", memory=False, prior_on_server=False), st3, 11, g_hat, replied)
    g3 = 1.5 * (np.array([1.0, 2.0]) + np.array([3.0, 4.0]))
    np.testing.assert_allclose(st3.theta, theta0 - 0.01 * g3 + np.sqrt(0.02) * z, rtol=1e-15, atol=1e-15)


def test_server_step_over_chains_is_each_chain_bitwise():
    spec = _spec()
    gen = np.random.default_rng(4)
    C = 4
    theta = gen.standard_normal((C, 2))
    g_hat = gen.standard_normal((C, 3, 2))
    replied = gen.random((C, 3)) < 0.6
    seeds = np.arange(C) + 20
    many = sampler.init_state(spec, theta)
    many.eta_i[:] = gen.standard_normal((C, 3, 2))
    many.eta = many.eta_i.sum(axis=1)
    singles = []
    for c in range(C):
        one = sampler.init_state(spec, theta[c])
        one.eta_i[:] = many.eta_i[c]
        one.eta = many.eta[c].copy()
        singles.append(one)
    sampler.server_step(spec, many, seeds, g_hat, replied)
    for c in range(C):
        sampler.server_step(spec, singles[c], int(seeds[c]), g_hat[c], replied[c])
        assert np.array_equal(many.theta[c], singles[c].theta)
        assert np.array_equal(many.eta_i[c], singles[c].eta_i) and np.array_equal(many.eta[c], singles[c].eta)


def test_full_local_gradient_includes_the_clients_share_of_the_prior():
    cfg = _cfg("qlsd-pp", "clients")
    sp = build.client_spec(cfg, 1, TASK.clients[1].n_data, TASK.dim, TASK.prior)
    got = full_local_grad(sp, TASK.clients[1], THETA)
    np.testing.assert_allclose(got, TASK.clients[1].grad_sum(THETA) + TASK.prior.grad(THETA) / TASK.b, rtol=1e-14)


def test_a_descent_stage_that_stops_improving_ends_at_its_best_point():
    # issue 37: a stage whose step no longer fits (here 2.05/λ on the stiff axis: a slow divergence, below the
    # 10× blow-up rule) ends STALL rounds after its best gradient, at that point, instead of using up its budget
    from qlsd_flwr.core.metric import Identity
    from qlsd_flwr.protocol.theta_star import STALL, optimise_theta_star

    lam = np.array([1.0, 100.0])
    calls, norms = [], []

    def grad(th):
        calls.append(1)
        g = lam * th
        norms.append(float(np.linalg.norm(g)))
        return g

    cfg = resolve({"task": "gaussian", "dim": 2, "opt-tol": 1e-12})
    th0 = np.array([1.0, 1e-3])
    info = {}
    th, rounds = optimise_theta_star(cfg, th0, grad, info, lr=2.05 / lam[1], precondition=Identity(), max_rounds=400,
                                     stall=STALL)
    best = int(np.argmin(norms))
    assert rounds == best + STALL < 400  # norms[0] is θ_0's; round r's gradient is norms[r]
    assert info["opt_grad_norm"] == min(norms) and not info["opt_converged"]
    assert float(np.linalg.norm(lam * th)) == min(norms)  # the best point, not where it wandered
    stalled = rounds
    calls.clear()
    norms.clear()
    # without it (a last stage), the descent goes on: here the blow-up rule halves the step and it converges
    _, rounds = optimise_theta_star(cfg, th0, grad, {}, lr=2.05 / lam[1], precondition=Identity(), max_rounds=400)
    assert rounds > stalled
