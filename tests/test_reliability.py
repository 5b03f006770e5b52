"""Long-run reliability: checkpoint and resume, crash-safe checkpoint files, divergence, hostile replies.

The kill tests run the chain in a subprocess that SIGKILLs itself after a round chosen at
random (seeded), with its run folder's files open, then resume it in this process and compare
with an uninterrupted run of the same seed: the chains, ``samples.nc`` and ``metrics.csv`` must
be equal bit for bit (``metrics.csv`` except its wall-clock ``seconds`` column).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.outputs import checkpoint as ckpt
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.protocol.divergence import DivergenceError
from qlsd_flwr.run import simulate

ROOT = Path(__file__).resolve().parents[1]

# the subprocess: run ``overrides`` and SIGKILL itself once round ``kill_after`` is done
KILLER = textwrap.dedent("""
    import json, os, signal, sys
    overrides, kill_after, kwargs = json.loads(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    from qlsd_flwr.protocol import server
    from qlsd_flwr.run import simulate
    from qlsd_flwr.engines.vectorised import driver

    def die(rec):
        # the worst case: what was written after the last checkpoint has reached the disk
        rec._flush(); rec._csv_file.flush(); rec._raw.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    end_round = server.QLSDServer.end_round
    def killing_end_round(self):
        row = end_round(self)
        if self.state.k == kill_after and self.observer is not None:  # not a chain of a ChainSet
            die(self.observer.recorder)
        return row
    server.QLSDServer.end_round = killing_end_round

    from qlsd_flwr.protocol import chains
    chain_set_end_round = chains.ChainSet.end_round
    def killing_chain_set_end_round(self):
        row = chain_set_end_round(self)
        if self.state.k == kill_after:
            die(self.observer.recorder)
        return row
    chains.ChainSet.end_round = killing_chain_set_end_round

    record_block = driver._record_block
    def killing_record_block(rec, k0, R, out, dt):
        record_block(rec, k0, R, out, dt)
        if k0 + R >= kill_after:  # after the block's rows are written, before its checkpoint
            die(rec)
    driver._record_block = killing_record_block
    simulate.run(overrides, **kwargs)
    sys.exit(3)  # never reached
""")


def run_and_kill(overrides: dict, kill_after: int, **kwargs) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", KILLER, json.dumps(overrides), str(kill_after), json.dumps(kwargs)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]


def metrics_rows(run_dir) -> list[dict]:
    with open(Path(run_dir) / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


def final_theta(outcome) -> np.ndarray:
    d = outcome.detail
    if hasattr(d, "theta"):  # vectorised
        return d.theta
    return (d.state if hasattr(d, "state") else d.server).theta  # strategy or RunResult


CASES = {
    # engine, overrides, kwargs for simulate.run, seed of the kill round
    "local": ({"engine": "local", "variant": "qlsd-pp", "p": "0.5", "s": "4"}, {}, 1),
    "local-star-optimise": ({"engine": "local", "variant": "qlsd-star", "theta-star": "optimise",
                             "s": "8", "prior-var": 5.0, "p": "0.7"}, {}, 2),
    "inprocess": ({"engine": "inprocess", "variant": "qlsd-pp", "p": "0.5", "s": "4"}, {"shuffle_seed": 7}, 3),
    # three chains in one Flower run (protocol.chains): every chain's state in one checkpoint
    "inprocess-3-chains": ({"engine": "inprocess", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-chains": 3},
                           {"shuffle_seed": 9}, 6),
    "vectorised-numba": ({"engine": "vectorised", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-chains": 3},
                         {"block_rounds": 4}, 4),
    # the compiled kernel on the logistic task (vectorised-backend = numba): resumes bitwise its own chain
    "vectorised-numba-logistic": ({"engine": "vectorised", "task": "logistic", "dataset": "breast_cancer",
                                   "vectorised-backend": "numba", "variant": "qlsd-pp", "p": "0.5", "s": "4",
                                   "num-chains": 2, "num-clients": 4}, {"block_rounds": 4}, 8),
    "vectorised-numpy": ({"engine": "vectorised", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-chains": 2},
                         {"block_rounds": 4, "backend": "numpy"}, 5),
    # the torch backend (a torch network's chains on its device; here the CPU): θ, ζ, ∇U_i(ζ) and η from the checkpoint
    "vectorised-torch": ({"engine": "vectorised", "task": "mnist", "dataset": "digits", "model": "mlp",
                          "vectorised-backend": "torch", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-chains": 2,
                          "num-clients": 4, "gamma": 1e-4, "batch-fraction": 0.2},
                         {"block_rounds": 4}, 23),
    # a metric, gamma = auto and dispersed starts: the resumed run takes M and γ from the checkpoint
    "local-metric-auto": ({"engine": "local", "variant": "qlsd-pp", "p": "0.5", "s": "4", "metric": "diagonal",
                           "gamma": "auto", "init": "dispersed"}, {}, 10),
    "inprocess-3-chains-dense": ({"engine": "inprocess", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-chains": 3,
                                  "metric": "dense", "gamma": "auto", "init": "dispersed", "temperature": 0.8},
                                 {"shuffle_seed": 11}, 12),
    "vectorised-numpy-metric": ({"engine": "vectorised", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-chains": 2,
                                 "metric": "diagonal", "gamma": "auto", "init": "dispersed"},
                                {"block_rounds": 4, "backend": "numpy"}, 13),
    # metric-from = adapt: the checkpoint holds the frozen M, so the resume does not rerun the warm-up
    # the rivals: VR-FALD*'s θ* claims and FALD's QSGD-coded local-step messages, over two chains
    # two VR-FALD* chains, each refreshing its own reference (its counts in its own checkpoint arrays)
    "inprocess-2-chains-vr-fald": ({"engine": "inprocess", "variant": "vr-fald-star", "p": "0.5", "local-steps": 2,
                                    "compressor": "qsgd", "s": "4", "num-chains": 2, "q": 0.2},
                                   {"shuffle_seed": 15}, 15),
    # DG-LMC: the clients' z_i are the checkpoint's memory mirrors
    "local-dg-lmc": ({"engine": "local", "variant": "dg-lmc", "p": "0.5", "local-steps": 2}, {}, 16),
    # FSGLD: the surrogates and the claims at θ* are in the checkpoint; one client a round
    # the rivals on the vectorised engine: the chains' servers' state in its checkpoint (engines.vectorised.rivals)
    # DG-LMC coupled in a diagonal metric's norm
    "vectorised-2-chains-dg-lmc": ({"engine": "vectorised", "variant": "dg-lmc", "p": "0.5", "local-steps": 2,
                                    "compressor": "qsgd", "s": "4", "num-chains": 2, "metric": "diagonal"},
                                   {"block_rounds": 4}, 18),
    # FALD with a dense metric and gamma = auto: M and γ from the checkpoint, M sent again to every client
    "local-fald-metric": ({"engine": "local", "variant": "fald", "p": "0.5", "local-steps": 2, "metric": "dense",
                           "gamma": "auto"}, {}, 19),
    # VR-FALD* refreshing its reference (q): θ_r, its claims and the refresh counts from the checkpoint
    "local-vr-fald-refresh": ({"engine": "local", "variant": "vr-fald-star", "p": "0.5", "q": 0.3, "local-steps": 2},
                              {}, 19),
    "inprocess-2-chains-fsgld": ({"engine": "inprocess", "variant": "fsgld", "local-steps": 2, "compressor": "qsgd",
                                  "s": "4", "num-chains": 2}, {"shuffle_seed": 17}, 17),
    # downlink = qsgd: each chain's w is in the checkpoint; after the resume every client is sent w in full once
    "local-downlink": ({"engine": "local", "variant": "qlsd-pp", "p": "0.5", "s": "4", "downlink": "qsgd",
                        "downlink-s": 8}, {}, 20),
    "inprocess-3-chains-downlink": ({"engine": "inprocess", "variant": "qlsd-pp", "p": "0.5", "s": "4",
                                     "num-chains": 3, "downlink": "qsgd", "downlink-s": 8}, {"shuffle_seed": 21}, 21),
    "vectorised-numpy-downlink": ({"engine": "vectorised", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-chains": 2,
                                   "downlink": "qsgd", "downlink-s": 8}, {"block_rounds": 4, "backend": "numpy"}, 22),
    "inprocess-2-chains-adapt": ({"engine": "inprocess", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-chains": 2,
                                  "metric": "dense", "metric-from": "adapt", "adapt-rounds": 30, "gamma": "auto",
                                  "init": "dispersed"}, {"shuffle_seed": 14}, 14),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kill_and_resume_is_bitwise_an_uninterrupted_run(case, tmp_path):
    over, kwargs, seed = CASES[case]
    K, every = 47, 6
    o = {"num-rounds": K, "burn-in": 0, "progress": False, "l": 10, "dim": 20, "num-clients": 6,
         "checkpoint-every": every, "output-dir": str(tmp_path), **over}
    kill_after = int(np.random.default_rng(seed).integers(every + 1, K))  # a random round, seeded
    ref = simulate.run({**o, "run-name": "uninterrupted"}, **kwargs)

    run_and_kill({**o, "run-name": "killed"}, kill_after, **kwargs)
    run_dir = tmp_path / "killed"
    meta, _ = ckpt.load(ckpt.path_in(run_dir))
    if over["engine"] == "vectorised":
        assert meta["k"] % every == 0 and meta["k"] < kill_after + 4
    else:
        assert meta["k"] == kill_after - kill_after % every
    assert not (run_dir / "samples.nc").exists() and not (run_dir / "summary.json").exists()
    # rows and draws past the checkpoint reached the disk before the kill: resuming drops them
    written = len(metrics_rows(run_dir))
    assert written > meta["k"] or written == meta["k"] == kill_after

    res = simulate.run({"resume": str(run_dir)}, **kwargs)  # the folder's config.json supplies the rest
    assert res.run_dir == run_dir and res.summary["resumed_from_round"] == meta["k"]
    a, b = load_samples(ref.run_dir), load_samples(run_dir)
    assert a.shape == (o.get("num-chains", 1), K, ref.detail.theta.shape[-1] if over.get("task") else 20)
    assert np.array_equal(a, b)
    assert np.array_equal(final_theta(ref), final_theta(res))
    rows_ref, rows = metrics_rows(ref.run_dir), metrics_rows(run_dir)
    if over["variant"] in ("vr-fald-star", "fsgld"):
        # a resume sends θ* to every client again, and its reply repeats ∇U_i(θ*) for the server's check
        # (protocol.claims): the messages after a resume are longer by design; everything else is equal
        for r in rows_ref + rows:
            r.pop("bytes_message")
    # a protocol server (every engine but the vectorised one's QLSD family) resyncs every client after a resume
    resent = over["engine"] != "vectorised" or resolve({**o, "resume": ""}).kind.local
    if resent:
        # the first message to each client after the restart carries its anchor and η_i mirror again (and,
        # on Flower, its settings): more downlink, never less, and exactly as before until the checkpoint
        down = [(int(r.pop("bits_down")), int(r.pop("bytes_message_down"))) for r in rows_ref]
        again = [(int(r.pop("bits_down")), int(r.pop("bytes_message_down"))) for r in rows]
        assert down[:meta["k"]] == again[:meta["k"]]
        assert all(a[0] >= d[0] and a[1] >= d[1] for a, d in zip(again, down))
        assert sum(a[0] for a in again) > sum(d[0] for d in down)
    assert rows_ref == rows  # the vectorised engine's downlink too: the resumed count replays who holds ζ
    for key in ("totals", "sample_mean", "sample_var", "draws_kept", "rounds", "rejected", "stats",
                "reference_refresh", "reference_refresh_per_chain"):
        a_, b_ = ref.summary.get(key), res.summary.get(key)
        if key == "totals" and over["variant"] in ("vr-fald-star", "fsgld"):
            a_, b_ = ({k: v for k, v in t.items() if k != "bytes_message"} for t in (a_, b_))
        if key == "totals" and resent:
            a_, b_ = ({k: v for k, v in t.items() if k not in ("bits_down", "bytes_message_down")} for t in (a_, b_))
        assert a_ == b_, key  # stats: the vectorised engine's
    import h5netcdf

    with h5netcdf.File(ref.run_dir / "samples.nc", "r") as f, h5netcdf.File(run_dir / "samples.nc", "r") as g:
        for name in ("theta", "draw", "chain", "theta_dim_0"):
            assert np.array_equal(f["posterior"][name][...], g["posterior"][name][...]), name
    assert not (run_dir / "draws.f8").exists()


def test_resume_checks_the_configuration(tmp_path):
    o = {"engine": "local", "num-rounds": 12, "burn-in": 0, "progress": False, "dim": 5, "num-clients": 3,
         "checkpoint-every": 4, "output-dir": str(tmp_path), "run-name": "r"}
    run_and_kill(o, 9)
    with pytest.raises(ConfigError, match="gamma"):
        simulate.run({"resume": str(tmp_path / "r"), "gamma": 1e-3})
    with pytest.raises(ConfigError, match="written by a server engine run"):
        simulate.run({"resume": str(tmp_path / "r"), "engine": "vectorised"})
    with pytest.raises(ConfigError, match="checkpoint-every"):
        resolve({"checkpoint-every": -1})
    # engines that run the same chain resume each other's checkpoints; num-rounds may grow
    res = simulate.run({"resume": str(tmp_path / "r"), "engine": "inprocess", "num-rounds": 15})
    assert res.summary["rounds"] == 15 and load_samples(res.run_dir).shape == (1, 15, 5)
    with pytest.raises(ConfigError, match="finished"):
        simulate.run({"resume": str(tmp_path / "r")})


# a process that writes checkpoints in a loop, printing each index once it is saved
WRITER = textwrap.dedent("""
    import sys, numpy as np
    from qlsd_flwr.outputs import checkpoint as ckpt
    path, n = sys.argv[1], 300_000
    for i in range(10**9):
        ckpt.save(path, {"x": np.full(n, float(i)), "y": np.arange(i % 7 + 1)}, {"i": i, "k": i * 3})
        print(i, flush=True)
""")


def test_a_kill_during_a_checkpoint_write_leaves_the_previous_complete_checkpoint(tmp_path):
    rng = np.random.default_rng(11)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    path = tmp_path / ckpt.NAME
    seen_mid_write = 0
    for trial in range(30):  # at least 6 kills, more until one has landed inside a write
        if trial >= 6 and seen_mid_write:
            break
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env, stdout=subprocess.PIPE, text=True)
        first = p.stdout.readline()  # at least one checkpoint exists before the kill
        assert first.strip().isdigit()
        time.sleep(float(rng.uniform(0.0, 0.4)))
        p.send_signal(signal.SIGKILL)
        out, _ = p.communicate()
        printed = [int(x) for x in (first + out).split()]
        meta, arrays = ckpt.load(path)
        i = meta["i"]
        # the newest complete checkpoint: the last reported, or the one whose replace had just happened
        assert printed[-1] <= i <= printed[-1] + 1
        assert meta["k"] == 3 * i and np.array_equal(arrays["x"], np.full(300_000, float(i)))
        assert np.array_equal(arrays["y"], np.arange(i % 7 + 1))
        seen_mid_write += any(f.name.endswith(".tmp") for f in tmp_path.iterdir())
    # the leftovers of an interrupted write are temporary files, never the checkpoint itself
    assert all(f.name == ckpt.NAME or f.name.endswith(".tmp") for f in tmp_path.iterdir())
    assert seen_mid_write >= 1  # some kills did land inside a write


@pytest.mark.parametrize("engine", ["local", "inprocess", "vectorised"])
def test_divergence_stops_with_a_clear_error_and_keeps_the_outputs(engine, tmp_path):
    o = {"engine": engine, "num-rounds": 60, "burn-in": 0, "progress": False, "l": 10, "p": "0.5", "s": "4",
         "gamma": 0.05, "checkpoint-every": 1, "output-dir": str(tmp_path), "run-name": "div"}
    with pytest.raises(DivergenceError, match=r"diverged at round (\d+).*smaller gamma") as info:
        simulate.run(o)
    import re

    r = int(re.search(r"round (\d+)", str(info.value)).group(1))
    run_dir = tmp_path / "div"
    samples = load_samples(run_dir)  # the run folder was closed: samples.nc opens
    assert samples.shape == (1, r - 1, 50) and np.all(np.isfinite(samples))
    assert len(metrics_rows(run_dir)) == r - 1
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["diverged_at_round"] == r and "smaller gamma" in s["error"]
    meta, arrays = ckpt.load(ckpt.path_in(run_dir))  # the last good checkpoint is kept
    assert meta["k"] == r - 1  # the run stops when θ runs away (10^4 × its scale), before it overflows
    assert f"last good checkpoint is at round {meta['k']}" in str(info.value)
    # the suggested step is below the stability limit the start-up warning names (2/τ; it
    # suggests 1/τ), not just a tenth of the step that diverged
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    tau = 1.0 / float(np.min(build_gaussian_task(20, 50, 0).posterior_var))
    suggested = float(re.search(r"e\.g\. gamma=([0-9.e+-]+)\)", str(info.value)).group(1))
    assert suggested <= 1.0 / tau * (1 + 1e-3) and suggested < 2.0 / tau


# ---------------------------------------------------------------------------------------------
# hostile replies: QLSDServer.accept never raises; a rejected reply is counted and leaves the
# chain exactly as if its client had been inactive that round
import copy  # noqa: E402
import struct  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qlsd_flwr.protocol import precondition  # noqa: E402
from qlsd_flwr.core.oracles import ClientState, full_local_grad  # noqa: E402
from qlsd_flwr.protocol import build  # noqa: E402
from qlsd_flwr.protocol.client import handle  # noqa: E402
from qlsd_flwr.protocol.server import QLSDServer  # noqa: E402
from qlsd_flwr.tasks import loading  # noqa: E402

FUZZ_VARIANTS = {"qlsd-pp": {"variant": "qlsd-pp", "s": "4"},  # QSGD (Elias/packed), memory, ζ anchor
                 "qlsd-packed": {"variant": "qlsd-star", "s": "3", "encoding": "packed"},
                 "lsd-pp": {"variant": "lsd-pp"},  # raw float64 payloads
                 # the rivals' local-step messages Δ_i: raw, and QSGD-coded with θ* and ∇U(θ*) sent in the round
                 "fald": {"variant": "fald", "local-steps": 2, "tau": 0.5},
                 # VR-FALD* with q = 1: every round refreshes θ_r, so the fuzzed reply carries ref_grad = ∇U_i(θ_k)
                 "vr-fald-qsgd": {"variant": "vr-fald-star", "local-steps": 2, "compressor": "qsgd", "s": "4", "q": 1.0},
                 # DG-LMC: the change of z_i, QSGD-coded, added to the server's mirror of z_i
                 "dg-lmc-qsgd": {"variant": "dg-lmc", "local-steps": 2, "compressor": "qsgd", "s": "4"},
                 # FSGLD: the round's one client's Δ_s, QSGD-coded, with θ*, ∇U(θ*), λ_s and Λ sent in the round
                 "fsgld-qsgd": {"variant": "fsgld", "local-steps": 2, "compressor": "qsgd", "s": "4"}}


NO_REPLY = object()


class ReplyFuzzer:
    """A server a few rounds into a chain; ``play(j, fields)`` runs one round from that snapshot
    in which client ``j`` replies ``fields`` (``NO_REPLY``: ``j`` does not reply at all)."""

    def __init__(self, variant: str, d: int = 6, b: int = 4, warm: int = 3):
        o = {**FUZZ_VARIANTS[variant], "dim": d, "num-clients": b, "p": "1.0", "l": 2, "num-rounds": 50,
             "burn-in": 0, "progress": False, "engine": "local"}
        self.cfg = cfg = resolve(o)
        self.task = task = loading.load_task(cfg)
        self.specs = [build.client_spec(cfg, i, task.clients[i].n_data, d, task.prior, build.blocks_for(cfg, task))
                      for i in range(b)]
        self.clients = [ClientState() for _ in range(b)]
        self.server = QLSDServer(cfg, task)
        prep = precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, self.specs))
        self.server.begin(prep.theta_star, prep.info, None, prep)
        if self.server.wants_claims():  # QLSD*, VR-FALD*, FSGLD: every client's ∇U_i(θ*), as the engines ask it
            self.server.set_claims([full_local_grad(s, task.clients[s.index], prep.theta_star) for s in self.specs])
        # round warm+1 refreshes ζ (l = 2): anchors travel in the fuzzed round; FSGLD asks one client a round,
        # so its fuzzed round is the first after warm in which client 1 is asked (its first: θ* travels in it)
        while self.server.state.k <= warm or 1 not in copy.deepcopy(self.server).begin_round():
            for i in self.server.begin_round():
                self.server.accept(i, self._reply(self.server, self.clients, i))
            self.server.end_round()
        self.snapshot = copy.deepcopy((self.server, self.clients))
        srv, cl = copy.deepcopy(self.snapshot)
        self.valid = {i: self._reply(srv, cl, i) for i in srv.begin_round()}  # what each asked client would send

    def _reply(self, server, clients, i):
        return handle(self.specs[i], self.task.clients[i], clients[i], self.cfg.seed, server.fields_for(i), self.task.dim)

    def play(self, j: int, fields) -> tuple[QLSDServer, dict]:
        server, clients = copy.deepcopy(self.snapshot)
        before = sum(server.rejected.values())
        for i in server.begin_round():
            if i != j:
                server.accept(i, self._reply(server, clients, i))
            elif fields is not NO_REPLY:
                server.accept(j, fields)
        server.end_round()  # a reply over the norm limit is rejected here, with the round's others in view
        accepted = j in server._g_hat
        counted = sum(server.rejected.values()) - before
        return server, {"accepted": accepted, "counted": counted}


def _set_norm(payload: bytes, value: float) -> bytes:
    return payload[:5] + struct.pack(">f", value) + payload[9:]  # the first block's float32 norm


def _levels_above_s(encoding: str, seed: int, d: int) -> bytes:
    """A well-formed QSGD code with s = 256: levels above the server's s (≤ 16 here)."""
    from qlsd_flwr.compression.qsgd import QSGD

    big = QSGD(s=256, encoding=encoding)
    r = np.random.default_rng(seed)
    v = r.normal(size=d)
    v[0] = 100.0  # one dominant coordinate: its level is near 256
    return big.encode(big.quantise(v, r.uniform(size=d)))


def _hostile(valid: dict, d: int):
    """Replies derived from a valid one (for client ``j``), and arbitrary values."""
    payload = valid["payload"]
    any_value = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                          st.text(max_size=8), st.binary(max_size=64), st.lists(st.integers(), max_size=3))
    keys = st.sampled_from(["client", "status", "payload", "anchor_version", "eta", "x", "anchor_grad", "ref_grad"])

    def with_(**kw):
        return {**valid, **kw}

    mutated_payload = st.one_of(
        st.binary(max_size=3 * len(payload)),  # random bytes
        st.integers(0, len(payload) - 1).map(lambda n: payload[:n]),  # truncated
        st.binary(min_size=1, max_size=40).map(lambda x: payload + x),  # oversized
        st.tuples(st.integers(0, len(payload) - 1), st.integers(1, 255)).map(  # a corrupted byte
            lambda t: payload[:t[0]] + bytes([payload[t[0]] ^ t[1]]) + payload[t[0] + 1:]),
        st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0]).map(lambda v: _set_norm(payload, v)),
        st.sampled_from([3.4028235e38, 1e30, 1e12]).map(lambda v: _set_norm(payload, v)),  # huge, valid norms
        st.integers(0, 2**32 - 1).filter(lambda x: x != d).map(  # wrong d in the header
            lambda x: payload[:1] + struct.pack("<I", x) + payload[5:]),
        st.integers(0, 255).map(lambda t: bytes([t]) + payload[1:]),  # any encoding tag
        st.sampled_from([np.nan, np.inf, 1e308]).map(lambda v: np.full(d, v).tobytes()),  # dense floats
        st.tuples(st.sampled_from(["elias", "packed"]), st.integers(0, 2**31)).map(  # levels > s
            lambda t: _levels_above_s(t[0], t[1], d)),
    )
    ref_grad = st.one_of(any_value, st.sampled_from([np.nan, np.inf, 1e308]).map(lambda v: np.full(d, v).tobytes()),
                         st.integers(0, 8 * d + 16).filter(lambda n: n != 8 * d).map(lambda n: bytes(n)))
    return st.one_of(
        ref_grad.map(lambda v: with_(ref_grad=v)),  # VR-FALD*'s refresh: a missing or unusable ∇U_i(θ_k)
        mutated_payload.map(lambda p: with_(payload=p)),
        any_value.map(lambda v: with_(payload=v)),  # wrong types
        st.one_of(st.integers(-3, 10), any_value).map(lambda c: with_(client=c)),  # another client id
        st.one_of(st.text(max_size=6), any_value).map(lambda s: with_(status=s)),
        st.one_of(st.integers(-3, 5), any_value).map(lambda v: with_(anchor_version=v)),
        st.sampled_from([2**63, 2**64, -(2**63) - 1, float("nan"), float("inf"), "NaN"]).map(  # overflow, NaN
            lambda v: with_(anchor_version=v)),
        keys.map(lambda k: {kk: vv for kk, vv in valid.items() if kk != k}),  # a key missing
        st.dictionaries(keys, any_value, max_size=5),  # anything
        st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=5), st.lists(st.integers(), max_size=3)),
    )


