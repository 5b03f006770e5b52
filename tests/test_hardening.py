"""Hardening (issue 14): a hostile or broken client, or a careless configuration, never ends or
silently poisons a run; each case is refused with a one-line reason naming the key, or counted.

(Reply validation of forged values: ``test_public_api.py``; key parsing: ``test_config.py``;
malformed replies and kills: ``test_reliability.py``.)
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.flower import QLSDStrategy, make_client_app
from qlsd_flwr.flower.inprocess import InProcessGrid
from qlsd_flwr.flower.nodes import HandshakeError
from qlsd_flwr.potentials import GaussianPrior, NumpyPotential, Task
from qlsd_flwr.run.simulate import run
from qlsd_flwr.tasks.gaussian import GaussianLocal, client_data

B, D = 3, 4
BASE = {"num-clients": B, "dim": D, "num-rounds": 12, "burn-in": 2, "progress": False, "s": "8"}


def _app():
    return make_client_app(lambda c: GaussianLocal(client_data(int(c.node_config["partition-id"]), D, 0)))


def test_a_node_claiming_a_live_clients_partition_id_is_refused_and_changes_nothing(tmp_path):
    seen_by: dict[int, int] = {}

    def spy(msg, ctx, call_next):
        if msg.metadata.message_type == "train":
            seen_by[ctx.node_id] = seen_by.get(ctx.node_id, 0) + 1
        return call_next(msg, ctx)

    def chain(intrude: bool):
        app = make_client_app(lambda c: GaussianLocal(client_data(int(c.node_config["partition-id"]), D, 0)),
                              mods=[spy])
        grid = InProcessGrid(app, B)
        intruder = 99_000_001

        def on_round(strategy):
            if intrude and strategy.state.k == 3:  # joins mid-run, claiming client 0's slot
                grid.node_ids.append(intruder)
                grid.contexts[intruder] = Context(run_id=1, node_id=intruder, state=RecordDict(), run_config={},
                                                  node_config={"partition-id": 0, "num-partitions": B})

        st = QLSDStrategy(num_clients=B, dim=D, num_rounds=12, burn_in=2, s=8, write=False, keep_trace=True,
                          progress=False, on_round=on_round)
        st.start(grid)
        return st, intruder

    honest, _ = chain(False)
    seen_by.clear()
    attacked, intruder = chain(True)
    assert np.array_equal(np.array(attacked.trace), np.array(honest.trace))  # the chain is untouched
    assert intruder not in seen_by  # it never received θ, an anchor or a mirror
    assert attacked.nodes.refused_claims == {0: [intruder]}
    assert attacked.summary_data["refused_claims"] == {"0": [intruder]}


def test_a_client_without_data_is_refused_at_the_start(tmp_path, monkeypatch):
    # every engine: a clear error naming the client, not a ZeroDivisionError every round
    def potential(c):
        i = int(c.node_config["partition-id"])
        return GaussianLocal(client_data(i, D, 0)[: (0 if i == 1 else None)])

    with pytest.raises(HandshakeError, match="partition-id 1: node .*holds no data points"):
        QLSDStrategy(num_clients=B, dim=D, write=False, progress=False).start(
            InProcessGrid(make_client_app(potential), B))
    with pytest.raises(ValueError, match="n_data and dim must be >= 1"):  # the adapter says it at once
        NumpyPotential(lambda th, idx: th, lambda th: 0.0, 0, D)
    task = Task(name="t", dim=D, clients=[GaussianLocal(client_data(0, D, 0)),
                                          GaussianLocal(np.zeros((0, D)))], prior=GaussianPrior(var=1.0))
    from qlsd_flwr.engines.local import run_local

    with pytest.raises(ConfigError, match="client 1 holds no data points"):
        run_local(resolve({**BASE, "num-clients": 2, "engine": "local"}), task=task, write=False)


def test_a_data_count_beyond_float64s_integers_is_refused_at_the_handshake():
    # Flower carries uint64: a claim of 2^63 points used to reach numpy's int64 and raise OverflowError
    class Boastful(GaussianLocal):
        def __init__(self, y):
            super().__init__(y)
            self.n_data = 2 ** 63

    def potential(c):
        i = int(c.node_config["partition-id"])
        return (Boastful if i == 1 else GaussianLocal)(client_data(i, D, 0))

    with pytest.raises(HandshakeError, match=r"partition-id 1: node .*claims 9223372036854775808 data points"):
        QLSDStrategy(num_clients=B, dim=D, write=False, progress=False).start(
            InProcessGrid(make_client_app(potential), B))


def test_theta_star_optimisation_that_stops_short_is_an_error_unless_accepted(tmp_path, caplog):
    o = {**BASE, "variant": "qlsd-star", "theta-star": "optimise", "opt-rounds": 2, "engine": "local",
         "gamma": 1e-4, "output-dir": str(tmp_path)}
    with pytest.raises(ConfigError, match="stopped at opt-rounds = 2 .*opt-accept-unconverged = true"):
        run(o)
    assert not list(tmp_path.iterdir())  # refused before any run folder was made
    with caplog.at_level(logging.WARNING, logger="qlsd_flwr"):
        out = run({**o, "opt-accept-unconverged": True})
    assert "theta-star: the optimisation stopped at opt-rounds = 2" in caplog.text
    assert out.summary["opt_converged"] is False and out.summary["opt_grad_norm"] > 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qlsd_flwr"):
        out = run({**o, "opt-rounds": 5000, "gamma": 1e-3, "run-name": "ok"})
    assert out.summary["opt_converged"] is True and "theta-star" not in caplog.text


def test_extreme_participation_is_refused_or_named():
    from qlsd_flwr.protocol.build import participation_warnings
    from qlsd_flwr.tasks.loading import load_task

    with pytest.raises(ConfigError, match="no client is expected to take part"):
        participation_warnings(resolve({**BASE, "p": 1e-6}), load_task(resolve(BASE)))
    cfg = resolve({**BASE, "num-clients": 20, "dim": 50, "p": 1e-3, "num-rounds": 500, "variant": "qlsd-sharp"})
    why = participation_warnings(cfg, load_task(cfg))
    assert any("fewer than one of the 500 rounds" in w for w in why)
    assert any("weighted 1/p_i = 1e+03" in w and "thrown far" in w for w in why)
    cfg = resolve({**BASE, "p": 0.5})
    assert participation_warnings(cfg, load_task(cfg)) == []
    with pytest.raises(ConfigError, match="p: K"):  # an engine refuses it at start
        run({**BASE, "p": 1e-6, "engine": "local"})


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", "a/b", "..", "."])
def test_a_run_name_never_writes_outside_the_output_dir(name):
    with pytest.raises(ConfigError, match="run-name must be one folder name inside output-dir"):
        resolve({"run-name": name})


def test_sgld_refuses_partial_participation():
    with pytest.raises(ConfigError, match="p must be 1 for variant sgld"):
        resolve({"variant": "sgld", "p": "0.5"})
    assert resolve({"variant": "sgld"}).p.tolist() == [1.0]


@pytest.mark.parametrize("engine, sig", [
    ("local", "SIGTERM"), ("vectorised", "SIGTERM"),
    # the run goes on in Flower's ServerApp thread; ray.init makes SIGTERM sys.exit(15) in the main thread
    # (and its C handler aborted the process) unless we put ours back (keep_our_sigterm); raised in the main
    # thread, Ctrl-C left the process hung at exit
    pytest.param("ray", "SIGTERM", marks=pytest.mark.ray), pytest.param("ray", "SIGINT", marks=pytest.mark.ray)])
def test_sigterm_or_ctrl_c_leaves_a_readable_run_folder_with_every_draw_so_far(tmp_path, engine, sig):
    # the default run (no checkpointing): SIGTERM or SIGINT mid-run, then the folder is complete and readable
    import csv
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from qlsd_flwr.outputs.recorder import load_samples

    sets = {"engine": engine, "num-rounds": 10**7, "burn-in": 10, "dim": 5, "num-clients": 4,
            "output-dir": str(tmp_path), "run-name": "t", "progress": False}
    if engine == "vectorised":
        sets["num-chains"] = 2
    if engine == "ray":  # two actors rather than four: the signal goes to the driver, half the actors' start-up
        sets["client-cpus"] = 1.0
    argv = [sys.executable, "-m", "qlsd_flwr", "run", *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])]
    # PYTHONFAULTHANDLER: a run still going long after the signal is made to print where it is (SIGABRT)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    try:
        metrics = tmp_path / "t" / "metrics.csv"
        deadline = time.time() + 300  # a cold numba cache compiles first; the signal goes once rounds run
        while time.time() < deadline and proc.poll() is None and (not metrics.exists() or metrics.stat().st_size < 2000):
            time.sleep(0.2)
        assert proc.poll() is None and metrics.stat().st_size >= 2000, proc.communicate()
        proc.send_signal(getattr(signal, sig))
        try:
            out, err = proc.communicate(timeout=180)  # 1.5 s (local) to 6 s (ray) idle; a busy machine is slower
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"the run went on 180 s after {sig}; its stacks:\n{err[-4000:]}")
    finally:
        if proc.poll() is None:  # never leave a run of 10**7 rounds taking a core from the rest of the suite
            proc.kill()
            proc.wait()
    assert proc.returncode == {"SIGTERM": 143, "SIGINT": 130}[sig], (out, err)
    assert f"stopped by {'SIGTERM' if sig == 'SIGTERM' else 'Ctrl-C'}" in err and "Traceback" not in err, err[-3000:]
    assert f"the run folder {tmp_path / 't'} holds every draw" in err, err[-3000:]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["stopped"].startswith("KeyboardInterrupt")
    with open(metrics) as f:
        rounds = [int(r["round"]) for r in csv.DictReader(f)]
    samples = load_samples(tmp_path / "t")  # readable: the draws of every recorded round past burn-in
    assert samples.shape[1] == len([r for r in rounds if r > 10]) > 0
    assert np.all(np.isfinite(samples)) and not (tmp_path / "t" / "draws.f8").exists()


@pytest.mark.ray
def test_the_ray_engine_keeps_our_sigterm_handler_so_a_stop_reaches_the_run_before_its_actors_die(attached_ray,
                                                                                                monkeypatch):
    # ray.init puts sys.exit(15) over SIGTERM: Flower's loop then tore its actors down under the messages
    # in flight, which it logged with tracebacks before the run heard of the stop (CI, once). Attached to the
    # session's head (QLSD_RAY_ADDRESS), as a user's cluster run is: ray.init installs the same handler
    import signal

    import ray

    from qlsd_flwr.run.simulate import keep_our_sigterm, ray_backend_config

    cfg = resolve({"dim": 3, "num-clients": 2})

    def ours(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, ours)
    try:
        if ray.is_initialized():  # an earlier test of this worker left it: this one starts its own
            ray.shutdown()
        assert keep_our_sigterm(ray_backend_config(cfg)) and ray.is_initialized()
        assert signal.getsignal(signal.SIGTERM) is ours
        assert not keep_our_sigterm(ray_backend_config(cfg))  # running already: Flower attaches to it
        ray.shutdown()
        ray.init(**ray_backend_config(cfg)["init_args"])  # the premise: Ray's own start replaces our handler
        assert signal.getsignal(signal.SIGTERM) is not ours
        ray.shutdown()
        signal.signal(signal.SIGTERM, ours)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # no handler of ours (a user's script): Ray's stays
        assert not keep_our_sigterm(ray_backend_config(cfg)) and not ray.is_initialized()
        # SIGTERM while Ray starts (its sys.exit(15) in place): the CLI's stop, our handler back, no Ray left
        signal.signal(signal.SIGTERM, ours)
        with monkeypatch.context() as m:
            def sigterm_in_start(config):
                ray.init(**config["init_args"])
                raise SystemExit(signal.SIGTERM)  # what Ray's handler raises

            m.setattr("flwr.server.superlink.fleet.vce.backend.raybackend.RayBackend", sigterm_in_start)
            with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
                keep_our_sigterm(ray_backend_config(cfg))
        assert signal.getsignal(signal.SIGTERM) is ours and not ray.is_initialized()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        signal.signal(signal.SIGTERM, before)


def test_a_stop_in_the_preparation_ends_it_at_the_next_exchange():
    # Flower's ServerApp thread (here a thread of ours, as run_simulation's): a stop signal to the CLI came
    # only to the sampling rounds, so one in a long θ* descent was lost and the process waited on; now
    # the next exchange of the preparation raises it
    import threading

    from qlsd_flwr.flower.records import from_content
    from qlsd_flwr.outputs import stopsignal
    from qlsd_flwr.tasks import loading

    o = {"variant": "qlsd-star", "theta-star": "optimise", "opt-tol": 1e-14, "opt-rounds": 100000,
         "opt-accept-unconverged": True, "dim": 5, "num-clients": 3, "num-rounds": 20, "burn-in": 5, "progress": False}
    asked = []  # one entry a message of the descent: 3 a gradient exchange

    def mod(msg, ctx, call_next):
        if from_content(msg.content)[0].get("phase") == "grad":
            asked.append(1)
            if len(asked) == 7:  # in the descent's third exchange
                stopsignal.stop_signal("SIGTERM")  # what the CLI's handler does in the main thread
        return call_next(msg, ctx)

    cfg = resolve(o)
    grid = InProcessGrid(make_client_app(overrides=o, mods=[mod]), cfg.b)
    strategy = QLSDStrategy.from_config(cfg, loading.load_task(cfg))
    got = {}

    def serverapp():
        try:
            strategy.start(grid=grid)
        except BaseException as exc:  # noqa: BLE001 — what the thread ended with
            got["exc"] = exc

    try:
        t = threading.Thread(target=serverapp)
        t.start()
        t.join(120)
        assert not t.is_alive()
    finally:
        stopsignal.clear()
    assert isinstance(got.get("exc"), KeyboardInterrupt) and str(got["exc"]) == "SIGTERM", got
    assert len(asked) == 9  # the exchange in flight ended; no other was asked for
    assert strategy.run_dir is None or not (strategy.run_dir / "metrics.csv").exists()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_signal_dropped_by_a_finaliser_still_stops_the_run_at_the_end_of_the_next_round():
    """CPython runs a signal handler at whatever bytecode the main thread is at; in a finaliser the
    handler's ``KeyboardInterrupt`` is printed as "Exception ignored" and dropped. The end of the next
    round's block raises it again, and the stop is forgotten only once the CLI has closed the run."""
    from qlsd_flwr.outputs import stopsignal

    class Finaliser:
        def __del__(self):
            stopsignal.stop_signal("SIGTERM")  # the handler, run inside a finaliser: its raise is dropped

    try:
        Finaliser()  # collected at once
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stopsignal.deferred_signals():
            pass  # a round's row and draw
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):  # still stopping: every later round too
            with stopsignal.deferred_signals(), stopsignal.deferred_signals():  # nested: raised at the outer end
                pass
    finally:
        stopsignal.clear()
    with stopsignal.deferred_signals():  # cleared: the next run in this process is not stopped
        pass
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):  # outside a round's block: at once
        stopsignal.stop_signal("SIGINT")
    stopsignal.clear()


