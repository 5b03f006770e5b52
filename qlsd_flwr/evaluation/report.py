"""A readable result: a table printed at the end of a run, and plots written beside it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from qlsd_flwr.outputs.recorder import load_samples


def posterior_errors(summary: dict) -> dict:
    """Errors of the sample moments against the exact posterior, when the task knows it."""
    if "posterior_mean_exact" not in summary:
        return {}
    m = np.asarray(summary["posterior_mean_exact"])
    v = np.asarray(summary["posterior_var_exact"])
    sm, sv = np.asarray(summary["sample_mean"]), np.asarray(summary["sample_var"])
    out = {
        "max |mean error| / posterior sd": float(np.max(np.abs(sm - m) / np.sqrt(v))),
        "sample var / posterior var (avg)": float(np.mean(sv / v)),
    }
    if "ula_var_exact" in summary:
        out["same, for exact-gradient ULA at this γ"] = float(np.mean(np.asarray(summary["ula_var_exact"]) / v))
    return out


def table(summary: dict, run_dir: Path | None) -> str:
    pr = summary.get("per_round", {})
    rows = [
        ("variant", summary.get("variant")),
        ("engine", summary.get("engine")),
        ("clients b / dimension d", f"{summary.get('b')} / {summary.get('d')}"),
        ("rounds / draws kept", f"{summary.get('rounds')} / {summary.get('draws_kept')}"),
        ("active clients per round", f"{pr.get('n_active', 0):.2f}"),
        ("uplink bits per round: exact code", f"{pr.get('bits_exact', 0):,.0f}"),
        ("uplink bits per round: QSGD bound", f"{pr.get('bits_bound', 0):,.0f}"),
        ("uplink bytes per round: payload", f"{pr.get('bytes_payload', 0):,.0f}"),
        ("uplink bytes per round: Flower message", f"{pr.get('bytes_message', 0):,.0f}"),
        ("float32 baseline bits per round", f"{32 * (summary.get('d') or 0) * pr.get('n_active', 0):,.0f}"),
        ("rejected replies", f"{int(summary.get('totals', {}).get('n_rejected', 0))} {summary.get('rejected', '')}"),
        ("wall time", f"{summary.get('wall_seconds', 0):.1f} s"),
    ]
    rows += [(k, f"{v:.3f}") for k, v in posterior_errors(summary).items()]
    if run_dir is not None:
        rows.append(("outputs", str(run_dir)))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def plot_run(run_dir: Path) -> list[Path]:
    """Trace, marginal against the exact posterior (if known), and bits per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = load_samples(run_dir)  # (chain, draw, d)
    out = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    j = 0
    x = samples[0, :, j]
    axes[0].plot(x, lw=0.6)
    axes[0].set(title=f"trace of θ[{j}] (after burn-in)", xlabel="draw", ylabel=f"θ[{j}]")
    axes[1].hist(x, bins=40, density=True, alpha=0.6, label="samples")
    if "posterior_mean_exact" in summary:
        m, v = summary["posterior_mean_exact"][j], summary["posterior_var_exact"][j]
        g = np.linspace(m - 4 * np.sqrt(v), m + 4 * np.sqrt(v), 200)
        axes[1].plot(g, np.exp(-(g - m) ** 2 / (2 * v)) / np.sqrt(2 * np.pi * v), "k", label="exact posterior")
        if "ula_var_exact" in summary:
            u = summary["ula_var_exact"][j]
            axes[1].plot(g, np.exp(-(g - m) ** 2 / (2 * u)) / np.sqrt(2 * np.pi * u), "k--", lw=1,
                         label="ULA at this γ (exact gradients)")
    axes[1].set(title=f"marginal of θ[{j}]", xlabel=f"θ[{j}]", ylabel="density")
    axes[1].legend()
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    r = np.array([float(x["round"]) for x in rows])
    for key, label in (("bits_exact", "exact code"), ("bits_bound", "QSGD bound")):
        axes[2].plot(r, [float(x[key]) for x in rows], lw=0.8, label=label)
    axes[2].plot(r, [8 * float(x["bytes_message"]) for x in rows], lw=0.8, label="Flower message (×8)")
    axes[2].set(title="uplink per round", xlabel="round", ylabel="bits", yscale="log")
    axes[2].legend()
    fig.suptitle(f"{summary.get('variant')} on {summary.get('task')} ({summary.get('engine')})")
    fig.tight_layout()
    path = run_dir / "overview.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)
    return out
