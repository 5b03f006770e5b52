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
        return g

    for name in ("clients", "combine", "n_data", "kept"):
        setattr(traced, name, getattr(grad_fn, name))
    t0 = time.perf_counter()
    prep = precondition.prepare(cfg, task, build.theta0_of(task), traced, curv_fn)
    info = prep.info
    return {"overrides": over, "gamma": prep.gamma, "lambda_max": info.get("lambda_max"),
            "descent_exchanges": info.get("opt_rounds"), "grad_norms": [round(x, 3) for x in norms],
            "grad_norm_end": info.get("opt_grad_norm"), "newton_decrement": info.get("opt_newton_decrement"),
            "exchanges": info.get("prep_exchanges"), "uplink": info.get("prep_uplink_bits"),
            "downlink": info.get("prep_downlink_bits"), "by_kind": info.get("prep_bits"),
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a row: the main job with this key set (repeat for more rows; none: the main job itself)")
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
        rows.append(row)
    path = out(HERE / a.out)
    path.write_text(json.dumps({"command": "python benchmarks/bench_preparation.py " + " ".join(sys.argv[1:]),
                                "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
