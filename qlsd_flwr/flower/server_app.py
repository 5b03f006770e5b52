"""The Flower ``ServerApp``: reads the run config, builds the strategy, writes the outputs."""

from __future__ import annotations

import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from qlsd_flwr.config import resolve
from qlsd_flwr.flower.logs import one_line_errors
from qlsd_flwr.flower.strategy import QLSDStrategy
from qlsd_flwr.outputs.resume import flwr_run_config
from qlsd_flwr.tasks import loading


def quiet_flower(verbose: bool) -> None:
    """Flower logs every round at INFO; a progress bar replaces that unless ``verbose``. Our
    errors reach Flower's log as one line (:class:`OneLineErrors`)."""
    level = logging.INFO if verbose else logging.ERROR
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(level)
    one_line_errors()
    logging.getLogger("qlsd_flwr").setLevel(logging.DEBUG if verbose else logging.INFO)


def evaluate_task_held_out(cfg, run_dir) -> None:
    """For a classification task, the held-out evaluation (``evaluation.json``, the reliability
    diagram) and the ``heldout_log_likelihood``, ``predictions`` and ``observed_data`` groups in
    ``samples.nc``, as ``qlsd-flwr run`` writes them; nothing for other tasks (a user's app gives
    its own data: ``QLSDStrategy(heldout=...)``)."""
    from qlsd_flwr.evaluation.evaluate import evaluate_classification
    from qlsd_flwr.flower.finish import announce_held_out

    if (ev := evaluate_classification(cfg.task, run_dir)) is not None:
        announce_held_out(cfg, ev, int(ev["n_test"]))


def flower_line(line: str, level: int = logging.INFO) -> None:
    """One line into Flower's log, whatever the level ``quiet_flower`` set (its handlers: the
    console, and in a deployment's ServerApp process the uploader behind ``flwr log``)."""
    flwr_log = logging.getLogger("flwr")
    flwr_log.handle(flwr_log.makeRecord(flwr_log.name, level, __file__, 0, line, (), None))


class ToFlowerLog(logging.Handler):
    """The package's own log records (the convergence report, warnings) into Flower's log."""

    def emit(self, record: logging.LogRecord) -> None:
        flower_line(record.getMessage(), record.levelno)


def log_into_flower() -> None:
    """Under ``flwr run``: progress, announcements and the package's log records go to Flower's
    log, which ``flwr log`` shows on every path (a deployment's ServerApp process does not copy
    standard error there)."""
    from qlsd_flwr.outputs.progress import set_sink

    set_sink(flower_line)
    ours = logging.getLogger("qlsd_flwr")
    if not any(isinstance(h, ToFlowerLog) for h in ours.handlers):
        ours.addHandler(ToFlowerLog())
        ours.propagate = False


def make_server_app(overrides: dict | None = None, sink: dict | None = None,
                    strategy_kwargs: dict | None = None, evaluate: bool = False) -> ServerApp:
    """A ServerApp; ``overrides`` are run-config values, ``sink`` receives the finished strategy
    (the ServerApp runs in the caller's process under ``run_simulation``); ``evaluate``: the
    held-out evaluation at the end (:func:`evaluate_task_held_out`; the app of ``flwr run``, whereas
    ``qlsd-flwr run`` evaluates after any engine)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        one_line_errors()  # before the configuration is read: its errors too
        if evaluate:  # the flwr run app: progress, announcements and warnings into flwr log
            log_into_flower()
        cfg = resolve(flwr_run_config({**dict(context.run_config), **(overrides or {})}))  # resume: the saved keys
        quiet_flower(cfg.verbose)
        task = loading.load_task(cfg)
        strategy = QLSDStrategy.from_config(cfg, task, **(strategy_kwargs or {}))
        strategy.start(grid=grid)
        if evaluate:
            evaluate_task_held_out(cfg, strategy.run_dir)
        if sink is not None:
            sink["strategy"] = strategy

    return app


app = make_server_app(evaluate=True)
