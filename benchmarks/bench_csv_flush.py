"""What flushing ``metrics.csv`` after every round costs: 50,000 rows of ``csv.DictWriter`` with and
without ``flush()`` after each, twice each, in one process (issue 22).

    python benchmarks/bench_csv_flush.py
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.smoke import small  # noqa: E402

ROW = {"round": 1, "n_active": 20, "n_replied": 20, "n_rejected": 0, "skipped": 0, "bits_bound": 1.5e6,
       "bits_exact": 390000, "bytes_payload": 50000, "bytes_message": 60000, "seconds": 0.0123}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=50000)
    a = ap.parse_args()
    a.rows = small(a.rows, 500)
    d = tempfile.mkdtemp()
    for flush in (False, True, False, True):
        with open(os.path.join(d, f"m{flush}.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(ROW))
            w.writeheader()
            t = time.perf_counter()
            for _ in range(a.rows):
                w.writerow(ROW)
                if flush:
                    f.flush()
            dt = time.perf_counter() - t
        print("flush after each row" if flush else "no flush", f"{1e6 * dt / a.rows:.2f} µs a row")


if __name__ == "__main__":
    main()
