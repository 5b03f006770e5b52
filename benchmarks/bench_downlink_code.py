"""What the compressed broadcast's messages cost in each code (issue 37: the main job's sampling downlink,
3.6e9 bits with QSGD's Elias code, was the largest single item of its traffic).

The main job's QLSD++ (its keys, ``downlink = qsgd`` at its ``downlink-s``, 128 since 2026-12-05, 256 before; EF21-P) runs on the local engine
with one chain for ``--rounds`` rounds; every broadcast of the second half (after the descent to stationarity)
is kept as the server coded it, and its levels are measured in bits a coordinate: QSGD's Elias code (``auto``,
the shorter of Elias and packed: the broadcast's code until 2026-12-03), the Rice code
(:mod:`qlsd_flwr.compression.rice`, the broadcast's code from then to 2026-12-05), the adaptive arithmetic code
(:mod:`qlsd_flwr.compression.arith`), the broadcast's code since (``dense``: the shorter of those two, message by
message), and the levels' order-0 entropy (what no code of one level at a time can beat). The levels are the same
whatever the code, so the chain is too.

It also measures what a code that adapts to a context both ends hold could reach, the levels' entropy given
that context: the coordinate's scale in the metric (``½ log₂ diag(M)`` rounded, the class a per-coordinate
scaling of the broadcast would use) and the coordinate's ``|level|`` in the message before (capped at 15). Where
these are no lower than the order-0 entropy, no per-coordinate context, and no scaling of the broadcast by the
metric's diagonal, buys bits on this job.

The same run's uplink messages (the clients' QSGD codes at ``s``, ``encoding = auto``: the shorter of Elias and
packed) are measured alongside: their bits a coordinate as sent, in the arithmetic code, and their levels' order-0
entropy (``uplink_*``), for what that code would save on the uplink (not built: issue 37's closing notes).

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
from qlsd_flwr.compression import arith  # noqa: E402
from qlsd_flwr.compression.qsgd import QSGD  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.core import downlink as dl  # noqa: E402
from qlsd_flwr.engines.local import run_local  # noqa: E402
from qlsd_flwr.experiments.mainjob import QLSD_MAIN  # noqa: E402
from qlsd_flwr.protocol import precondition  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--out", default="downlink_code.json", help="a JSON file under benchmarks/")
    a = ap.parse_args(argv)
    over = {"num-clients": 4, "dataset": "digits", "task": "logistic", "metric-rank": 0} if SMOKE else {}
    rounds = small(a.rounds, 20)
    cfg = resolve({**QLSD_MAIN, **over, "engine": "local", "num-chains": 1, "num-rounds": rounds, "burn-in": 0,
                   "progress": False, "plot": False})
    sent = []  # (round, code) of every coded broadcast: the union's code (each client is sent its own part of it)
    real = dl.Downlink.step

    def send(self, theta, w, seed, k):
        held["support"] = self.support  # downlink-support = data: the coordinates the codes carry (None: all)
        got = real(self, theta, w, seed, k)
        if got[1] is not None:
            sent.append((k, self.compressor.encode(got[1])))
        return got

    held = {}
    prepare = precondition.prepare
    ups = []  # (round, levels) of every uplink message
    quantise = QSGD.quantise

    def quantised(self, v, u):
        q = quantise(self, v, u)
        if self.encoding == "auto":
            ups.append(q)
        return q

    def prepared(*args, **kw):  # the run's metric, for its diagonal
        got = prepare(*args, **kw)
        held["diag"] = got.metric.diagonal(args[1].dim)
        return got

    dl.Downlink.step, precondition.prepare, QSGD.quantise = send, prepared, quantised
    t0 = time.perf_counter()
    try:
        run_local(cfg, write=False, progress=False)
    finally:
        dl.Downlink.step, precondition.prepare, QSGD.quantise = real, prepare, quantise
    s = int(cfg.get("downlink-s"))
    late = [code for k, code in sent if k > rounds // 2]
    broadcast, elias = dl.broadcast_code(s), QSGD(s)
    rice, arith = QSGD(s, encoding="rice"), QSGD(s, encoding="arith")
    qs = [broadcast.decode(code, _dim(code)) for code in late]
    d = qs[0].d
    levels = np.stack([q.levels for q in qs])
    p = _frequencies(levels)
    diag = held["diag"] if held.get("support") is None else held["diag"][held["support"]]
    scale = np.round(0.5 * np.log2(diag))  # the power of two of each coded coordinate's scale in M
    row = {"rounds": rounds, "messages": len(qs), "d": d, "downlink_s": s,
           "elias_auto_bits_per_coordinate": float(sum(elias.code_length_bits(q) for q in qs) / levels.size),
           "rice_bits_per_coordinate": float(sum(rice.code_length_bits(q) for q in qs) / levels.size),
           "arith_bits_per_coordinate": float(sum(arith.code_length_bits(q) for q in qs) / levels.size),
           "broadcast_bits_per_coordinate": float(sum(broadcast.code_length_bits(q) for q in qs) / levels.size),
           "entropy_order0_bits": float(-(p * np.log2(p)).sum()),
           "entropy_given_metric_scale_bits": _conditional(levels, np.broadcast_to(scale, levels.shape)),
           "metric_scale_classes": int(np.unique(scale).size),
           "metric_diagonal_spread": float(held["diag"].max() / held["diag"].min()),
           "entropy_given_previous_level_bits": _conditional(levels[1:], np.minimum(np.abs(levels[:-1]), 15)),
           "zero_share": float((levels == 0).mean()), "mean_abs_level": float(np.abs(levels).mean()),
           "max_abs_level": int(np.abs(levels).max()), **_uplink(ups[len(ups) // 2:]),
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(row), flush=True)
    out(HERE / a.out).write_text(json.dumps(
        {"command": "python benchmarks/bench_downlink_code.py " + " ".join(sys.argv[1:]), **row}, indent=1))


def _uplink(qs) -> dict:
    """The uplink's messages (the second half of the run's): bits a coordinate as sent, in the arithmetic code, and
    their levels' order-0 entropy."""
    if not qs:
        return {}
    code = QSGD(qs[0].s)
    n = sum(q.d for q in qs)
    levels = np.concatenate([q.levels for q in qs])
    p = _frequencies(levels)
    return {"uplink_messages": len(qs), "uplink_s": qs[0].s,
            "uplink_auto_bits_per_coordinate": float(sum(code.code_length_bits(q) for q in qs) / n),
            "uplink_arith_bits_per_coordinate": float(sum(int(arith.code_bits(q.levels, q.blocks, q.s))
                                                          for q in qs) / n),
            "uplink_entropy_order0_bits": float(-(p * np.log2(p)).sum())}


def _frequencies(x: np.ndarray) -> np.ndarray:
    return np.unique(x, return_counts=True)[1] / x.size


def _conditional(levels: np.ndarray, context: np.ndarray) -> float:
    """``H(level | context)`` in bits, from the empirical joint frequencies."""
    h = 0.0
    for c in np.unique(context):
        p = _frequencies(levels[context == c])
        h -= (context == c).sum() * float((p * np.log2(p)).sum())
    return h / levels.size


def _dim(code: bytes) -> int:
    """The message's ``d`` from its header."""
    return int.from_bytes(code[1:5], "little")


if __name__ == "__main__":
    main()
