"""The memory ablation of the supplement (Vono et al. 2022, S5.2, "Benefits of the memory
mechanism", Figure S3), scaled to 2 cores.

The paper: FedProx's Synthetic(α = 1, β = 1) data, low-dimensional, ``b = 50`` clients (the
generator's natural, highly heterogeneous split), Bayesian logistic regression, QLSD++ with
and without the memory terms (``α = 1/(ω+1)`` vs ``α = 0``), ``s ∈ {2^1, 2^2}``, ``l = 100``,
``γ = 1e−5``, ``K = 100,000`` rounds without burn-in. Metric: the Euclidean norm of the error
between the posterior variance (per coordinate) estimated by MALA and the empirical variance of
the QLSD++ samples. The paper's claim: memory reduces the bias due to compression when ``ω``
is large.

Here: :func:`qlsd_flwr.data.datasets.synthetic_fedprox` with ``n_features = 2`` (10 classes, so
``d = (2 + 1)·10 = 30``), ``b = 50``, seed 0 (9,931 training points, clients of 40 to 1,819),
prior ``N(0, 2e−2 I)`` (the paper's logistic prior), ``p = 1``, minibatches of 10 %,
``l = 100``, as in the paper. Scaled down: ``γ = 5e−5`` (5× the paper's, ``γ·λ_max ≈ 0.46``)
and ``--rounds`` rounds per chain (default 3,000, the first 600 dropped), ``--chains`` chains
per configuration (seeds ``seed + c``), on the framework-free engine (one round of 50 clients
costs ~25 ms in Python here, so the paper's 100,000 rounds × 5 rows would take hours). The
larger step costs discretisation bias, shown by the exact-gradient ULA row, and buys 5× more
Langevin time per round (the slowest direction, ``λ_min = 50`` from the prior, decorrelates in
``1/(γλ_min) = 400`` rounds). The reference:
MALA on the pooled data (same posterior), 4 chains, cached on disk
(:func:`qlsd_flwr.evaluation.reference.mala`).

The error is reported per configuration as ``‖v̂ − v_MALA‖₂`` (and relative to
``‖v_MALA‖₂``), with a Monte Carlo standard error from the spread between chains, and for
scale the same error of exact-gradient ULA at this ``γ`` (LSD++ with full local batches).

    python simulations/memory_ablation.py                  # 864 s measured on 2 cores (861 s of it the MALA reference, cached afterwards)
    python simulations/memory_ablation.py --rounds 3000 --chains 1 --out /tmp/ma   # a quick look
"""

from __future__ import annotations

import argparse
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
from results_io import markdown, write_results  # noqa: E402

PRIOR_VAR = 2e-2


def build(pooled: bool = False, seed: int = 0):
    from qlsd_flwr.data.datasets import synthetic_fedprox
    from qlsd_flwr.tasks.logistic import build_logistic_task

    ds = synthetic_fedprox(1.0, 1.0, b=50, seed=seed, n_features=2)
    return build_logistic_task(ds, b=50, partition="natural", prior_var=PRIOR_VAR, pooled=pooled)


def rows_config(args) -> list[tuple[str, dict]]:
    base = {"task": "logistic", "num-clients": 50, "p": "1.0", "l": args.l,
            "batch-fraction": args.batch_fraction, "gamma": args.gamma, "num-rounds": args.rounds,
            "burn-in": args.burn_in, "seed": args.seed, "prior-var": PRIOR_VAR,
            "engine": "local", "progress": False}
    rows = [("ULA (exact gradients)", {**base, "variant": "lsd-pp", "batch-fraction": 1.0})]
    for s in args.s:
        for mem, a in (("memory", "auto"), ("no memory", "0")):
            rows.append((f"QLSD++ s={s}, {mem}", {**base, "variant": "qlsd-pp", "s": str(s), "alpha": a}))
    return rows


