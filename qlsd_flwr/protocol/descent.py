"""θ*'s descent as the point where the curvature is taken, in stages (issue 37): the federated descent of
:mod:`qlsd_flwr.protocol.theta_star`, preconditioned by the metric taken at the start of each stage and stepped by
``1/λ_max`` of that metric, until its gradient meets ``opt-tol``'s rule and its Newton decrement ``∇Uᵀ M ∇U ≤ d``
in the stage's metric; then checked once more in the metric taken at θ* itself, the one the run keeps.

Why the last check can fail where the stage's passed: a stage begun far out, where a regression with an unknown
σ is not convex, takes its metric there, and that metric can read the descent's end near where the metric at
θ* reads it far. On posteriordb's earn_height from ``β = 0, σ = 1`` the descent met both rules after 1,297
exchanges, and the metric at θ* put it 40.5 from the mode (1,266 nats above it, 31 posterior sd off): one
more stage in that metric (:data:`CHECK_STAGES`) reached it in 5 more exchanges, decrement 0.34, 0.056 nats and
0.26 sd from the mode (``python benchmarks/bench_posteriordb.py --posteriordb PATH --descent``). The metric taken for the check is
the one :func:`qlsd_flwr.protocol.precondition.prepare` keeps when the check passes (``final``): no exchange is
added where the first check passes, as on the main job, whose run is bit for bit the one before.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core import curvature as cv
from qlsd_flwr.core.metric import Identity, Metric
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.curvature_exchange import curvature_metric, merge_reports, needs_curvature
from qlsd_flwr.protocol.theta_star import (STALL, closed_form_theta_star, decrement_squared, needs_theta_star,
                                          optimise_theta_star)
from qlsd_flwr.protocol.traffic import phase, precision

log = logging.getLogger("qlsd_flwr")

#: stages of the descent to θ*: the metric and the descent's step are taken again at the start of each
#: (a Newton-like refresh: a curvature far from the mode, e.g. at a noise scale σ = 1, misleads the first)
DESCENT_STAGES = 4
#: the width of the descent's exchanges where θ* is only the point where the curvature is taken (the ``grad``
#: request's ``precision``, :mod:`qlsd_flwr.protocol.gradients`): θ down as float32, each client's gradient back as one
#: 16-bit fixed-point row. The rounding is within ``σ_i/2L`` (``σ_i`` the row's largest entry, ``L = 32,767``) a
#: coordinate, which the stopping rule ``‖∇U‖ ≤ opt-tol (1 + ‖∇U(θ_0)‖)`` does not see: on the main job ``√(b d) σ_i/2L``
#: is below 0.01 against a threshold of 4.4 (measured: the same number of descent exchanges as float32's, 75)
DESCENT_PRECISION = 16
#: stages more, after the descent, where the metric taken at θ* reads its end farther from the mode than ``d`` in the
#: Newton decrement (module docstring: earn_height needed one)
CHECK_STAGES = 2


def curvature_point(cfg: RunConfig, task: Task, theta0: np.ndarray, grad_fn: Callable | None,
                    curv_fn: Callable | None, n_data, file_metric: Metric | None, info: dict,
                    inputs: cv.KronInputs | None, hvp, last: list | None = None,
                    final: list | None = None) -> np.ndarray:
    """θ* as the point where the curvature is taken: the closed form where the task has one,
    otherwise the federated descent (:func:`qlsd_flwr.protocol.theta_star.optimise_theta_star`),
    preconditioned by the metric and stepped by ``1/λ_max`` of that metric when there is one (or
    ``gamma = auto``), in :data:`DESCENT_STAGES` stages that each take the curvature again. ``hvp``: the power
    iteration's products (:func:`~qlsd_flwr.protocol.precondition.products_for`); ``last`` (a list) receives the
    descent's ``∇U(θ*)``; ``final`` (a list), the metric taken at θ* for the last check, ``[θ*, M, facts]``, when the
    run may keep it (module docstring)."""
    if task.theta_star is not None and (cfg.theta_star == "closed-form" or not needs_theta_star(cfg)):
        info["theta_star"] = "closed-form"
        return closed_form_theta_star(cfg, task)
    if grad_fn is None:
        raise ConfigError("metric/gamma = auto/init = dispersed: this path cannot reach its clients before "
                          "sampling (the legacy Flower API); use the Message-API strategy, or metric = <file.npy> "
                          "and a numeric gamma")
    curv = needs_curvature(cfg) and curv_fn is not None
    stages = DESCENT_STAGES if curv else 1
    theta, rounds, g0, carry = theta0, 0, None, 0
    for stage in range(stages):
        metric = file_metric
        if metric is None and curv:
            metric, ci = curvature_metric(cfg, task, theta, curv_fn, n_data, inputs)
            merge_reports(info, ci)
        # a stage's share of opt-rounds, plus what a stage before it left when it stalled
        budget = cfg.opt_rounds // stages + (cfg.opt_rounds % stages if stage == stages - 1 else 0) + carry
        theta, r = _stage(cfg, theta, grad_fn, metric, info, hvp, budget, g0, STALL if stage < stages - 1 else None,
                          last, metric is not None and metric is not file_metric)
        carry = budget - r
        g0 = info["opt_grad0_norm"]  # the first stage's start: the stopping rule stays relative to it
        rounds += r
        if info["opt_converged"] or not np.all(np.isfinite(theta)):
            break
    point = _as_point(cfg, theta)
    for check in range(CHECK_STAGES + 1 if curv and final is not None else 0):
        if not (info["opt_converged"] and last and np.all(np.isfinite(point))):
            break
        metric, ci = curvature_metric(cfg, task, point, curv_fn, n_data, inputs)
        final[:] = [point, metric, ci]
        left = cfg.opt_rounds - rounds
        if decrement_squared(last[0], metric) <= point.size or left <= 0 or check == CHECK_STAGES:
            break
        # the metric at θ* reads the end farther from the mode than the stage's did: one more stage in it
        merge_reports(info, ci)
        final.clear()  # that metric was taken at a point the descent leaves
        theta, r = _stage(cfg, theta, grad_fn, metric, info, hvp, left, g0, STALL, last, True)
        rounds += r
        point = _as_point(cfg, theta)
    info.update({"theta_star": "optimise", "opt_rounds": rounds})
    if not info["opt_converged"]:
        from qlsd_flwr.keys import flag

        why = (f"theta-star: the descent to the point where the metric is taken stopped at opt-rounds = {rounds} "
               f"with ‖∇U‖ = {info['opt_grad_norm']:.3g}; raise opt-rounds, or set opt-accept-unconverged = true")
        if needs_theta_star(cfg) and not flag("opt-accept-unconverged", cfg.raw.get("opt-accept-unconverged")):
            raise ConfigError(why)
        log.warning(why + " (the metric and γ are taken there)")
    return point


def _as_point(cfg: RunConfig, theta: np.ndarray) -> np.ndarray:
    """Where θ* is only the point where the curvature is taken, it is rounded to float32, as its descent's exchanges
    carried it: the curvature reports, the products and λ_max's products then send it in 32 bits a number,
    losing nothing (traffic.point_bits; issue 37). QLSD*'s θ* stays as it is."""
    return theta if needs_theta_star(cfg) else build.as_sent(theta, 32)


def _stage(cfg: RunConfig, theta, grad_fn, metric: Metric | None, info: dict, hvp, budget: int, g0, stall, last,
           newton: bool):
    """One stage of the descent from ``theta`` with ``metric`` (or none), stepped by ``1/λ_max`` of it."""
    lr = cfg.gamma
    if cfg.gamma_auto or metric is not None:
        with phase(grad_fn, "power_iteration"):
            lam, _ = cv.rough_lambda_max(grad_fn, theta, metric or Identity(), cfg.seed, hvp=hvp)
        lr = 1.0 / lam if lam > 0 else 1.0
        info.setdefault("opt_lr", []).append(lr)
    # float64 buys nothing where θ* is only the point where the curvature is taken (to opt-tol, 1e-3 on the
    # main job): θ goes as float32, the gradients as 16-bit rows (DESCENT_PRECISION). QLSD*'s θ* stays float64
    with precision(grad_fn, 64 if needs_theta_star(cfg) else DESCENT_PRECISION):
        return optimise_theta_star(cfg, theta, grad_fn, info, lr=lr, precondition=metric, max_rounds=budget,
                                   g0_norm=g0, stall=stall, last=last, newton=newton)


