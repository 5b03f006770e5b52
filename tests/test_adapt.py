"""``metric-from = adapt`` (:mod:`qlsd_flwr.core.adapt`): the warm-up chain's windows, what it learns
where the curvature misleads, the frozen metric's stationary law, and the engines' agreement."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.linalg import solve_discrete_lyapunov

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.core import adapt
from qlsd_flwr.core.metric import Dense, Diagonal
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.run.simulate import run
from test_metric import MatrixGaussian, _exact, ill_conditioned_task


class MisleadingCurvature(MatrixGaussian):
    """A client whose curvature report is the identity whatever its precision (a mode's curvature
    that says nothing of the posterior's shape): ``metric-from = curvature`` builds a useless M."""

    def hessian(self, theta):
        return np.eye(len(self.mu))

    def curvature_diag(self, theta):
        return np.ones(len(self.mu))


def _misled_task():
    task = ill_conditioned_task(d=3)
    task.clients = [MisleadingCurvature(c.A, c.mu) for c in task.clients]
    return task, sum(c.A for c in task.clients)


def _kappa(summary_metric, P) -> float:
    """``κ(M^{1/2} P M^{1/2})``: 1 for the ideal metric ``P^{-1}``."""
    M = np.asarray(summary_metric, dtype=np.float64)
    L = np.linalg.cholesky(np.diag(M) if M.ndim == 1 else M)
    lam = np.linalg.eigvalsh(L.T @ P @ L)
    return float(lam.max() / lam.min())


@pytest.mark.parametrize("rounds", [20, 57, 300, 1000, 12345])
def test_the_windows_double_inside_the_buffers_and_end_where_the_last_buffer_begins(rounds):
    w = adapt.windows(rounds)
    assert w[0][0] == int(0.15 * rounds) and w[-1][1] == rounds - int(0.10 * rounds)
    assert all(a[1] == b[0] for a, b in zip(w, w[1:]))  # contiguous
    lengths = [e - s for s, e in w]
    assert all(b == 2 * a for a, b in zip(lengths[:-2], lengths[1:-1]))  # doubling; the last takes the rest
    assert lengths[-1] >= lengths[-2] if len(lengths) > 1 else True


def test_the_pooled_covariance_centres_each_chain_on_its_own_mean():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 3, 4))
    shifted = x + np.array([0.0, 100.0, -50.0])[None, :, None]  # chains far apart: no effect
    v, n = adapt.pooled_cov(shifted, dense=False)
    S, _ = adapt.pooled_cov(shifted, dense=True)
    assert n == 150 and np.allclose(v, np.diag(S))
    want = sum(np.cov(x[:, c, :].T) * 49 for c in range(3)) / (3 * 49)
    assert np.allclose(S, want)


def test_regularisation_keeps_a_singular_window_positive_definite():
    d = 6
    cov = np.outer(np.arange(1.0, 7.0), np.arange(1.0, 7.0))  # rank one: fewer draws than d
    m = adapt.regularise(cov, 1, Dense(np.eye(d) * 2.0), d)
    assert m.kind == "dense" and np.all(np.linalg.eigvalsh(m.m) > 0)
    m2 = adapt.regularise(np.zeros(d), 3, Diagonal(np.full(d, 4.0)), d)
    assert np.allclose(m2.m, 4.0 * 5 / 8)  # the shrinkage weight n / (n + 5)


@pytest.mark.parametrize("kind", ["dense", "diagonal"])
def test_adapt_learns_the_posterior_s_shape_where_the_curvature_misleads(kind):
    """The curvature metric here is the identity (κ(M^½ P M^½) = 2,641); the warm-up's covariance
    must bring κ near what the metric's kind can reach. For ``dense`` that is 1: with ``n_eff`` effective
    draws in the last window the estimate's eigenvalues lie within Marchenko–Pastur's edges
    (1 ± √(d/n_eff))², and ULA at γ = c/λ_max inflates the stiffest direction by 1/(1 − c/2) = 1.14, so
    κ ≤ 2 holds for n_eff ≥ 150 (the last window has 4 × 1,350 draws). For ``diagonal`` the best is
    κ of the diagonally scaled P (the correlation ρ = 0.8 stays): the bound is twice that."""
    task, P = _misled_task()
    cur = _exact({"gamma": "auto", "metric": kind}, task, 4, 10)
    ada = _exact({"gamma": "auto", "metric": kind, "metric-from": "adapt", "adapt-rounds": 3000}, task, 4, 10)
    assert _kappa(cur.summary["metric"], P) > 2000
    D = np.diag(1.0 / np.sqrt(np.diag(P)))
    w = np.linalg.eigvalsh(D @ P @ D)
    best = 1.0 if kind == "dense" else w.max() / w.min()
    assert _kappa(ada.summary["metric"], P) < 2.0 * best
    s = ada.summary
    assert s["adapt_rounds"] == 3000 and s["adapt_exchanges"] == 4 * 3000 and len(s["adapt_windows"]) >= 4
    assert s["gamma"] > 100 * cur.summary["gamma"]  # the step follows the metric (gamma = auto)


