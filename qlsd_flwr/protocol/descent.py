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

from qlsd_flwr.compression import fixed
from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core import curvature as cv
from qlsd_flwr.core.metric import Identity, Metric
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol.gradients import as_sent
from qlsd_flwr.protocol.curvature_exchange import curvature_metric, merge_reports, needs_curvature, products_in
from qlsd_flwr.protocol.theta_star import (STALL, closed_form_theta_star, decrement_squared, needs_theta_star,
                                          optimise_theta_star)
from qlsd_flwr.protocol.traffic import phase, precision

log = logging.getLogger("qlsd_flwr")

#: stages of the descent to θ*: the metric and the descent's step are taken again at the start of each
#: (a Newton-like refresh: a curvature far from the mode, e.g. at a noise scale σ = 1, misleads the first)
DESCENT_STAGES = 4
#: the share of the descent's stopping threshold ``opt-tol (1 + ‖∇U(θ_0)‖)``, or of its last gradient's norm where that
#: is larger, that the rounding of the clients' gradients may take (:class:`DescentWidth`)
ROUNDING_SHARE = 0.25


class DescentWidth:
    """The width of the descent's gradient replies where θ* is only the point where the curvature is taken (a rule for
    :func:`qlsd_flwr.protocol.traffic.precision`, one for the whole descent, its stages included).

    Before each exchange (``rule(scales, norm)``, from the exchange before: the clients' row scales
    ``σ_i = max_j |∇U_i(θ)_j|`` and the summed gradient's norm): the narrowest of 12 and 16 bits
    (:mod:`qlsd_flwr.compression.fixed`), float32 or float64 whose rounding, at most ``Σ_i √d σ_i / 2L`` in norm
    (:meth:`bound`), is within :data:`ROUNDING_SHARE` of ``max(T, ‖∇U‖)``, ``T = opt-tol (1 + ‖∇U(θ_0)‖)`` the
    stopping threshold (``‖∇U(θ_0)‖`` the first reading's). The first exchange has no scales to go by: 16 bits.
    After it (:meth:`recheck`, with that exchange's own scales): where the reading ``‖∇Û‖`` is within its rounding
    of ``T`` (it may end the descent) and that rounding is above the share of ``T``, the same θ is asked again at
    the width that meets it, and that reading is the one the descent takes.

    Why: a step on a gradient whose error is at most a quarter of its norm still descends (its inner product with the
    true one is at least 3/4 of its square), and a reading that ends the descent is within a quarter of ``T`` of the
    true ``‖∇U‖``. On the main job (``opt-tol = 1e-2``, ``T = 43.6``) every exchange after the first is 12 bits
    (``python benchmarks/bench_preparation.py``); where 16-bit rows cannot resolve ``T`` it widens: at the default
    ``opt-tol = 1e-6`` a 650-coordinate digits regression spent all 500 of its exchanges at ``‖∇U‖ = 2.9e-3``
    against ``T = 2.0e-3`` with 16-bit rows, and now ends in 40, float32 near the end."""

    def __init__(self, d: int, opt_tol: float):
        self.d, self.opt_tol, self.g0 = int(d), float(opt_tol), None

    def bound(self, scales, bits: int) -> float:
        """The rounding's largest norm at width ``bits``: ``Σ_i √d σ_i / 2L`` (:func:`~qlsd_flwr.compression.fixed.max_error`)."""
        return np.sqrt(self.d) * float(np.sum(scales)) * fixed.max_error(bits)

    def _narrowest(self, scales, allowance: float) -> int:
        return next((w for w in (fixed.NARROW, fixed.BITS, 32) if self.bound(scales, w) <= allowance), 64)

    def _threshold(self, norm: float) -> float:
        return self.opt_tol * (1.0 + (norm if self.g0 is None else self.g0))

    def __call__(self, scales, norm) -> int:
        if self.g0 is None or not scales or norm is None or not np.isfinite(norm):
            return fixed.BITS  # nothing seen in this descent yet
        return self._narrowest(scales, ROUNDING_SHARE * max(self._threshold(norm), norm))

    def recheck(self, scales, norm: float, bits: int) -> int | None:
        """The width to ask the same θ again at, or ``None``; then :meth:`saw` the reading the descent takes."""
        if not scales or not np.isfinite(norm):
            return None
        T, err = self._threshold(norm), self.bound(scales, bits)
        if norm - err <= T and err > ROUNDING_SHARE * T:
            return self._narrowest(scales, ROUNDING_SHARE * T)
        return None

    def saw(self, norm: float) -> None:
        """The reading the descent took: the first is ``‖∇U(θ_0)‖``, as :func:`optimise_theta_star` takes it."""
        self.g0 = float(norm) if self.g0 is None else self.g0


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
    width = DescentWidth(theta0.size, cfg.opt_tol)  # one rule for every stage: it keeps ‖∇U(θ_0)‖ and the scales
    for stage in range(stages):
        metric = file_metric
        if metric is None and curv:
            metric, ci = curvature_metric(cfg, task, theta, curv_fn, n_data, inputs)
            merge_reports(info, ci)
        # a stage's share of opt-rounds, plus what a stage before it left when it stalled
        budget = cfg.opt_rounds // stages + (cfg.opt_rounds % stages if stage == stages - 1 else 0) + carry
        theta, r = _stage(cfg, theta, grad_fn, metric, info, hvp, budget, g0, STALL if stage < stages - 1 else None,
                          width, last, metric is not None and metric is not file_metric)
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
        theta, r = _stage(cfg, theta, grad_fn, metric, info, hvp, left, g0, STALL, width, last, True)
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
    return theta if needs_theta_star(cfg) else as_sent(theta, 32)


def _stage(cfg: RunConfig, theta, grad_fn, metric: Metric | None, info: dict, hvp, budget: int, g0, stall, width, last,
           newton: bool):
    """One stage of the descent from ``theta`` with ``metric`` (or none), stepped by ``1/λ_max`` of it."""
    lr = cfg.gamma
    if cfg.gamma_auto or metric is not None:
        with phase(grad_fn, "power_iteration"):
            lam, _ = cv.rough_lambda_max(grad_fn, theta, metric or Identity(), cfg.seed,
                                         hvp=products_in(hvp, metric or Identity()))
        lr = 1.0 / lam if lam > 0 else 1.0
        info.setdefault("opt_lr", []).append(lr)
    # float64 buys nothing where θ* is only the point where the curvature is taken (to opt-tol, 1e-2 on the main
    # job): θ goes as float32, the gradients as rows as narrow as the stopping rule allows. QLSD*'s θ* stays float64
    with precision(grad_fn, 64 if needs_theta_star(cfg) else width):
        return optimise_theta_star(cfg, theta, grad_fn, info, lr=lr, precondition=metric, max_rounds=budget,
                                   g0_norm=g0, stall=stall, last=last, newton=newton)


