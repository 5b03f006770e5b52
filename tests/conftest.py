"""Test-suite plumbing.

``./dev test`` runs pytest with three xdist workers (``-n 3 --dist loadgroup``) on the 2-core machine. Every test
that starts Flower's Ray engine goes to the group ``engines`` and every test that starts only real
SuperLink/SuperNode processes to ``deployments``: each group runs one test at a time in one worker (never two Ray
clusters or two deployments at once), and the CPU-bound tests take the third worker and whatever the groups leave.
A deployment test mostly waits on Flower's fixed 3 s polls, so the third worker uses that idle core: measured on
2026-12-06 (the working copy, idle), 1,054 tests in 650 s with two workers and one group, 593 s with three workers and
one group, 572 s with three workers and the two groups. (On 2026-12-03 three workers had measured slower, 834 s
against 768 s, on that day's suite, not examined; and a deployment test once timed out beside Ray runs, whose waits
have been lengthened since.) Both groups are collected
first, so that they start at once. Without xdist the markers are inert.

Ray starts its workers at nice 15 (``RAY_worker_niceness``), so on 2 cores a CPU-bound test beside a
Ray run took most of its actors' time (a Ray test measured 29 s beside one busy process, 22 s at nice
0, 20 s alone; 199 s against 17 s beside a run left going by a failed test); here they run at the
other tests' priority. Nothing a run computes depends on it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_worker_niceness", "0")  # before any Ray start, inherited by flwr's processes


def _engine(item) -> bool:
    """Starts Ray or real SuperLink/SuperNode processes: a test of the group "engines" or "deployments"."""
    return bool(item.get_closest_marker("ray") or item.get_closest_marker("deployment"))


def _group(item) -> str:
    """``engines`` for a test that starts Ray (its own or the session's head; ``flwr run``'s simulation too),
    ``deployments`` for one that starts only SuperLink/SuperNode processes: the two run beside each other, each
    group one test at a time."""
    return "engines" if item.get_closest_marker("ray") else "deployments"


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
        if _engine(item):
            item.add_marker(pytest.mark.xdist_group(_group(item)))
            engines.add(item.nodeid)
    # the groups are the suite's longest units of work (the engines group about 7 of its minutes): collected first,
    # each starts at once in its worker and the third takes the rest, instead of starting after whatever a worker
    # was handed before it (a stable sort keeps each file's own order)
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
    come from the attribute xdist rewrites), and Ray runs then ran side by side on 2 cores, timing out a
    deployment test. Hence ``pytest<9`` in the test extra."""
    if not getattr(item.config.option, "loadgroup", False):  # not an xdist worker in loadgroup mode
        return
    if _engine(item) and not item.nodeid.endswith("@" + _group(item)):
        pytest.fail(f"xdist did not put this test in the '{_group(item)}' group, so it may run beside another Ray "
                    "run or deployment; check the pytest / pytest-xdist versions", pytrace=False)


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


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One ``ray start --head`` for the whole session, started at the first Ray test that asks for it (all of
    them run in the ``engines`` group's worker) and stopped by its process group at the end. Flower's Ray
    backend starts a Ray instance of its own at every run and shuts it down after: measured here, a 20-round
    run of 4 clients took 16.3 s and 21.4 CPU-seconds, 11.4 s and 16.2 attached to a running head (and 7.8 s,
    6.4 with one actor instead of four). On 2 cores the suite is CPU-bound, so each Ray start is paid by the
    other worker too. The tests that attach are Ray runs as a user runs them on a cluster (DEPLOYMENT §10,
    ``QLSD_RAY_ADDRESS``), and ``tests/test_flwr_run.py``'s simulation SuperLink, whose Ray backend's ``ray.init()``
    reads ``RAY_ADDRESS`` (its stop/resume tests: 81-89 s each before, 51-54 s attached). Flower's own start of
    Ray is kept by ``tests/test_flower.py``'s Ray test and the signal tests of ``tests/test_hardening.py``."""
    import shutil
    import tempfile

    from qlsd_flwr import deploy as D

    port = D.free_port()
    ray_tmp = tempfile.mkdtemp(prefix="rq", dir="/tmp")  # short: Ray's socket paths are limited
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(D.REPO))
    head = D.Proc("ray-head", D.ray_head_argv(port, ray_tmp), env,
                  tmp_path_factory.mktemp("ray-head") / "ray-head.log").start()
    try:
        D.wait_port(port, timeout=120, proc=head)
        yield f"127.0.0.1:{port}"
    finally:
        head.stop(grace=15)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture()
def attached_ray(ray_cluster, monkeypatch):
    """The test's Ray runs attach to the session's head (:func:`ray_cluster`) through ``QLSD_RAY_ADDRESS``."""
    monkeypatch.setenv("QLSD_RAY_ADDRESS", ray_cluster)
    return ray_cluster
