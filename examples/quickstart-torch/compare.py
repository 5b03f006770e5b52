"""QLSD++ and FedAvg on the same clients, model and prior: one table.

    python examples/quickstart-torch/compare.py            # about 2 min on 2 cores

The quickstart's network (qlsd_quickstart/task.py) on wine, 30 % of the points held out, the rest
split over 4 clients. QLSD++ samples the posterior (4 chains in one Flower run); Flower's own
FedAvg trains the same model on the MAP objective of the same posterior
(:func:`qlsd_flwr.flower.make_fedavg_client_app`). Both run on an in-process Flower grid
(:class:`qlsd_flwr.flower.InProcessGrid`); under ``flwr run`` the same strategies and ClientApps
run unchanged. The table: accuracy, nNLL, ECE and Brier of QLSD++'s posterior predictive and
of FedAvg's plug-in predictive on the held-out points.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

from flwr.app import ArrayRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qlsd_quickstart.task import PRIOR_VAR, held_out_data, potential  # noqa: E402

from qlsd_flwr import posterior_predictive, predictive_metrics  # noqa: E402
from qlsd_flwr.flower import (  # noqa: E402
    InProcessGrid,
    QLSDStrategy,
    fedavg_strategy,
    make_client_app,
    make_fedavg_client_app,
    plug_in_probs,
)

B = 4


def main(rounds: int = 1500, fedavg_rounds: int = 30, out: str | None = None) -> dict:
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower's FedAvg logs every round at INFO
    pots = [potential(i, B) for i in range(B)]  # the app's clients: the points not held out, split in 4
    X_te, y_te = held_out_data()
    node = lambda context: pots[int(context.node_config["partition-id"])]  # noqa: E731
    theta0 = ArrayRecord(pots[0].named_arrays())
    out = out or tempfile.mkdtemp(prefix="compare-")

    qlsd = QLSDStrategy(num_clients=B, dim=pots[0].dim, variant="qlsd-pp", gamma="auto", metric="diagonal",
                        num_rounds=rounds, burn_in=rounds // 2, thin=5, num_chains=4, init="dispersed", s=16,
                        prior_var=PRIOR_VAR, seed=0, output_dir=out, run_name="qlsd-pp", progress=False,
                        heldout=(pots[0], X_te, y_te))  # the verdict reads the predictive on them
    qlsd.start(InProcessGrid(make_client_app(node), B), initial_arrays=theta0)
    p_qlsd = posterior_predictive(qlsd.run_dir, pots[0], X_te)  # all kept draws of the 4 chains

    fed_app = make_fedavg_client_app(node, prior_var=PRIOR_VAR, n_total=sum(p.n_data for p in pots))
    result = fedavg_strategy(B).start(InProcessGrid(fed_app, B), initial_arrays=theta0, num_rounds=fedavg_rounds)
    p_fed = plug_in_probs(pots[0], result.arrays, X_te)

    rows = {"QLSD++ (posterior predictive)": predictive_metrics(p_qlsd, y_te),
            "FedAvg (plug-in)": predictive_metrics(p_fed, y_te)}
    print(f"{'method':32s} {'acc %':>6s} {'nNLL':>7s} {'ECE':>7s} {'Brier':>7s}   ({len(y_te)} held-out points)")
    for name, m in rows.items():
        print(f"{name:32s} {100 * m['accuracy']:6.1f} {m['nnll']:7.3f} {m['ece']:7.4f} {m['brier']:7.4f}")
    conv = qlsd.summary_data.get("convergence", {})
    print(f"QLSD++ convergence: {conv.get('verdict', '?')}; samples and summary in {qlsd.run_dir}")
    return rows


if __name__ == "__main__":
    main()