def test_keys_are_private_from_their_first_byte_and_never_overwritten(tmp_path, monkeypatch, capsys):
    import os
    import stat

    from qlsd_flwr.deploy import certs
    from qlsd_flwr.deploy.cli import main as deploy_main

    created = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *a, **kw):  # the mode each file is created with
        created.append((os.path.basename(path), mode))
        return real_open(path, flags, mode, *a, **kw)

    monkeypatch.setattr(certs.os, "open", spy)
    paths = certs.make_tls_certificates(tmp_path / "c")
    priv, pub = certs.make_node_keypair(tmp_path / "k", "node0")
    modes = dict(created)
    assert modes["ca.key"] == modes["server.key"] == modes["node0"] == 0o600
    for p in (paths["ca_key"], paths["server_key"], priv):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    before = paths["ca_key"].read_bytes()
    assert deploy_main(["certs", str(tmp_path / "c")]) == 2  # kept, with the remedy
    assert "exist" in capsys.readouterr().err and paths["ca_key"].read_bytes() == before
    assert deploy_main(["node-key", str(tmp_path / "k"), "node0"]) == 2
    assert deploy_main(["certs", str(tmp_path / "c"), "--force"]) == 0 and paths["ca_key"].read_bytes() != before
    capsys.readouterr()
    for argv, words in ((["certs", str(tmp_path / "d"), "--days", "0"], "--days must be an integer >= 1"),
                        (["certs", str(tmp_path / "d"), "--days", "-5"], "--days must be an integer >= 1"),
                        (["certs", str(tmp_path / "d"), "--host", ""], "--host must be a non-empty")):
        assert deploy_main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d" / "ca.key").exists()