def run_row(item) -> dict:
    """One (configuration, chain): the framework-free engine (``run_local``, ``wire=False``:
    the same oracles, QSGD and server step as every engine, without encoding the messages)."""
    name, overrides, chain = item
    from qlsd_flwr.config import resolve
    from qlsd_flwr.engines.local import run_local

    cfg = resolve({**overrides, "seed": int(overrides["seed"]) + chain, "engine": "local"})
    task = build()
    t0 = time.perf_counter()
    res = run_local(cfg, task=task, write=False, keep_trace=True, progress=False, wire=False)
    kept = res.trace[cfg.burn_in::cfg.thin]
    return {"name": name, "chain": chain, "wall_seconds": time.perf_counter() - t0,
            "var": kept.var(axis=0, ddof=1), "finite": bool(np.all(np.isfinite(kept)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3_000)
    ap.add_argument("--burn-in", type=int, default=600)
    ap.add_argument("--chains", type=int, default=2)
    ap.add_argument("--gamma", type=float, default=5e-5)
    ap.add_argument("--l", type=int, default=100)
    ap.add_argument("--batch-fraction", type=float, default=0.1)
    ap.add_argument("--s", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--mala-draws", type=int, default=30_000)
    ap.add_argument("--out", default=str(ROOT / "simulations" / "results" / "memory_ablation"))
    args = ap.parse_args(argv)

    from qlsd_flwr.evaluation import hpd
    from qlsd_flwr.evaluation import reference as R

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    items = rows_config(args)
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        futs = [ex.submit(run_row, (name, ov, c)) for name, ov in items for c in range(args.chains)]
        pooled = build(pooled=True)
        _, H, _ = hpd.map_and_hessian(pooled)
        eig = np.linalg.eigvalsh(H)
        t_m = time.perf_counter()
        ref = R.mala(pooled, n_draws=args.mala_draws, n_warmup=2_000, n_chains=4, seed=0)
        mala_s = time.perf_counter() - t_m
        results = [f.result() for f in futs]
    v_ref = ref.var
    ess = ref.diagnostics.get("ess_bulk")
    # MC error of the MALA variance estimate: Gaussian approximation 2σ⁴/ESS per coordinate
    ref_err = float(np.sqrt(np.sum(2 * v_ref ** 2 / np.asarray(ess)))) if ess is not None else float("nan")
    from qlsd_flwr.compression.qsgd import QSGD

    d = pooled.dim
    table = []
    for name, ov in items:
        rs = [r for r in results if r["name"] == name]
        vc = np.array([r["var"] for r in rs])  # (C, d)
        errs = np.linalg.norm(vc - v_ref, axis=1)
        err = float(np.linalg.norm(vc.mean(axis=0) - v_ref))
        se = float(errs.std(ddof=1) / np.sqrt(len(errs))) if len(errs) > 1 else float("nan")
        s_ = int(ov.get("s", 0)) if "QLSD" in name else None
        table.append({"method": name, "var_error": err, "var_error_chain_se": se,
                      "var_error_per_chain": errs.tolist(),
                      "rel_var_error": err / float(np.linalg.norm(v_ref)),
                      "omega": QSGD(s=s_).omega(d) if s_ else 0.0,
                      "mean_var_ratio": float(np.mean(vc.mean(axis=0) / v_ref)),
                      "finite": all(r["finite"] for r in rs),
                      "wall_seconds": float(sum(r["wall_seconds"] for r in rs))})
    total = time.perf_counter() - t0
    head = ["configuration", "ω", "‖var − var_MALA‖", "± (chains)", "relative",
            "mean var / var_MALA"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        lines.append(f"| {t['method']} | {t['omega']:.2f} | {t['var_error']:.3e} | "
                     f"{t['var_error_chain_se']:.1e} | {t['rel_var_error']:.3f} | "
                     f"{t['mean_var_ratio']:.3f} |")
    notes = [
        f"Scale: Synthetic(1,1) with 2 features and 10 classes (d = {d}), b = 50 natural clients "
        f"({pooled.n_data.sum():,} training points), prior N(0, {PRIOR_VAR} I), p = 1, "
        f"γ = {args.gamma:g} (γ·λ_max(∇²U) = {args.gamma * eig[-1]:.3f}), l = {args.l}, batch "
        f"fraction {args.batch_fraction}; {args.chains} chain(s) × {args.rounds:,} rounds "
        f"({args.burn_in:,} burn-in) per row. Paper: K = 100,000 rounds, one run, no burn-in.",
        f"Error: ‖v̂ − v_MALA‖₂ over the {d} coordinates, v̂ the variance of the kept draws pooled "
        f"over chains; ± is the standard error of the per-chain errors (chains differ by seed). "
        f"‖v_MALA‖₂ = {np.linalg.norm(v_ref):.3e}; MALA's own Monte Carlo error ≈ {ref_err:.1e} "
        f"(4 × {args.mala_draws:,} draws, acceptance {np.round(ref.acceptance, 2).tolist()}).",
        "Memory: α = 1/(ω+1) vs α = 0; ω = min(d/s², √d/s) = "
        + ", ".join(f"{min(d / s ** 2, np.sqrt(d) / s):.2f} (s={s})" for s in args.s) + ".",
        "Paper (Figure S3): with memory the variance error is lower than without at s = 2 and "
        "s = 4 (figure only, no numbers given).",
        f"Wall time {total:.0f} s on {os.cpu_count()} cores ({platform.processor() or platform.machine()}); "
        f"MALA {mala_s:.0f} s (cached afterwards).",
    ]
    md = markdown("Memory ablation: QLSD++ with and without memory on Synthetic(1,1)", lines, notes)
    write_results(out, "memory_ablation", md, table, {
        "args": vars(args), "rows": table, "mala_var": v_ref.tolist(), "hessian_eigs": eig.tolist(),
        "total_seconds": total}, __file__, argv, total, drop=("var_error_per_chain",))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
