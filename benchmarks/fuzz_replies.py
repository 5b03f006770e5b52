"""A long fuzzing session of the server's reply path (issue 6, "hostile payloads").

The property of ``tests/test_reliability.py::test_hostile_replies_are_rejected_counted_and_harmless``
over many more inputs: for each generated reply (random bytes, truncated or oversized valid
payloads, corrupted bytes, NaN/Inf/negative norms crafted into a valid payload, a wrong ``d`` or
tag in the header, levels above ``s``, wrong types, another client id, missing keys...),
``QLSDServer.accept`` must not raise, and a rejected reply must be counted once and leave θ, η,
η_i and the memory counters exactly as if its client had been inactive that round. Failures
are collected, not raised, so one session reports all of them.

    .venv/bin/python benchmarks/fuzz_replies.py --n 20000 [--seed 1] [--variants qlsd-pp,lsd-pp]

Prints, per variant, how many inputs were tried, how many the server accepted (valid codes a
corruption can still produce) and rejected, and every failure (at most 20 shown per variant).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import test_reliability as T  # noqa: E402
from benchmarks.smoke import few, small  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402


def session(variant: str, n: int, rng_seed: int) -> dict:
    fz, inactive = T.fuzzer(variant)
    out = {"tried": 0, "accepted": 0, "rejected": 0, "failures": []}

    @seed(rng_seed)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(T._hostile(fz.valid[1], fz.task.dim))
    def prop(fields):
        out["tried"] += 1
        problem = T.check_hostile_reply(fz, 1, fields, inactive)
        if problem is not None:
            out["failures"].append((problem, repr(fields)[:300]))
            return
        try:
            _, facts = fz.play(1, fields)
            out["accepted" if facts["accepted"] else "rejected"] += 1
        except T.DivergenceError:
            out["accepted"] += 1

    prop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000, help="inputs per variant")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", default=",".join(T.FUZZ_VARIANTS))
    args = ap.parse_args(argv)
    total_fail = 0
    for v in few(args.variants.split(","), 2):
        t0 = time.perf_counter()
        r = session(v, small(args.n, 30), args.seed)
        dt = time.perf_counter() - t0
        print(f"{v:12s} tried {r['tried']:7d}  accepted {r['accepted']:6d}  rejected {r['rejected']:7d}  "
              f"failures {len(r['failures']):4d}  ({dt:.1f} s)")
        for problem, fields in r["failures"][:20]:
            print(f"    FAIL {problem}: {fields}")
        total_fail += len(r["failures"])
    print(f"total failures: {total_fail}")
    return 1 if total_fail else 0


if __name__ == "__main__":
    sys.exit(main())
