"""Steady memory on the Ray engine (issue 6): RSS growth per 1,000 rounds, ours against a no-op.

Runs QLSD++ (10 clients, d = 50, p = 1, samples streamed to disk) for ``--rounds`` rounds on
Flower's Ray simulation engine, then a no-op Flower app (empty message, one-field reply) for the
same number of rounds on the same engine, and samples the resident set size every
``--every`` rounds: the driver process (which runs the ServerApp and our strategy) plus every
Ray worker process (``ray::...``: the ClientApp actors, which hold the clients'
``context.state``). The growth per 1,000 rounds is the slope of a least-squares line through
the samples after the first ``--warmup`` rounds. RSS is read from ``/proc`` (Linux).

    python benchmarks/bench_memory.py --rounds 20000 --every 500     # the issue's setting
    python benchmarks/bench_memory.py --rounds 20000 --every 500 --parallel   # both arms at once
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

from benchmarks.smoke import SMOKE, run_apps, small  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402
from benchmarks.smoke import run_ray as smoke_run_ray  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _descendants(root: int) -> set[int]:
    """Every process below ``root`` in the process tree (from ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def ray_worker_pids() -> list[int]:
    """The Ray worker processes (``ray::...``) of *this* process's Ray instance: its
    descendants only, so that two arms measured side by side do not count each other's."""
    out = []
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if cmd.startswith(b"ray::"):
            out.append(pid)
    return out


def total_rss() -> dict:
    workers = ray_worker_pids()
    drv = _rss(os.getpid())
    wk = sum(_rss(p) for p in workers)
    return {"driver": drv, "workers": wk, "total": drv + wk, "n_workers": len(workers)}


def slope_per_1000(samples: list[tuple[int, dict]], key: str, warmup: int) -> tuple[float, float]:
    """Least-squares growth of ``key`` per 1,000 rounds after ``warmup``, and its standard error."""
    pts = [(r, s[key]) for r, s in samples if r >= warmup]
    if len(pts) < 3:
        return float("nan"), float("nan")
    x, y = np.array(pts, dtype=float).T
    slope, icept = np.polyfit(x, y, 1)
    resid = y - (slope * x + icept)
    se = np.sqrt(resid @ resid / (len(x) - 2) / np.sum((x - x.mean()) ** 2))
    return float(slope * 1000.0), float(se * 1000.0)


def growth(samples: dict, warmup: int) -> tuple[dict, dict]:
    """``(growth, standard error)`` in bytes per 1,000 rounds, per arm and per process kind."""
    fits = {name: {k: slope_per_1000(s, k, warmup) for k in ("driver", "workers", "total")}
            for name, s in samples.items()}
    return ({n: {k: v[0] for k, v in f.items()} for n, f in fits.items()},
            {n: {k: v[1] for k, v in f.items()} for n, f in fits.items()})


def run_ours(rounds: int, every: int, out_dir: str) -> list:
    samples: list = []

    def on_round(strategy):
        k = int(strategy.state.k)
        if k % every == 0:
            samples.append((k, total_rss()))

    o = {"variant": "qlsd-pp", "num-clients": 10, "dim": 50, "num-rounds": rounds, "burn-in": 0,
         "p": "1.0", "s": "16", "progress": False, "engine": "ray", "output-dir": out_dir,
         "run-name": f"memory-{int(time.time())}"}
    smoke_run_ray(o, strategy_kwargs={"on_round": on_round})
    return samples


def run_noop(rounds: int, every: int) -> list:
    from noop_app import noop_apps

    from qlsd_flwr.config import resolve
    from qlsd_flwr.flower.server_app import quiet_flower
    from qlsd_flwr.run.simulate import ray_backend_config

    samples: list = []

    def on_round(r, _seconds):
        if r % every == 0:
            samples.append((r, total_rss()))

    server, client = noop_apps(rounds, 10, on_round)
    quiet_flower(False)
    cfg = resolve({"num-clients": 10, "engine": "ray"})
    run_apps(server, client, 10, ray_backend_config(cfg))
    return samples


def run_arm(arm: str, rounds: int, every: int) -> tuple[list, float]:
    t0 = time.perf_counter()
    samples = run_ours(rounds, every, str(Path(SMOKE) / "runs") if SMOKE else "/tmp/qlsd-bench-memory") if arm == "qlsd" else run_noop(rounds, every)
    return samples, time.perf_counter() - t0


def arms_side_by_side(args) -> tuple[dict, dict, str]:
    """Both arms at once, each in its own process with its own Ray instance (same engine, same
    clients, same machine, same wall-clock period): the 2 cores are shared by the two, so a
    round is slower than alone, but neither arm's memory is measured under other conditions
    than the other's."""
    import subprocess
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    procs = {arm: subprocess.Popen([sys.executable, __file__, "--arm", arm, "--rounds", str(args.rounds),
                                    "--every", str(args.every), "--out", str(tmp / f"{arm}.json")])
             for arm in ("qlsd", "noop")}
    for arm, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"the {arm} arm failed (exit {proc.returncode})")
    got = {arm: json.loads((tmp / f"{arm}.json").read_text()) for arm in procs}
    return ({arm: got[arm]["samples"] for arm in got}, {arm: got[arm]["seconds"] for arm in got},
            "side by side (two processes, two Ray instances, at the same time)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=None, help="rounds ignored by the fit (default: 20 %%)")
    ap.add_argument("--parallel", action="store_true",
                    help="run the two arms at the same time, in two processes (half the wall time)")
    ap.add_argument("--arm", choices=("qlsd", "noop"), help=argparse.SUPPRESS)  # one arm (--parallel)
    ap.add_argument("--out", default="benchmarks/memory.json")
    args = ap.parse_args()
    args.rounds, args.every = small(args.rounds, 12), small(args.every, 3)
    if args.arm:  # one arm of --parallel: raw samples only
        samples, seconds = run_arm(args.arm, args.rounds, args.every)
        Path(args.out).write_text(json.dumps({"samples": samples, "seconds": seconds}))
        return
    warm = args.warmup if args.warmup is not None else args.rounds // 5
    if args.parallel:
        samples, seconds, mode = arms_side_by_side(args)
    else:
        samples, seconds = {}, {}
        for arm in ("qlsd", "noop"):
            samples[arm], seconds[arm] = run_arm(arm, args.rounds, args.every)
        mode = "one after the other"
    fit, fit_se = growth(samples, warm)
    res = {"machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
           "command": " ".join(["python"] + sys.argv), "rounds": args.rounds, "every": args.every,
           "warmup": warm, "arms": mode, "seconds": seconds,
           "growth_bytes_per_1000_rounds": fit,
           "growth_se_bytes_per_1000_rounds": fit_se,
           "rss_first_last": {name: [s[0], s[-1]] for name, s in samples.items() if s},
           "samples": samples}
    smoke_out(args.out).write_text(json.dumps(res, indent=1))
    g, se = res["growth_bytes_per_1000_rounds"], res["growth_se_bytes_per_1000_rounds"]
    for name in ("qlsd", "noop"):
        parts = ", ".join(f"{label} {g[name][k] / 1e3:7.1f} ± {se[name][k] / 1e3:4.1f} kB"
                          for k, label in (("driver", "driver"), ("workers", "Ray workers"), ("total", "total")))
        print(f"{name:5s}: RSS growth per 1,000 rounds: {parts} ({res['seconds'][name]:.0f} s)")


if __name__ == "__main__":
    main()