def test_a_stopped_checkpointed_run_resumes_bitwise_and_a_second_resume_is_locked_out(tmp_path):
    # Ctrl-C/SIGTERM closes the folder (samples so far readable) and the run resumes from its
    # checkpoint to the very chain of an uninterrupted run; while a run writes its folder, a
    # second run on the same folder is refused before it touches a file
    from qlsd_flwr.config import resolve
    from qlsd_flwr.engines.local import run_local
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.outputs.run_dir import lock_run_dir

    o = {**BASE, "engine": "local", "num-rounds": 40, "checkpoint-every": 10, "output-dir": str(tmp_path)}
    ref = load_samples(run({**o, "run-name": "ref"}).run_dir)
    calls = {"n": 0}

    class Stop(KeyboardInterrupt):
        pass

    import qlsd_flwr.protocol.server as server_mod

    real_end = server_mod.QLSDServer.end_round

    def end_round(self):
        calls["n"] += 1
        if calls["n"] == 25:
            raise Stop("SIGTERM")
        return real_end(self)

    server_mod.QLSDServer.end_round = end_round
    try:
        with pytest.raises(Stop):
            run_local(resolve({**o, "run-name": "cut"}))
    finally:
        server_mod.QLSDServer.end_round = real_end
    cut = tmp_path / "cut"
    assert load_samples(cut).shape[1] == 24 - 2  # rounds 3..24 kept, readable after the stop
    holder = lock_run_dir(cut)  # another run writing this folder
    with pytest.raises(ConfigError, match="is in use by another run"):
        run({"resume": str(cut), "progress": False})
    holder.close()
    assert np.array_equal(load_samples(run({"resume": str(cut), "progress": False}).run_dir), ref)


