"""Where a LeNet-5 round goes on Flower's Ray engine, and what a batched torch oracle would give
(issue 15). Three measurements, each printed as JSON:

1. ``--actor``: the ``ray`` engine on the LeNet-5 benchmark config of ``bench_chains.py`` with a
   client mod that times each ``train`` message inside the Ray actor (wall and the handler
   thread's CPU time, torch's thread count), and the strategy's view: seconds from pushing a
   round's messages to its last reply, and from the last reply to the next push (the server's
   own work: decoding, the server step, recording, building the next messages).
2. ``--transfer``: Ray alone, no Flower: an actor method that returns what it is given, called
   20 times a round over 4 actors (``num_cpus = 0.5``, as ``client-cpus`` sets) with a 494 KB
   argument (θ at d = 61,706) and a context of 300 bytes or of 1.48 MB (the QLSD++ client state
   η_i, ζ, ∇U_i(ζ) that Flower's Ray backend passes with every message, both ways).
3. ``--vmap``: one torch thread, LeNet-5, 64 images: the gradients at R parameter sets (R = 2:
   QLSD++'s θ and ζ; R = 8: four chains) with ``torch.func.vmap(grad(functional_call))``
   against R plain backward passes.

    python benchmarks/bench_lenet_parts.py --actor --transfer --vmap [--out FILE]
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


def actor(rounds: int) -> dict:
    from bench_chains import LENET, _round_seconds

    import qlsd_flwr.flower.strategy as S
    from qlsd_flwr.config import resolve
    from qlsd_flwr.run.simulate import run_ray

    folder = tempfile.mkdtemp(prefix="qlsd-actor-")
    pushes, lasts = [], []
    real = S._RepliesAsTheyArrive.send_and_receive

    def spy(self, messages, *, timeout=None):
        msgs = list(messages)
        if not msgs:
            return []
        replies = real(self, msgs, timeout=timeout)
        pushes.append(time.perf_counter())

        def each():
            yield from replies
            lasts.append(time.perf_counter())
        return each()

    S._RepliesAsTheyArrive.send_and_receive = spy
    try:
        o = {**LENET, "engine": "ray", "num-rounds": rounds, "output-dir": tempfile.mkdtemp()}
        strat = run_ray(resolve(o), o, mods=[_actor_mod(folder)])
    finally:
        S._RepliesAsTheyArrive.send_and_receive = real
    rows = [line.split() for f in glob.glob(os.path.join(folder, "*.txt")) for line in open(f)]
    train = [r for r in rows if r[2] == "train"][5 * 20:]  # the first 5 rounds warm the actors
    wall = [float(b) - float(a) for a, b, *_ in train]
    cpu = [float(r[3]) for r in train]
    return {"rounds": rounds, "s_per_round_mean": statistics.fmean(_round_seconds(strat.run_dir)),
            "train_message_wall_ms_median": 1e3 * statistics.median(wall),
            "train_message_cpu_ms_median": 1e3 * statistics.median(cpu),
            "torch_threads_in_actors": sorted({r[4] for r in train}),
            "push_to_last_reply_s_median": statistics.median([b - a for a, b in zip(pushes, lasts)][5:]),
            "last_reply_to_next_push_s_median": statistics.median([b - a for a, b in zip(lasts, pushes[1:])][5:])}


def transfer(batches: int = 10) -> dict:
    import ray

    ray.init(num_cpus=os.cpu_count() or 2, logging_level="ERROR", log_to_driver=False)

    @ray.remote(num_cpus=0.5)
    class Echo:
        def run(self, message, context):
            return b"r" * 100, context

    actors = [Echo.remote() for _ in range(4)]
    out = {}
    for size in (300, 1_481_698):
        msg, ctx = b"m" * 494_729, b"c" * size
        ray.get([a.run.remote(msg, ctx) for a in actors])
        one = []
        for _ in range(30):
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
    for R in (2, 8):
        P = {k: torch.stack([v + 0.01 * i for i in range(R)]) for k, v in base.items()}
        batched = tvmap(grad(loss), in_dims=(0, None, None))

        def with_vmap():
            batched(P, X, y)

        def one_by_one():
            for i in range(R):
                model.load_state_dict({k: v[i] for k, v in P.items()}, strict=False)
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(X), y, reduction="sum").backward()

        times = {}
        for f in (with_vmap, one_by_one, with_vmap, one_by_one):  # interleaved, the second pair kept
            f()
            t = time.perf_counter()
            for _ in range(reps):
                f()
            times[f.__name__] = 1e3 * (time.perf_counter() - t) / reps
        out[f"R={R}"] = {"vmap_ms": times["with_vmap"], "backward_passes_ms": times["one_by_one"],
                         "vmap_over_passes": times["with_vmap"] / times["one_by_one"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--actor", action="store_true")
    ap.add_argument("--transfer", action="store_true")
    ap.add_argument("--vmap", action="store_true")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                 "load_at_start": os.getloadavg()}
    if a.vmap:
        res["vmap"] = vmap()
        print(json.dumps(res["vmap"], indent=1), flush=True)
    if a.transfer:
        res["transfer"] = transfer()
        print(json.dumps(res["transfer"], indent=1), flush=True)
    if a.actor:
        res["actor"] = actor(a.rounds)
        print(json.dumps(res["actor"], indent=1), flush=True)
    res["load_at_end"] = os.getloadavg()
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
