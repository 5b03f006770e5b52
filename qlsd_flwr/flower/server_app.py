"""The Flower ``ServerApp``: reads the run config, builds the strategy, writes the outputs."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from qlsd_flwr.config import resolve
from qlsd_flwr.flower.strategy import QLSDStrategy
from qlsd_flwr.tasks import loading


def quiet_flower(verbose: bool) -> None:
    """Flower logs every round at INFO; a progress bar replaces that unless ``verbose``."""
    level = logging.INFO if verbose else logging.ERROR
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(level)
    logging.getLogger("qlsd_flwr").setLevel(logging.DEBUG if verbose else logging.INFO)


def make_server_app(overrides: dict | None = None, sink: dict | None = None,
                    strategy_kwargs: dict | None = None) -> ServerApp:
    """A ServerApp; ``overrides`` are run-config values, ``sink`` receives the finished strategy
    (the ServerApp runs in the caller's process under ``run_simulation``)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        cfg = resolve({**dict(context.run_config), **(overrides or {})})
        quiet_flower(cfg.verbose)
        task = loading.load_task(cfg)
        strategy = QLSDStrategy.from_config(cfg, task, **(strategy_kwargs or {}))
        strategy.start(grid=grid)
        if sink is not None:
            sink["strategy"] = strategy

    return app


app = make_server_app()
