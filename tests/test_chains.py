"""Several chains in one Flower run (``num-chains``; :mod:`qlsd_flwr.protocol.chains`).

Chain ``c`` of a Flower run must be chain ``c`` of the vectorised engine and the one-chain run
with seed ``seed + c``, bit for bit, whatever order the replies come in; its samples file holds
every chain (R-hat from one run); each chain's replies are validated and counted on its own; and
the Gaussian posterior checks of ``test_gaussian_posterior`` hold for every chain.
"""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from gaussian_theory import check_chain, variance_band
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.engines.vectorised import run_vectorised
from qlsd_flwr.flower.records import RECORD, config_record
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.protocol import wire
from qlsd_flwr.run import simulate
from qlsd_flwr.run.simulate import run_inprocess, run_ray
from qlsd_flwr.tasks import loading
from qlsd_flwr.tasks.gaussian import build_gaussian_task

BASE = {"task": "gaussian", "num-clients": 5, "dim": 6, "num-rounds": 40, "burn-in": 5, "gamma": 1e-3,
        "progress": False, "seed": 3, "l": 7, "s": "4"}


def _inprocess(o, **kw):
    o = {**BASE, "engine": "inprocess", **o}
    return run_inprocess(resolve(o), o, strategy_kwargs={"keep_trace": True, "write": False}, **kw)


def _trace(strategy) -> np.ndarray:
    tr = np.stack(strategy.trace)
    return np.moveaxis(tr, 0, 1) if tr.ndim == 3 else tr  # (C, K, d), or (K, d) for one chain


@pytest.mark.parametrize("variant, p", [("qlsd-pp", "0.5"), ("qlsd-star", "0.6"), ("qlsd-sharp", "1.0"),
                                        ("lsd-pp", "0.7"), ("qlsd", "0.5")])
def test_chain_c_is_the_vectorised_chain_c_and_the_one_chain_run_with_seed_plus_c(variant, p):
    o = {"variant": variant, "p": p, "num-chains": 3}
    flower = _trace(_inprocess(o, shuffle_seed=11))  # replies taken in a shuffled order
    vec = run_vectorised(resolve({**BASE, **o, "engine": "vectorised"}), write=False, keep_trace=True,
                         backend="numpy").trace
    assert flower.shape == vec.shape == (3, 40, 6)
    assert np.array_equal(flower, vec)
    one = _trace(_inprocess({"variant": variant, "p": p, "seed": BASE["seed"] + 2}))
    assert np.array_equal(flower[2], one)
    assert not np.array_equal(flower[0], flower[1])  # the chains are not copies


