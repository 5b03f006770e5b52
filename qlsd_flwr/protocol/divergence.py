"""A chain that runs away: how it is detected and what the user is told."""

from __future__ import annotations

import logging
import math

import numpy as np

from qlsd_flwr.compression.format import QuantiseError

log = logging.getLogger("qlsd_flwr")


class DivergenceError(ValueError):
    """θ became non-finite: the step size is too large for the target (or the start too far)."""


# what a client's compressor says when θ has run away (a client's error reply carries the text)
_OVERFLOW = tuple(e.message for e in QuantiseError if e not in (QuantiseError.OK, QuantiseError.DITHER))


def is_overflow(reason) -> bool:
    """Whether an error (or a client's error reply) says the message could not be formed
    because the gradient overflowed or is not finite."""
    return any(m in str(reason) for m in _OVERFLOW)


def stop_server(server, round_: int, why: str = "θ is not finite", stable: float | None = None,
                stalled: bool = False) -> None:
    """Stop ``server``'s observer (samples up to the last finite θ) and raise :class:`DivergenceError` naming
    the round (``err.why``: the cause, which a several-chain run words its own message with). ``stalled``: the
    chain did not run away but stands still (the norm guard refuses most replies), and ``why`` says why."""
    obs = server.observer
    suspects = server.ts_info.get("products_clipped_clients") or []
    if stalled:
        msg = f"the run stopped at round {round_}: {why}." + saved_where(
            round_, obs.run_dir if obs is not None else None, obs.last_checkpoint if obs is not None else None)
        suspects = []
    if suspects and server.cfg.gamma_auto:  # the step came from λ_max's products, in which they were out of scale
        named = ", ".join(str(i) for i in suspects)
        why = (f"{why}; gamma = auto's λ_max iteration scaled down the products of client {named} as out of scale "
               f"(products_clipped): a false product can set the step, so the likely cause is client {named}; "
               "rerun with a numeric gamma, or without it")
    if not stalled:
        msg = divergence_message(round_, server.cfg.gamma, obs.run_dir if obs is not None else None,
                                 obs.last_checkpoint if obs is not None else None, why=why, stable=stable)
    log.error(msg)
    if obs is not None:
        server.ts_info = {**server.ts_info, "diverged_at_round": round_, "error": msg}
        server.finish()  # the observer closes its folder (samples up to round_ - 1), keeps run_dir
    err = DivergenceError(msg)
    err.why, err.stalled = why, stalled
    raise err


def divergence_message(round_: int, gamma: float, run_dir=None, last_checkpoint: int | None = None,
                       where: str = "", why: str = "θ is not finite", stable: float | None = None) -> str:
    """``stable``: a step known to be stable on this target (``1/τ``, see
    :func:`qlsd_flwr.protocol.build.stable_gamma`); the suggestion is never above it, so it agrees
    with the start-up warning."""
    if stable is not None and stable < gamma:  # the estimate says why: suggest it, not a blind γ/10
        msg = (f"the chain diverged at round {round_}{where}: {why}. The step size gamma = {gamma:g} is above "
               f"the step {stable:.3g} estimated from this target's curvature; rerun with a smaller gamma, within "
               f"that estimate (gamma = auto chooses it; e.g. gamma={stable:.3g}).")
    elif stable is not None:  # the step was within the estimate: the start or the gradients' noise
        msg = (f"the chain diverged at round {round_}{where}: {why}. The step size gamma = {gamma:g} is within "
               f"the step {stable:.3g} estimated from the curvature at θ*, so the chain left the region where "
               f"that estimate holds (a far start, heavy gradient noise at low p or s); rerun with a smaller "
               f"gamma, a larger p or s, or a metric (metric = diagonal; e.g. gamma={gamma / 4:.3g}).")
    else:
        msg = (f"the chain diverged at round {round_}{where}: {why}. The step size gamma = {gamma:g} "
               f"is too large for this target; rerun with gamma = auto, which estimates the stable step from "
               f"the curvature, or a smaller gamma (e.g. gamma={gamma / 10:.3g}).")
    return msg + saved_where(round_, run_dir, last_checkpoint)


def saved_where(round_: int, run_dir=None, last_checkpoint: int | None = None) -> str:
    """Where a stopped run's rounds so far are, for its message ('' without a run folder)."""
    if run_dir is None:
        return ""
    return (f" The samples and metrics of rounds 1..{round_ - 1} are in {run_dir} (the run folder was closed "
            "cleanly)" + (f"; the last good checkpoint is at round {last_checkpoint}." if last_checkpoint
                          else "; no checkpoint was written."))


#: a chain is run away when ‖θ‖ exceeds this multiple of :func:`runaway_scale`
RUNAWAY_FACTOR = 1e4
RUNAWAY_WINDOW = 10  # rounds whose replies the run-away message ranks


def runaway_scale(task, theta0: np.ndarray, theta_star, metric) -> float:
    """The largest of the scales θ is known to live at: the start ``‖θ_0‖``, ``‖θ*‖`` (the run's
    or the task's closed form), the prior's ``√(d · var)`` (a Gaussian prior that is not flat), the
    metric's ``√(d · λ_max(M))`` (about ``√d`` posterior sd when M comes from the curvature) and
    ``√d``."""
    d = theta0.shape[-1]
    scales = [float(np.linalg.norm(theta0)), math.sqrt(d)]
    for ts in (theta_star, getattr(task, "theta_star", None)):
        if ts is not None:
            scales.append(float(np.linalg.norm(ts)))
    var = getattr(task.prior, "var", None)
    if isinstance(var, (int, float)) and not isinstance(var, bool) and math.isfinite(var):
        scales.append(math.sqrt(d * float(var)))
    if not metric.is_identity:
        scales.append(math.sqrt(d * metric.largest()))
    return max(scales)


def runaway_why(size: float, scale: float, recent) -> str:
    """Why a run-away chain stops: ``‖θ‖ = size`` over :data:`RUNAWAY_FACTOR` × ``scale``, naming the clients
    whose replies dominated the last rounds (``recent``: per round, each client's reply norm): an attacker
    inside the norm bound, or a p so small that one 1/p-weighted reply throws θ."""
    totals: dict[int, float] = {}
    for rnd in recent:
        for i, x in rnd.items():
            totals[i] = totals.get(i, 0.0) + x
    whole = sum(totals.values()) or 1.0
    top = sorted(totals.items(), key=lambda t: -t[1])[:3]
    named = ", ".join(f"client {i} ({100 * x / whole:.0f} %)" for i, x in top) or "none (no replies)"
    cause = ("one client dominated them" if top and top[0][1] > 0.5 * whole else
             "they were spread over the clients: the step, not one client, is the likely cause")
    return (f"‖θ‖ = {size:.3g} is over {RUNAWAY_FACTOR:g}× the scale {scale:.3g} that the start, θ* and the prior "
            f"allow (a run-away chain); the largest replies of the last {len(recent)} rounds came from {named}: "
            f"{cause}. A posterior truly at this scale: start near it (initial θ) or set norm-bound = off, which "
            "turns this check off too")
