"""The Flower path: same chain as the framework-free path, memory bookkeeping, bad replies.

These use Flower's real ClientApp, Message and record classes over the in-process grid (with
messages processed and returned in shuffled order), and Flower's Ray simulation engine.
"""

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from qlsd_flwr.config import resolve
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.flower.client_app import STATE
from qlsd_flwr.flower.records import RECORD
from qlsd_flwr.protocol.wire import bytes_to_arr
from qlsd_flwr.run.simulate import run_inprocess, run_ray

BASE = {"num-rounds": 60, "burn-in": 0, "progress": False, "gamma": 4.9e-4, "l": 10}


def local_trace(overrides):
    return run_local(resolve(overrides), write=False, keep_trace=True, progress=False).trace


@pytest.mark.parametrize("overrides", [
    {"variant": "qlsd-pp", "p": "0.5", "s": "4"},
    {"variant": "qlsd-star", "p": "0.25", "s": "16", "aggregation": "active-fraction"},
    {"variant": "qlsd-sharp", "p": "1.0", "s": "2,4,8,16,32,64,128,256,2,4,8,16,32,64,128,256,2,4,8,16"},
    {"variant": "qlsd", "p": "0.7", "s": "16", "prior-var": 10.0, "prior-on": "clients"},
    {"variant": "lsd-pp", "p": "0.5", "prior-var": 10.0},
    {"variant": "qlsd-star", "theta-star": "optimise", "s": "8", "prior-var": 5.0},
    {"variant": "qlsd-pp", "block-norm": "tensor", "encoding": "elias", "alpha": 0.0},
])
def test_inprocess_flower_matches_framework_free_bitwise(overrides, tmp_path):
    o = {**BASE, **overrides, "output-dir": str(tmp_path)}
    strat = run_inprocess(resolve(o), o, shuffle_seed=123, strategy_kwargs={"keep_trace": True})
    np.testing.assert_array_equal(np.array(strat.trace), local_trace(o))
    assert strat.summary_data["totals"]["n_rejected"] == 0


@pytest.mark.ray
def test_ray_engine_matches_framework_free_bitwise(tmp_path):
    o = {**BASE, "variant": "qlsd-pp", "p": "0.5", "s": "8", "num-rounds": 25, "output-dir": str(tmp_path),
         "client-cpus": 1.0}
    strat = run_ray(resolve({**o, "engine": "ray"}), o, strategy_kwargs={"keep_trace": True})
    np.testing.assert_array_equal(np.array(strat.trace), local_trace(o))
    s = strat.summary_data
    assert s["rounds"] == 25 and s["totals"]["bits_exact"] > 0 and s["totals"]["bytes_message"] > s["totals"]["bytes_payload"]


def client_etas(grid, b, d):
    out = np.zeros((b, d))
    for i, nid in enumerate(grid_node_ids(grid)):
        st = grid.contexts[nid].state
        if STATE in st and "eta" in st.config_records[STATE]:
            out[i] = bytes_to_arr(st.config_records[STATE]["eta"], d)
    return out


def grid_node_ids(grid):
    return grid.node_ids


def test_memory_bookkeeping_every_round(tmp_path):
    """After every round the server's η equals Σ_i of the clients' own η_i (read from their
    Flower context.state), and each mirror equals its client's term exactly."""
    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.flower.strategy import QLSDStrategy
    from qlsd_flwr.tasks.loading import load_task

    o = {**BASE, "variant": "qlsd-pp", "p": "0.5", "s": "2", "num-rounds": 40, "output-dir": str(tmp_path)}
    cfg = resolve(o)
    grid = InProcessGrid(make_client_app(overrides=o), cfg.b, shuffle_seed=5)
    checked = []

    def check(strategy):
        etas = client_etas(grid, cfg.b, strategy.d)
        np.testing.assert_array_equal(strategy.state.eta_i, etas)
        np.testing.assert_array_equal(strategy.state.eta, etas.sum(axis=0))
        checked.append(float(np.abs(strategy.state.eta).sum()))

    strat = QLSDStrategy.from_config(cfg, load_task(cfg), on_round=check)
    strat.start(grid=grid)
    assert len(checked) == 40 and checked[-1] > 0  # memory actually moved
    # the end-of-run audit (each client's own η_i, queried through Flower) says the same
    audit = strat.summary_data["memory_check"]
    assert audit["clients_reported"] == list(range(cfg.b)) and audit["clients_pending_resync"] == []
    assert audit["max_abs_eta_minus_sum"] == 0.0 and audit["max_abs_mirror_diff"] == 0.0
    assert all(audit["eta_count_agrees"].values())


