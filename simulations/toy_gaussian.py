"""The paper's toy Gaussian figure (Vono et al. 2022, §4 and Figure 1; supplement S5.1).

MSE of the estimate of ``E_π[‖θ‖]`` over independent runs against the bits each iteration
uploads, for QLSD# and QLSD* at 4, 8 and 16 bits (``s = 2^4, 2^8, 2^16``) and LSD* (the
uncompressed QLSD*), with ``b = 20``, ``d = 50``, ``γ = 4.9e-4``, ``n_i = ⌊N_i/10⌋``,
``K = 500,000`` rounds and ``450,000`` burn-in, 30 runs each.

Run ``c`` of every configuration uses seed ``seed + c`` (the vectorised engine's chain rule);
the configurations run side by side (:func:`qlsd_flwr.engines.vectorised.run_side_by_side`), which
streams ``Σ‖θ_k‖`` over the kept rounds of each run, so memory stays flat. The truth
``E_π‖θ‖`` is exact: under ``π = N(ȳ, I/N)``, ``N‖θ‖²`` is noncentral χ² with ``d`` degrees of
freedom and noncentrality ``N‖ȳ‖²``.

Bits per iteration are the sum over the clients that uploaded in the round, averaged over
rounds and runs, counted two ways: the exact length of the code ``QSGD.encode`` produces
(``encoding = auto``: the shorter of the Elias and the packed code) and the analytic bound
``QSGD.bound_bits(d)``. LSD* sends float64: ``64·d`` bits per client.

Companion (``--companion``): the step-size / compression trade-off of the supplement
(Figure S2): MSE against bits for QLSD* at several ``s`` and LSD*, for a few ``γ``.

Outputs (``--out``, default ``simulations/results/toy_gaussian``): ``toy_gaussian.png``,
``toy_gaussian.csv``, ``toy_gaussian.md``, ``runs.json`` (every run's estimate and bits) and
``command.txt``; with ``--companion`` also ``stepsize_tradeoff.{png,csv,md}``.

    python simulations/toy_gaussian.py                 # the full figure (about 10 minutes)
    python simulations/toy_gaussian.py --companion     # and the step-size trade-off
    python simulations/toy_gaussian.py --rounds 20000 --burn-in 10000 --runs 8   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.smoke import SMOKE, folder  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.engines.vectorised import run_side_by_side  # noqa: E402
from qlsd_flwr.tasks.gaussian import build_gaussian_task  # noqa: E402

GAMMA = 4.9e-4
MAIN = [("qlsd-sharp", 4), ("qlsd-sharp", 8), ("qlsd-sharp", 16),
        ("qlsd-star", 4), ("qlsd-star", 8), ("qlsd-star", 16), ("lsd-star", None)]
LABEL = {"qlsd-sharp": "QLSD#", "qlsd-star": "QLSD*", "lsd-star": "LSD*"}


def true_mean_norm(task) -> float:
    """``E‖θ‖`` under the exact posterior ``N(ȳ, I/N)`` (flat prior)."""
    from scipy import stats

    N = float(task.meta["N"])
    mu = np.asarray(task.posterior_mean)
    return float(stats.ncx2(df=task.dim, nc=N * float(mu @ mu)).expect(np.sqrt) / np.sqrt(N))


def ula_mean_norm(task, gamma: float) -> float:
    """``E‖θ‖`` under ULA's stationary law with exact gradients, ``N(ȳ, I/(N(1 − γN/2)))``: the
    discretisation bias that every variant shares (LSD* here *is* ULA: its control-variate
    oracle is the exact gradient on this task)."""
    from scipy import stats

    N = float(task.meta["N"])
    var = 1.0 / (N * (1.0 - gamma * N / 2.0))
    mu = np.asarray(task.posterior_mean)
    return float(stats.ncx2(df=task.dim, nc=float(mu @ mu) / var).expect(np.sqrt) * np.sqrt(var))


def key(variant: str, bits: int | None, gamma: float) -> str:
    return f"{variant}|{bits if bits else '-'}|{gamma:.6g}"


def configs(combos, args, gamma: float):
    base = {"task": "gaussian", "num-clients": 20, "dim": 50, "data-seed": args.data_seed,
            "num-rounds": args.rounds, "burn-in": args.burn_in, "seed": args.seed,
            "num-chains": args.runs, "batch-fraction": 0.1, "p": "1.0", "engine": "vectorised",
            "gamma": gamma, "progress": False}
    out = []
    for variant, bits in combos:
        out.append(resolve({**base, "variant": variant, "s": str(2 ** bits if bits else 2)}))
    return out


def run_configs(combos, gammas, args, task, store: dict) -> tuple[float, float]:
    """Run every (variant, bits) × γ not yet in ``store`` side by side; returns the wall and
    the CPU seconds (all threads) of the engine."""
    todo = [(v, b, g) for g in gammas for v, b in combos if key(v, b, g) not in store]
    if not todo:
        return 0.0, 0.0
    cfgs = []
    for v, b, g in todo:
        cfgs += configs([(v, b)], args, g)
    t0, c0 = time.perf_counter(), time.process_time()
    res = run_side_by_side(cfgs, task=task, progress=not args.quiet, threads=args.threads,
                           labels=f"{len(cfgs)} configs")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    for (v, b, g), r in zip(todo, res):
        st = r.stats
        store[key(v, b, g)] = {
            "variant": v, "bits": b, "s": 2 ** b if b else None, "gamma": g,
            "estimates": st.mean_f().tolist(),  # per run: mean of ‖θ_k‖ over the kept rounds
            "bits_exact_per_iter": st.bits_exact_per_round().tolist(),
            "bits_bound_per_iter": st.bits_bound_per_round().tolist(),
            "n_kept": st.n_kept, "subset_ties": int(st.subset_ties.sum()),
            "seconds_side_by_side": wall,
        }
    return wall, cpu


def summarise(rec: dict, truth: float) -> dict:
    est = np.asarray(rec["estimates"])
    err2 = (est - truth) ** 2
    n = len(est)
    return {"method": LABEL[rec["variant"]], "bits": rec["bits"], "s": rec["s"], "gamma": rec["gamma"],
            "bits_exact": float(np.mean(rec["bits_exact_per_iter"])),
            "bits_bound": float(np.mean(rec["bits_bound_per_iter"])),
            "mse": float(err2.mean()), "mse_se": float(err2.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan"),
            "bias2": float((est.mean() - truth) ** 2), "var": float(est.var(ddof=1)) if n > 1 else float("nan"),
            "mean_estimate": float(est.mean()), "runs": n}


def write_table(rows, path_csv: Path, path_md: Path, title: str, notes: list[str]) -> None:
    cols = ["method", "bits", "s", "gamma", "bits_exact", "bits_bound", "mse", "mse_se", "bias2", "var",
            "mean_estimate", "runs"]
    with open(path_csv, "w") as f:
        f.write(",".join(cols) + "\n")
        for r in rows:
            f.write(",".join("" if r[c] is None else (f"{r[c]:.6g}" if isinstance(r[c], float) else str(r[c]))
                             for c in cols) + "\n")
    lines = [f"# {title}", "", "| method | s | γ | bits/iter (exact) | bits/iter (bound) | MSE ± s.e. | bias² | variance |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        s = f"2^{r['bits']}" if r["bits"] else "—"
        lines.append(f"| {r['method']} | {s} | {r['gamma']:.3g} | {r['bits_exact']:,.0f} | {r['bits_bound']:,.0f} | "
                     f"{r['mse']:.3e} ± {r['mse_se']:.1e} | {r['bias2']:.2e} | {r['var']:.2e} |")
    lines += [""] + notes
    path_md.write_text("\n".join(lines) + "\n")


def plot_main(rows, ula_bias2: float, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    style = {"QLSD#": dict(color="tab:red", marker="o"), "QLSD*": dict(color="tab:blue", marker="s"),
             "LSD*": dict(color="black", marker="*", markersize=12)}
    for ax, col, name in zip(axes, ["bits_exact", "bits_bound"],
                             ["exact code length (Elias or packed, the shorter)", "analytic bound (QSGD.bound_bits)"]):
        for method in ["QLSD#", "QLSD*", "LSD*"]:
            rs = sorted([r for r in rows if r["method"] == method], key=lambda r: r[col])
            x = [r[col] for r in rs]
            y = [r["mse"] for r in rs]
            e = [r["mse_se"] for r in rs]
            ax.errorbar(x, y, yerr=e, label=method, capsize=3, linestyle="-" if len(rs) > 1 else "none", **style[method])
            for r in rs:
                if r["bits"]:
                    ax.annotate(f"{r['bits']} bits", (r[col], r["mse"]), textcoords="offset points",
                                xytext=(6, 4), fontsize=8, color=style[method]["color"])
        ax.axhline(ula_bias2, color="grey", linestyle=":", linewidth=1,
                   label="ULA bias² (exact gradients, same γ)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bits uploaded per iteration (all clients) [bits]")
        ax.set_title(name, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("MSE of the estimate of E[‖θ‖]")
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(f"Toy Gaussian (b=20, d=50, γ={args_gamma(args):.2g}): {args.runs} runs of K={args.rounds:,}, "
                 f"burn-in {args.burn_in:,}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def args_gamma(args) -> float:
    return GAMMA


def plot_companion(rows, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    gammas = sorted({r["gamma"] for r in rows}, reverse=True)
    colors = plt.cm.viridis(np.linspace(0, 0.85, len(gammas)))
    for g, colr in zip(gammas, colors):
        rs = sorted([r for r in rows if r["gamma"] == g and r["method"] == "QLSD*"], key=lambda r: r["bits_exact"])
        ax.errorbar([r["bits_exact"] for r in rs], [r["mse"] for r in rs], yerr=[r["mse_se"] for r in rs],
                    color=colr, marker="s", capsize=3, label=f"QLSD*, γ={g:.3g}")
        for r in rs:
            ax.annotate(f"{r['bits']}b", (r["bits_exact"], r["mse"]), textcoords="offset points", xytext=(5, 3),
                        fontsize=7, color=colr)
        ls = [r for r in rows if r["gamma"] == g and r["method"] == "LSD*"]
        for r in ls:
            ax.errorbar([r["bits_exact"]], [r["mse"]], yerr=[r["mse_se"]], color=colr, marker="*", markersize=12,
                        capsize=3, linestyle="none", label=f"LSD*, γ={g:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bits uploaded per iteration (all clients, exact code length) [bits]")
    ax.set_ylabel("MSE of the estimate of E[‖θ‖]")
    ax.set_title(f"Step size vs compression ({args.runs} runs of K={args.rounds:,})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=500_000)
    ap.add_argument("--burn-in", type=int, default=450_000)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--companion", action="store_true", help="also the step-size trade-off figure")
    ap.add_argument("--companion-gammas", default="4.9e-4,2.45e-4,1.225e-4")
    ap.add_argument("--companion-bits", default="2,4,8,16")
    ap.add_argument("--only-companion", action="store_true", help="skip the main figure's runs")
    ap.add_argument("--out", default=str(ROOT / "simulations" / "results" / "toy_gaussian"))
    ap.add_argument("--fresh", action="store_true", help="ignore runs.json (recompute everything)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if SMOKE:  # a smoke run (tests/test_docs_commands.py): a few rounds, two runs, one companion step
        args.rounds, args.burn_in, args.runs, args.fresh = 40, 20, 2, True
        args.companion_gammas = args.companion_gammas.split(",")[0]
        args.out = str(folder(args.out))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = build_gaussian_task(b=20, d=50, data_seed=args.data_seed)
    truth = true_mean_norm(task)
    ula = ula_mean_norm(task, GAMMA)
    runs_path = out / "runs.json"
    store = {}
    settings = {"rounds": args.rounds, "burn_in": args.burn_in, "runs": args.runs, "seed": args.seed,
                "data_seed": args.data_seed}
    if runs_path.exists() and not args.fresh:
        old = json.loads(runs_path.read_text())
        if old.get("settings") == settings:
            store = old["runs"]
    timings = {}
    if not args.only_companion:
        timings["main_wall_s"], timings["main_cpu_s"] = run_configs(MAIN, [GAMMA], args, task, store)
        runs_path.write_text(json.dumps({"settings": settings, "truth": truth, "runs": store}, indent=1))
        rows = [summarise(store[key(v, b, GAMMA)], truth) for v, b in MAIN]
        q16 = next(r for r in rows if r["method"] == "QLSD*" and r["bits"] == 16)
        lsd = next(r for r in rows if r["method"] == "LSD*")
        notes = [f"Truth E‖θ‖ = {truth:.12f} (exact posterior N(ȳ, I/N), N = {task.meta['N']}); "
                 f"ULA's stationary E‖θ‖ at γ = {GAMMA} is {ula:.12f}, so the discretisation alone gives "
                 f"bias² = {(ula - truth) ** 2:.3e}.",
                 f"{args.runs} runs per method, seeds {args.seed}..{args.seed + args.runs - 1}; K = {args.rounds:,}, "
                 f"burn-in {args.burn_in:,}; MSE = mean over runs of (estimate − truth)²; s.e. = std/√runs.",
                 f"Bits: summed over the 20 clients, mean over rounds and runs. LSD* sends float64 "
                 f"(64·d = 3200 bits per client). QLSD* 16 bits / LSD*: {lsd['bits_exact'] / q16['bits_exact']:.2f}× fewer "
                 f"bits (exact), {lsd['bits_bound'] / q16['bits_bound']:.2f}× (bound); against float32 LSD* "
                 f"(32·d per client) {lsd['bits_exact'] / 2 / q16['bits_exact']:.2f}×.",
                 "Minibatch subset ties at the boundary (where the numba engine could differ from numpy's "
                 f"argpartition): {sum(store[key(v, b, GAMMA)]['subset_ties'] for v, b in MAIN)}."]
        write_table(rows, out / "toy_gaussian.csv", out / "toy_gaussian.md",
                    "Toy Gaussian: MSE of E[‖θ‖] against bits per iteration", notes)
        plot_main(rows, (ula - truth) ** 2, out / "toy_gaussian.png", args)
    if args.companion or args.only_companion:
        gammas = [float(x) for x in args.companion_gammas.split(",")]
        combos = [("qlsd-star", int(b)) for b in args.companion_bits.split(",")] + [("lsd-star", None)]
        timings["companion_wall_s"], timings["companion_cpu_s"] = run_configs(combos, gammas, args, task, store)
        runs_path.write_text(json.dumps({"settings": settings, "truth": truth, "runs": store}, indent=1))
        rows = [summarise(store[key(v, b, g)], truth) for g in gammas for v, b in combos]
        notes = [f"Truth E‖θ‖ = {truth:.12f}. ULA bias² (exact gradients) per γ: " +
                 ", ".join(f"γ={g:.3g}: {(ula_mean_norm(task, g) - truth) ** 2:.2e}" for g in gammas) + ".",
                 f"{args.runs} runs per point, K = {args.rounds:,}, burn-in {args.burn_in:,}."]
        write_table(rows, out / "stepsize_tradeoff.csv", out / "stepsize_tradeoff.md",
                    "Toy Gaussian: step size vs compression (QLSD*, LSD*)", notes)
        plot_companion(rows, out / "stepsize_tradeoff.png", args)
    cmd = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, "simulations/toy_gaussian.py", *(argv or sys.argv[1:])])
    log = out / "command.txt"
    prev = log.read_text() if log.exists() else ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    log.write_text(prev + f"$ {cmd}\n# {time.strftime('%Y-%m-%d %H:%M:%S')}, {platform.machine()}, "
                   f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores, "
                   f"1-min load average at the end {load:.1f}; engine seconds (wall, CPU over all threads): "
                   f"{json.dumps({k: round(v, 1) for k, v in timings.items()})}\n")
    print(json.dumps({k: round(v, 1) for k, v in timings.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