def check_hostile_reply(fz: ReplyFuzzer, j: int, fields, inactive) -> str | None:
    """The property; returns what went wrong, or ``None``."""
    try:
        server, facts = fz.play(j, fields)
    except DivergenceError:
        # only a reply the codec accepted as valid (e.g. a huge but finite raw vector) may do that
        return None if _decodes_finite(fz, j, fields) else "a rejected reply made the run diverge"
    except Exception as exc:  # noqa: BLE001
        return f"the server raised {type(exc).__name__}: {exc}"
    if facts["accepted"]:
        return None if _decodes_finite(fz, j, fields) else "accepted a reply that does not decode to finite values"
    if facts["counted"] != 1:
        return f"rejected reply counted {facts['counted']} times"
    ref = inactive
    for name in ("theta", "eta", "eta_i", "zeta"):
        a, b = getattr(server.state, name), getattr(ref.state, name)
        if not (a is None and b is None or np.array_equal(a, b)):
            return f"state {name} differs from the run where client {j} was inactive"
    a, b = server.spec.theta_star, ref.spec.theta_star  # θ* (VR-FALD*: the reference θ_r, refreshed or not)
    if not (a is None and b is None or np.array_equal(a, b)):
        return "theta_star differs from the run where the client was inactive"
    if not np.array_equal(server.eta_count, ref.eta_count):
        return "eta_count differs from the run where the client was inactive"
    return None