def test_the_memory_audit_sends_digests_and_asks_for_the_vector_only_where_one_differs(tmp_path):
    """The end-of-run audit (``protocol.memory_audit``): each client sends a 64-bit digest of its η_i, not the vector;
    a client whose η_i no longer equals its mirror (here damaged in its ``context.state`` after the last round) is
    named and asked for the vector, and the audit reports by how much it differs; the bits counted are the digests and
    that one vector."""
    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.flower.strategy import QLSDStrategy
    from qlsd_flwr.protocol.wire import arr_to_bytes
    from qlsd_flwr.tasks.loading import load_task

    o = {**BASE, "variant": "qlsd-pp", "s": "2", "num-rounds": 6, "output-dir": str(tmp_path)}
    cfg = resolve(o)
    grid = InProcessGrid(make_client_app(overrides=o), cfg.b, shuffle_seed=5)

    def damage(strategy):
        if strategy.state.k == cfg.num_rounds - 1:
            rec = grid.contexts[grid_node_ids(grid)[2]].state.config_records[STATE]
            eta = bytes_to_arr(rec["eta"], strategy.d)
            eta[0] += 1e-3
            rec["eta"] = arr_to_bytes(eta)

    strat = QLSDStrategy.from_config(cfg, load_task(cfg), on_round=damage)
    strat.start(grid=grid)
    s = strat.summary_data
    audit = s["memory_check"]
    assert s["memory_digest_differs"] == {"2": [0]}
    assert audit["clients_reported"] == list(range(cfg.b))
    assert audit["max_abs_mirror_diff"] == pytest.approx(1e-3, rel=1e-6)
    assert s["memory_check_bits"] == {"uplink": 128 * cfg.b + 64 * strat.d, "downlink": 0}


def corrupting_mod(plan):
    """A Flower client mod that damages replies: plan[(round, client)] = kind."""
    def mod(msg: Message, ctx, call_next):
        rec = msg.content.config_records.get(RECORD)
        key = (int(rec["round"]), int(ctx.node_config["partition-id"])) if rec and "round" in rec else None
        kind = plan.get(key)
        if kind == "raise":
            raise RuntimeError("injected client failure")
        reply = call_next(msg, ctx)
        if kind is None:
            return reply
        fields = dict(reply.content.config_records[RECORD])
        if kind == "garbage":
            fields["payload"] = bytes(np.random.default_rng(0).integers(0, 256, 37, dtype=np.uint8))
        elif kind == "truncated":
            fields["payload"] = fields["payload"][:3]
        elif kind == "nan":
            fields["payload"] = np.full(50, np.nan).tobytes()
        elif kind == "no-record":
            return Message(RecordDict({"other": ConfigRecord({"x": 1})}), reply_to=msg)
        return Message(RecordDict({RECORD: ConfigRecord(fields)}), reply_to=msg)
    return mod


