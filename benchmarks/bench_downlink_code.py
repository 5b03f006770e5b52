"""What the compressed broadcast's messages cost in each code (issue 37: the main job's sampling downlink,
3.6e9 bits with QSGD's Elias code, was the largest single item of its traffic).

The main job's QLSD++ (its keys, ``downlink = qsgd`` at ``downlink-s = 256``, EF21-P) runs on the local engine
with one chain for ``--rounds`` rounds; every broadcast of the second half (after the descent to stationarity)
is kept as the server coded it, and its levels are measured in bits a coordinate: QSGD's Elias code (``auto``,
the shorter of Elias and packed: the broadcast's code until 2026-12-03), the Rice code
(:mod:`qlsd_flwr.compression.rice`, the broadcast's code since), and the levels' order-0 entropy (what no code
of one level at a time can beat). The levels are the same whatever the code, so the chain is too.

    python benchmarks/bench_downlink_code.py --rounds 300
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.smoke import SMOKE, out, small  # noqa: E402
from qlsd_flwr.compression.qsgd import QSGD  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.core import downlink as dl  # noqa: E402
from qlsd_flwr.engines.local import run_local  # noqa: E402
from qlsd_flwr.experiments.mainjob import QLSD_MAIN  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--out", default="downlink_code.json", help="a JSON file under benchmarks/")
    a = ap.parse_args(argv)
    over = {"num-clients": 4, "dataset": "digits", "task": "logistic", "metric-rank": 0} if SMOKE else {}
    rounds = small(a.rounds, 20)
    cfg = resolve({**QLSD_MAIN, **over, "engine": "local", "num-chains": 1, "num-rounds": rounds, "burn-in": 0,
                   "progress": False, "plot": False})
    sent = []  # (round, code) of every coded broadcast
    real = dl.Downlink.send

    def send(self, theta, w, seed, k):
        got = real(self, theta, w, seed, k)
        if got[1] is not None:
            sent.append((k, got[1]))
        return got

    dl.Downlink.send = send
    t0 = time.perf_counter()
    try:
        run_local(cfg, write=False, progress=False)
    finally:
        dl.Downlink.send = real
    s = int(cfg.get("downlink-s"))
    late = [code for k, code in sent if k > rounds // 2]
    rice, elias = dl.broadcast_code(s), QSGD(s)
    qs = [rice.decode(code, _dim(code)) for code in late]
    d = qs[0].d
    levels = np.stack([q.levels for q in qs])
    _, counts = np.unique(levels, return_counts=True)
    p = counts / levels.size
    row = {"rounds": rounds, "messages": len(qs), "d": d, "downlink_s": s,
           "elias_auto_bits_per_coordinate": float(sum(elias.code_length_bits(q) for q in qs) / levels.size),
           "rice_bits_per_coordinate": float(sum(rice.code_length_bits(q) for q in qs) / levels.size),
           "entropy_order0_bits": float(-(p * np.log2(p)).sum()),
           "zero_share": float((levels == 0).mean()), "mean_abs_level": float(np.abs(levels).mean()),
           "max_abs_level": int(np.abs(levels).max()), "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(row), flush=True)
    out(HERE / a.out).write_text(json.dumps(
        {"command": "python benchmarks/bench_downlink_code.py " + " ".join(sys.argv[1:]), **row}, indent=1))


def _dim(code: bytes) -> int:
    """The message's ``d`` from its header."""
    return int.from_bytes(code[1:5], "little")


if __name__ == "__main__":
    main()
