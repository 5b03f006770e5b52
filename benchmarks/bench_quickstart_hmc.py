"""The quickstart's own network, as a user's app runs it, against full-batch HMC (issue 39).

The posterior: ``examples/quickstart-torch`` (13-16-3 tanh, d = 275, prior N(0, 5 I), the 4
clients' 125 training points; the 53 held-out points are the server's). The reference: full-batch
HMC in float64 (4 chains × 2,000 draws after 500 warm-up, 20 leapfrog steps, dispersed starts).
Each row is ``QLSDStrategy`` with its defaults (QLSD++, ``s = 16``, ``batch-fraction = 0.1``,
``l = 100``) plus what a row names, 4 chains from dispersed starts, half the rounds burn-in, run on
the in-process grid exactly as the app runs it. The figure: the total variation between the
predictive on all 178 inputs of the row's kept draws and HMC's, divided by the TV between HMC's
two halves (chains 0–1 against 2–3), the measure of issue 39 (target ≤ 2).

    python benchmarks/bench_quickstart_hmc.py [--rounds 8000] [--rows identity:0.001,diagonal:auto]

A row is ``metric:gamma[:gamma-c[:noise-correction]]``; ``gamma-c`` omitted (or empty) is the key's default (its
rule for networks included); ``noise-correction`` omitted is ``off``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples" / "quickstart-torch"))

from benchmarks.smoke import few, small  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402

B = 4


def tv(p, q) -> float:
    return float(0.5 * np.abs(p - q).sum(axis=1).mean())


def reference(X):
    """HMC on the float64 posterior → (predictive of all draws, TV between its halves, info)."""
    import torch
    from qlsd_quickstart.task import PRIOR_VAR, load_partition, make_model

    from qlsd_flwr.evaluation.reference import hmc
    from qlsd_flwr.potentials import GaussianPrior, Task, TorchPotential

    clients = [TorchPotential(make_model(), *load_partition(i, B), dtype=torch.float64) for i in range(B)]
    task = Task(name="quickstart-f64", dim=clients[0].dim, clients=clients, prior=GaussianPrior(var=PRIOR_VAR),
                theta0=clients[0].theta0())
    t = time.perf_counter()
    ref = hmc(task, n_draws=small(2000, 20), n_warmup=small(500, 10), n_chains=4, seed=1, n_leapfrog=20,
              init_scale=0.5, cache=not bool(small("", "smoke")))
    S = np.asarray(ref.samples)

    def pred(draws):
        flat = draws.reshape(-1, task.dim)
        return clients[0].predict_proba(flat[:: max(1, len(flat) // 800)], X)

    p, pa, pb = pred(S), pred(S[:2]), pred(S[2:])
    return p, tv(pa, pb), {"seconds": round(time.perf_counter() - t, 1),
                           "acceptance": float(np.mean(ref.acceptance)), "tv_between_halves": tv(pa, pb)}


def row(spec: str, rounds: int, folder: str, X, p_ref, halves: float) -> dict:
    import torch
    from flwr.app import ArrayRecord
    from qlsd_quickstart.task import PRIOR_VAR, held_out_data, make_model, potential

    from qlsd_flwr.flower import InProcessGrid, QLSDStrategy, make_client_app
    from qlsd_flwr.potentials import TorchPotential

    metric, gamma, *rest = spec.split(":")
    extra = {"gamma_c": float(rest[0])} if rest and rest[0] else {}
    if len(rest) > 1:  # a fourth field: noise-correction's value
        extra["noise_correction"] = rest[1]
    pots = [potential(i, B) for i in range(B)]
    Xh, yh = held_out_data()
    st = QLSDStrategy(num_clients=B, dim=pots[0].dim, gamma=gamma if gamma == "auto" else float(gamma),
                      metric=metric, num_rounds=rounds, burn_in=rounds // 2, num_chains=4, init="dispersed",
                      prior_var=PRIOR_VAR, seed=0, output_dir=folder, run_name=spec.replace(":", "_"),
                      progress=False, loo="off", keep_trace=True, heldout=(potential(0, B), Xh, yh), **extra)
    t = time.perf_counter()
    st.start(InProcessGrid(make_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])]), B),
             initial_arrays=ArrayRecord(make_model().state_dict()))
    wall = time.perf_counter() - t
    summary = json.loads((Path(st.run_dir) / "summary.json").read_text())
    draws = np.asarray(st.trace)[-(rounds - rounds // 2):].transpose(1, 0, 2)  # (chains, kept, d)
    f64 = TorchPotential(make_model(), X[:1], np.zeros(1, dtype=np.int64), dtype=torch.float64)

    def pred(d):
        flat = d.reshape(-1, d.shape[-1]).astype(np.float64)
        return f64.predict_proba(flat[:: max(1, len(flat) // 800)], X)

    p = pred(draws)
    cv = summary["convergence"]
    pr = cv.get("predictive") or {}
    return {"row": spec, "rounds": rounds, "gamma": summary["gamma"], "gamma_c": summary.get("gamma_c"),
            "noise_factor": summary.get("noise_factor", 1.0),
            "tv_to_hmc": tv(p, p_ref), "tv_ratio_to_hmc_halves": tv(p, p_ref) / halves,
            "tv_own_halves": tv(pred(draws[:2]), pred(draws[2:])),
            "agreement_with_hmc": float(np.mean(p.argmax(1) == p_ref.argmax(1))),
            "verdict": cv["verdict"], "rhat_pred_worst": max(pr.get("rhat_pred_max") or 0, pr.get("rhat_loglik") or 0),
            "ess_bulk_pred_min": pr.get("ess_bulk_pred_min"), "excluded": summary.get("excluded", {}),
            "wall_seconds": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8000)
    ap.add_argument("--rows", default="identity:0.001,diagonal:auto", help="comma-separated metric:gamma[:gamma-c[:noise-correction]]")
    ap.add_argument("--out", default="quickstart_hmc.json", help="file name under benchmarks/")
    a = ap.parse_args()
    from qlsd_quickstart.task import _wine

    X = _wine()[0].astype(np.float64)  # all 178 standardised inputs
    p_ref, halves, info = reference(X)
    print("hmc", json.dumps(info), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for spec in few(a.rows.split(",")):
            rows.append(row(spec, small(a.rounds, 40), folder, X, p_ref, halves))
            print(json.dumps(rows[-1]), flush=True)
    path = smoke_out(ROOT / "benchmarks" / a.out)
    path.write_text(json.dumps({"command": "python benchmarks/bench_quickstart_hmc.py " + " ".join(sys.argv[1:]),
                                "machine": f"{platform.machine()}, {platform.python_version()}",
                                "hmc": info, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
