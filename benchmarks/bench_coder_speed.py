"""How long the adaptive arithmetic code (:mod:`qlsd_flwr.compression.arith`) takes to write and to read one
message of the main job's size (``d = 7,850``), and a fingerprint of its bytes, so that a faster coder can be shown
to write the very same code (issue 37's five-minute job: on the main job the coder wrote 84 and read 84 such codes a
round).

Three messages, Laplace levels (seed 0) clipped to ``s``: the broadcast's kind (``s = 128``, scale 1.6), the uplink's
(``s = 16``, scale 0.35) and one with escapes (``s = 512``, scale 40). Each is written and read ``--repeats`` times
(after a warm-up that compiles the coder); the mean milliseconds a call and the SHA-1 of the code are recorded.

    python benchmarks/bench_coder_speed.py --out coder_speed.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.smoke import out, small  # noqa: E402
from qlsd_flwr.compression import arith  # noqa: E402

D = 7850
CASES = {"broadcast_s128": (128, 1.6), "uplink_s16": (16, 0.35), "escapes_s512": (512, 40.0)}


def measure(repeats: int) -> dict:
    rng = np.random.default_rng(0)
    rows = {}
    for name, (s, scale) in CASES.items():
        levels = np.clip(np.round(rng.laplace(0.0, scale, D)), -s, s).astype(np.int64)
        norm = np.array([123456], dtype=np.int64)
        code, bits = arith.write(levels, norm, [D], s)
        for _ in range(3):
            arith.write(levels, norm, [D], s)
            arith.decode(code, D, [D], s)
        t = time.perf_counter()
        for _ in range(repeats):
            arith.write(levels, norm, [D], s)
        write_ms = (time.perf_counter() - t) / repeats * 1e3
        t = time.perf_counter()
        for _ in range(repeats):
            _, back, _ = arith.decode(code, D, [D], s)
        read_ms = (time.perf_counter() - t) / repeats * 1e3
        assert np.array_equal(back, levels)
        rows[name] = {"s": s, "bits_per_coordinate": bits / D, "write_ms": write_ms, "read_ms": read_ms,
                      "sha1": hashlib.sha1(code).hexdigest()}
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="coder_speed.json", help="file name under benchmarks/")
    a = ap.parse_args(argv)
    rows = measure(small(a.repeats, 2))
    for name, r in rows.items():
        print(f"{name}: {r['bits_per_coordinate']:.3f} bits a coordinate, write {r['write_ms']:.3f} ms, "
              f"read {r['read_ms']:.3f} ms, sha1 {r['sha1'][:12]}")
    path = out(HERE / a.out)
    path.write_text(json.dumps({"command": "python benchmarks/bench_coder_speed.py " + " ".join(argv or sys.argv[1:]),
                                "d": D, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
