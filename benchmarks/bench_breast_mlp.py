"""A user's MLP on breast_cancer: QLSD++ from the defaults a user gets, next to FedAvg (issue 39).

The setting of the issue's report: a 30-16-2 tanh MLP (d = 530) on scikit-learn's breast_cancer,
standardised, 30 % held out (stratified, seed 0), the rest split over 5 clients by a Dirichlet(0.5)
label split (the package's ``partition = dirichlet``; the issue used flwr-datasets' partitioner, the
same kind of split). QLSD++ with what a user sets for a network and nothing else: ``metric =
diagonal``, ``gamma = auto`` (``gamma-c = auto``: 0.125 for a network), ``init = dispersed``, 4
chains, prior N(0, 5 I), half the rounds burn-in; each row a number of rounds. FedAvg: the package's
(Flower's ``FedAvg`` on the Ray engine; 50 rounds, 2 local epochs, SGD lr 0.1, batch 32) on the same
clients and model. Both are judged on the same held-out points (accuracy, nNLL, ECE with 10 bins),
and against full-batch HMC on the same posterior (float64, 4 chains × 2,000 draws): the predictive's
total variation from HMC's, as a multiple of the TV between HMC's own halves (chains 0–1 against 2–3).

    python benchmarks/bench_breast_mlp.py [--rounds 10000,40000] [--out breast_mlp.json]

The dataset and model are this file's plug-ins (``bench_breast_mlp:load``, ``bench_breast_mlp:make``),
so the sampler and FedAvg read the same split; QLSD++ runs on the vectorised engine (the same chain
as on Flower's, bit for bit: ``tests/test_equivalence.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def load(seed: int):
    """breast_cancer (569 × 30, 2 classes), standardised on the training part, 70/30 stratified."""
    from qlsd_flwr.data.datasets import load_breast_cancer

    return load_breast_cancer(test_frac=0.3, seed=seed, dtype=np.float32)


def make(n_classes: int, input_shape: tuple) -> nn.Module:
    """The issue's 30-16-2 MLP (tanh; 530 parameters)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16), nn.Tanh(),
                         nn.Linear(16, n_classes))


COMMON = {"task": "mnist", "dataset": "bench_breast_mlp:load", "model": "bench_breast_mlp:make",
          "num-clients": 5, "partition": "dirichlet", "partition-alpha": 0.5, "prior-var": 5.0}


def tv(p, q) -> float:
    """The mean over test points of the total variation between two predictives."""
    return float(0.5 * np.abs(p - q).sum(axis=1).mean())


def predictive(draws: np.ndarray, X) -> np.ndarray:
    """The posterior predictive on ``X`` of ``draws`` ``(chains, draws, d)`` (at most 800 of them)."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.tasks import registry

    flat = draws.reshape(-1, draws.shape[-1]).astype(np.float64)
    return registry.predictor_of(resolve(COMMON)).predict_proba(flat[:: max(1, len(flat) // 800)], X)


def hmc_row() -> tuple[dict, np.ndarray]:
    """Full-batch HMC on the same posterior (float64; 4 chains × 2,000 draws after 500 warm-up, 20
    leapfrog steps): the posterior's own predictive, against which the sampler and FedAvg are read."""
    import torch

    from qlsd_flwr.config import resolve
    from qlsd_flwr.evaluation.evaluate import predictive_metrics
    from qlsd_flwr.evaluation.reference import hmc
    from qlsd_flwr.potentials import Task, TorchPotential
    from qlsd_flwr.tasks import loading, registry
    from benchmarks.smoke import small

    cfg = resolve(COMMON)
    task = loading.load_task(cfg)
    # copies: .to(float64) converts a module in place, and the task's model is shared with the runs below
    f64 = [TorchPotential(copy.deepcopy(c.model), c.X, c.y, dtype=torch.float64) for c in task.clients]
    task64 = Task(name="breast-mlp-f64", dim=task.dim, clients=f64, prior=task.prior, theta0=task.theta0)
    t = time.perf_counter()
    ref = hmc(task64, n_draws=small(2000, 20), n_warmup=small(500, 10), n_chains=4, seed=1, n_leapfrog=20,
              init_scale=0.5, cache=not bool(small("", "smoke")))
    S = np.asarray(ref.samples)
    X, y, _, _ = registry.test_set(cfg)
    p = predictive(S, X)
    m = predictive_metrics(p, y)
    return {"method": "hmc", "accuracy": m["accuracy"], "nnll": m["nnll"], "ece": m["ece"],
            "tv_between_halves": tv(predictive(S[:2], X), predictive(S[2:], X)),
            "acceptance": float(np.mean(ref.acceptance)), "wall_seconds": round(time.perf_counter() - t, 1)}, p


