"""What a finished :class:`~qlsd_flwr.flower.QLSDStrategy` run adds to its run folder on every Flower
path (``flwr run``, a user's own ServerApp, the in-process grid): the federated LOO, the overview
plot and, when the strategy was given held-out data (``heldout``), the held-out evaluation that
``qlsd-flwr run`` writes for its classification tasks, whose predictive R-hat the verdict then reads."""

from __future__ import annotations

import json
from pathlib import Path

from qlsd_flwr.flower.loo_phase import after_sampling
from qlsd_flwr.outputs.progress import announce


def finish_run(strategy, grid) -> None:
    cfg, run_dir = strategy.cfg, strategy.run_dir
    after_sampling(strategy, grid)  # the federated LOO (key loo), into samples.nc and summary.json
    # lazily: the strategy's modules import no evaluation (matplotlib, the predictors) until a run ends
    from qlsd_flwr.evaluation.report import draw_overview

    draw_overview(run_dir, cfg.get("plot"))
    if run_dir is None:
        return
    announce(f"{cfg.variant}: {strategy.state.k} rounds done; samples in "
             f"{Path(run_dir).resolve() / 'samples.nc'} (arviz.from_netcdf)", cfg.progress)
    heldout = strategy.task.meta.get("heldout")
    if heldout is not None:
        from qlsd_flwr.evaluation.evaluate import evaluate_held_out

        predictor, X, y = heldout
        ev = evaluate_held_out(run_dir, predictor, X, y, cfg, title=f"{cfg.variant}: held-out data")
        # the verdict the evaluation gave (summary.json), for callers reading strategy.summary_data
        strategy.summary_data["convergence"] = json.loads((Path(run_dir) / "summary.json").read_text())["convergence"]
        announce(f"{cfg.variant}: held-out accuracy {100 * ev['accuracy']:.1f} %, nNLL {ev['nnll']:.4f}, "
                 f"ECE {ev['ece']:.4f} on {len(y)} points (evaluation.json, reliability.png; "
                 "heldout_log_likelihood in samples.nc)", cfg.progress)
