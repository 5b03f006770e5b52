"""A block of rounds that ran away or left the finite numbers: each chain's limit on ``‖θ‖`` and the first
bad round of a block (the vectorised engine checks whole blocks; the protocol engines check each round,
:mod:`qlsd_flwr.protocol.divergence`)."""

from __future__ import annotations

import numpy as np

from qlsd_flwr.config import RunConfig
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.divergence import RUNAWAY_FACTOR, runaway_scale


def runaway_limits(cfg: RunConfig, task: Task, part, theta_now: np.ndarray) -> np.ndarray:
    """Each chain's run-away limit on ``‖θ‖`` (:func:`qlsd_flwr.protocol.divergence.runaway_scale`
    of its own start, as the protocol engines take it; ``inf`` with ``norm-bound = off``)."""
    if str(cfg.raw.get("norm-bound", "auto")).strip().lower() == "off":
        return np.full(theta_now.shape[0], np.inf)
    theta0 = part[4] if part[4] is not None else np.broadcast_to(build.theta0_of(task), theta_now.shape)
    return np.array([RUNAWAY_FACTOR * runaway_scale(task, theta0[c], part[2], part[1].metric)
                     for c in range(theta_now.shape[0])])


def first_bad_round(out: dict, theta: np.ndarray, R: int, limits: np.ndarray | None = None) -> int | None:
    """Index in the block of the first round whose state is not finite or has run away (``‖θ‖``
    over its chain's limit), or was not computed because a client's message could not be formed;
    ``None`` when the whole block is fine."""
    limits = np.full(theta.shape[0], np.inf) if limits is None else limits
    states = out.get("states")
    if states is None and out.get("norms") is not None:  # (C, R) ‖θ‖ each round (a sparse-states backend)
        norms = out["norms"]
        within = norms <= limits[:, None]  # NaN compares False
        if out.get("error") is None and within.all():
            return None
        ok = np.isfinite(norms).all(axis=0) & within.all(axis=0)
        bad = np.flatnonzero(~ok)
        if out.get("error") is None and bad.size and np.isfinite(norms[:, bad[0]]).all():
            out["error"] = RAN_AWAY
        return int(bad[0]) if bad.size else R - 1
    # each round's ‖θ‖ is within its chain's limit (one pass over the block's states)
    within = (np.linalg.norm(theta, axis=-1) <= limits)[:, None] if states is None else \
        np.linalg.norm(states, axis=2) <= limits[:, None]  # (C, R); NaN compares False
    finite = np.all(np.isfinite(theta))
    if out.get("error") is None and finite and within.all():
        return None
    if states is None:
        if out.get("error") is None and finite:
            out["error"] = RAN_AWAY
        return 0  # not recorded: somewhere in this block
    ok = np.isfinite(states).all(axis=(0, 2)) & within.all(axis=0)
    bad = np.flatnonzero(~ok)
    if bad.size and np.isfinite(states[:, bad[0]]).all():  # finite, over its limit: that is the news
        out["error"] = RAN_AWAY
    return int(bad[0]) if bad.size else R - 1


RAN_AWAY = "θ ran away (‖θ‖ over 10^4 times the scale its start, θ* and the prior allow)"
