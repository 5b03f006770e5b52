"""The convergence report's cost: ArviZ's R-hat and bulk/tail ESS one coordinate at a time
(``az.rhat``, ``az.ess``) against the same estimators for all coordinates at once
(:mod:`qlsd_flwr.outputs.diagnostics`, what every run's report now uses), on the main job's shape:
4 chains × 100 kept draws × 7,850 coordinates (Gaussian draws; the cost does not depend on them).
Also the largest relative difference between the two (float rounding).

    python benchmarks/bench_diagnostics.py [--d 7850] [--draws 100] [--chains 4]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.smoke import small  # noqa: E402


def main() -> None:
    import arviz as az

    from qlsd_flwr.outputs.diagnostics import rhat_ess

    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=7850)
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--chains", type=int, default=4)
    a = ap.parse_args()
    a.d = small(a.d, 50)
    x = np.random.default_rng(0).normal(size=(a.chains, a.draws, a.d))
    t = time.perf_counter()
    mine = rhat_ess(x)
    t_mine = time.perf_counter() - t
    logging.getLogger("arviz").setLevel(logging.ERROR)
    ds = az.convert_to_dataset({"v": x})
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = (az.rhat(ds)["v"].values, az.ess(ds, method="bulk")["v"].values, az.ess(ds, method="tail")["v"].values)
    t_az = time.perf_counter() - t
    diff = max(float(np.max(np.abs(m - np.asarray(r)) / np.abs(np.asarray(r)))) for m, r in zip(mine, ref))
    print(f"{a.chains} chains × {a.draws} draws × {a.d} coordinates: ArviZ {t_az:.2f} s, all at once "
          f"{t_mine:.2f} s ({t_az / t_mine:.1f}×); largest relative difference {diff:.1e}")


if __name__ == "__main__":
    main()
