"""θ*, the mode of the posterior, for QLSD*'s control variate (one path for every engine).

QLSD* uses ``H_i(θ) = (N_i/n_i) Σ_{j∈S_i} [∇U_ij(θ) − ∇U_ij(θ*)] + …`` (ALGORITHMS.md), which
needs ``θ* = argmin U``. It comes from the task in closed form (``theta-star = closed-form``) or
from a federated gradient-descent phase run through the engine's own clients first
(``theta-star = optimise``): ``θ ← θ − γ ∇U(θ)`` with ``∇U(θ) = Σ_i ∇U_i(θ) [+ ∇U_0(θ)]``.
Each engine passes :func:`resolve_theta_star` the function that gets ``∇U(θ)`` from its clients;
nothing else differs between them.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core.potential import Task
from qlsd_flwr.keys import flag

log = logging.getLogger("qlsd_flwr")


def needs_theta_star(cfg: RunConfig) -> bool:
    """Whether the variant's oracle is centred at θ* (QLSD*, LSD*, VR-FALD*, FSGLD's surrogates)."""
    return cfg.kind.needs_theta_star


def closed_form_theta_star(cfg: RunConfig, task: Task) -> np.ndarray:
    if task.theta_star is None:
        raise ConfigError(
            f"theta-star: task {task.name!r} has no closed-form θ*; set theta-star = optimise")
    return np.asarray(task.theta_star, dtype=np.float64)


def gd_step(theta: np.ndarray, grad: np.ndarray, lr: float) -> np.ndarray:
    """One step of the federated optimisation phase that finds ``θ* = argmin U``."""
    return theta - lr * grad


def opt_converged(grad: np.ndarray, grad0_norm: float, tol: float, metric=None) -> bool:
    """``‖∇U(θ)‖ ≤ tol·(1 + ‖∇U(θ_0)‖)``: relative to the start, so the scale of U does not matter. With a
    ``metric`` (the preconditioned descent's), also ``∇Uᵀ M ∇U ≤ d`` (:func:`newton_decrement`): a start far out
    in a flat direction makes the first rule loose."""
    if float(np.linalg.norm(grad)) > tol * (1.0 + grad0_norm):
        return False
    return metric is None or decrement_squared(grad, metric) <= grad.size


def decrement_squared(grad: np.ndarray, metric) -> float:
    """The squared Newton decrement ``∇Uᵀ M ∇U``, held to ``d`` by :func:`opt_converged` and :func:`newton_decrement`."""
    return float(grad @ metric.apply(grad))


def optimise_theta_star(cfg: RunConfig, theta0: np.ndarray,
                        grad_fn: Callable[[np.ndarray], np.ndarray], info: dict | None = None,
                        lr: float | None = None, precondition=None, max_rounds: int | None = None,
                        g0_norm: float | None = None, stall: int | None = None,
                        last: list | None = None, newton: bool = False) -> tuple[np.ndarray, int]:
    """Federated gradient descent for ``θ* = argmin U``: ``θ ← θ − γ ∇U(θ)``.

    ``lr`` replaces ``γ`` as the step and ``precondition`` (a :class:`~qlsd_flwr.core.metric.Metric`)
    makes it ``θ ← θ − lr M ∇U(θ)`` (:mod:`qlsd_flwr.protocol.precondition` does both for ``gamma =
    auto`` and a metric); ``max_rounds`` replaces ``opt-rounds`` and ``g0_norm`` the start's
    ``‖∇U(θ_0)‖`` in the stopping rule (a descent resumed in stages keeps the first stage's); ``stall``
    (with ``precondition``) ends it after that many rounds without a new smallest gradient, at the best point
    (a stage that has a next one: :data:`STALL`).

    ``grad_fn(θ)`` returns ``∇U(θ)`` as summed from the clients' full local gradients (plus the
    prior); it is how each engine reaches its clients. Stops when
    ``‖∇U‖ ≤ opt-tol·(1 + ‖∇U(θ_0)‖)`` or after ``opt-rounds`` rounds; returns ``(θ*, rounds)``.
    ``info`` (a dict) receives ``opt_converged`` and ``opt_grad_norm`` (``‖∇U(θ*)‖``); ``last`` (a list), when
    given, ``∇U(θ*)`` itself. ``newton``: ``precondition`` is the curvature's inverse (not a user's file), and the
    descent ends only within :func:`newton_decrement`'s bound in it too.
    """
    theta = theta0.copy()
    g = grad_fn(theta)
    g0 = float(np.linalg.norm(g)) if g0_norm is None else float(g0_norm)
    rounds = 0
    step = cfg.gamma if lr is None else float(lr)
    budget = cfg.opt_rounds if max_rounds is None else int(max_rounds)
    if precondition is None:
        for rounds in range(1, budget + 1):
            theta = gd_step(theta, g, step)
            g = grad_fn(theta)
            if opt_converged(g, g0, cfg.opt_tol):
                break
    else:
        theta, g, rounds = _nesterov(cfg, theta, g, g0, grad_fn, step, precondition, budget, stall, newton)
    if info is not None:
        info["opt_grad0_norm"] = g0  # a descent resumed in stages keeps it (g0_norm)
        info["opt_converged"] = bool(opt_converged(g, g0, cfg.opt_tol, precondition if newton else None))
        info["opt_grad_norm"] = float(np.linalg.norm(g))
    if last is not None:
        last[:] = [g]
    return theta, rounds


#: a gradient this many times the best seen ends a descent's momentum and halves its step (the
#: step left the region where the curvature it was chosen from holds)
BLOWUP = 10.0
#: a stage of the descent ends when its gradient has not come below the best seen for this many rounds: the
#: metric and step it was chosen from no longer fit where it is (a curvature taken far from the mode), and the
#: next stage takes them again from the best point. Why 5: a new stage costs a curvature exchange and a λ_max
#: for its step (at least 4 products), about 5 exchanges, and waiting no longer than a restart costs is the
#: ski-rental rule, within twice the cost of the better choice made knowing the future (docs/METRIC.md). On the
#: main job stage 1 (K-FAC at θ_0 = 0) reached ‖∇U‖ = 51 in 30 rounds and then climbed to 75 in 20 more (20
#: until 2026-12-05); the kidiq-shaped descents of tests/test_descent_unknown_sigma.py never stall
STALL = 5


def _nesterov(cfg, theta, g, g0, grad_fn, step, metric, budget, stall=None, newton=False):
    """Preconditioned accelerated descent with adaptive restart (Nesterov; O'Donoghue & Candès
    2015): ``y ← θ − lr M ∇U(θ)``, ``θ ← y + k/(k+3) (y − y_prev)``, the momentum reset whenever
    it points uphill (``∇U(θ)ᵀ(y − y_prev) > 0``). About ``√κ`` times fewer rounds than plain
    descent on a target of condition number ``κ`` in the metric; each round is one exchange. Ends after
    ``stall`` rounds without a new smallest gradient, when given. Returns ``(θ, ∇U(θ), rounds)``."""
    y_prev = theta.copy()
    best = (float(np.linalg.norm(g)), theta.copy(), g.copy())
    k = 0
    rounds = since_best = 0
    for rounds in range(1, budget + 1):
        y = theta - step * metric.apply(g)
        k = 0 if float(g @ (y - y_prev)) > 0 else k + 1
        theta = y + (k / (k + 3.0)) * (y - y_prev)
        y_prev = y
        g = grad_fn(theta)
        norm = float(np.linalg.norm(g))
        if not np.isfinite(norm) or norm > BLOWUP * best[0]:
            # the step left the region where the curvature it was chosen from holds (a target that is
            # not quadratic): back to the best point, half the step, no momentum
            theta, g, step, k = best[1].copy(), best[2].copy(), step / 2.0, 0
            y_prev = theta.copy()
            since_best = 0  # the halved step gets its own STALL rounds
            continue
        if norm < best[0]:
            best, since_best = (norm, theta.copy(), g.copy()), 0
        else:
            since_best += 1
        if opt_converged(g, g0, cfg.opt_tol, metric if newton else None) or (stall is not None and since_best >= stall):
            break
    if best[0] < float(np.linalg.norm(g)):
        # a target that is not convex (a network): the descent may leave the basin it found; the
        # next stage (or the metric) starts from the best point seen, not from where it wandered
        theta, g = best[1], best[2]
    return theta, g, rounds


def newton_decrement(cfg: RunConfig, grad: np.ndarray, metric, info: dict) -> None:
    """Holds the descent's end to the mode in the metric taken there: ``λ² = ∇U(θ*)ᵀ M ∇U(θ*)``, about
    ``2 (U(θ*) − U_min)`` and ``(θ* − mode)ᵀ H (θ* − mode)`` near the mode, must be at most ``d``, no farther
    than a typical posterior draw (``χ²_d``). The stopping rule ``‖∇U‖ ≤ opt-tol (1 + ‖∇U(θ_0)‖)`` is relative to
    the start, and a start far out in a flat direction passes it: on posteriordb's earn_height (``y`` in dollars,
    ``σ = 1`` at the start, ``‖∇U(θ_0)‖ = 1.1e12``) the descent stopped after 24 exchanges, 5.0e5 nats above the
    mode. Not met: ``opt_converged`` is false and the run warns (θ* only the curvature point), or stops as an
    unconverged descent does (QLSD*'s θ*, unless ``opt-accept-unconverged``)."""
    lam2 = decrement_squared(grad, metric)
    info["opt_newton_decrement"] = float(np.sqrt(max(lam2, 0.0)))
    if lam2 <= grad.size or not info.get("opt_converged", False):
        return
    info["opt_converged"] = False
    why = (f"theta-star: the descent met opt-tol but stopped {np.sqrt(lam2):.3g} from the mode in the metric's norm "
           f"(Newton decrement; a posterior draw is about √d = {np.sqrt(grad.size):.3g}): its start's gradient "
           f"‖∇U(θ_0)‖ = {info.get('opt_grad0_norm', float('nan')):.3g} made opt-tol loose; lower opt-tol or give "
           "theta0 nearer the mode")
    if needs_theta_star(cfg) and not flag("opt-accept-unconverged", cfg.raw.get("opt-accept-unconverged")):
        raise ConfigError(why)
    log.warning(why + " (the metric and γ are taken there)")


def resolve_theta_star(cfg: RunConfig, task: Task, theta0: np.ndarray,
                       grad_fn: Callable[[np.ndarray], np.ndarray] | None
                       ) -> tuple[np.ndarray | None, dict]:
    """``(θ*, facts for the summary)``; ``(None, {})`` when the variant needs no θ*.

    ``grad_fn`` is ``None`` on a path that cannot run the optimisation phase (the legacy
    adapter): ``theta-star = optimise`` is then refused with the key's name.
    """
    if not needs_theta_star(cfg):
        return None, {}
    if cfg.theta_star == "closed-form":
        return closed_form_theta_star(cfg, task), {"theta_star": "closed-form"}
    if grad_fn is None:
        raise ConfigError("theta-star: this path supports only closed-form (the legacy Flower API has "
                          "no message type for the optimisation phase; use the Message-API strategy)")
    info: dict = {}
    ts, rounds = optimise_theta_star(cfg, theta0, grad_fn, info)
    if not info["opt_converged"]:
        # QLSD*'s control variate assumes Σ_i ∇U_i(θ*) = 0: what is left of ∇U(θ*) biases every step
        why = (f"theta-star: the optimisation stopped at opt-rounds = {rounds} with ‖∇U(θ*)‖ = "
               f"{info['opt_grad_norm']:.3g}, above opt-tol·(1 + ‖∇U(θ_0)‖); QLSD*/LSD* would drift by that "
               "gradient. Raise opt-rounds (or gamma, if stable), give θ* in closed form, or set "
               "opt-accept-unconverged = true")
        if not flag("opt-accept-unconverged", cfg.raw.get("opt-accept-unconverged", False)):
            raise ConfigError(why)
        log.warning(why)
    return ts, {"theta_star": "optimise", "opt_rounds": rounds, **info}
