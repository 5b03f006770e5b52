"""Command line: ``qlsd-flwr demo | run | plot | config | check`` (the text of ``--help`` is :data:`HELP`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qlsd_flwr import __version__
from qlsd_flwr.config import ConfigError
from qlsd_flwr.keys_text import help_text, markdown_table, pyproject_block
from qlsd_flwr.protocol.divergence import DivergenceError
from qlsd_flwr.protocol.wire import PhaseError

HELP = """QLSD, QLSD#, QLSD* and QLSD++ (Vono et al., AISTATS 2022): federated Langevin sampling on Flower.

  qlsd-flwr demo [key=value ...]
      The main job: QLSD++ on the offline MNIST subset, split non-IID (dominant label) over 20
      virtual clients on Flower's Ray engine, next to Flower's FedAvg on the same clients. Prints
      one comparison table; writes plots, the posterior samples and comparison.json (a few
      minutes on 2 cores). key=value overrides go to QLSD++ (shared keys such as num-clients to
      both), plus fedavg-rounds, fedavg-epochs, fedavg-lr.
  qlsd-flwr demo --toy [key=value ...]
      The toy Gaussian demo (QLSD++, 20 clients, Ray, about a minute); its table compares the
      samples with the exact posterior.
  qlsd-flwr run --config conf/gaussian_qlsdpp_ray.toml [--set key=value ...]
      Any configuration, on the engine its `engine` key names (ray, inprocess, local, vectorised).
  qlsd-flwr plot RUN_DIR
      Draw a run's overview plot again.
  qlsd-flwr config [--toml | --markdown]
      Every run-config key with its default, paper symbol, allowed values and meaning (--toml: the
      [tool.flwr.app.config] block; --markdown: docs/CONFIGURATION.md's table). `qlsd-flwr run --help` lists
      them too.
  qlsd-flwr check [APP_DIR] [--run-config STRING]
      Before `flwr run APP_DIR --run-config STRING`: the keys APP_DIR/pyproject.toml (default .)
      declares in [tool.flwr.app.config], and the run config's keys and values. Flower refuses a key
      the app does not declare with only "[code: 15] Invalid run configuration."; this names it, with
      a did-you-mean, one line a problem (exit 2; docs/CONFIGURATION.md gives the rule for an app's
      own keys).
"""

# the toy Gaussian demo (``qlsd-flwr demo --toy``; also conf/gaussian_qlsdpp_ray.toml)
DEMO = {"task": "gaussian", "variant": "qlsd-pp", "num-clients": 20, "dim": 50, "num-rounds": 300,
        "burn-in": 100, "gamma": 4.9e-4, "s": "16", "p": "0.5", "l": 50, "engine": "ray",
        "run-name": "", "output-dir": "outputs"}


def parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = _auto(v.strip())
    return out


def _auto(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    return v.strip('"')


class InputError(Exception):
    """A file or folder given on the command line cannot be used (one line, exit code 2)."""


def load_config_file(path: str) -> dict:
    """A TOML file: either flat keys or a ``[tool.flwr.app.config]`` table."""
    from qlsd_flwr.deploy.appcheck import read_toml

    data = read_toml(Path(path), f"config file {path}", InputError)
    return data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", data)


def execute(overrides: dict) -> int:
    from qlsd_flwr.evaluation.report import draw_overview, table
    from qlsd_flwr.run import simulate

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    outcome = simulate.run(overrides)
    print("\nQLSD run finished\n" + table(outcome.summary, outcome.run_dir))
    if outcome.run_dir is not None:
        import json

        from qlsd_flwr.evaluation.evaluate import evaluate_classification

        saved = json.loads((outcome.run_dir / "config.json").read_text())
        if (ev := evaluate_classification(saved["resolved"]["task"], outcome.run_dir)) is not None:  # held-out
            print(f"  held-out: accuracy {100 * ev['accuracy']:.1f} %, nNLL {ev['nnll']:.4f}, ECE {ev['ece']:.4f}"
                  " (evaluation.json; heldout_log_likelihood and predictions in samples.nc)")
        for p in draw_overview(outcome.run_dir, saved["config"].get("plot", True)):  # drawn by the run already
            print(f"  plot: {p}")
        print(f"  samples load with: arviz.from_netcdf('{outcome.run_dir / 'samples.nc'}')")
    return 0


def _sigterm_stops_cleanly():
    """SIGTERM (a scheduler's stop, ``kill``) and SIGINT (Ctrl-C) stop a run the same way: a
    ``KeyboardInterrupt`` in the main thread, deferred while a round's row and draw are being
    written (:func:`qlsd_flwr.outputs.stopsignal.stop_signal`), so the engines close their outputs
    consistently instead of dying with files open. Returns the handlers it replaced (``None``
    off the main thread)."""
    import signal
    import threading

    from qlsd_flwr.outputs.stopsignal import stop_signal

    if threading.current_thread() is not threading.main_thread():
        return None
    # Ray's driver installs a C failure-signal handler over SIGTERM at ray.init (engine = ray), which
    # aborted this process before Python's handler ran: no samples.nc, no summary.json, a stale .lock
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    names = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}
    return {sig: signal.signal(sig, lambda signum, frame: stop_signal(names[signum])) for sig in names}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="qlsd-flwr", description=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"qlsd-flwr {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the main job: QLSD++ vs FedAvg on heterogeneous MNIST (Ray)")
    d.add_argument("--toy", action="store_true",
                   help="run the toy Gaussian demo instead (about 1 minute)")
    d.add_argument("sets", nargs="*", help="key=value overrides")
    from qlsd_flwr.keys_text import help_text

    r = sub.add_parser("run", help="run a configuration", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="run-config keys (key = default (symbol), then meaning and allowed values):\n\n"
                              + help_text())
    r.add_argument("--config", help="TOML file with run-config keys")
    r.add_argument("--set", dest="sets", action="append", default=[], help="key=value (repeatable)")
    p = sub.add_parser("plot", help="draw a run's overview plot")
    p.add_argument("run_dir")
    c = sub.add_parser("config", help="every run-config key with its default and allowed values")
    fmt = c.add_mutually_exclusive_group()
    fmt.add_argument("--toml", action="store_true", help="as the [tool.flwr.app.config] block")
    fmt.add_argument("--markdown", action="store_true", help="as docs/CONFIGURATION.md's table")
    k = sub.add_parser("check", help="a Flower app's run-config keys, and a --run-config, before `flwr run`")
    k.add_argument("app_dir", nargs="?", default=".", help="the app's folder (its pyproject.toml), default .")
    k.add_argument("--run-config", dest="run_config", action="append", default=[], metavar="STRING",
                   help="what `flwr run` would get: 'k=v k2=\"text\"' or a .toml file (repeatable)")
    args = ap.parse_args(argv)
    previous = _sigterm_stops_cleanly()
    try:
        return _dispatch(args)
    finally:
        if previous is not None:
            import signal

            from qlsd_flwr.outputs import stopsignal

            for sig, handler in previous.items():
                signal.signal(sig, handler)
            stopsignal.clear()  # the run it stopped is closed: the next one (in this process) starts clean


def _dispatch(args) -> int:
    from qlsd_flwr.outputs.run_dir import OPENED

    before = len(OPENED)  # the run folders locked before this command (a process may run several)
    try:
        if args.cmd == "demo":
            if args.toy:
                return execute({**DEMO, **parse_sets(args.sets)})
            from qlsd_flwr.experiments.mainjob import run_main_job

            return run_main_job(parse_sets(args.sets))
        if args.cmd == "run":
            base = load_config_file(args.config) if args.config else {}
            return execute({**base, **parse_sets(args.sets)})
        if args.cmd == "config":
            print(pyproject_block() if args.toml else markdown_table() if args.markdown else help_text(), end="")
            return 0
        if args.cmd == "check":
            from qlsd_flwr.deploy.appcheck import check_app

            return check_app(args.app_dir, args.run_config).emit()
        if args.cmd == "plot":
            from qlsd_flwr.evaluation.report import plot_run

            run_dir = Path(args.run_dir)
            if not (run_dir / "summary.json").is_file() and not (run_dir / "metrics.csv").is_file():
                raise InputError(f"plot: {args.run_dir} is not a run folder (no summary.json or metrics.csv)")
            for path in plot_run(run_dir):
                print(path)
            return 0
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        sig = "SIGTERM" if str(exc) == "SIGTERM" else "Ctrl-C"
        if len(OPENED) > before:
            print(f"qlsd-flwr: stopped by {sig}; the run folder {OPENED[-1]} holds every draw and round so far "
                  "(samples.nc, metrics.csv, summary.json with 'stopped')", file=sys.stderr)
        else:  # in the preparation (or before it): no run folder was begun
            print(f"qlsd-flwr: stopped by {sig} before the run began writing (in its preparation); no run folder "
                  "was made", file=sys.stderr)
        return 143 if sig == "SIGTERM" else 130
    except (InputError, PhaseError) as exc:  # PhaseError: a client's unusable reply before sampling, named
        print(f"qlsd-flwr: {exc}", file=sys.stderr)
        return 2
    except DivergenceError as exc:  # a run-away chain: one line; the run folder keeps the rounds before it
        print(f"qlsd-flwr: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # an output folder that cannot be made or written, a full disk, ...
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"qlsd-flwr: cannot write or read{where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
