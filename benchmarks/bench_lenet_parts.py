"""Where a LeNet-5 round goes on Flower's Ray engine, and what a batched torch oracle would give
(issue 15). Three measurements, each printed as JSON:

1. ``--actor``: the ``ray`` engine on the LeNet-5 benchmark config of ``bench_chains.py`` with a
   client mod that times each ``train`` message inside the Ray actor (wall and the handler
   thread's CPU time, torch's thread count), and the strategy's view: seconds from a round's
   push to its last reply, the time ``aggregate_train`` held the replies (decoding, validation;
   it overlaps the clients still at work), and from the last reply to the next push (the last
   decode, the server step, recording, building the next messages).
2. ``--transfer``: Ray alone, no Flower: an actor method that returns what it is given, called
   20 times a round over 4 actors (``num_cpus = 0.5``, as ``client-cpus`` sets) with a 494 KB
   argument (θ at d = 61,706) and a context of 300 bytes or of 1.48 MB (the QLSD++ client state
   η_i, ζ, ∇U_i(ζ) that Flower's Ray backend passes with every message, both ways).
3. ``--vmap``: one torch thread, LeNet-5, 64 images: the gradients at R parameter sets (R = 2:
   QLSD++'s θ and ζ; R = 8: four chains) with ``torch.func.vmap(grad(functional_call))``
   against R plain backward passes; and 20 clients' gradients at one shared θ (vmapped over
   the clients' 64-image minibatches) against 20 passes.

4. ``--poll``: the strategy's reply poll before and after d8766a9, in turn (see :func:`poll`).
5. ``--layout``: ``TorchPotential.grad_sum`` on a 64-image minibatch of 200 MNIST images, one torch
   thread, with LeNet-5's weights in channels-last memory order (the default on the CPU since issue
   39's table) against the plain NCHW order, interleaved; and the largest relative difference of the
   two gradients (float rounding: the kernels sum in another order).

    python benchmarks/bench_lenet_parts.py --actor --transfer --vmap --poll [--out FILE]
    python benchmarks/bench_lenet_parts.py --layout --out benchmarks/lenet_layout.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Ray's own costs are what this script measures: a smoke run keeps Ray, at a few rounds and calls
from benchmarks.smoke import few, small  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402


def _actor_mod(folder: str):
    def mod(msg, ctx, call_next):
        import torch

        t0, c0 = time.time(), time.thread_time()
        out = call_next(msg, ctx)
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as f:
            f.write(f"{t0} {time.time()} {msg.metadata.message_type} {time.thread_time() - c0} "
                    f"{torch.get_num_threads()}\n")
        return out
    return mod


def _timed_stream(S, log: list):
    """The strategy's reply stream, timed per round: when it starts (before the push), when the
    round's last reply was pulled, and how long the consumer (``aggregate_train``: decoding,
    validation) held each reply."""
    real = S.RepliesAsTheyArrive._stream

    def stream(self, msgs, timeout, interval):
        t0, held, last = time.perf_counter(), 0.0, None
        for msg in real(self, msgs, timeout, interval):
            last = time.perf_counter()
            yield msg
            held += time.perf_counter() - last
        log.append({"start": t0, "last_reply": last, "decode": held, "end": time.perf_counter()})
    return real, stream


def actor(rounds: int) -> dict:
    from bench_chains import LENET, _round_seconds

    import qlsd_flwr.flower.grid_stream as S
    from qlsd_flwr.config import resolve
    from qlsd_flwr.run.simulate import run_ray

    folder = tempfile.mkdtemp(prefix="qlsd-actor-")
    log: list = []
    real, S.RepliesAsTheyArrive._stream = _timed_stream(S, log)
    try:
        o = {**LENET, "engine": "ray", "num-rounds": rounds, "output-dir": tempfile.mkdtemp()}
        strat = run_ray(resolve(o), o, mods=[_actor_mod(folder)])
    finally:
        S.RepliesAsTheyArrive._stream = real
    rows = sorted(line.split() for f in glob.glob(os.path.join(folder, "*.txt")) for line in open(f))
    train = [r for r in rows if r[2] == "train"][5 * 20:]  # in time order; the first 5 rounds warm the actors
    wall = [float(b) - float(a) for a, b, *_ in train]
    cpu = [float(r[3]) for r in train]
    log = log[5:]
    return {"rounds": rounds, "s_per_round_mean": statistics.fmean(_round_seconds(strat.run_dir)),
            "train_message_wall_ms_median": 1e3 * statistics.median(wall),
            "train_message_cpu_ms_median": 1e3 * statistics.median(cpu),
            "torch_threads_in_actors": sorted({r[4] for r in train}),
            "push_to_last_reply_s_median": statistics.median([r["last_reply"] - r["start"] for r in log]),
            "decoding_s_per_round_median": statistics.median([r["decode"] for r in log]),
            "last_reply_to_next_push_s_median": statistics.median(
                [n["start"] - r["end"] + (r["end"] - r["last_reply"]) for r, n in zip(log, log[1:])])}


def poll(pairs: int) -> dict:
    """Seconds per round with the strategy's reply poll as it is (5 ms after a reply, doubling
    up to Flower's 0.1 s) and as it was before d8766a9 (a flat 0.1 s: ``FIRST_POLL_S = 0.1``
    makes the same loop wait 0.1 s every time), run in turn: the toy (20 clients, d = 50,
    40 rounds) and LeNet-5 (30 rounds) on Ray, and 1,000 toy clients (8 rounds, one pair)."""
    from bench_chains import LENET, _round_seconds

    import qlsd_flwr.flower.grid_stream as S
    from qlsd_flwr.run import simulate

    toy = {"variant": "qlsd-pp", "num-clients": 20, "dim": 50, "burn-in": 0, "p": "1.0", "s": "16",
           "gamma": 4.9e-4, "progress": False, "engine": "ray", "output-dir": tempfile.mkdtemp()}  # bench_chains'
    cases = few({"toy": ({**toy, "num-rounds": small(40, 7)}, 5, pairs),
                 "lenet": ({**LENET, "engine": "ray", "num-rounds": 30, "output-dir": tempfile.mkdtemp()}, 5, pairs),
                 "toy_1000_clients": ({**toy, "num-clients": 1000, "gamma": 4.9e-4 * 20 / 1000, "num-rounds": 8}, 2, 1)})
    new = S.FIRST_POLL_S
    out: dict = {}
    for name, (o, skip, n) in cases.items():
        res = {"flat_0.1s": [], "backoff": []}
        for _ in range(n):
            for label, first in (("flat_0.1s", 0.1), ("backoff", new)):
                S.FIRST_POLL_S = first
                try:
                    t = _round_seconds(simulate.run(o).run_dir, skip=skip)
                finally:
                    S.FIRST_POLL_S = new
                res[label].append(statistics.fmean(t))
        res["backoff_over_flat"] = statistics.fmean(res["backoff"]) / statistics.fmean(res["flat_0.1s"])
        out[name] = res
        print(name, json.dumps(res), flush=True)
    return out


def transfer(batches: int = 10) -> dict:
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, logging_level="ERROR", log_to_driver=False)

    @ray.remote(num_cpus=0.5)
    class Echo:
        def run(self, message, context):
            return b"r" * 100, context

    actors = [Echo.remote() for _ in range(4)]
    out = {}
    for size in few((300, 1_481_698)):
        msg, ctx = b"m" * 494_729, b"c" * size
        ray.get([a.run.remote(msg, ctx) for a in actors])
        one = []
        for _ in range(small(30, 2)):
            t = time.perf_counter()
            ray.get(actors[0].run.remote(msg, ctx))
            one.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(batches):
            ray.get([actors[i % 4].run.remote(msg, ctx) for i in range(20)])
        out[f"context_{size}_bytes"] = {"one_call_ms_median": 1e3 * statistics.median(one),
                                        "round_of_20_calls_s": (time.perf_counter() - t) / batches}
    ray.shutdown()
    return out


def _vmap_against_passes(with_vmap, passes, reps: int) -> dict:
    """Milliseconds a call of each, interleaved (vmap, passes, vmap, passes), the second pair kept."""
    ms = {}
    for name, f in (("vmap", with_vmap), ("passes", passes)) * 2:
        f()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        ms[name] = 1e3 * (time.perf_counter() - t) / reps
    return {"vmap_ms": ms["vmap"], "backward_passes_ms": ms["passes"], "vmap_over_passes": ms["vmap"] / ms["passes"]}


def vmap(reps: int = 10) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad
    from torch.func import vmap as tvmap

    from qlsd_flwr.tasks.torch_models import LeNet5

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LeNet5()
    X, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    base = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, X, y):
        return F.cross_entropy(functional_call(model, p, (X,)), y, reduction="sum")

    out = {"torch": torch.__version__}
    for R in few((2, 8)):
        P = {k: torch.stack([v + 0.01 * i for i in range(R)]) for k, v in base.items()}
        batched = tvmap(grad(loss), in_dims=(0, None, None))

        def with_vmap():
            batched(P, X, y)

        def one_by_one():
            for i in range(R):
                model.load_state_dict({k: v[i] for k, v in P.items()}, strict=False)
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(X), y, reduction="sum").backward()

        out[f"R={R}"] = _vmap_against_passes(with_vmap, one_by_one, reps)
    # the vectorised engine's case: 20 clients' minibatch gradients at one shared θ (one chain),
    # vmapped over the clients' data, against 20 backward passes
    G = 20
    Xg, yg = torch.randn(G, 64, 1, 28, 28), torch.randint(0, 10, (G, 64))
    over_clients = tvmap(grad(loss), in_dims=(None, 0, 0))

    def clients_vmap():
        over_clients(base, Xg, yg)

    def clients_passes():
        for g in range(G):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(Xg[g]), yg[g], reduction="sum").backward()

    out["clients=20, shared θ"] = _vmap_against_passes(clients_vmap, clients_passes, reps // 2)
    return out


def layout(reps: int = 200) -> dict:
    import copy

    import numpy as np
    import torch

    from qlsd_flwr.data.datasets import load_mnist_subset
    from qlsd_flwr.tasks.torch_models import LeNet5, TorchPotential

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ds = load_mnist_subset()
    X, y = ds.X_train[:200], ds.y_train[:200]
    model = LeNet5()
    pots = {"nchw": TorchPotential(model, X, y, channels_last=False),
            "channels_last": TorchPotential(copy.deepcopy(model), X, y)}
    theta = pots["nchw"].theta0()
    idx = np.random.default_rng(0).choice(200, 64, replace=False)
    g = {k: p.grad_sum(theta, idx) for k, p in pots.items()}
    ms = {}
    for k, pot in list(pots.items()) * 2:  # interleaved; the second pass kept
        pot.grad_sum(theta, idx)
        t = time.perf_counter()
        for _ in range(reps):
            pot.grad_sum(theta, idx)
        ms[k] = 1e3 * (time.perf_counter() - t) / reps
    return {"torch": torch.__version__, "nchw_ms": ms["nchw"], "channels_last_ms": ms["channels_last"],
            "nchw_over_channels_last": ms["nchw"] / ms["channels_last"],
            "max_relative_difference": float(np.abs(g["nchw"] - g["channels_last"]).max()
                                             / np.abs(g["nchw"]).max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actor", action="store_true")
    ap.add_argument("--transfer", action="store_true")
    ap.add_argument("--vmap", action="store_true")
    ap.add_argument("--poll", action="store_true")
    ap.add_argument("--layout", action="store_true")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.pairs, a.rounds = small(a.pairs, 1), small(a.rounds, 7)
    res: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                 "load_at_start": os.getloadavg()}
    if a.vmap:
        res["vmap"] = vmap(small(10, 2))
        print(json.dumps(res["vmap"], indent=1), flush=True)
    if a.layout:
        res["layout"] = layout(small(200, 3))
        print(json.dumps(res["layout"], indent=1), flush=True)
    if a.transfer:
        res["transfer"] = transfer(small(10, 1))
        print(json.dumps(res["transfer"], indent=1), flush=True)
    if a.poll:
        res["poll"] = poll(a.pairs)
    if a.actor:
        res["actor"] = actor(a.rounds)
        print(json.dumps(res["actor"], indent=1), flush=True)
    res["load_at_end"] = os.getloadavg()
    if a.out:
        smoke_out(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
