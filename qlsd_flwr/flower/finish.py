"""What a finished :class:`~qlsd_flwr.flower.QLSDStrategy` run adds to its run folder on every Flower
path (``flwr run``, a user's own ServerApp, the in-process grid): the federated LOO, the overview
plot and, when the strategy was given held-out data (``heldout``), the held-out evaluation that
``qlsd-flwr run`` writes for its classification tasks, whose predictive R-hat the verdict then reads."""

from __future__ import annotations

import json
from pathlib import Path

from qlsd_flwr.flower.loo_phase import after_sampling
from qlsd_flwr.outputs.progress import announce


def check_heldout(strategy, theta0) -> None:
    """``heldout`` tried before the run, so that a mistake costs a second, not the run: the run must
    write its folder, the predictor must give one probability row a held-out input at ``θ_0`` and
    every label must be one of its classes. ``ConfigError`` naming ``heldout``."""
    import numpy as np

    from qlsd_flwr.config import ConfigError

    heldout = strategy.task.meta.get("heldout")
    if heldout is None:
        return
    if strategy.server.observer is None:  # write = False (the run folder itself is made when the chain begins)
        raise ConfigError("heldout: the held-out evaluation is written to the run folder; set write = True")
    predictor, X, y = heldout
    try:
        probs = np.asarray(predictor.predict_proba(np.asarray(theta0, dtype=np.float64)[None], X[:2]))
    except Exception as exc:  # noqa: BLE001 — the user's predictor: any failure is named, before the run
        raise ConfigError(f"heldout: predictor.predict_proba(θ_0, X[:2]) failed: {type(exc).__name__}: {exc}") from None
    if probs.ndim != 2 or probs.shape[0] != min(2, len(X)):
        raise ConfigError(f"heldout: predict_proba(θ_0, X[:2]) gave shape {probs.shape}, expected (2, classes)")
    if y.min() < 0 or y.max() >= probs.shape[1]:
        raise ConfigError(f"heldout: labels must be in 0..{probs.shape[1] - 1} (the predictor's classes), got "
                          f"{int(y.min())}..{int(y.max())}")


def announce_held_out(cfg, ev: dict, n: int) -> None:
    """The held-out evaluation's line (every path that evaluates: the repository's app, a user's)."""
    announce(f"{cfg.variant}: held-out accuracy {100 * ev['accuracy']:.1f} %, nNLL {ev['nnll']:.4f}, "
             f"ECE {ev['ece']:.4f} on {n} points (evaluation.json, reliability.png; heldout_log_likelihood in "
             "samples.nc)", cfg.progress)


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
        verdict = json.loads((Path(run_dir) / "summary.json").read_text()).get("convergence")
        if verdict is not None:
            strategy.summary_data["convergence"] = verdict
        announce_held_out(cfg, ev, len(y))
