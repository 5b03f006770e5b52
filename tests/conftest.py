"""Test-suite plumbing.

``./dev test`` runs pytest with two xdist workers (``-n 2 --dist loadgroup``). Every test that
starts Flower's Ray engine or real SuperLink/SuperNode processes goes to one group, so those
run one after another in a single worker (never two Ray clusters or two deployments at once);
the CPU-bound tests run in the other worker meanwhile, overlapping the deployments' polling
waits. Without xdist the marker is inert.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marker into the group
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("ray") or item.get_closest_marker("deployment"):
            item.add_marker(pytest.mark.xdist_group("engines"))



def pytest_collection_finish(session):
    """Under ``--dist loadgroup``, check that xdist really grouped the engine tests: with
    pytest 9.2 and xdist 3.8 its grouping silently did nothing (pytest's node ids no longer
    come from the attribute xdist rewrites), and Ray runs and deployments then ran side by
    side on 2 cores, timing out a deployment test. Hence ``pytest<9`` in the test extra."""
    if not getattr(session.config.option, "loadgroup", False):  # not an xdist worker in loadgroup mode
        return
    lost = [i.nodeid for i in session.items
            if (i.get_closest_marker("ray") or i.get_closest_marker("deployment"))
            and not i.nodeid.endswith("@engines")]
    if lost:
        raise pytest.UsageError(f"xdist did not put {len(lost)} engine tests in the 'engines' group "
                                f"(e.g. {lost[0]}); check the pytest/pytest-xdist versions")
