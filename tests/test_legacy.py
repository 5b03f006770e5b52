"""The legacy-API pair (flwr.server.strategy.Strategy + NumPyClient) runs the same chain.

It runs on Flower's Ray engine and must give, bit for bit, the chain of the framework-free
path, which the posterior tests check against the toy Gaussian's exact posterior.
"""

import numpy as np
import pytest

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.flower.legacy import LegacyQLSDStrategy
from qlsd_flwr.run.simulate import run_legacy_simulation


@pytest.mark.ray
def test_legacy_pair_on_ray_matches_framework_free_chain(tmp_path, attached_ray):
    o = {"variant": "qlsd-pp", "p": "0.5", "s": "8", "num-rounds": 12, "burn-in": 0, "progress": False,
         "l": 5, "num-clients": 6, "output-dir": str(tmp_path), "run-name": "legacy", "client-cpus": 1.0}
    cfg = resolve(o)
    strat = run_legacy_simulation(cfg, o, keep_trace=True)
    ref = run_local(cfg, write=False, keep_trace=True, progress=False).trace
    np.testing.assert_array_equal(np.array(strat.server.trace), ref)
    s = strat.server.summary_data
    assert s["rounds"] == 12 and s["totals"]["n_rejected"] == 0 and s["totals"]["bits_exact"] > 0
    # the federated LOO as the last round's evaluate step: the framework-free run's number, in the files
    import json

    mine = run_local(resolve({**o, "run-name": "local"}), progress=False)
    assert "error" not in s["loo"] and s["loo"]["elpd_loo"] == mine.summary["loo"]["elpd_loo"]
    assert json.loads((tmp_path / "legacy" / "summary.json").read_text())["loo"]["elpd_loo"] == s["loo"]["elpd_loo"]


@pytest.mark.ray
@pytest.mark.parametrize("rival", [{"variant": "fald", "tau": 0.5, "metric": "dense"},
                                   {"variant": "dg-lmc", "metric": "diagonal"}])
def test_legacy_pair_runs_the_rivals_fald_and_dg_lmc_bit_for_bit(tmp_path, rival, attached_ray):
    # FALD's local steps (with a dense metric from a file, its 50 × 50 numbers sent as bytes in the first
    # FitIns config) and QSGD-coded Δ_i, DG-LMC's z_i (sent with the first message, coupled in a diagonal
    # metric's norm) and its coded changes, through FitIns/FitRes; VR-FALD* and FSGLD need the clients'
    # ∇U_i(θ*) before sampling, which this loop cannot ask: refused
    m = np.linspace(0.5, 2.0, 50)
    q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(50, 50)))
    np.save(tmp_path / "m.npy", q @ np.diag(m) @ q.T if rival["metric"] == "dense" else m)
    rival = {**rival, "metric": str(tmp_path / "m.npy")}
    o = {"p": "0.5", "local-steps": 2, "compressor": "qsgd", "s": "8", "num-rounds": 8,
         "burn-in": 0, "progress": False, "num-clients": 4, "output-dir": str(tmp_path), "run-name": "legacy",
         "loo": "off", "client-cpus": 1.0, **rival}
    cfg = resolve(o)
    strat = run_legacy_simulation(cfg, o, keep_trace=True)
    ref = run_local(cfg, write=False, keep_trace=True, progress=False).trace
    np.testing.assert_array_equal(np.array(strat.server.trace), ref)
    assert strat.server.summary_data["totals"]["n_rejected"] == 0
    from qlsd_flwr.tasks.loading import load_task

    c = resolve({"variant": "vr-fald-star"})
    with pytest.raises(ConfigError, match="vr-fald-star needs every client's"):
        LegacyQLSDStrategy(c, load_task(c), write=False)
    c = resolve({"variant": "fsgld"})
    with pytest.raises(ConfigError, match="fsgld needs every client's"):
        LegacyQLSDStrategy(c, load_task(c), write=False)


def test_legacy_refuses_optimisation_phase():
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve({"variant": "qlsd-star", "theta-star": "optimise"})
    with pytest.raises(ConfigError, match="closed-form"):
        LegacyQLSDStrategy(cfg, load_task(cfg), write=False)


def test_legacy_refuses_the_compressed_downlink():
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve({"variant": "qlsd-pp", "downlink": "qsgd"})
    with pytest.raises(ConfigError, match="downlink: the legacy strategy sends θ in full"):
        LegacyQLSDStrategy(cfg, load_task(cfg), write=False)


def test_legacy_takes_a_metric_file_and_refuses_what_needs_the_clients_before_sampling(tmp_path):
    from qlsd_flwr.tasks.loading import load_task

    np.save(tmp_path / "m.npy", np.linspace(0.5, 2.0, 50))
    cfg = resolve({"metric": str(tmp_path / "m.npy"), "gamma": 1e-4})
    strat = LegacyQLSDStrategy(cfg, load_task(cfg), write=False)
    assert strat.server.spec.metric.kind == "diagonal"
    assert np.array_equal(strat.server.spec.metric.m, np.linspace(0.5, 2.0, 50))
    for bad, what in (({"metric": "diagonal"}, "curvature"), ({"gamma": "auto"}, "gamma")):
        c = resolve(bad)
        with pytest.raises(ConfigError, match=what):
            LegacyQLSDStrategy(c, load_task(c), write=False)
    # dispersed starts need θ* only: in closed form (the Gaussian task) the legacy pair has them
    c = resolve({"init": "dispersed"})
    task = load_task(c)
    strat = LegacyQLSDStrategy(c, task, write=False)
    assert not np.array_equal(strat.server.state.theta, task.theta_star)