@pytest.mark.parametrize("variant", ["qlsd-pp", "lsd-star"])
def test_bad_replies_are_rejected_counted_and_chain_goes_on(variant, tmp_path):
    plan = {(3, 0): "garbage", (4, 1): "truncated", (5, 2): "nan", (6, 3): "raise", (7, 4): "no-record",
            (8, 5): "garbage"}
    o = {**BASE, "variant": variant, "p": "1.0", "s": "4", "num-rounds": 30, "output-dir": str(tmp_path)}
    cfg = resolve(o)
    strat = run_inprocess(cfg, o, mods=[corrupting_mod(plan)], strategy_kwargs={"keep_trace": True})
    trace = np.array(strat.trace)
    assert np.all(np.isfinite(trace))
    s = strat.summary_data
    # LSD* sends raw float64: "nan" decodes but is non-finite; QSGD payloads of the wrong size fail to decode
    assert s["totals"]["n_rejected"] == len(plan), s["rejected"]
    assert s["rejected"].get("client_error") == 1 and s["rejected"].get("malformed") >= 1
    for (k, i) in plan:
        assert k + 1 in s["missed_rounds"][str(i)]
    # the chain is still near the posterior: within 6 posterior s.d. per coordinate at the end
    mean, sd = np.array(s["posterior_mean_exact"]), np.sqrt(np.array(s["posterior_var_exact"]))
    assert np.all(np.abs(trace[-1] - mean) < 6 * sd)
    if variant == "qlsd-pp":  # the clients whose reply was lost resynchronised their memory
        assert s["rejected"].get("resync", 0) >= 1


def test_node_restarting_with_empty_state_is_resynchronised(tmp_path):
    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.flower.strategy import QLSDStrategy
    from qlsd_flwr.tasks.loading import load_task

    o = {**BASE, "variant": "qlsd-pp", "p": "1.0", "s": "4", "num-rounds": 20, "output-dir": str(tmp_path)}
    cfg = resolve(o)
    grid = InProcessGrid(make_client_app(overrides=o), cfg.b)
    seen = []

    def hook(strategy):
        k = strategy.state.k
        if k == 8:
            grid.reset_node(2)  # node 2 restarts: η_2 and its anchor are gone
        if k >= 11:
            np.testing.assert_array_equal(strategy.state.eta_i, client_etas(grid, cfg.b, strategy.d))
        seen.append(k)

    strat = QLSDStrategy.from_config(cfg, load_task(cfg), on_round=hook)
    strat.start(grid=grid)
    assert strat.rejected.get("resync") == 1
    # reset after 8 rounds: in round 9 the node answers "resync" (counted as inactive), and
    # from round 10 on it holds the server's mirror again
    assert strat.missed_rounds == {2: [9]}
    assert strat.summary_data["missed_rounds"] == {"2": [9]}


@pytest.mark.parametrize("variant", ["qlsd-pp", "qlsd-sharp", "lsd-star", "qlsd"])
def test_direct_numeric_path_equals_protocol_path(variant):
    """run_local(wire=False), used by the statistical tests, gives the protocol's chain."""
    o = {**BASE, "variant": variant, "p": "0.6", "s": "8"}
    cfg = resolve(o)
    a = run_local(cfg, write=False, keep_trace=True, progress=False, wire=True).trace
    b = run_local(cfg, write=False, keep_trace=True, progress=False, wire=False).trace
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("private_ids", [True, False], ids=["flower-id-cache", "fallback"])
def test_message_nbytes_equals_deflating_the_whole_tree(private_ids, monkeypatch):
    # message_nbytes deflates each object once (children first, reusing their ids); the
    # reference deflates the tree as it comes: the same bytes on every shape of message, with
    # Flower's private id cache and with the fallback used where that cache is missing
    from qlsd_flwr.flower import sizing

    if not private_ids:
        monkeypatch.setattr(sizing, "_computed_ids", None)
    from flwr.app import Array, ArrayRecord, Error, MessageType, MetricRecord
    from flwr.supercore.task_identity import TaskIdentity

    from qlsd_flwr.flower.sizing import message_nbytes, message_nbytes_reference

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    sent = Message(RecordDict({RECORD: ConfigRecord({"theta": bytes(400), "round": 3})}), 7, MessageType.TRAIN)
    sent.metadata.__dict__["_message_id"] = "m" * 64
    shapes = [
        sent,
        Message(RecordDict({RECORD: ConfigRecord({"client": 2, "status": "ok", "payload": bytes(range(37)),
                                                  "anchor_version": 12})}), reply_to=sent),
        Message(RecordDict({"w": ArrayRecord({"a": Array(np.arange(12.0).reshape(3, 4)), "b": Array(np.ones(5))}),
                            "m": MetricRecord({"loss": 0.5}), "c": ConfigRecord({"x": [1, 2], "y": "z"})}),
                9, MessageType.TRAIN),
        Message(RecordDict(), 4, MessageType.QUERY),
        Message(Error(code=2, reason="boom"), reply_to=sent),
    ]
    for msg in shapes:
        assert message_nbytes(msg) == message_nbytes_reference(msg) > 0


