"""Core benchmark (issue: Core). Ratios measured within one run; results go to RESULTS.md.

1. Overhead of our strategy: seconds per round of QLSD++ (p = 1, d = 50) on Flower's Ray
   engine with 10, 20 and 100 clients, next to a no-op strategy on the same engine (every node
   gets an empty message and answers an empty reply) and to a "shape-only" app that moves
   QLSD++'s messages and client state through Flower without computing anything (the floor
   Flower sets for carrying this protocol; ``noop_app.shape_apps``). The three run in turn in
   one process; the per-round time excludes Ray's start-up and the handshake.
2. Bytes on the wire: per client message, for d = 50 and d = 1e5 and s = 2, 2^4, 2^8, 2^16,
   the payload bytes our encoder produces, the exact code length, the analytic QSGD bound and
   float32 (32 d bits); plus the bytes of the whole Flower reply message.

    python benchmarks/bench_core.py [--rounds 30] [--pairs 2] [--clients 10,20,100] [--out benchmarks/core.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from noop_app import noop_apps, shape_apps  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.smoke import SMOKE, few, run_apps, small  # noqa: E402
from benchmarks.smoke import run_ray as smoke_run_ray  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402


def ray_round_times(b: int, rounds: int, pairs: int = 1) -> dict:
    """``pairs`` × (QLSD++, no-op, shape-only), in turn, so that a change in the machine's load
    hits all three; the rounds of all runs of one kind are pooled (after each run's warm-up).

    A round is a whole number of Flower's 0.1 s polls plus a little, so the median snaps to a
    multiple of 0.1 s and whether two apps' medians land on the same multiple is close to a coin
    toss when their rounds are near a boundary. The mean averages over the poll phase and grows
    with the real work; its ratio is reported with the spread of the per-pair ratios (each pair
    of runs is one independent replicate; rounds within a run are not independent)."""
    skip = min(5, rounds // 3)  # the first rounds warm up Ray's actors
    got: dict[str, list] = {"qlsd": [], "noop": [], "shape": []}
    per_pair: list[dict] = []
    for _ in range(pairs):
        run = {k: v[skip:] for k, v in _ray_runs(b, rounds).items()}
        for kind, times in run.items():
            got[kind] += times
        per_pair.append({k: statistics.fmean(v) for k, v in run.items()})
    med = {k: statistics.median(v) for k, v in got.items()}
    mean = {k: statistics.fmean(v) for k, v in got.items()}
    pair_ratio = [p["qlsd"] / p["noop"] for p in per_pair]
    return {"clients": b, "rounds": rounds, "pairs": pairs, "qlsd_s_per_round": med["qlsd"],
            "noop_s_per_round": med["noop"], "shape_s_per_round": med["shape"],
            "ratio": med["qlsd"] / med["noop"], "shape_ratio": med["shape"] / med["noop"],
            "qlsd_over_shape": med["qlsd"] / med["shape"],
            **{f"{k}_mean": v for k, v in mean.items()},
            "mean_ratio": mean["qlsd"] / mean["noop"], "mean_shape_ratio": mean["shape"] / mean["noop"],
            "pair_mean_ratios": pair_ratio,
            "pair_ratio_se": statistics.stdev(pair_ratio) / len(pair_ratio) ** 0.5 if pairs > 1 else None}


def _ray_runs(b: int, rounds: int) -> dict[str, list]:
    import csv

    from qlsd_flwr.config import resolve
    from qlsd_flwr.flower.server_app import quiet_flower
    from qlsd_flwr.run.simulate import ray_backend_config

    # γ scaled with b: the target's precision is N = Σ N_i ∝ b, and ULA diverges once γN > 2
    # (the paper's γ = 4.9e-4 gives γN ≈ 1 at b = 20; unscaled, the 100-client chain diverges)
    o = {"variant": "qlsd-pp", "num-clients": b, "dim": 50, "num-rounds": rounds, "burn-in": 0,
         "p": "1.0", "s": "16", "gamma": 4.9e-4 * 20 / b, "progress": False, "engine": "ray",
         "output-dir": os.path.join(SMOKE, "runs") if SMOKE else "/tmp/qlsd-bench"}
    cfg = resolve(o)
    strat = smoke_run_ray(o)
    with open(strat.run_dir / "metrics.csv") as f:
        out = {"qlsd": [float(r["seconds"]) for r in csv.DictReader(f)]}
    for kind, apps in (("noop", noop_apps), ("shape", shape_apps)):
        times: list = []
        server, client = apps(rounds, b, lambda r, sec: times.append(sec))
        quiet_flower(False)
        run_apps(server, client, b, ray_backend_config(cfg))
        out[kind] = times
    return out


def wire_sizes() -> list[dict]:
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from qlsd_flwr.compression.qsgd import QSGD
    from qlsd_flwr.core import rng
    from qlsd_flwr.flower.records import RECORD
    from qlsd_flwr.flower.sizing import message_nbytes

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    rows = []
    for d in (50, small(100_000, 2_000)):
        v = rng.normal(0, rng.Stream.DATA, 9, 9, d)
        for s in few((2, 2**4, 2**8, 2**16), 2):
            comp = QSGD(s=s, encoding="auto")
            reps = 5 if d > 1000 else 50
            payload, exact, t_enc, t_dec = [], [], 0.0, 0.0
            warm = comp.quantise(v, rng.uniform(0, rng.Stream.DITHER, reps, 0, d))
            comp.decode(comp.encode(warm), d)  # first calls load the compiled kernels: not timed
            for k in range(reps):
                q = comp.quantise(v, rng.uniform(0, rng.Stream.DITHER, k, 0, d))
                t0 = time.perf_counter()
                p = comp.encode(q)
                t_enc += time.perf_counter() - t0
                t0 = time.perf_counter()
                comp.decode(p, d)
                t_dec += time.perf_counter() - t0
                payload.append(len(p))
                exact.append(comp.code_length_bits(q))
            dummy = Message(RecordDict(), 1, MessageType.TRAIN)
            dummy.metadata.__dict__["_message_id"] = "x"
            reply = Message(RecordDict({RECORD: ConfigRecord({"client": 0, "status": "ok", "payload": p,
                                                              "anchor_version": 0})}), reply_to=dummy)
            rows.append({"d": d, "s": s, "payload_bytes": float(np.mean(payload)),
                         "exact_bits": float(np.mean(exact)), "bound_bits": comp.bound_bits(d),
                         "float32_bits": 32 * d, "flower_message_bytes": message_nbytes(reply),
                         "encode_ms": 1e3 * t_enc / reps, "decode_ms": 1e3 * t_dec / reps})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--clients", default="10,20,100")
    ap.add_argument("--out", default="benchmarks/core.json")
    ap.add_argument("--pairs", type=int, default=2, help="QLSD++/no-op/shape-only runs per size, in turn")
    ap.add_argument("--skip-ray", action="store_true")
    args = ap.parse_args()
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
              "command": " ".join([sys.executable.split("/")[-1]] + sys.argv), "wire": wire_sizes()}
    print("bytes per client message")
    print(f"{'d':>7} {'s':>6} {'payload B':>10} {'exact bits':>11} {'bound bits':>11} {'float32 bits':>12} "
          f"{'exact/bound':>11} {'f32/exact':>9} {'Flower msg B':>12} {'enc ms':>7} {'dec ms':>7}")
    for r in result["wire"]:
        print(f"{r['d']:>7} {r['s']:>6} {r['payload_bytes']:>10.1f} {r['exact_bits']:>11.0f} {r['bound_bits']:>11.0f} "
              f"{r['float32_bits']:>12} {r['exact_bits'] / r['bound_bits']:>11.3f} {r['float32_bits'] / r['exact_bits']:>9.1f} "
              f"{r['flower_message_bytes']:>12} {r['encode_ms']:>7.2f} {r['decode_ms']:>7.2f}")
    if not args.skip_ray:
        result["ray"] = []
        for b in few([int(x) for x in args.clients.split(",")]):
            row = ray_round_times(b, small(args.rounds, 6), small(args.pairs, 1))
            result["ray"].append(row)
            print(f"Ray, {b} clients, median s/round: QLSD++ {row['qlsd_s_per_round']:.3f}, no-op "
                  f"{row['noop_s_per_round']:.3f}, shape-only {row['shape_s_per_round']:.3f} "
                  f"(QLSD++/no-op {row['ratio']:.2f}); mean: QLSD++ {row['qlsd_mean']:.3f}, no-op "
                  f"{row['noop_mean']:.3f}, shape-only {row['shape_mean']:.3f}; QLSD++/no-op "
                  f"{row['mean_ratio']:.2f} (pairs: {', '.join(f'{r:.2f}' for r in row['pair_mean_ratios'])}), "
                  f"shape-only/no-op {row['mean_shape_ratio']:.2f}", flush=True)
    with open(smoke_out(args.out), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