def test_the_kept_draws_are_ula_under_the_frozen_adapted_metric():
    """After the warm-up the metric is constant: 1,000 chains' stationary covariance is the discrete
    Lyapunov solution Σ = BΣBᵀ + 2γM with B = I − γMP, for the M the summary records (a short warm-up
    leaves M a mix of the curvature metric and a noisy window estimate: any SPD M must satisfy it)."""
    task = ill_conditioned_task(d=3)
    P = sum(c.A for c in task.clients)
    C, K = 1000, 400
    res = _exact({"gamma": "auto", "metric": "dense", "metric-from": "adapt", "adapt-rounds": 40}, task, C, K)
    M, gamma = np.asarray(res.summary["metric"]), res.summary["gamma"]
    assert not np.allclose(M, np.linalg.inv(P), rtol=1e-3)  # the warm-up moved M off the curvature metric
    B = np.eye(3) - gamma * M @ P
    assert max(abs(np.linalg.eigvals(B))) ** (2 * K) < 1e-5  # K rounds forget the warm-up's ends
    sigma = solve_discrete_lyapunov(B, 2 * gamma * M)
    S = np.cov((res.theta - task.theta_star).T)
    se = np.sqrt((np.outer(np.diag(sigma), np.diag(sigma)) + sigma**2) / (C - 1))
    assert np.max(np.abs(S - sigma) / se) < 5.0


@pytest.mark.parametrize("metric", ["diagonal", "dense"])
def test_engines_agree_bit_for_bit_with_an_adapted_metric(metric, tmp_path):
    base = {"num-chains": 2, "num-rounds": 20, "burn-in": 5, "progress": False, "output-dir": str(tmp_path),
            "metric": metric, "metric-from": "adapt", "adapt-rounds": 30, "gamma": "auto", "variant": "qlsd-pp",
            "init": "dispersed", "p": "0.6", "dim": 5, "num-clients": 3, "l": 7, "s": "4"}
    a = run({**base, "engine": "inprocess", "run-name": "a"})
    b = run({**base, "engine": "vectorised", "run-name": "b"})
    assert np.array_equal(load_samples(a.run_dir), load_samples(b.run_dir))
    assert a.summary["metric"] == b.summary["metric"] and a.summary["adapt_exchanges"] == 60
    one = run({**base, "engine": "local", "num-chains": 1, "run-name": "c"})
    c1 = run({**base, "engine": "vectorised", "num-chains": 1, "run-name": "d"})
    assert np.array_equal(load_samples(one.run_dir), load_samples(c1.run_dir))
    cur = run({**base, "engine": "vectorised", "metric-from": "curvature", "run-name": "e"})
    assert cur.summary["metric"] != b.summary["metric"]  # the warm-up changed M


def test_adapt_keys_name_the_bad_value():
    with pytest.raises(ConfigError, match="metric-from: adapt refines a diagonal or dense metric"):
        resolve({"metric": "kronecker", "metric-from": "adapt", "task": "logistic"})
    with pytest.raises(ConfigError, match="metric-from: unknown value 'stan'"):
        resolve({"metric": "diagonal", "metric-from": "stan"})
    with pytest.raises(ConfigError, match="adapt-rounds"):
        resolve({"metric": "diagonal", "metric-from": "adapt", "adapt-rounds": 3})


def test_a_warm_up_that_diverges_names_the_step():
    task, _ = _misled_task()
    with pytest.raises(ConfigError, match="metric-from = adapt: the warm-up chain left the finite numbers by its round"):
        _exact({"gamma": 5.0, "metric": "dense", "metric-from": "adapt", "adapt-rounds": 50}, task, 2, 5)


