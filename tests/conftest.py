"""Test-suite plumbing.

``./dev test`` runs pytest with two xdist workers (``-n 2 --dist loadgroup``). Every test that
starts Flower's Ray engine or real SuperLink/SuperNode processes goes to one group, so those
run one after another in a single worker (never two Ray clusters or two deployments at once);
the CPU-bound tests run in the other worker meanwhile, overlapping the deployments' polling
waits. Without xdist the marker is inert.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("ray") or item.get_closest_marker("deployment"):
            item.add_marker(pytest.mark.xdist_group("engines"))
