"""Test-suite plumbing.

``./dev test`` runs pytest with two xdist workers (``-n 2 --dist loadgroup``). Every test that
starts a Ray cluster (Flower's Ray engine in this process or under ``flwr run``) goes to the group
``ray``, and every other test that starts real SuperLink/SuperNode processes to the group
``deployment``: each group runs one test after another in one worker (never two Ray clusters or
two deployments at once), the two groups side by side, and the CPU-bound tests fill the workers
around them. The groups are collected first, so that they start at once. Without xdist the
markers are inert.

Ray starts its workers at nice 15 (``RAY_worker_niceness``), so on 2 cores a CPU-bound test beside a
Ray run took most of its actors' time (a Ray test measured 29 s beside one busy process, 22 s at nice
0, 20 s alone); here they run at the other tests' priority. Nothing a run computes depends on it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_worker_niceness", "0")  # before any Ray start, inherited by flwr's processes
GROUPS = ("ray", "deployment")  # a test's group: the first of these markers it has


def _group(item) -> str | None:
    return next((g for g in GROUPS if item.get_closest_marker(g)), None)


def pytest_configure(config):
    """SIGTERM (``pkill``, a CI job's timeout) ends the run as Ctrl-C does, so fixtures' teardown still stops by
    PID the SuperLinks, SuperNodes and Ray heads the tests started: killed by the default handler, a test worker
    left a ``flwr run`` of 10⁶ rounds (the stop/resume tests) running behind it, a core's share for an hour."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marker into the group
def pytest_collection_modifyitems(config, items):
    engines = set()
    for item in items:
        if (group := _group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            engines.add(item.nodeid)
    # the groups are the suite's longest units of work (about 6 and 4 of its minutes): collected
    # first, each starts at once in its own worker and the other tests fill in around them, instead
    # of starting after whatever a worker was handed before (a stable sort keeps each file's order)
    items.sort(key=lambda it: it.nodeid not in engines)



@pytest.fixture(autouse=True)
def _overview_only_where_asked(monkeypatch):
    """``overview.png`` costs about 1 s of matplotlib a run and the suite makes hundreds of runs, so
    in this process the key ``plot`` defaults to false. The tests of the plot ask for it
    (``plot = true``), and the runs in Flower's own processes (``flwr run``, the deployments) draw it
    with the package's default, which those tests check."""
    from qlsd_flwr import keys

    monkeypatch.setitem(keys.DEFAULTS, "plot", False)


def pytest_runtest_setup(item):
    """Under ``--dist loadgroup``, an engine test fails unless xdist really put it in the group:
    with pytest 9.2 and xdist 3.8 the grouping silently did nothing (pytest's node ids no longer
    come from the attribute xdist rewrites), and Ray runs and deployments then ran side by side
    on 2 cores, timing out a deployment test. Hence ``pytest<9`` in the test extra."""
    if not getattr(item.config.option, "loadgroup", False):  # not an xdist worker in loadgroup mode
        return
    if (group := _group(item)) is not None and not item.nodeid.endswith(f"@{group}"):
        pytest.fail(f"xdist did not put this engine test in the '{group}' group, so it may run beside "
                    "another Ray run or deployment; check the pytest / pytest-xdist versions", pytrace=False)


@pytest.fixture()
def quickstart(monkeypatch):
    """``examples/quickstart-torch``'s ``task`` module (its model, data and potentials), imported from
    the example's folder and forgotten after the test."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples" / "quickstart-torch"))
    from qlsd_quickstart import task

    yield task
    for name in ("qlsd_quickstart", "qlsd_quickstart.task"):
        sys.modules.pop(name, None)