def _inprocess(o, **strategy_kwargs):
    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.flower.strategy import QLSDStrategy
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve(o)
    grid = InProcessGrid(make_client_app(overrides=o), cfg.b, shuffle_seed=3)
    return QLSDStrategy.from_config(cfg, load_task(cfg), keep_trace=True, **strategy_kwargs), grid


def test_strategy_keeps_flowers_contract(tmp_path, monkeypatch):
    """Flower's own Strategy.start drives the rounds: configure_train builds each round's
    messages and aggregate_train reduces their replies (K calls each, on the live path);
    start() honours initial_arrays, num_rounds, train_config and evaluate_fn, and refuses
    evaluate_config (there is no client-side evaluation round) and a θ_0 of the wrong size."""
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import Strategy

    from qlsd_flwr.flower.strategy import QLSDStrategy

    o = {**BASE, "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-rounds": 12, "output-dir": str(tmp_path)}
    calls = {"configure": 0, "aggregate": 0, "loop": 0}
    loop = Strategy.start

    def counting_loop(self, *a, **k):
        calls["loop"] += 1
        return loop(self, *a, **k)

    monkeypatch.setattr(Strategy, "start", counting_loop)
    for name, key in (("configure_train", "configure"), ("aggregate_train", "aggregate")):
        orig = getattr(QLSDStrategy, name)
        monkeypatch.setattr(QLSDStrategy, name, lambda self, *a, _o=orig, _k=key, **k: (
            calls.__setitem__(_k, calls[_k] + 1), _o(self, *a, **k))[1])
    strat, grid = _inprocess(o)
    seen = []
    result = strat.start(grid, num_rounds=8, train_config=ConfigRecord({"lr-hint": 0.5}),
                         evaluate_fn=lambda rnd, arrays: seen.append((rnd, arrays["theta"].numpy().copy())))
    assert calls == {"configure": 8, "aggregate": 8, "loop": 1}
    assert [r for r, _ in seen] == list(range(9))  # θ_0, then after every round
    for k in range(1, 9):  # evaluate_fn sees θ_k, the sample aggregate_train returned
        np.testing.assert_array_equal(seen[k][1], strat.trace[k - 1])
    np.testing.assert_array_equal(result.arrays["theta"].numpy(), strat.trace[-1])
    np.testing.assert_array_equal(strat.trace, local_trace({**o, "num-rounds": 8}))  # the same chain

    # θ_0 from initial_arrays: the task's own θ_0 gives the very same chain; another one is used
    strat, grid = _inprocess({**o, "run-name": "init"})
    theta0 = np.zeros(strat.d)
    strat.start(grid, initial_arrays=ArrayRecord({"theta": Array(theta0)}), num_rounds=8)
    np.testing.assert_array_equal(strat.trace, local_trace({**o, "num-rounds": 8}))
    strat, grid = _inprocess({**o, "run-name": "init2"})
    got = []
    strat.start(grid, initial_arrays=ArrayRecord({"a": Array(np.ones(20)), "b": Array(np.ones(30))}),
                num_rounds=2, evaluate_fn=lambda rnd, arrays: got.append(arrays["theta"].numpy().copy()))
    np.testing.assert_array_equal(got[0], np.ones(50))

    strat, grid = _inprocess({**o, "run-name": "bad"})
    with pytest.raises(ValueError, match="evaluate_config"):
        strat.start(grid, evaluate_config=ConfigRecord({"x": 1}))
    with pytest.raises(ValueError, match=r"initial_arrays: 49 values in 1 array\(s\), the model has d = 50"):
        strat.start(grid, initial_arrays=ArrayRecord({"theta": Array(np.zeros(49))}))