def _decodes_finite(fz, j, fields) -> bool:
    try:
        comp = fz.server.compressors[j]
        return bool(np.all(np.isfinite(comp.dequantise(comp.decode(fields["payload"], fz.task.dim)))))
    except Exception:  # noqa: BLE001
        return False


_FUZZERS: dict = {}


def fuzzer(variant: str) -> tuple[ReplyFuzzer, QLSDServer]:
    if variant not in _FUZZERS:
        fz = ReplyFuzzer(variant)
        _FUZZERS[variant] = (fz, fz.play(1, NO_REPLY)[0])  # client 1 inactive: the reference
    return _FUZZERS[variant]


@pytest.mark.parametrize("variant", list(FUZZ_VARIANTS))
def test_hostile_replies_are_rejected_counted_and_harmless(variant):
    fz, inactive = fuzzer(variant)

    @settings(max_examples=400, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(_hostile(fz.valid[1], fz.task.dim))
    def prop(fields):
        problem = check_hostile_reply(fz, 1, fields, inactive)
        assert problem is None, (problem, fields)

    prop()


def test_fuzz_harness_sees_valid_replies_accepted():
    """The harness is not vacuous: the valid reply is accepted and changes the chain."""
    fz, inactive = fuzzer("qlsd-pp")
    server, facts = fz.play(1, fz.valid[1])
    assert facts["accepted"] and facts["counted"] == 0
    assert not np.array_equal(server.state.theta, inactive.state.theta)
    server, facts = fz.play(1, {**fz.valid[1], "payload": _set_norm(fz.valid[1]["payload"], float("nan"))})
    assert not facts["accepted"] and server.rejected.get("decode_error", 0) >= 1


@pytest.mark.ray
def test_a_killed_run_resumes_on_the_ray_engine_bitwise(tmp_path, attached_ray):
    """Resume on Flower's Ray engine (fresh SuperNodes: every client's context.state is empty)
    a run killed on the framework-free engine: the same chain as an uninterrupted run."""
    o = {"engine": "local", "variant": "qlsd-pp", "p": "0.5", "s": "4", "num-rounds": 23, "burn-in": 0,
         "progress": False, "l": 5, "dim": 10, "num-clients": 4, "checkpoint-every": 4,
         "output-dir": str(tmp_path)}
    ref = simulate.run({**o, "run-name": "uninterrupted"})
    run_and_kill({**o, "run-name": "killed"}, 14)
    res = simulate.run({"resume": str(tmp_path / "killed"), "engine": "ray", "client-cpus": 1.0})
    assert res.summary["resumed_from_round"] == 12 and res.summary["engine"] == "flower-ray"
    assert np.array_equal(load_samples(ref.run_dir), load_samples(res.run_dir))
    assert np.array_equal(final_theta(ref), final_theta(res))
    assert res.summary["rejected"] == ref.summary["rejected"]  # no client lost a round to a resync


def _drop_claims(meta, arrays):
    for name in [n for n in arrays if n.endswith(".claims") or n.endswith(".claims_total")]:
        arrays.pop(name)


@pytest.mark.parametrize("edit, words", [
    (lambda m, a: m["runner"].update(chain_meta=m["runner"]["chain_meta"][:1]), r"'runner' must hold 2 chain"),
    (lambda m, a: m["runner"].update(ts_info=5), "runner.ts_info must be a table"),
    (lambda m, a: m["runner"]["chain_meta"][1].update(missed_rounds={"x": "y"}),
     r"runner.chain_meta\[1\].missed_rounds' holds 'x'"),
    (lambda m, a: a.update({"run_c0.anchor_acked": a["run_c0.anchor_acked"][:2]}), "chain 0: array '"),
    (_drop_claims, r"the claims at θ\* \('claims'\) are missing"),
    (lambda m, a: a.update({"run_c1.surrogate": -a["run_c1.surrogate"] - 1}), "'surrogate' must be 4 × 6 finite"),
])
def test_a_crafted_vectorised_checkpoint_of_a_rival_is_refused_by_name(tmp_path, edit, words):
    # the rivals' servers' state in the vectorised engine's checkpoint (engines.vectorised.rivals): every part
    # a resume reads is checked, and a bad one is a one-line error naming it, not a crash
    o = {"engine": "vectorised", "variant": "fsgld", "num-chains": 2, "num-clients": 4, "dim": 6, "num-rounds": 40,
         "burn-in": 2, "checkpoint-every": 5, "progress": False, "loo": "off", "output-dir": str(tmp_path),
         "run-name": "r"}
    run_and_kill(o, 12, block_rounds=4)  # killed after its checkpoint at round 10
    meta, arrays = ckpt.load(ckpt.path_in(tmp_path / "r"))
    meta.pop("format")
    edit(meta, arrays)
    ckpt.save(ckpt.path_in(tmp_path / "r"), arrays, meta)
    with pytest.raises(ConfigError, match=words):
        simulate.run({"resume": str(tmp_path / "r"), "progress": False}, block_rounds=4)


@pytest.mark.parametrize("edit", [
    lambda a: a.pop("reference_refresh"),
    lambda a: a.update(reference_refresh=np.array([3, -1, 0, 0])),
    lambda a: a.update(reference_refresh=np.array([3.0, 1.0, 0.0, 0.0])),
    lambda a: a.update(reference_refresh=np.array([3, 1, 0])),
])
def test_a_checkpoint_with_bad_refresh_counts_is_refused_by_name(tmp_path, edit):
    # VR-FALD*'s refresh counts give its anchor versions: a resume reads them from the checkpoint's arrays,
    # and a missing or malformed one is a one-line error naming the field, not a crash or a reset count
    o = {"engine": "local", "variant": "vr-fald-star", "q": 0.5, "num-clients": 4, "dim": 6, "num-rounds": 40,
         "burn-in": 2, "checkpoint-every": 5, "progress": False, "loo": "off", "output-dir": str(tmp_path),
         "run-name": "r"}
    run_and_kill(o, 12)  # killed after its checkpoint at round 10
    meta, arrays = ckpt.load(ckpt.path_in(tmp_path / "r"))
    assert arrays["reference_refresh"][0] >= 1  # it refreshed before the checkpoint
    meta.pop("format")
    edit(arrays)
    ckpt.save(ckpt.path_in(tmp_path / "r"), arrays, meta)
    with pytest.raises(ConfigError, match="'reference_refresh' must be the 4 counts rounds, installed"):
        simulate.run({"resume": str(tmp_path / "r"), "progress": False})
