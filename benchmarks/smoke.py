"""Reduced-size runs of the documented benchmark and simulation commands, so that a test can run
every command the docs give (issue 22: "every command in the docs is run by a test or by CI").

With ``QLSD_SMOKE=<folder>`` in the environment, each script under ``benchmarks/`` and
``simulations/`` runs the documented command through the same code at a size that takes seconds
(a few rounds, a few draws, one repeat), swaps Flower's Ray engine for the in-process one (the Ray
engine has its own tests), and writes its results under ``<folder>`` instead of over the recorded
ones. Only ``tests/test_docs_commands.py`` sets it; a smoke run's numbers mean nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

SMOKE = os.environ.get("QLSD_SMOKE", "")


def small(full, smoke):
    """``full`` normally, ``smoke`` under ``QLSD_SMOKE``."""
    return smoke if SMOKE else full


def out(path) -> Path:
    """Where a result goes: ``path`` normally, the same name inside the smoke folder under
    ``QLSD_SMOKE`` (so a smoke run never overwrites a recorded result)."""
    path = Path(path)
    return folder(path.parent) / path.name if SMOKE else path


def engine(name: str) -> str:
    """The engine a script asked for, with ``ray`` made ``inprocess`` under ``QLSD_SMOKE``."""
    return "inprocess" if SMOKE and name == "ray" else name


def few(items, n: int = 1):
    """``items`` (a sequence or dict) normally, its first ``n`` under ``QLSD_SMOKE``: a smoke run
    takes one row of a table through the code, not every row."""
    if not SMOKE:
        return items
    if isinstance(items, dict):
        return dict(list(items.items())[:n])
    return list(items)[:n]


def run_apps(server_app, client_app, num_nodes: int, backend_config: dict) -> None:
    """Flower's ``run_simulation`` (the Ray engine) normally; under ``QLSD_SMOKE`` the same apps on
    the in-process grid (:class:`qlsd_flwr.flower.inprocess.InProcessGrid`)."""
    if not SMOKE:
        from flwr.simulation import run_simulation

        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_nodes,
                       backend_config=backend_config)
        return
    from flwr.app import Context, RecordDict

    from qlsd_flwr.flower.inprocess import InProcessGrid

    server_app(InProcessGrid(client_app, num_nodes),
               Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))


def run_ray(overrides: dict, **kwargs):
    """:func:`qlsd_flwr.run.simulate.run_ray` normally, :func:`~qlsd_flwr.run.simulate.run_inprocess`
    under ``QLSD_SMOKE``; returns the finished strategy."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.run import simulate

    o = {**overrides, "engine": engine(overrides.get("engine", "ray"))}
    return (simulate.run_inprocess if SMOKE else simulate.run_ray)(resolve(o), o, **kwargs)


def folder(default) -> Path:
    """A folder for results: ``default`` normally, the smoke folder under ``QLSD_SMOKE``."""
    if not SMOKE:
        return Path(default)
    Path(SMOKE).mkdir(parents=True, exist_ok=True)
    return Path(SMOKE)