def test_train_config_travels_with_every_round_message(tmp_path):
    from flwr.app import ConfigRecord as CR

    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.flower.strategy import QLSDStrategy
    from qlsd_flwr.tasks.loading import load_task

    o = {**BASE, "variant": "qlsd-sharp", "num-rounds": 3, "output-dir": str(tmp_path)}
    cfg = resolve(o)
    seen = []

    def spy(msg, ctx, call_next):
        if msg.metadata.message_type == "train":
            seen.append(dict(msg.content["config"]) if "config" in msg.content else None)
        return call_next(msg, ctx)

    grid = InProcessGrid(make_client_app(overrides=o, mods=[spy]), cfg.b, shuffle_seed=1)
    QLSDStrategy.from_config(cfg, load_task(cfg), write=False).start(grid, train_config=CR({"note": "x"}))
    assert len(seen) == 3 * cfg.b and all(s == {"note": "x"} for s in seen)


def test_a_short_simulation_fails_fast_with_the_command_that_sizes_it(tmp_path, monkeypatch, caplog):
    # the simulation engine has every SuperNode from the start: fewer than num-clients is an
    # error naming the remedy, said at once, not a silent wait until reply-timeout (600 s)
    import logging

    from qlsd_flwr.flower import nodes
    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid

    monkeypatch.setattr(nodes, "SIMULATION_GRACE", 0.3)
    o = {**BASE, "variant": "qlsd-sharp", "num-clients": 3, "output-dir": str(tmp_path)}
    grid = InProcessGrid(make_client_app(overrides=o), 2)
    grid.pull_interval = 0.1  # what Flower's in-memory simulation grid has
    registry = nodes.NodeRegistry(3, 50)
    with caplog.at_level(logging.WARNING, logger="qlsd_flwr"):
        with pytest.raises(nodes.HandshakeError, match=r"num-clients = 3 but the simulation has 2 SuperNodes.*"
                                                       r"--num-supernodes 3"):
            registry.handshake(grid, timeout=600.0)
    assert "waiting for 3 client nodes, 2 connected" in caplog.text


def test_replies_are_polled_soon_after_one_came_and_never_slower_than_the_grid(monkeypatch):
    # the strategy's grid view on the simulation engine: every reply is yielded once; after a
    # poll that brought one the next wait is 5 ms, an empty poll doubles it, capped at the
    # grid's own pull_interval (a flat 0.1 s left the round's last reply waiting 0.05 s on average)
    from types import SimpleNamespace

    from qlsd_flwr.flower import grid_stream as S

    class Grid:
        pull_interval = 0.1

        def __init__(self):
            self.polls = 0
            # poll number -> replies it brings: one at once, then a long silence, then two
            self.script = {0: ["a"], 40: ["b", "c"]}

        def push_messages(self, msgs):
            return ["a", "b", "c"]

        def pull_messages(self, ids):
            got = self.script.get(self.polls, [])
            self.polls += 1
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in got]

    waits = []
    monkeypatch.setattr(S.time, "sleep", waits.append)
    pushed = []
    view = S.RepliesAsTheyArrive(Grid(), pushed.append)
    got = [m.metadata.reply_to_message_id for m in view.send_and_receive(["m1", "m2", "m3"])]
    assert got == ["a", "b", "c"] and pushed == [["m1", "m2", "m3"]]
    assert waits[0] == S.FIRST_POLL_S  # right after a reply
    assert waits[1:6] == [0.01, 0.02, 0.04, 0.08, 0.1]  # doubling while nothing comes
    assert max(waits) == Grid.pull_interval and len(waits) == 40


