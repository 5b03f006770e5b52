"""The main job's preparation alone, exchange by exchange (issue 37: what the preparation sends, and where the θ*
descent spends its exchanges).

Runs :func:`qlsd_flwr.protocol.precondition.prepare` for the main job's keys (``QLSD_MAIN``, with ``--set key=value``
overrides) on the direct exchanges the local and vectorised engines use (the same messages, rounded as Flower carries
them), and records the descent's ``‖∇U‖`` at each of its gradient exchanges, its Newton decrement at θ*, γ, and the
bits by phase, both ways. No sampling round runs.

    python benchmarks/bench_preparation.py --set opt-tol=1e-3 --set opt-tol=1e-2 --out preparation.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.smoke import SMOKE, out  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.experiments.mainjob import QLSD_MAIN  # noqa: E402
from qlsd_flwr.protocol import build, precondition  # noqa: E402
from qlsd_flwr.tasks import loading  # noqa: E402


def one(over: dict) -> dict:
    """The preparation of the main job with ``over``: the descent's gradient norms, γ and the bits."""
    small = {"num-clients": 4, "dataset": "digits", "task": "logistic", "metric-block": 4, "metric-rank": 8} if SMOKE else {}
    cfg = resolve({**QLSD_MAIN, **small, **over, "engine": "vectorised", "progress": False})
    task = loading.load_task(cfg)
    blocks = build.blocks_for(cfg, task)
    specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, blocks) for i in range(cfg.b)]
    grad_fn, curv_fn = build.direct_exchanges(cfg, task, specs)
    norms: list[float] = []

    def traced(th, precision=64):
        g = grad_fn(th, precision)
        norms.append(float(np.linalg.norm(g)))
        traced.scales = grad_fn.scales  # the clients' row scales, for the descent's next width (DescentWidth)
        traced.uplink = grad_fn.uplink  # the replies' bits (their code depends on the levels)
        return g

    traced.scales = traced.uplink = None

    for name in ("clients", "combine", "n_data", "kept"):
        setattr(traced, name, getattr(grad_fn, name))
    point = []  # where the last curvature report was asked: θ* (the block's, K-FAC's at θ*)

    def curv(th, kind, *rest):
        if kind in ("kronecker", "kronecker-a", "kronecker-block"):
            point[:] = [np.array(th)]
        return curv_fn(th, kind, *rest)

    t0 = time.perf_counter()
    prep = precondition.prepare(cfg, task, build.theta0_of(task), traced, curv)
    info = prep.info
    return {"overrides": over, "gamma": prep.gamma, "lambda_max": info.get("lambda_max"),
            "descent_exchanges": info.get("opt_rounds"), "grad_norms": [round(x, 3) for x in norms],
            "grad_norm_end": info.get("opt_grad_norm"), "newton_decrement": info.get("opt_newton_decrement"),
            "exchanges": info.get("prep_exchanges"), "uplink": info.get("prep_uplink_bits"),
            "downlink": info.get("prep_downlink_bits"), "by_kind": info.get("prep_bits"),
            "seconds": round(time.perf_counter() - t0, 1), "theta_star": point[0] if point else None}


