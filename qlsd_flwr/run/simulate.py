"""One entry point for every engine, chosen by the ``engine`` key of the run config.

* ``ray``        — Flower's simulation engine (Ray), one virtual SuperNode per client.
* ``inprocess``  — the same ServerApp strategy and ClientApp over :class:`InProcessGrid`.
* ``local``      — the framework-free loop (:mod:`qlsd_flwr.engines.local`).
* ``vectorised`` — many chains at once, vectorised over clients (:mod:`qlsd_flwr.engines.vectorised`).

All write the same output folder (see :mod:`qlsd_flwr.outputs.recorder`).

``checkpoint-every = N`` saves the chain every ``N`` rounds; ``resume = <run folder>`` continues
a killed run in its folder from its last checkpoint, bitwise as if it had never stopped
(``qlsd-flwr run --set resume=outputs/<run>``; the folder's ``config.json`` supplies every other
key; see :mod:`qlsd_flwr.outputs.checkpoint`). ``local``, ``inprocess`` and ``ray`` share one checkpoint
format and may resume each other's runs.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from qlsd_flwr.config import RunConfig, resolve
from qlsd_flwr.core.potential import Task
from qlsd_flwr.outputs.resume import resume_overrides
from qlsd_flwr.tasks import loading


@dataclass
class Outcome:
    summary: dict
    run_dir: Path | None
    detail: object = None  # the strategy (Flower engines) or RunResult (local engines)


def run(overrides: dict | None = None, **kwargs) -> Outcome:
    overrides = resume_overrides(overrides)  # resume: the run folder's config under the overrides
    cfg = resolve(overrides)
    if not cfg.get("resume") and kwargs.get("write", True):
        from qlsd_flwr.outputs.run_dir import refuse_taken

        refuse_taken(cfg.get("output-dir"), cfg.get("run-name"))  # before the preparation's exchanges
    if cfg.engine == "local":
        from qlsd_flwr.engines.local import run_local

        res = run_local(cfg, **kwargs)
        out = Outcome(res.summary, res.run_dir, res)
    elif cfg.engine == "vectorised":
        from qlsd_flwr.engines.vectorised import run_vectorised

        res = run_vectorised(cfg, **kwargs)
        out = Outcome(res.summary, res.run_dir, res)
    else:
        strat = (run_inprocess if cfg.engine == "inprocess" else run_ray)(cfg, overrides or {}, **kwargs)
        out = Outcome(strat.summary_data, strat.run_dir, strat)
    from qlsd_flwr.evaluation.report import draw_overview

    draw_overview(out.run_dir, cfg.get("plot"))  # every engine (the Flower strategy drew it already)
    return out


def run_inprocess(cfg: RunConfig, overrides: dict, shuffle_seed: int | None = None, mods=None,
                  strategy_kwargs: dict | None = None, is_up=None):
    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.flower.server_app import quiet_flower
    from qlsd_flwr.flower.strategy import QLSDStrategy

    quiet_flower(cfg.verbose)
    grid = InProcessGrid(make_client_app(overrides=overrides, mods=mods), cfg.b, shuffle_seed=shuffle_seed, is_up=is_up)
    strategy = QLSDStrategy.from_config(cfg, loading.load_task(cfg), **{"engine_label": "flower-inprocess", **(strategy_kwargs or {})})
    strategy.start(grid=grid)
    return strategy


def ray_backend_config(cfg: RunConfig) -> dict:
    init_args = {"logging_level": logging.ERROR, "log_to_driver": cfg.verbose}
    address = os.environ.get("QLSD_RAY_ADDRESS")
    if address:  # attach to an existing Ray cluster (``ray start --head``)
        init_args["address"] = address
    else:
        init_args["num_cpus"] = os.cpu_count() or 2
    cpus = float(cfg.get("client-cpus"))
    gpus = 0.0
    if str(cfg.get("device")).lower().startswith("cuda"):
        # share one GPU among the clients that can run at once (CPU-bound concurrency)
        concurrent = max(1, min(cfg.b, int((os.cpu_count() or 2) / max(cpus, 1e-9))))
        gpus = 1.0 / concurrent
    return {"client_resources": {"num_cpus": cpus, "num_gpus": gpus}, "init_args": init_args}


def keep_our_sigterm(backend_config: dict) -> bool:
    """Start Ray here, as Flower's backend would (:class:`RayBackend`: its own ``ray.init``), and keep
    the SIGTERM handler this process had (our CLI's), which ``ray.init`` replaces with ``sys.exit(15)``.

    Why: under Ray's handler, SIGTERM unwinds Flower's simulation loop in the main thread, whose
    ``finally`` tears the Ray actors down under the messages in flight before the ServerApp's run hears
    of the stop; Flower then logged each of them with its traceback (a CI run's SIGTERM test, 1 in
    some dozens). Under ours the stop goes as Ctrl-C's does: the run is asked first
    (:func:`qlsd_flwr.flower.stopping.Stopper.request`, which quiets those errors), ends at the next
    round and closes its outputs, and only then does Flower tear down. Nothing happens off the main
    thread, with no handler of ours (a user's script: Ray's ``sys.exit(15)`` stays, caught in
    :func:`run_ray`), or when Ray is already initialised in this process. ``True`` when it started Ray."""
    import threading

    import ray

    if threading.current_thread() is not threading.main_thread() or ray.is_initialized():
        return False
    ours = signal.getsignal(signal.SIGTERM)
    if not callable(ours):
        return False
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    try:  # ray_backend_config sets the init_args defaults run_simulation would add, so Ray starts as there
        RayBackend(backend_config)
    except BaseException as exc:
        if ray.is_initialized():  # started, then failed: nothing of it stays
            ray.shutdown()
        if isinstance(exc, SystemExit) and exc.code == signal.SIGTERM:  # SIGTERM while Ray started, under its handler
            raise KeyboardInterrupt("SIGTERM") from None  # our CLI's stop, as its handler has it
        raise
    finally:
        signal.signal(signal.SIGTERM, ours)
    return True


def run_ray(cfg: RunConfig, overrides: dict, mods=None, strategy_kwargs: dict | None = None):
    """Run on Flower's Ray simulation engine; returns the finished strategy."""
    from flwr.simulation import run_simulation

    from qlsd_flwr.flower.client_app import make_client_app
    from qlsd_flwr.flower.server_app import make_server_app, quiet_flower
    from qlsd_flwr.flower.stopping import RunStopped, stop_in_thread

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    quiet_flower(cfg.verbose)
    sink: dict = {}
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    failure: dict = {}
    kwargs = {"engine_label": "flower-ray", "failure_sink": failure, **(strategy_kwargs or {})}
    backend_config = ray_backend_config(cfg)
    started = False
    try:
        started = keep_our_sigterm(backend_config)
        run_simulation(server_app=make_server_app(overrides, sink, kwargs),
                       client_app=make_client_app(overrides=overrides, mods=mods), num_supernodes=cfg.b,
                       backend_config=backend_config, verbose_logging=cfg.verbose)
    except RunStopped:  # a signal to our CLI stopped the ServerApp's thread: its KeyboardInterrupt, here
        raise failure["error"] from None
    except SystemExit as exc:  # SIGTERM, as ray.init's handler has it: the ServerApp's run stops and closes
        if exc.code != signal.SIGTERM or not stop_in_thread("SIGTERM"):
            raise
        raise failure.get("error", KeyboardInterrupt("SIGTERM")) from None
    finally:
        import ray

        if started and ray.is_initialized():  # Flower shuts Ray down with its backend; not if it failed first
            ray.shutdown()
    if "error" in failure:  # e.g. the chain diverged: the ServerApp's error, not Flower's
        raise failure["error"]
    if "strategy" not in sink:
        raise RuntimeError("the Flower simulation ended without finishing the run; "
                           "rerun with verbose=true to see Flower's log")
    return sink["strategy"]


def run_legacy_simulation(cfg: RunConfig, overrides: dict, task: Task | None = None, **strategy_kwargs):
    """Run the legacy pair on Flower's Ray engine; returns the strategy."""
    from flwr.client import ClientApp
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.simulation import run_simulation

    from qlsd_flwr.flower.legacy import LegacyQLSDStrategy, make_numpy_client_fn
    from qlsd_flwr.flower.server_app import quiet_flower

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    quiet_flower(cfg.verbose)
    strategy = LegacyQLSDStrategy(cfg, task or loading.load_task(cfg), **strategy_kwargs)
    server_app = ServerApp(server_fn=lambda ctx: ServerAppComponents(
        strategy=strategy, config=ServerConfig(num_rounds=cfg.num_rounds)))
    client_app = ClientApp(client_fn=make_numpy_client_fn(overrides))
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=cfg.b,
                   backend_config=ray_backend_config(cfg))
    return strategy