@pytest.mark.parametrize("variant", ["qlsd-pp", "qlsd-star", "qlsd-sharp", "qlsd", "lsd-pp"])
def test_a_logistic_client_batches_its_chains_oracles_and_each_chain_is_still_the_reference(variant, monkeypatch):
    # the logistic potential has grad_sum_batch: a several-chain message makes one batched
    # gradient of its chains (client_rounds), a one-chain message the per-chain oracle; both
    # equal the vectorised engine's chains bit for bit
    from qlsd_flwr.core import oracles

    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "variant": variant, "p": "0.6",
         "num-chains": 3, "num-rounds": 25, "gamma": 1e-4, "batch-fraction": 0.1, "l": 6,
         "theta-star": "optimise", "opt-accept-unconverged": True}
    calls = []
    real = oracles.oracle_batch
    monkeypatch.setattr(oracles, "oracle_batch", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    flower = _trace(_inprocess(o, shuffle_seed=5))
    assert calls and set(calls) <= {1, 2, 3} and max(calls) == 3  # the chains that sample, in one batch
    vec = run_vectorised(resolve({**BASE, **o, "engine": "vectorised"}), write=False, keep_trace=True,
                         backend="numpy").trace
    assert flower.shape == vec.shape and np.array_equal(flower, vec)
    one = _trace(_inprocess({**o, "num-chains": 1, "seed": BASE["seed"] + 1}))
    assert np.array_equal(flower[1], one)


@pytest.mark.ray
def test_a_ray_run_of_four_chains_writes_them_all_and_arviz_reads_rhat(tmp_path, attached_ray):
    import arviz as az

    o = {**BASE, "engine": "ray", "variant": "qlsd-pp", "p": "0.8", "num-chains": 4, "num-rounds": 30,
         "output-dir": str(tmp_path), "run-name": "ray4", "client-cpus": 1.0}
    strat = run_ray(resolve(o), o, strategy_kwargs={"keep_trace": True})
    vec = run_vectorised(resolve({**o, "engine": "vectorised"}), write=False, keep_trace=True, backend="numpy")
    assert np.array_equal(_trace(strat), vec.trace)
    draws = load_samples(tmp_path / "ray4")
    assert draws.shape == (4, 25, 6) and np.array_equal(draws, vec.trace[:, 5:])
    idata = az.from_netcdf(tmp_path / "ray4" / "samples.nc")
    rhat = az.rhat(idata)["theta"].values
    assert rhat.shape == (6,) and np.all(np.isfinite(rhat))
    s = strat.summary_data
    assert s["num_chains"] == 4 and s["rejected"] == {} and set(s["memory_check"]) == {f"chain{c}" for c in range(4)}
    for c in range(4):
        mc = s["memory_check"][f"chain{c}"]
        assert mc["max_abs_eta_minus_sum"] == 0.0 and all(mc["eta_count_agrees"].values())
    # the federated LOO over Ray's nodes: az.loo on the pooled pointwise log-likelihood (test_loo.py)
    import qlsd_flwr
    from test_loo import assert_same_loo, pooled_loo

    ref, _ = pooled_loo(loading.load_task(resolve(o)).clients, idata.posterior["theta"].values)
    assert_same_loo(qlsd_flwr.loo(tmp_path / "ray4"), ref)


def test_every_chain_of_a_flower_run_samples_the_gaussian_posterior():
    """``test_gaussian_posterior``'s check (derived variance band, batch-means z-test of the mean)
    on each of 2 chains of QLSD++ at p = 0.25. The 3,000 rounds run on the vectorised engine, whose chains are
    the in-process Flower run's bit for bit: checked here on the first 300 rounds of the same configuration (the
    whole Flower run cost 41 s of the suite's CPU-bound minutes; tests/test_vectorised.py and the test above
    check the engines' equality on other configurations)."""
    gamma, K, burn, s = 2e-4, 3000, 300, 2**16
    task = build_gaussian_task(b=20, d=50, data_seed=0)
    o = {"variant": "qlsd-pp", "gamma": gamma, "num-rounds": K, "burn-in": 0, "p": "0.25", "s": str(s),
         "l": 50, "seed": 1, "progress": False, "engine": "inprocess", "num-chains": 2}
    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.flower.strategy import QLSDStrategy

    head = {**o, "num-rounds": burn}
    cfg = resolve(head)
    strat = QLSDStrategy.from_config(cfg, task, write=False, keep_trace=True)
    strat.start(grid=InProcessGrid(make_client_app(overrides=head), cfg.b))
    tr = run_vectorised(resolve({**o, "engine": "vectorised"}), task=task, write=False, keep_trace=True).trace
    assert tr.shape == (2, K, 50) and np.array_equal(_trace(strat), tr[:, :burn])
    band = variance_band(task, "qlsd-pp", gamma, 0.25, s)
    for c in range(2):
        out = check_chain(tr[c, burn:], task, gamma, band)
        assert out["mean_ok"] and out["var_ok"], (c, out)


def _corrupt_chain(chain: int, client: int):
    """A client mod that zeroes the QSGD norm of one chain's payload in one client's replies (a
    decodable message with another value is not what we want here: a bad code is)."""
    def mod(msg: Message, context, call_next) -> Message:
        reply = call_next(msg, context)
        if reply.has_error() or int(context.node_config["partition-id"]) != client:
            return reply
        rec = dict(config_record(reply.content))
        if "chains" in rec and chain in rec["chains"]:
            j = rec["chains"].index(chain)
            payload = list(rec["payload"])
            payload[j] = payload[j][:3]  # truncated: the decoder refuses it
            rec["payload"] = payload
        return Message(RecordDict({RECORD: ConfigRecord(rec)}), reply_to=msg)
    return mod


def test_a_bad_reply_for_one_chain_is_rejected_in_that_chain_only():
    o = {"variant": "qlsd-pp", "p": "1.0", "num-chains": 3}
    clean = _trace(_inprocess(o))
    strat = _inprocess(o, mods=[_corrupt_chain(1, client=2)])
    bad = _trace(strat)
    assert np.array_equal(bad[0], clean[0]) and np.array_equal(bad[2], clean[2])
    assert not np.array_equal(bad[1], clean[1])
    per_chain = strat.summary_data["rejected_per_chain"]
    assert per_chain[0] == {} and per_chain[2] == {}
    # every round of chain 1 loses client 2's message: 39 bad codes, and one resync (the client
    # applied its memory update for a message the server refused; its counter then disagrees)
    assert per_chain[1] == {"decode_error": 39, "resync": 1}
    assert strat.summary_data["missed_rounds"]["1"]["2"] == list(range(1, 41))


@pytest.mark.parametrize("reply", [
    {"client": 0, "status": "ok", "payload": b"x", "anchor_version": 0},  # one payload for 2 chains
    {"client": 0, "chains": [0], "status": ["ok"], "payload": [b"x"], "anchor_version": [0]},  # chain 1 missing
    {"client": 0, "chains": [1, 0], "status": ["ok"] * 2, "payload": [b""] * 2, "anchor_version": [0] * 2},
    {"client": 0, "chains": [0, 1], "status": ["ok"], "payload": [b""] * 2, "anchor_version": [0] * 2},
    {"client": 0, "chains": [0, True], "status": ["ok"] * 2, "payload": [b""] * 2, "anchor_version": [0] * 2},
    {"client": 0, "chains": [0, 2 ** 40], "status": ["ok"] * 2, "payload": [b""] * 2, "anchor_version": [0] * 2},
    None,
])
def test_a_malformed_several_chain_reply_is_refused_for_every_chain_asked(reply):
    with pytest.raises(wire.ReplyError):
        wire.unbundle_reply(reply, [0, 1])


def test_a_resync_without_chains_holds_for_every_chain_and_requests_round_trip():
    assert wire.unbundle_reply({"client": 4, "status": "resync"}, [0, 2]) == {
        0: {"client": 4, "status": "resync"}, 2: {"client": 4, "status": "resync"}}
    th = np.arange(12.0).reshape(2, 6)
    per = {0: {"phase": "sample", "round": 3, "client": 4, "theta": th[0], "anchor_version": 1, "eta_count": 2},
           2: {"phase": "sample", "round": 3, "client": 4, "theta": th[1], "anchor_version": 1, "eta_count": 5,
               "anchor": -th[1], "eta": th[1] * 2}}
    back = wire.unbundle_request(wire.bundle_request(per), 6)
    assert set(back) == {0, 2} and "anchor" not in back[0]
    for c in per:
        for k, v in per[c].items():
            assert np.array_equal(back[c][k], v), (c, k)
    with pytest.raises(ValueError, match="anchor_chains"):
        wire.unbundle_request({**wire.bundle_request(per), "anchor_chains": [1]}, 6)


def test_several_chains_are_refused_by_name_where_they_cannot_run():
    with pytest.raises(ConfigError, match="num-chains = 2 needs engine = ray, inprocess or vectorised"):
        resolve({"engine": "local", "num-chains": 2})
    from qlsd_flwr.flower.legacy import LegacyQLSDStrategy
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve({**BASE, "engine": "ray", "num-chains": 2})
    with pytest.raises(ConfigError, match="legacy strategy runs one chain"):
        LegacyQLSDStrategy(cfg, load_task(cfg), write=False)


def test_a_written_inprocess_run_of_three_chains_has_them_in_its_samples(tmp_path):
    o = {**BASE, "engine": "inprocess", "variant": "qlsd-pp", "p": "0.5", "num-chains": 3,
         "output-dir": str(tmp_path), "run-name": "three"}
    res = simulate.run(o)
    draws = load_samples(tmp_path / "three")
    assert draws.shape == (3, 35, 6)
    vec = run_vectorised(resolve({**o, "engine": "vectorised"}), write=False, keep_trace=True, backend="numpy")
    assert np.array_equal(draws, vec.trace[:, 5:])
    assert res.summary["num_chains"] == 3 and res.summary["draws_kept"] == 35


def test_torch_threads_are_set_by_the_rule_of_each_engine():
    """``torch-threads = auto``: ⌊client-cpus⌋ (at least 1) in a Ray actor, one less than the
    process's cores (at least 1) in one-process engines and in the ServerApp's process; a number
    everywhere; a bad value by name."""
    from qlsd_flwr.tasks.threads import apply_threads, cores, torch_threads

    assert torch_threads({"engine": "ray", "client-cpus": 0.5}) == 1
    assert torch_threads({"engine": "ray", "client-cpus": 2.5}) == 2
    assert torch_threads({"engine": "ray", "client-cpus": 0.5}, client=False) == max(1, cores() - 1)
    assert torch_threads({"engine": "inprocess"}) == torch_threads({"engine": "vectorised"}) == max(1, cores() - 1)
    assert torch_threads({"engine": "ray", "torch-threads": 3}) == 3
    with pytest.raises(ConfigError, match="torch-threads"):
        torch_threads({"torch-threads": "many"})
    import torch

    before = torch.get_num_threads()
    try:
        assert apply_threads({"torch-threads": 1}) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


_BLAS_PROBE = """
import hashlib, numpy as np
from threadpoolctl import threadpool_info
from qlsd_flwr.config import resolve
from qlsd_flwr.tasks import loading
task = loading.load_task(resolve({"task": "mnist", "dataset": "mnist_subset", "model": "logistic", "num-clients": 4}))
pot, rng = task.clients[0], np.random.default_rng(0)
theta, V = 0.1 * rng.normal(size=task.dim), rng.normal(size=(16, task.dim))
out = np.concatenate([pot.hvp_batch(theta, V).ravel(), pot.grad_sum(theta)])
print(sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}),
      hashlib.sha256(out.tobytes()).hexdigest())
"""


def test_blas_runs_one_thread_so_the_engines_compute_the_same_numbers():
    """A process that loads a task (every engine, the ServerApp and each ClientApp do) runs numpy's BLAS on one
    thread (``tasks/threads.pin_blas``): the logistic client's products and gradient are then bit for bit the same
    whether the process started with 1 or 2 BLAS threads. Unpinned, OpenBLAS's split of the product changed them by
    3e-13 (measured on the main job's data), which made the Ray engine's chains (one thread an actor) differ from the
    in-process engine's."""
    import os
    import subprocess
    import sys

    outs = []
    for n in ("1", "2"):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
        p = subprocess.run([sys.executable, "-c", _BLAS_PROBE], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(p.stdout.strip().splitlines()[-1])
    assert outs[0] == outs[1] and outs[0].startswith("[1] "), outs


def test_a_diverging_chain_stops_the_run_naming_it_and_every_chain_keeps_its_draws(tmp_path):
    from qlsd_flwr.protocol.divergence import DivergenceError

    o = {**BASE, "engine": "inprocess", "num-chains": 3, "gamma": 5.0, "burn-in": 0, "num-rounds": 40,
         "output-dir": str(tmp_path), "run-name": "away"}
    with pytest.raises(DivergenceError, match=r"in chain \d \(seed \d\)") as err:
        simulate.run(o)
    summary = __import__("json").loads((tmp_path / "away" / "summary.json").read_text())
    r = summary["diverged_at_round"]
    assert f"round {r} in chain {summary['diverged_chain']}" in str(err.value)
    draws = load_samples(tmp_path / "away")
    assert draws.shape == (3, r - 1, 6) and np.all(np.isfinite(draws))


def _stopped_three_chain_run(tmp_path):
    """A 3-chain run with checkpoints, its summary marked as stopped (so it may resume)."""
    import json

    o = {**BASE, "engine": "inprocess", "variant": "qlsd-pp", "num-chains": 3, "num-rounds": 20,
         "checkpoint-every": 10, "output-dir": str(tmp_path), "run-name": "ck"}
    simulate.run(o)
    run_dir = tmp_path / "ck"
    (run_dir / "summary.json").write_text(json.dumps({"stopped": "KeyboardInterrupt"}))
    return o, run_dir


@pytest.mark.parametrize("tamper, words", [
    (lambda m, a: a.pop("c1.eta_i"), "array 'c1.eta_i' is missing"),
    (lambda m, a: m["chain_meta"][2].update(k=3), r"chain_meta\[2\].k = 3"),
    (lambda m, a: m.update(rejected="x"), "'rejected' must be a table"),
    (lambda m, a: m.update(chains=1), "chains must be an integer >= 2"),
    (lambda m, a: a.update({"c0.theta": np.zeros((2, 6))}), "chain 0: array 'theta' must be one vector"),
])
def test_a_damaged_several_chain_checkpoint_is_refused_in_one_line(tmp_path, tamper, words):
    from qlsd_flwr.outputs import checkpoint as ckpt

    o, run_dir = _stopped_three_chain_run(tmp_path)
    meta, arrays = ckpt.load(ckpt.path_in(run_dir))
    meta.pop("format")
    tamper(meta, arrays)
    ckpt.save(ckpt.path_in(run_dir), arrays, meta)
    with pytest.raises(ckpt.CheckpointError, match=words) as err:
        ckpt.load_for_resume(resolve({**o, "resume": str(run_dir)}), "server")
    assert "\n" not in str(err.value) and "checkpoint.npz" in str(err.value)


def test_a_checkpoint_resumed_with_another_chain_count_is_refused_by_name(tmp_path):
    from qlsd_flwr.outputs import checkpoint as ckpt

    o, run_dir = _stopped_three_chain_run(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="holds 3 chain\\(s\\), the run has num-chains = 2"):
        ckpt.load_for_resume(resolve({**o, "num-chains": 2, "resume": str(run_dir)}), "server")


def test_convergence_summarises_arviz_per_test_point_and_for_the_total_log_likelihood():
    """The summary is ArviZ's R-hat / bulk ESS on ``exp(ll)`` per point and on ``Σ_j ll``: the worst
    point is the one whose chains were shifted apart, and the numbers are ArviZ's to float rounding
    (computed for all points at once, :mod:`qlsd_flwr.outputs.diagnostics`)."""
    import arviz as az

    from qlsd_flwr.outputs.convergence import predictive as convergence

    gen = np.random.default_rng(7)
    ll = -np.abs(gen.normal(0.5, 0.1, size=(4, 200, 5)))
    ll[:, :, 3] -= np.arange(4)[:, None] * 0.3  # point 3: the chains disagree
    out = convergence(ll)
    per_point = [float(az.rhat(np.exp(ll[:, :, j]))) for j in range(5)]
    same = lambda a, b: np.isclose(a, b, rtol=1e-12, atol=0)  # noqa: E731
    assert same(out["rhat_pred_max"], max(per_point)) and max(per_point) == per_point[3] > 1.5
    assert max(per_point[:3] + per_point[4:]) < 1.05  # the mixed points read as mixed
    assert same(out["rhat_pred_p99"], float(np.quantile(per_point, 0.99)))
    assert same(out["ess_bulk_pred_min"], min(float(az.ess(np.exp(ll[:, :, j]), method="bulk")) for j in range(5)))
    assert same(out["rhat_loglik"], float(az.rhat(ll.sum(axis=2))))
    assert same(out["ess_bulk_loglik"], float(az.ess(ll.sum(axis=2), method="bulk")))
    one = convergence(ll[:1])
    assert one["rhat_loglik"] is None and "2 chains" in one["why"]


def _chain_set_round():
    """A 2-chain server (QLSD++, anchors in flight) at its round, with every client's valid reply."""
    import copy

    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol import build
    from qlsd_flwr.protocol.chains import ChainSet
    from qlsd_flwr.protocol.client import handle_chains
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve({**BASE, "engine": "inprocess", "variant": "qlsd-pp", "num-chains": 2, "num-clients": 3, "l": 2})
    task = load_task(cfg)
    specs = [build.client_spec(cfg, i, task.clients[i].n_data, 6, task.prior) for i in range(3)]
    states = {i: {} for i in range(3)}
    server = ChainSet(cfg, task)
    server.begin(None)

    def reply(i):
        rep, sts = handle_chains(specs[i], task.clients[i], lambda c: states[i].get(c, ClientState()),
                                 cfg.seed, server.fields_for(i), 6)
        states[i].update(sts)
        return rep

    for _ in range(3):
        for i in server.begin_round():
            server.accept(i, reply(i))
        server.end_round()
    server.begin_round()
    return copy.deepcopy(server), {i: reply(i) for i in range(3)}


CHAIN_SET, VALID = _chain_set_round()
_ANY = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=5),
                 st.binary(max_size=40), st.lists(st.one_of(st.integers(-3, 3), st.binary(max_size=20),
                                                            st.text(max_size=3)), max_size=4))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(["client", "chains", "status", "payload", "anchor_version", "x"]),
                               st.one_of(st.just("DROP"), _ANY), max_size=3))
def test_a_hostile_several_chain_reply_never_raises_and_each_chain_counts_what_it_refused(changes):
    import copy

    server = copy.deepcopy(CHAIN_SET)
    rec = dict(VALID[0])
    for k, v in changes.items():
        rec.pop(k, None) if v == "DROP" else rec.__setitem__(k, v)
    before = [sum(ch.rejected.values()) for ch in server.chains]
    for i in (1, 2):
        server.accept(i, VALID[i])
    server.accept(0, rec)  # never raises
    server.end_round()
    assert np.all(np.isfinite(server.state.theta))
    for c, ch in enumerate(server.chains):
        took = 0 not in ch.missed_rounds or ch.state.k not in ch.missed_rounds[0]
        # a chain that did not take client 0's part counted why (a resync is counted too)
        assert took or sum(ch.rejected.values()) == before[c] + 1, (c, ch.rejected)
        if rec == VALID[0]:
            assert took
