"""How many rounds the quickstart's own network needs (issue 39): a user's app, as
``examples/quickstart-torch/compare.py`` runs it (QLSD++, 4 chains, diagonal metric,
``gamma = auto``, dispersed starts, s = 16, half the rounds burn-in), with the held-out points
given to the strategy (``heldout``) so that the verdict reads the posterior predictive.

For each number of rounds: the verdict, the held-out predictive's worst R-hat (over test points and
the log-likelihood), its smallest bulk ESS, θ's R-hat (for information: a network's weights have
symmetries), the excluded clients, the held-out accuracy, nNLL and ECE, and the wall time.

    python benchmarks/bench_user_app.py [--rounds 1500,6000] [--draws 150]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "quickstart-torch"))

from benchmarks.smoke import out as smoke_out  # noqa: E402
from benchmarks.smoke import small  # noqa: E402

B = 4


def one(rounds: int, draws: int, folder: str, gamma_c="auto") -> dict:
    from flwr.app import ArrayRecord
    from qlsd_quickstart.task import PRIOR_VAR, held_out_data, make_model, potential

    from qlsd_flwr.flower import InProcessGrid, QLSDStrategy, make_client_app

    pots = [potential(i, B) for i in range(B)]
    X, y = held_out_data()
    burn = rounds // 2
    st = QLSDStrategy(num_clients=B, dim=pots[0].dim, variant="qlsd-pp", gamma="auto", metric="diagonal",
                      num_rounds=rounds, burn_in=burn, thin=max(1, (rounds - burn) // draws), num_chains=4,
                      init="dispersed", s=16, prior_var=PRIOR_VAR, seed=0, output_dir=folder,
                      run_name=f"rounds-{rounds}", progress=False, loo="off", heldout=(potential(0, B), X, y),
                      gamma_c=gamma_c)
    t = time.perf_counter()
    st.start(InProcessGrid(make_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])]), B),
             initial_arrays=ArrayRecord(make_model().state_dict()))
    wall = time.perf_counter() - t
    summary = json.loads((Path(st.run_dir) / "summary.json").read_text())
    ev = json.loads((Path(st.run_dir) / "evaluation.json").read_text())
    cv, pr = summary["convergence"], summary["convergence"].get("predictive") or {}
    return {"rounds": rounds, "verdict": cv["verdict"], "criterion": cv["criterion"],
            "rhat_pred_worst": max(pr.get("rhat_pred_max") or 0, pr.get("rhat_loglik") or 0),
            "ess_bulk_pred_min": pr.get("ess_bulk_pred_min"), "rhat_theta_max": cv.get("rhat_max"),
            "excluded": summary.get("excluded", {}), "accuracy": ev["accuracy"], "nnll": ev["nnll"],
            "ece": ev["ece"], "wall_seconds": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", default="1500,6000", help="comma-separated numbers of rounds")
    ap.add_argument("--draws", type=int, default=150, help="kept draws per chain")
    ap.add_argument("--gamma-c", default="auto", help="gamma-c (auto: 0.125 for this network; the rows recorded "
                    "before 2026-12-02 ran at 0.25, the default then)")
    a = ap.parse_args()
    rounds = small([int(r) for r in a.rounds.split(",")], [40])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for r in rounds:
            rows.append(one(r, small(a.draws, 5), folder, a.gamma_c))
            print(json.dumps(rows[-1]), flush=True)
    path = smoke_out(ROOT / "benchmarks" / "user_app.json")
    path.write_text(json.dumps({"command": "python benchmarks/bench_user_app.py " + " ".join(sys.argv[1:]),
                                "machine": f"{platform.machine()}, {platform.python_version()}", "rows": rows},
                               indent=2))


if __name__ == "__main__":
    main()