WARM_KILLER = """
import json, os, signal, sys
from qlsd_flwr.outputs import warmup
from qlsd_flwr.run import simulate
save = warmup.WarmupStore.save
def killing_save(self, state):
    save(self, state)
    if state["r"] >= int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)
warmup.WarmupStore.save = killing_save
simulate.run(json.loads(sys.argv[1]))
sys.exit(3)
"""


@pytest.mark.parametrize("engine", ["inprocess", "vectorised"])
def test_a_run_killed_in_its_warm_up_continues_it_bit_for_bit(engine, tmp_path, caplog):
    """kill -9 during the warm-up (after its state was saved at round 24 of 40), then the same keys
    again: the warm-up continues from round 24, and the chain is bitwise the uninterrupted one."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    o = {"engine": engine, "num-chains": 2, "num-rounds": 12, "burn-in": 2, "progress": False, "dim": 5,
         "num-clients": 3, "l": 7, "variant": "qlsd-pp", "p": "0.6", "s": "4", "metric": "dense",
         "metric-from": "adapt", "adapt-rounds": 40, "gamma": "auto", "init": "dispersed", "checkpoint-every": 8,
         "output-dir": str(tmp_path)}
    ref = run({**o, "run-name": "ref"})
    assert not list(tmp_path.glob(".warmup-*"))  # removed (file and folder) once the warm-up ended
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.run([sys.executable, "-c", WARM_KILLER, json.dumps({**o, "run-name": "b"}), "24"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    kept = list(tmp_path.glob(".warmup-*/state.npz"))
    assert len(kept) == 1 and not (tmp_path / "b").exists()  # no run folder before M is frozen
    assert np.load(kept[0])["a_kept"].shape[1:] == (2, 5)
    with caplog.at_level("INFO"):
        again = run({**o, "run-name": "b"})
    assert "continuing the warm-up from its round 24" in caplog.text
    assert np.array_equal(load_samples(ref.run_dir), load_samples(again.run_dir))
    assert again.summary["metric"] == ref.summary["metric"] and again.summary["gamma"] == ref.summary["gamma"]
    assert not kept[0].exists() and not kept[0].parent.exists()


def test_a_damaged_warm_up_state_is_refused_naming_the_file(tmp_path):
    from qlsd_flwr.outputs import checkpoint as ckpt
    from qlsd_flwr.outputs.warmup import warmup_store

    cfg = resolve({"metric": "dense", "metric-from": "adapt", "checkpoint-every": 5, "output-dir": str(tmp_path),
                   "dim": 3})
    store = warmup_store(cfg)
    R = 100  # windows(100): the first slow window is rounds 15..24, so round 17 holds 2 of its draws
    good = adapt.snapshot(17, 0, 0.1, Dense(np.eye(3)), np.zeros((2, 3)), [np.ones((2, 3))] * 2, [])
    store.save(good)
    assert store.load(2, 3, "dense", R)["r"] == 17
    with pytest.raises(ckpt.CheckpointError, match=r"warm-up state .*\.warmup-.*array 'theta' is not 4 × 3"):
        store.load(4, 3, "dense", R)  # another number of chains
    with pytest.raises(ckpt.CheckpointError, match=r"r must be an integer in \[0, 12\]"):
        store.load(2, 3, "dense", 12)  # a state past this run's warm-up
    store.save({**good, "kept": np.ones((5, 2, 3))})
    with pytest.raises(ckpt.CheckpointError, match="holds 5 draws of the current window, its round 17 means 2"):
        store.load(2, 3, "dense", R)
    store.save({**good, "theta": np.full((2, 3), np.nan)})
    with pytest.raises(ckpt.CheckpointError, match="non-finite|is not 2 × 3 finite"):
        store.load(2, 3, "dense", R)
    store.save({**good, "metric": Diagonal(np.ones(3))})
    with pytest.raises(ckpt.CheckpointError, match="its metric is diagonal, this run's dense"):
        store.load(2, 3, "dense", R)
    store.path.write_bytes(b"not a zip")
    with pytest.raises(ckpt.CheckpointError, match="cannot read checkpoint"):
        store.load(2, 3, "dense", R)