def test_resume_compares_values_not_spellings_and_names_a_broken_config(tmp_path):
    from qlsd_flwr.outputs.resume import resume_overrides

    o = {**BASE, "engine": "local", "num-rounds": 20, "checkpoint-every": 5, "p": "1.0",
         "output-dir": str(tmp_path), "run-name": "r"}
    run(o)
    assert resume_overrides({"resume": str(tmp_path / "r"), "p": 1})["resume"] == str(tmp_path / "r")
    with pytest.raises(ConfigError, match="p differ"):
        resume_overrides({"resume": str(tmp_path / "r"), "p": 0.5})
    (tmp_path / "r" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json cannot be read"):
        resume_overrides({"resume": str(tmp_path / "r")})


@pytest.mark.parametrize("change, words", [
    (lambda m, a: m.update(k=-100), "k must be an integer >= 0"),
    (lambda m, a: m["recorder"].update(n_draws=-1), "recorder.n_draws must be an integer >= 0"),
    (lambda m, a: m.pop("recorder"), "missing field 'recorder'"),
    (lambda m, a: a.update(theta=np.zeros(D + 1)), "'eta_i' has shape"),
    (lambda m, a: a.update(theta=np.full(D, np.nan)), "'theta' has non-finite values"),
])
def test_a_checkpoint_with_bad_contents_is_refused_by_name(tmp_path, change, words):
    from qlsd_flwr.outputs import checkpoint as ckpt

    o = {**BASE, "engine": "local", "num-rounds": 20, "checkpoint-every": 5, "variant": "qlsd-pp",
         "output-dir": str(tmp_path), "run-name": "r"}
    run({**o, "num-rounds": 10})  # a run whose checkpoint is at round 10, then edited
    (tmp_path / "r" / "summary.json").unlink()
    meta, arrays = ckpt.load(ckpt.path_in(tmp_path / "r"))
    meta.pop("format")
    change(meta, arrays)
    ckpt.save(ckpt.path_in(tmp_path / "r"), arrays, meta)  # a valid file with bad contents
    with pytest.raises(ConfigError, match=words):
        run({"resume": str(tmp_path / "r"), "num-rounds": 20, "progress": False})


def _attacker(mode: str):
    """The benchmark's attacker (``benchmarks/bench_byzantine.py``): a client mod rewriting client
    0's real reply to float32's largest QSGD norm (``max``), or dropping it (``silent``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from bench_byzantine import attacker
    finally:
        sys.path.pop(0)
    return attacker(mode)


@pytest.mark.parametrize("variant", ["qlsd", "qlsd-pp"])
def test_one_attacker_sending_the_largest_valid_reply_every_round_is_held_off(tmp_path, variant):
    # the largest valid code, through Flower's in-process path, 200 rounds: the attacker is held
    # off on probation and excluded at its 8th reply, so the chain is exactly the one in which it
    # is silent; without the bound θ is thrown far
    from qlsd_flwr.outputs.recorder import load_samples

    o = {"variant": variant, "num-clients": 5, "dim": 5, "num-rounds": 200, "burn-in": 0, "s": "16", "l": 20,
         "engine": "inprocess", "progress": False, "output-dir": str(tmp_path)}
    guarded = run({**o, "run-name": "guarded"}, mods=[_attacker("max")])
    silent = run({**o, "run-name": "silent"}, mods=[_attacker("silent")])
    assert np.array_equal(load_samples(guarded.run_dir), load_samples(silent.run_dir))
    rejected = guarded.summary["rejected"]
    assert rejected == {"norm_bound": 7, "excluded": 1} and guarded.summary["excluded"] == {"0": 8}
    honest = run({**o, "run-name": "honest"})
    assert honest.summary["rejected"] == {}  # no honest reply is ever rejected here
    off = run({**o, "run-name": "off", "norm-bound": "off"}, mods=[_attacker("max")])
    assert np.abs(load_samples(off.run_dir)).max() > 1e30


def test_node_keys_bind_each_partition_to_its_registered_key(tmp_path):
    # with node authentication the SuperLink knows each node's key (Grid.get_nodes()); node-keys
    # makes partition i the node whose key is <folder>/node<i>.pub (the real SuperLink: the
    # secured deployment test); here the grid reports keys as the SuperLink does
    from flwr.proto.node_pb2 import NodeInfo

    from qlsd_flwr.deploy.certs import make_node_keypair

    pubs = [make_node_keypair(tmp_path / "keys", f"node{i}")[1] for i in range(B)]
    impostor_pub = make_node_keypair(tmp_path / "other", "impostor")[1]

    class KeyedGrid(InProcessGrid):
        def get_nodes(self):
            keys = [p.read_bytes() for p in pubs] + [impostor_pub.read_bytes()]
            return [NodeInfo(node_id=n, public_key=keys[k]) for k, n in enumerate(self.node_ids)]

    grid = KeyedGrid(_app(), B)
    impostor = 99_000_003
    grid.node_ids.append(impostor)  # a registered node claiming partition 0 from the start
    grid.contexts[impostor] = Context(run_id=1, node_id=impostor, state=RecordDict(), run_config={},
                                      node_config={"partition-id": 0, "num-partitions": B})
    st = QLSDStrategy(num_clients=B, dim=D, num_rounds=4, burn_in=1, write=False, progress=False,
                      node_keys=str(tmp_path / "keys"))
    st.start(grid)
    assert st.nodes.refused_claims == {0: [impostor]} and st.nodes.node_of[0] == grid.node_ids[0]
    with pytest.raises(ConfigError, match="node-keys: .*node0.pub"):
        QLSDStrategy(num_clients=B, dim=D, write=False, node_keys=str(tmp_path / "nowhere"))


def test_review_cases_values_norms_and_closing(tmp_path):
    from qlsd_flwr.outputs.checkpoint import same_value
    from qlsd_flwr.outputs.recorder import Recorder
    from qlsd_flwr.robust.norm_guard import NormGuard

    # resume compares meanings: aliases, one value against one per client, a key an older
    # checkpoint lacks against its default; a plug-in path as written
    assert same_value("variant", "qlsd++", "qlsd-pp") and same_value("p", "0.5", "0.5,0.5,0.5")
    assert not same_value("p", "0.5", "0.5,0.25") and same_value("norm-bound", None, "auto")
    assert not same_value("task", "m:Gauss", "m:gauss")
    # a round whose norms are mostly 0 (QSGD may code an honest message as zeros) is judged against
    # the non-zero ones, never against a limit of 0
    g = NormGuard("auto", 3, [10, 10, 10])
    assert g.judge({0: 0.0, 1: 0.0, 2: 3.0}, 1) == ({}, [])
    assert NormGuard("auto", 2).judge({0: 1.0, 1: 1e30}, 1) == ({}, [])  # fewer than 3 clients: no reference
    # a recorder closes once, and releases its folder whatever happens
    rec = Recorder(tmp_path / "r", {}, 2, 1, 0, 1)
    rec.record_round({"round": 1, "n_active": 1, "n_replied": 1, "n_rejected": 0, "bits_exact": 8})
    rec.record_sample(1, np.zeros(2))
    assert rec.close({})["draws_kept"] == 1 and rec.close({}) == {}
    Recorder(tmp_path / "r2", {}, 2, 1, 0, 1).close({})  # the lock went with the first close


def test_a_norm_rejection_marks_the_client_out_of_step():
    # the client applied its memory update: the server marks it for a resync at once, as a
    # restored server would (so a resumed run takes the very same path)
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol.build import client_spec_from_settings
    from qlsd_flwr.protocol.client import handle
    from qlsd_flwr.protocol.server import QLSDServer
    from qlsd_flwr.protocol.wire import vectors_to_bytes
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    cfg = resolve({**BASE, "variant": "qlsd-pp", "norm-bound": 1e-9})
    task = build_gaussian_task(B, D, 0)
    server = QLSDServer(cfg, task)
    server.begin(None)
    for i in server.begin_round():
        spec = client_spec_from_settings(server.settings[i], i, task.clients[i].n_data, D)[0]
        server.accept(i, handle(spec, task.clients[i], ClientState(), cfg.seed, vectors_to_bytes(server.fields_for(i)), D))
    server.end_round()
    assert server.rejected["norm_bound"] == B and server.needs_resync.all()
