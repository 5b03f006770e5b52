"""Many chains per Flower round, many virtual clients, and LeNet-5 round times (issue 15).

1. ``--chains``: seconds per round of QLSD++ on Flower's Ray engine (toy Gaussian, 20 clients,
   d = 50, p = 1, s = 16) with C = 1, 4, 16 chains in one run (``num-chains``: one message per
   client and round carries the C chains' θ), run in turn, ``--pairs`` times; per-round times
   from ``metrics.csv`` after each run's first 5 rounds (Ray's actors warm up). Target of the
   issue: C = 16 at ≤ 1.5× C = 1 (C separate runs would cost C×).
2. ``--many``: 1,000 virtual clients on the Ray engine (toy, d = 50, p = 1): seconds per round,
   and the peak resident memory of the whole process tree (this process, Ray's raylet and its
   actors), sampled every 0.2 s.
3. ``--lenet``: LeNet-5 on the heterogeneous MNIST federation (20 clients × 200 images, batch 64,
   QLSD++ s = 2, l = 20): seconds per round on the ``local``, ``inprocess`` and ``ray`` engines,
   next to a bare torch loop doing the same passes (each round 20 × 2 minibatch gradients of 64
   images: QLSD++'s control variate takes each client's minibatch gradient at θ and at its
   anchor ζ; every l-th round also each client's full gradient at the new anchor), with the
   threads each engine sets (``torch-threads = auto``). Target of the issue: ray ≤ 1.3×, local ≤
   1.1× the bare loop. ``--lenet-rounds 1000`` is the measured run from which the paper-scale
   1e5-round time is projected.

    python benchmarks/bench_chains.py --chains --many --lenet [--pairs 2] [--out benchmarks/chains.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.smoke import SMOKE, few, small  # noqa: E402
from benchmarks.smoke import engine as smoke_engine  # noqa: E402
from benchmarks.smoke import run_ray as smoke_run_ray  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402

OUT = str(Path(SMOKE) / "runs") if SMOKE else "/tmp/qlsd-bench-chains"


def _round_seconds(run_dir: Path, skip: int = 5) -> list[float]:
    with open(Path(run_dir) / "metrics.csv") as f:
        return [float(r["seconds"]) for r in csv.DictReader(f)][skip:]


def _ray(o: dict):
    return smoke_run_ray(o)


def chains_per_round(rounds: int, pairs: int, counts=tuple(few((1, 4, 16), 2))) -> dict:
    base = {"variant": "qlsd-pp", "num-clients": 20, "dim": 50, "num-rounds": rounds, "burn-in": 0, "p": "1.0",
            "s": "16", "gamma": 4.9e-4, "progress": False, "engine": "ray", "output-dir": OUT}
    got: dict[int, list[float]] = {c: [] for c in counts}
    per_pair = []
    for _ in range(pairs):
        means = {}
        for c in counts:
            t = _round_seconds(_ray({**base, "num-chains": c}).run_dir)
            got[c] += t
            means[c] = statistics.fmean(t)
        per_pair.append(means)
    out = {"rounds": rounds, "pairs": pairs,
           "s_per_round_mean": {c: statistics.fmean(v) for c, v in got.items()},
           "s_per_round_median": {c: statistics.median(v) for c, v in got.items()}}
    c1 = out["s_per_round_mean"][counts[0]]
    out["ratio_to_one_chain"] = {c: v / c1 for c, v in out["s_per_round_mean"].items()}
    out["pair_ratios"] = [{c: p[c] / p[counts[0]] for c in counts} for p in per_pair]
    return out


def _tree_rss() -> int:
    import psutil

    me = psutil.Process()
    total = 0
    procs = [me, *me.children(recursive=True)]
    # Ray's raylet and workers are started detached from this process in some versions: add them
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if ("ray::" in cmd or "raylet" in cmd or "gcs_server" in cmd) and p not in procs:
            procs.append(p)
    for p in procs:
        try:
            total += p.memory_info().rss
        except Exception:  # noqa: BLE001 — a process that just ended
            pass
    return total


def many_clients(b: int, rounds: int) -> dict:
    peak = {"rss": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], _tree_rss())
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    try:
        strat = _ray({"variant": "qlsd-pp", "num-clients": b, "dim": 50, "num-rounds": rounds, "burn-in": 0,
                      "p": "1.0", "s": "16", "gamma": 4.9e-4 * 20 / b, "progress": False, "engine": "ray",
                      "output-dir": OUT})
    finally:
        stop.set()
        th.join()
    t = _round_seconds(strat.run_dir, skip=2)
    return {"clients": b, "rounds": rounds, "s_per_round_mean": statistics.fmean(t),
            "s_per_round_median": statistics.median(t), "peak_rss_gib_process_tree": peak["rss"] / 2**30,
            "command_seconds": time.perf_counter() - t0}


LENET = {"task": "mnist", "dataset": "mnist_subset", "model": "lenet5", "partition": "dominant_label",
         "num-clients": 20, "prior-var": 0.2, "variant": "qlsd-pp", "s": "2", "l": 20, "p": "1.0",
         "batch-fraction": 0.32, "gamma": 2.5e-5, "burn-in": 0, "progress": False, "seed": 0, "data-seed": 0,
         "output-dir": OUT}


def bare_torch(rounds: int) -> float:
    """Seconds per round of the same passes with nothing around them: per round, each client's
    two minibatch gradients of QLSD++'s control variate (at θ and at the anchor ζ, on the same
    64 of its 200 images), and every l-th round its full gradient at the new anchor too."""
    import numpy as np
    import torch

    from qlsd_flwr.config import resolve
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve({**LENET, "engine": "local", "num-rounds": rounds})
    task = load_task(cfg)  # sets torch's threads as the local engine does
    theta = np.asarray(task.theta0, dtype=np.float64)
    zeta = theta + 1e-3
    gen = np.random.default_rng(0)
    times = []
    for k in range(rounds):
        t = time.perf_counter()
        for pot in task.clients:
            if k % cfg.l == 0:
                pot.grad_sum(zeta, None)
            idx = gen.choice(pot.n_data, 64, replace=False)
            pot.grad_sum(theta, idx)
            pot.grad_sum(zeta, idx)
        times.append(time.perf_counter() - t)
    del torch
    return statistics.fmean(times[5:])


def lenet(rounds: int, engines=("local", "inprocess", "ray")) -> dict:
    from qlsd_flwr.run import simulate

    first = bare_torch(rounds)  # before and after the engines: a change of the machine's load shows
    out: dict = {"rounds": rounds}
    for eng in engines:
        res = simulate.run({**LENET, "engine": smoke_engine(eng), "num-rounds": rounds})
        out[f"{eng}_s_per_round"] = statistics.fmean(_round_seconds(res.run_dir))
    last = bare_torch(rounds)
    out.update({"bare_torch_s_per_round": (first + last) / 2, "bare_torch_first_last": [first, last]})
    for eng in engines:
        out[f"{eng}_ratio"] = out[f"{eng}_s_per_round"] / out["bare_torch_s_per_round"]
    from qlsd_flwr.tasks.threads import cores

    out["threads"] = {"cores": cores(), "local/inprocess": "cores - 1 (at least 1)", "ray actor": "floor(client-cpus) = 1"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chains", action="store_true")
    ap.add_argument("--many", action="store_true")
    ap.add_argument("--lenet", action="store_true")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--many-clients", type=int, default=1000)
    ap.add_argument("--many-rounds", type=int, default=8)
    ap.add_argument("--lenet-rounds", type=int, default=60)
    ap.add_argument("--lenet-engines", default="local,inprocess,ray")
    ap.add_argument("--out", default="benchmarks/chains.json")
    a = ap.parse_args()
    res: dict = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                             "python": sys.version.split()[0]},
                 "command": "python benchmarks/bench_chains.py " + " ".join(sys.argv[1:]),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if a.chains:
        res["chains_per_round"] = chains_per_round(small(a.rounds, 7), small(a.pairs, 1))
        print(json.dumps(res["chains_per_round"], indent=1), flush=True)
    if a.many:
        res["many_clients"] = many_clients(small(a.many_clients, 30), small(a.many_rounds, 3))
        print(json.dumps(res["many_clients"], indent=1), flush=True)
    if a.lenet:
        res["lenet"] = lenet(small(a.lenet_rounds, 7), tuple(a.lenet_engines.split(",")))
        print(json.dumps(res["lenet"], indent=1), flush=True)
    dest = smoke_out(a.out)
    old = json.loads(dest.read_text()) if dest.exists() else {}
    dest.write_text(json.dumps({**old, **res}, indent=1))


if __name__ == "__main__":
    main()