def test_metrics_csv_holds_each_round_as_soon_as_it_ends(tmp_path):
    """A watcher of a running job (``tail -f metrics.csv``, a dashboard) sees every round's row on disk
    when that round ends, not in bursts (issue 22: a deployment showed nothing for 10 rounds)."""
    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.flower.strategy import QLSDStrategy
    from qlsd_flwr.tasks.loading import load_task

    o = {**BASE, "num-rounds": 25, "output-dir": str(tmp_path)}
    cfg = resolve(o)
    run_dir = tmp_path / "watched"
    seen = []

    def watch(strategy):
        with open(run_dir / "metrics.csv") as f:  # another reader, as a watcher would be
            seen.append(sum(1 for _ in f) - 1)  # rows after the header

    strat = QLSDStrategy.from_config(cfg, load_task(cfg), run_dir=run_dir, on_round=watch)
    strat.start(grid=InProcessGrid(make_client_app(overrides=o), cfg.b, shuffle_seed=0))
    assert seen == list(range(1, 26))


def test_a_nodes_chains_hold_their_shared_metric_once_in_its_context():
    """Flower's Ray engine ships a client's whole Context with each message: the metric (the main job's 0.70 MB
    block basis) is held once a node, not once a chain; each chain reads it back, and a state written before
    (the metric in the chain's own record) still reads."""
    from flwr.app import Context

    from qlsd_flwr.core.metric import Diagonal
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.flower.client_app import METRIC, load_state, save_state, state_key
    from qlsd_flwr.protocol.wire import metric_of, metric_to_bytes

    d = 6
    raw = metric_to_bytes(Diagonal(np.arange(1.0, d + 1)))
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    for c in range(4):
        st = ClientState()
        st.metric, st.eta = metric_of(raw, d), np.zeros(d)
        save_state(ctx, st, d, c)
    assert [k for k in ctx.state if "metric" in ctx.state[k]] == [METRIC]
    for c in range(4):
        np.testing.assert_array_equal(load_state(ctx, c).metric.apply(np.ones(d)), np.arange(1.0, d + 1))
    st = load_state(ctx, 0)  # a resync brings chain 0 another metric: it replaces the node's, for every chain
    st.metric = metric_of(metric_to_bytes(Diagonal(np.full(d, 7.0))), d)
    save_state(ctx, st, d, 0)
    np.testing.assert_array_equal(load_state(ctx, 3).metric.apply(np.ones(d)), np.full(d, 7.0))
    old = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    old.state[state_key(0)] = ConfigRecord({"dim": d, "metric": raw})
    np.testing.assert_array_equal(load_state(old, 0).metric.apply(np.ones(d)), np.arange(1.0, d + 1))



def test_a_nodes_block_directions_are_held_once_until_its_basis_is_built():
    """``metric-block``'s directions, which the clients' basis is built from when it comes by reference
    (core.block_basis.BasisRef), are kept once a node from the block exchange (the preparation's state), read by each
    chain's first message, and dropped from the Context (which Flower's Ray engine ships with every message) once
    the chain holds a metric."""
    from flwr.app import Context

    from qlsd_flwr.core.metric import Diagonal
    from qlsd_flwr.flower.client_app import BLOCK_DIRS, load_state, save_state

    d = 6
    rows = np.arange(2.0 * d).reshape(2, d)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    st = load_state(ctx)
    st.block_dirs = rows
    save_state(ctx, st, d)
    assert BLOCK_DIRS in ctx.state
    for c in range(3):  # each chain's first message (no record of its own yet) reads them
        np.testing.assert_array_equal(load_state(ctx, c).block_dirs, rows)
    st = load_state(ctx, 0)
    st.metric, st.block_dirs = Diagonal(np.ones(d)), None  # the basis built (protocol.client drops the directions)
    save_state(ctx, st, d, 0)
    assert BLOCK_DIRS not in ctx.state and load_state(ctx, 1).block_dirs is None
    # a chain that starts later (its first message: no record of its own) finds the metric the node holds
    np.testing.assert_array_equal(load_state(ctx, 5).metric.apply(np.ones(d)), np.ones(d))
