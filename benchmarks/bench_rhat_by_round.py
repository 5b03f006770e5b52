"""When a run's chains mixed: its convergence figures recomputed on the draws kept up to each of several rounds, with
the wall time at which the run reached that round (issue 37's target for the main job: the worst test point's R-hat
at most 1.05 within five minutes on 2 cores).

For each run folder (a QLSD++ run with a held-out ``heldout_log_likelihood`` group in its ``samples.nc``, as the main
job writes) and each round ``N`` of ``--rounds``, the draws whose round is at most ``N`` are judged as the run judges
its own: the held-out predictive's R-hat and bulk ESS (:func:`qlsd_flwr.outputs.convergence.predictive`: the worst
test point, the log-likelihood) and θ's (:func:`~qlsd_flwr.outputs.convergence.theta_report`, with the verdict's
rule: R-hat ≤ 1.05 and bulk and tail ESS ≥ 100). The time is ``summary.json``'s ``prep_seconds`` plus
``metrics.csv``'s ``seconds`` summed to round ``N`` (so only as meaningful as the run's engine and machine).

    python benchmarks/bench_rhat_by_round.py --runs outputs/<stamp>-mainjob/qlsd-pp --rounds 600 700 800 900 1050
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.smoke import out  # noqa: E402
from qlsd_flwr.outputs import convergence as cv  # noqa: E402


def judged(run: Path, cutoffs) -> dict:
    import arviz as az

    idata = az.from_netcdf(run / "samples.nc")
    rounds = np.asarray(idata.sample_stats["round"].values)[0]
    theta = np.asarray(idata.posterior["theta"].values)  # (chain, draw, d)
    ll = np.asarray(idata.heldout_log_likelihood["y"].values)  # (chain, draw, point)
    summary = json.loads((run / "summary.json").read_text())
    with open(run / "metrics.csv") as f:
        seconds = {int(r["round"]): float(r["seconds"]) for r in csv.DictReader(f)}
    rows = []
    for n in cutoffs:
        kept = rounds <= n
        if kept.sum() < 4:
            continue
        pred = cv.predictive(ll[:, kept])
        rep = cv.verdict(cv.theta_report(np.transpose(theta[:, kept], (1, 0, 2)), dispersed=True), pred)
        rows.append({"round": int(n), "draws": int(kept.sum()),
                     "seconds": float(summary.get("prep_seconds", 0.0)) + sum(v for k, v in seconds.items() if k <= n),
                     "rhat_pred_max": pred["rhat_pred_max"], "ess_bulk_pred_min": pred["ess_bulk_pred_min"],
                     "rhat_loglik": pred["rhat_loglik"], "rhat_theta_max": rep.get("rhat_max"),
                     "ess_bulk_theta_min": rep.get("ess_bulk_min"), "verdict": rep.get("verdict")})
    return {"run": str(run), "prep_seconds": summary.get("prep_seconds"), "rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, help="run folders (outputs/<stamp>-mainjob/qlsd-pp)")
    ap.add_argument("--rounds", nargs="+", type=int, default=[600, 700, 800, 900, 1050])
    ap.add_argument("--out", default="rhat_by_round.json", help="file name under benchmarks/")
    a = ap.parse_args(argv)
    runs = []
    for r in a.runs:
        run = Path(r)
        if not (run / "samples.nc").is_file() or not (run / "summary.json").is_file():
            raise SystemExit(f"bench_rhat_by_round: {r} is not a run folder (no samples.nc and summary.json)")
        runs.append(judged(run, a.rounds))
        for row in runs[-1]["rows"]:
            print(f"{r} round {row['round']} ({row['seconds']:.0f} s): worst test point R-hat "
                  f"{row['rhat_pred_max']:.3f} (ESS {row['ess_bulk_pred_min']:.0f}), θ R-hat {row['rhat_theta_max']:.3f}, "
                  f"bulk ESS {row['ess_bulk_theta_min']:.0f}: {row['verdict']}")
    out(HERE / a.out).write_text(json.dumps({"command": "python benchmarks/bench_rhat_by_round.py "
                                             + " ".join(argv or sys.argv[1:]), "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
