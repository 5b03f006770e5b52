"""A readable result: a table printed at the end of a run, and plots written beside it."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np

from qlsd_flwr.keys import flag
from qlsd_flwr.outputs.recorder import load_samples

log = logging.getLogger("qlsd_flwr")


def posterior_errors(summary: dict) -> dict:
    """Errors of the sample moments against the exact posterior, when the task knows it."""
    if "posterior_mean_exact" not in summary:
        return {}
    mean = np.asarray(summary["posterior_mean_exact"])
    v = np.asarray(summary["posterior_var_exact"])
    sm, sv = np.asarray(summary["sample_mean"]), np.asarray(summary["sample_var"])
    out = {
        "max |mean error| / posterior sd": float(np.max(np.abs(sm - mean) / np.sqrt(v))),
        "sample var / posterior var (avg)": float(np.mean(sv / v)),
    }
    if "ula_var_exact" in summary:
        out["same, for exact-gradient ULA at this γ (noise-correction's included)"] = float(np.mean(np.asarray(summary["ula_var_exact"]) / v))
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


def informative_coordinates(samples: np.ndarray, n: int = 3) -> list[int]:
    """The ``n`` coordinates the data moved most: the largest ``|posterior mean| / posterior sd``
    over all chains (a corner pixel's weight, which only the prior shapes, scores near 0)."""
    flat = samples.reshape(-1, samples.shape[-1])
    score = np.abs(flat.mean(axis=0)) / np.maximum(flat.std(axis=0), 1e-300)
    return sorted(np.argsort(-score, kind="stable")[:min(n, samples.shape[-1])].tolist())


def rolling_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Mean over the last ``window`` values (fewer at the start)."""
    c = np.cumsum(np.concatenate([[0.0], np.asarray(x, dtype=np.float64)]))
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def coordinate_labels(run_dir: Path, d: int) -> list[str]:
    """``θ[<label>]`` for each coordinate, from ``samples.nc``'s ``theta_dim_0`` coordinate."""
    import h5netcdf

    with h5netcdf.File(Path(run_dir) / "samples.nc", "r") as f:
        lab = f["posterior"]["theta_dim_0"][...]
    return [f"θ[{x.decode() if isinstance(x, bytes) else x}]" for x in np.asarray(lab).tolist()][:d]


def draw_overview(run_dir, wanted=True) -> list[Path]:
    """``overview.png`` at the end of a run (key ``plot``): ``qlsd_flwr.run`` calls this after any
    engine, the Flower strategy at its end (``flwr run``, a user's ServerApp), so every path writes
    it. Drawn unless it is newer than ``summary.json`` already (another layer drew it once the
    folder closed); with ``plot = false`` an older one (a stopped run's, before this resume) is
    removed rather than left stale. A plot that fails is a warning, never the run's failure.
    Returns what exists."""
    if run_dir is None:
        return []
    png, summary = Path(run_dir) / "overview.png", Path(run_dir) / "summary.json"
    fresh = png.exists() and summary.exists() and png.stat().st_mtime_ns > summary.stat().st_mtime_ns
    if not flag("plot", wanted):
        if png.exists() and not fresh:
            png.unlink()
        return []
    if fresh:
        return [png]
    try:
        return plot_run(Path(run_dir))
    except Exception as exc:  # noqa: BLE001 (the samples are written; a picture must not undo that)
        log.warning("overview.png not drawn: %s: %s", type(exc).__name__, exc)
        return []


def plot_run(run_dir: Path) -> list[Path]:
    """``overview.png``: for the most informative coordinates (:func:`informative_coordinates`) and
    the two with the worst R-hat (``summary.json``'s convergence report), the trace of every chain and the marginal against the exact posterior (when known); below,
    the uplink bits per round as a rolling mean. Legends sit outside the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = load_samples(run_dir)  # (chain, draw, d)
    C, n, d = samples.shape
    conv = summary.get("convergence") or {}
    worst = [int(j) for j in conv.get("worst_coordinates", []) if 0 <= int(j) < d][:2]
    # the coordinates the data moved most, and those whose chains agree least (worst R-hat)
    coords = informative_coordinates(samples, 3 if not worst else 2) if n else [0]
    coords = coords + [j for j in worst if j not in coords]
    rhat = dict(zip(conv.get("worst_coordinates", []), conv.get("worst_rhat", [])))
    labels = coordinate_labels(run_dir, d)
    fig = plt.figure(figsize=(14, 3.0 * (len(coords) + 1)))
    grid = fig.add_gridspec(len(coords) + 1, 2, width_ratios=(2, 1))
    colours = plt.cm.tab10(np.arange(C) % 10)
    for row, j in enumerate(coords):
        tr, mg = fig.add_subplot(grid[row, 0]), fig.add_subplot(grid[row, 1])
        for c in range(C):
            tr.plot(samples[c, :, j], lw=0.6, color=colours[c], label=f"chain {c}")
            mg.hist(samples[c, :, j], bins=30, density=True, alpha=0.35, color=colours[c])
        ylab = labels[j] + (f"\nR-hat {rhat[j]:.3g}" if j in rhat else "")
        tr.set(ylabel=ylab, xlabel="draw (after burn-in and thinning)" if row == len(coords) - 1 else None)
        if row == 0:
            tr.set_title(f"traces of the coordinates the data moved most (|mean|/sd)"
                         f"{' and of the worst R-hat' if worst else ''}, {C} chain(s)")
            mg.set_title("marginals")
        if "posterior_mean_exact" in summary:
            m, v = summary["posterior_mean_exact"][j], summary["posterior_var_exact"][j]
            g = np.linspace(m - 4 * np.sqrt(v), m + 4 * np.sqrt(v), 200)
            mg.plot(g, np.exp(-(g - m) ** 2 / (2 * v)) / np.sqrt(2 * np.pi * v), "k", label="exact posterior")
            if "ula_var_exact" in summary:
                u = summary["ula_var_exact"][j]
                mg.plot(g, np.exp(-(g - m) ** 2 / (2 * u)) / np.sqrt(2 * np.pi * u), "k--", lw=1,
                        label="ULA at this γ (exact gradients)")
        mg.set(xlabel=labels[j])
        if row == 0:
            if C > 1:
                tr.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
            if mg.get_legend_handles_labels()[0]:
                mg.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)
    bits = fig.add_subplot(grid[len(coords), :])
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    r = np.array([float(x["round"]) for x in rows])
    window = max(1, len(rows) // 50)
    for key, label in (("bits_exact", "exact code"), ("bits_bound", "QSGD bound")):
        bits.plot(r, rolling_mean([float(x[key]) for x in rows], window), lw=1.0, label=label)
    msg = [8 * float(x["bytes_message"]) for x in rows]
    if any(msg):
        bits.plot(r, rolling_mean(msg, window), lw=1.0, label="Flower message (×8)")
    bits.set(title=f"uplink bits per round, rolling mean over {window} rounds", xlabel="round", ylabel="bits")
    if any(v > 0 for v in msg) or len(rows):
        bits.set_yscale("log")
    bits.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", frameon=False)
    head = f"{summary.get('variant')} on {summary.get('task')} ({summary.get('engine')})"
    if conv.get("verdict"):
        rh = conv.get("rhat_max")
        head += (f" — {conv['verdict']}: worst R-hat {rh:.3g} (target ≤ {conv.get('target', 1.05)}), "
                 f"min bulk ESS {conv.get('ess_bulk_min') or 0:.0f}, starts {conv.get('starts')}") if rh is not None \
            else f" — {conv['verdict']}"
    fig.suptitle(head, color="black" if conv.get("verdict") in (None, "MIXED") else "firebrick")
    fig.tight_layout()
    path = run_dir / "overview.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [path]