def reports(over: dict, theta: np.ndarray) -> dict:
    """K-FAC's input factors and ``metric-block``'s blocks at ``theta`` as their square roots carry them
    (:mod:`qlsd_flwr.compression.root`) against the exact ones: each client's rank, the bits, and the whitened
    eigenvalues of the rounded sum against the exact sum (the blocks with the prior's curvature added)."""
    from qlsd_flwr.compression import root
    from qlsd_flwr.core import kron_block as kb

    small = {"num-clients": 4, "dataset": "digits", "task": "logistic", "metric-block": 4} if SMOKE else {}
    cfg = resolve({**QLSD_MAIN, **small, **over, "engine": "vectorised", "progress": False})
    task = loading.load_task(cfg)

    def whitened(approx, exact):
        w, V = np.linalg.eigh(exact)
        W = V / np.sqrt(w)
        e = np.linalg.eigvalsh(W.T @ approx @ W)
        return [float(e[0] - 1), float(e[-1] - 1)]

    G = [0.5 * g + 0.5 * g.T for g in (c.kron_factors(theta)[0] for c in task.clients)]
    Gs = sum(G)
    shift = 1e-6 * float(np.linalg.eigvalsh(Gs)[-1]) * np.eye(Gs.shape[0])  # G alone is singular: its top's 1e-6
    k = int(cfg.get("metric-block") or 0)
    Q = np.linalg.eigh(Gs)[1][:, ::-1][:, :k]
    blocks = [kb.check_block(kb.block_report(*c.kron_inputs(theta), Q), Q.shape[1] * c.kron_inputs(theta)[1].shape[1])
              for c in task.clients] if k else []
    exact = []
    for c in task.clients if k else []:
        Xa, P = c.kron_inputs(theta)
        Z = Xa @ Q
        Y = (Z[:, :, None] * P[:, None, :]).reshape(Z.shape[0], -1)
        B = -(Y.T @ Y)
        for a in range(P.shape[1]):
            B[a::P.shape[1], a::P.shape[1]] += (Z * P[:, a:a + 1]).T @ Z
        exact.append(0.5 * B + 0.5 * B.T)
    prior = float(np.mean(1.0 / np.asarray(task.prior.var, dtype=float))) * np.eye(len(exact[0])) if k else None
    return {"G_ranks": [root.factor(g)[0].shape[0] for g in G], "G_bits": sum(8 * len(root.encode(g)) for g in G),
            "G_triangle_bits": 32 * len(G) * Gs.shape[0] * (Gs.shape[0] + 1) // 2,
            "G_whitened": whitened(sum(root.rounded(g) for g in G) + shift, Gs + shift),
            "block_ranks": [root.factor(b)[0].shape[0] for b in exact],
            "block_bits": sum(8 * len(root.encode(b)) for b in exact),
            "block_triangle_bits": sum(32 * len(b) * (len(b) + 1) // 2 for b in exact),
            "block_whitened": whitened(sum(blocks) + prior, sum(exact) + prior) if k else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a row: the main job with this key set (repeat for more rows; none: the main job itself)")
    ap.add_argument("--reports", action="store_true",
                    help="also K-FAC's input factors and the blocks at each row's θ*: square roots against exact")
    ap.add_argument("--out", default="preparation.json", help="a JSON file under benchmarks/")
    a = ap.parse_args(argv)
    rows = []
    for item in a.set or [""]:
        over = dict([item.split("=", 1)]) if item else {}
        row = one(over)
        print(f"{over or 'the main job'}: γ = {row['gamma']:.4g}, descent {row['descent_exchanges']} exchanges to "
              f"‖∇U‖ = {row['grad_norm_end']:.3g} (decrement {row['newton_decrement']:.3g}); preparation "
              f"{row['exchanges']} exchanges, {row['uplink']:.3g} bits up, {row['downlink']:.3g} down, "
              f"{row['seconds']} s", flush=True)
        if a.reports and row["theta_star"] is not None:
            row["reports"] = reports(over, np.asarray(row.pop("theta_star")))
            r = row["reports"]
            print(f"  square roots: G {r['G_bits']:.3g} bits (triangles {r['G_triangle_bits']:.3g}), ranks "
                  f"{min(r['G_ranks'])}–{max(r['G_ranks'])}, whitened {r['G_whitened']}; blocks {r['block_bits']:.3g} "
                  f"({r['block_triangle_bits']:.3g}), ranks {min(r['block_ranks'], default=0)}–"
                  f"{max(r['block_ranks'], default=0)}, whitened with the prior {r['block_whitened']}", flush=True)
        row.pop("theta_star", None)
        rows.append(row)
    path = out(HERE / a.out)
    path.write_text(json.dumps({"command": "python benchmarks/bench_preparation.py " + " ".join(sys.argv[1:]),
                                "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