def qlsd_row(rounds: int, folder: str, p_ref=None, halves=None) -> dict:
    from qlsd_flwr.config import resolve
    from qlsd_flwr.evaluation.evaluate import evaluate_run
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.tasks import registry
    from qlsd_flwr.run.simulate import run

    t = time.perf_counter()
    o = run({**COMMON, "engine": "vectorised", "metric": "diagonal", "gamma": "auto", "init": "dispersed",
             "num-chains": 4, "num-rounds": rounds, "burn-in": rounds // 2, "progress": False, "loo": "off",
             "plot": False, "output-dir": folder, "run-name": f"qlsd-{rounds}"})
    wall = time.perf_counter() - t
    ev = evaluate_run(o.run_dir, write=True)
    summary = json.loads((Path(o.run_dir) / "summary.json").read_text())
    cv = summary["convergence"]
    pr = cv.get("predictive") or {}
    return {"method": "qlsd-pp", "rounds": rounds, "gamma": summary["gamma"], "gamma_c": summary.get("gamma_c"),
            "accuracy": ev["accuracy"], "nnll": ev["nnll"], "ece": ev["ece"], "verdict": cv["verdict"],
            "criterion": cv.get("criterion"),
            "rhat_pred_worst": max(pr.get("rhat_pred_max") or 0, pr.get("rhat_loglik") or 0) or None,
            "ess_bulk_pred_min": pr.get("ess_bulk_pred_min"), "wall_seconds": round(wall, 1),
            **_against(predictive(load_samples(o.run_dir), registry.test_set(resolve(COMMON))[0]), p_ref, halves)}


def _against(p, p_ref, halves) -> dict:
    if p_ref is None:
        return {}
    return {"tv_to_hmc": tv(p, p_ref), "tv_ratio_to_hmc_halves": tv(p, p_ref) / halves}


def fedavg_row(folder: str, p_ref=None, halves=None) -> dict:
    import torch

    from benchmarks.smoke import small
    from qlsd_flwr.config import resolve
    from qlsd_flwr.experiments.fedavg import _setup, run_fedavg
    from qlsd_flwr.tasks import registry

    fa = run_fedavg({**COMMON, "progress": False}, num_rounds=small(None, 2), out_dir=Path(folder) / "fedavg")
    m = fa.metrics
    model = _setup(json.dumps({**COMMON, "progress": False}, sort_keys=True, default=str))[2]()
    model.load_state_dict(fa.state_dict)  # the final global model, as judged above
    with torch.no_grad():
        X = torch.as_tensor(np.asarray(registry.test_set(resolve(COMMON))[0]), dtype=torch.float32)
        p = torch.softmax(model.eval()(X).double(), dim=1).numpy()
    return {"method": "fedavg", "rounds": fa.rounds, "accuracy": m["accuracy"], "nnll": m["nnll"], "ece": m["ece"],
            "wall_seconds": round(fa.wall_seconds_total, 1), **_against(p, p_ref, halves)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", default="10000,40000", help="comma-separated numbers of rounds, one row each")
    ap.add_argument("--out", default="breast_mlp.json", help="file name under benchmarks/")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))  # the plug-ins, here and in Ray's workers
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])
    from benchmarks.smoke import few, small
    from benchmarks.smoke import out as smoke_out

    ref, p_ref = hmc_row()
    rows = [ref]
    print(json.dumps(ref), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        rows.append(fedavg_row(folder, p_ref, ref["tv_between_halves"]))
        print(json.dumps(rows[-1]), flush=True)
        for r in few([int(x) for x in a.rounds.split(",")]):
            rows.append(qlsd_row(small(r, 40), folder, p_ref, ref["tv_between_halves"]))
            print(json.dumps(rows[-1]), flush=True)
    path = smoke_out(ROOT / "benchmarks" / a.out)
    path.write_text(json.dumps({"command": "python benchmarks/bench_breast_mlp.py " + " ".join(sys.argv[1:]),
                                "machine": f"{platform.machine()}, {platform.python_version()}", "rows": rows},
                               indent=2))


if __name__ == "__main__":
    main()
