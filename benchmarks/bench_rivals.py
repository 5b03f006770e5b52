"""The rivals on the toy Gaussian (issue 23, first of the comparison's three tasks): posterior error
against rounds and uplink bits.

Every sampler runs on the same heterogeneous toy Gaussian (``build_gaussian_task(20, 50)``: 20
clients of very unequal sizes and means, prior N(0, 5 I)), whose posterior is known exactly, for
the same rounds, 4 chains each from the task's θ_0 = 0, far from the posterior:

* the QLSD family on the vectorised engine (bit for bit the Flower engines' chains): QLSD++ and
  QLSD\\* with QSGD ``s = 16``, LSD++ uncompressed; γ = 0.25/P;
* FALD (``K = 5`` local steps, τ = 0.5, weights ``N_i/N``) and VR-FALD\\* (reference at θ\\*,
  never refreshed), step ``h = 0.25/(K P)`` per local step (the same drift per round as QLSD);
* DG-LMC (``ρ_i = 0.02/N_i``, ``K = 5`` ULA steps with ``γ_i = 0.25/(N_i + 1/ρ_i)``);
* FSGLD (one client a round chosen with ``f_i = N_i/N``, ``K = 5`` steps of ``h = 0.25/(K P)``;
  its surrogates are Laplace fits, exact on this task, so FSGLD is ULA here: the best case);
* SGLD on the pooled data (the centralised reference: ULA, γ = 0.25/P).

Only the QLSD family runs through the protocol and Flower today; the rivals are their
framework-free cores (``qlsd_flwr/core``), and their messages are counted as uncompressed float64
(``64 d`` bits per client message; FSGLD adds its surrogates, ``2 · 64 d`` bits per client, once).
Measured after each budget of rounds (the second half of the rounds so far kept): the largest
``|mean − exact| / sd`` over θ's coordinates (pooled over chains) and the mean ratio of the sample
variance to the exact one.

    python benchmarks/bench_rivals.py [--rounds 2000] [--out benchmarks/rivals_gaussian.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

B, D, PV, CHAINS, K = 20, 50, 5.0, 4, 5


def errors(draws: np.ndarray, task) -> dict:
    """``draws`` ``(chains, n, d)``: the error figures of the kept draws."""
    sd = np.sqrt(task.posterior_var)
    x = draws.reshape(-1, draws.shape[-1])
    return {"mean_err_sd": float(np.max(np.abs(x.mean(0) - task.posterior_mean) / sd)),
            "var_ratio": float(np.mean(x.var(0) / task.posterior_var))}


def main() -> None:
    from qlsd_flwr.core import dglmc, fald, fsgld
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.run.simulate import run
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--out", default="benchmarks/rivals_gaussian.json")
    a = ap.parse_args()
    R = a.rounds
    budgets = [R // 8, R // 4, R // 2, R]
    task = build_gaussian_task(B, D, 0, prior_var=PV)
    n = np.array([c.n_data for c in task.clients], dtype=float)
    P = n.sum() + 1 / PV
    start = task.theta0  # θ_0 = 0, as the QLSD family's runs start: far from the posterior (burn-in)
    out = {"machine": platform.processor() or platform.machine(), "rounds": R, "b": B, "d": D, "chains": CHAINS,
           "command": "python benchmarks/bench_rivals.py " + " ".join(sys.argv[1:]), "samplers": {}}

    def record(name: str, traces: np.ndarray, bits_per_round: float, once: float = 0.0, seconds: float = 0.0):
        rows = []
        for r in budgets:
            kept = traces[:, r // 2:r]
            rows.append({"rounds": r, "uplink_bits": once + bits_per_round * r, **errors(kept, task)})
        out["samplers"][name] = {"rows": rows, "uplink_bits_per_round": bits_per_round, "once_bits": once,
                                 "seconds": seconds}
        print(name, json.dumps(rows[-1]), flush=True)

    # the QLSD family: the vectorised engine, every round's draw kept (thin 1, burn-in 0), exact bits
    tmp = tempfile.mkdtemp()
    for name, variant, s in (("QLSD++ (s = 16)", "qlsd-pp", "16"), ("QLSD* (s = 16)", "qlsd-star", "16"),
                             ("LSD++ (float64)", "lsd-pp", "16")):
        t = time.perf_counter()
        cfg = {"task": "gaussian", "num-clients": B, "dim": D, "prior-var": PV, "variant": variant, "s": s,
               "gamma": 0.25 / P, "num-rounds": R, "burn-in": 0, "thin": 1, "num-chains": CHAINS,
               "engine": "vectorised", "loo": "off", "plot": False, "progress": False, "output-dir": tmp,
               "run-name": variant}
        r = run(cfg)
        draws = load_samples(r.run_dir)
        bits = float(r.summary["totals"]["bits_exact"]) / (R * CHAINS)
        record(name, draws, bits, seconds=time.perf_counter() - t)

    def rival(name, one_chain, bits_per_round, once=0.0):
        t = time.perf_counter()
        traces = np.stack([one_chain(c) for c in range(CHAINS)])
        record(name, traces, bits_per_round, once, time.perf_counter() - t)

    h = 0.25 / (K * P)
    rival("FALD (K = 5, τ = 0.5)", lambda c: fald.run(task, h, K, R, tau=0.5, seed=c, theta0=start), B * 64 * D)
    rival("VR-FALD* (K = 5, at θ*)", lambda c: fald.run(task, h, K, R, tau=0.5, seed=c, theta0=start,
                                                       anchor=task.theta_star), B * 64 * D)
    rho = 0.02 / n
    rival("DG-LMC (K = 5, ρ_i = 0.02/N_i)",
          lambda c: dglmc.run(task, rho, 0.25 / (n + 1 / rho), K, R, seed=c, theta0=start), B * 64 * D)
    mu, lam = fsgld.gaussian_surrogates(task)
    rival("FSGLD (K = 5, Laplace surrogates)",
          lambda c: fsgld.run(task, mu, lam, n / n.sum(), h, K, R, seed=c, theta0=start), 64 * D, once=B * 2 * 64 * D)
    pooled = build_gaussian_task(B, D, 0, prior_var=PV, pooled=True)
    rival("SGLD, pooled data (centralised)",
          lambda c: fald.run(pooled, 0.25 / P, 1, R, tau=1.0, seed=c, theta0=start), 0.0)
    Path(a.out).write_text(json.dumps(out, indent=1))
    plot(out, Path(a.out).with_suffix(".png"))


def plot(out: dict, path: Path) -> None:
    """Error against uplink bits, one line per sampler (the issue's figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, s in out["samplers"].items():
        x = [max(r["uplink_bits"], 1.0) for r in s["rows"]]
        axes[0].plot(x, [r["mean_err_sd"] for r in s["rows"]], marker="o", label=name)
        axes[1].plot(x, [abs(r["var_ratio"] - 1) for r in s["rows"]], marker="o", label=name)
    for ax, what in zip(axes, ("max |mean − exact| / sd", "|variance ratio − 1|")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("uplink bits (all clients, one chain)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    fig.suptitle(f"toy Gaussian (b = {out['b']}, d = {out['d']}): error against uplink bits "
                 f"({out['chains']} chains; the centralised SGLD sends nothing: drawn at 1 bit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("plot:", path)


if __name__ == "__main__":
    main()
