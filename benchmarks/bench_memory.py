"""Steady memory on the Ray engine (issue 6): RSS growth per 1,000 rounds, ours against a no-op.

Runs QLSD++ (10 clients, d = 50, p = 1, samples streamed to disk) for ``--rounds`` rounds on
Flower's Ray simulation engine, then a no-op Flower app (empty message, one-field reply) for the
same number of rounds on the same engine, and samples the resident set size every
``--every`` rounds: the driver process (which runs the ServerApp and our strategy) plus every
Ray worker process (``ray::...``: the ClientApp actors, which hold the clients'
``context.state``). The growth per 1,000 rounds is the slope of a least-squares line through
the samples after the first ``--warmup`` rounds. RSS is read from ``/proc`` (Linux).

    python benchmarks/bench_memory.py --rounds 20000 --every 500     # the issue's setting
    python benchmarks/bench_memory.py --rounds 1500 --every 100      # what fits in a short session
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def ray_worker_pids() -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(b"ray::"):
            out.append(int(name))
    return out


def total_rss() -> dict:
    workers = ray_worker_pids()
    drv = _rss(os.getpid())
    wk = sum(_rss(p) for p in workers)
    return {"driver": drv, "workers": wk, "total": drv + wk, "n_workers": len(workers)}


def slope_per_1000(samples: list[tuple[int, dict]], key: str, warmup: int) -> float:
    pts = [(r, s[key]) for r, s in samples if r >= warmup]
    if len(pts) < 3:
        return float("nan")
    x, y = np.array(pts, dtype=float).T
    return float(np.polyfit(x, y, 1)[0] * 1000.0)


def run_ours(rounds: int, every: int, out_dir: str) -> list:
    from qlsd_flwr.config import resolve
    from qlsd_flwr.simulate import run_ray

    samples: list = []

    def on_round(strategy):
        k = int(strategy.state.k)
        if k % every == 0:
            samples.append((k, total_rss()))

    o = {"variant": "qlsd-pp", "num-clients": 10, "dim": 50, "num-rounds": rounds, "burn-in": 0,
         "p": "1.0", "s": "16", "progress": False, "engine": "ray", "output-dir": out_dir,
         "run-name": f"memory-{int(time.time())}"}
    run_ray(resolve(o), o, strategy_kwargs={"on_round": on_round})
    return samples


def run_noop(rounds: int, every: int) -> list:
    from flwr.simulation import run_simulation

    from noop_app import noop_apps
    from qlsd_flwr.config import resolve
    from qlsd_flwr.server_app import quiet_flower
    from qlsd_flwr.simulate import ray_backend_config

    samples: list = []

    def on_round(r, _seconds):
        if r % every == 0:
            samples.append((r, total_rss()))

    server, client = noop_apps(rounds, 10, on_round)
    quiet_flower(False)
    cfg = resolve({"num-clients": 10, "engine": "ray"})
    run_simulation(server_app=server, client_app=client, num_supernodes=10,
                   backend_config=ray_backend_config(cfg))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=None, help="rounds ignored by the fit (default: 20 %%)")
    ap.add_argument("--out", default="benchmarks/memory.json")
    args = ap.parse_args()
    warm = args.warmup if args.warmup is not None else args.rounds // 5
    t0 = time.perf_counter()
    ours = run_ours(args.rounds, args.every, "/tmp/qlsd-bench-memory")
    t1 = time.perf_counter()
    noop = run_noop(args.rounds, args.every)
    t2 = time.perf_counter()
    res = {"machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
           "command": " ".join(["python"] + sys.argv), "rounds": args.rounds, "every": args.every,
           "warmup": warm, "seconds": {"qlsd": t1 - t0, "noop": t2 - t1},
           "growth_bytes_per_1000_rounds": {
               name: {k: slope_per_1000(s, k, warm) for k in ("driver", "workers", "total")}
               for name, s in (("qlsd", ours), ("noop", noop))},
           "samples": {"qlsd": ours, "noop": noop}}
    Path(args.out).write_text(json.dumps(res, indent=1))
    g = res["growth_bytes_per_1000_rounds"]
    for name in ("qlsd", "noop"):
        print(f"{name:5s}: RSS growth per 1,000 rounds: driver {g[name]['driver'] / 1e3:8.1f} kB, "
              f"Ray workers {g[name]['workers'] / 1e3:8.1f} kB, total {g[name]['total'] / 1e3:8.1f} kB "
              f"({res['seconds'][name]:.0f} s)")


if __name__ == "__main__":
    main()
