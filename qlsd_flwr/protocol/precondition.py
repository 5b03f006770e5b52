"""What is settled before the first sampling round, on every engine: θ*, the metric ``M``, the
step ``γ`` (for ``gamma = auto``) and the chains' starting points.

Each engine hands :func:`prepare` two ways to reach its clients: ``grad_fn(θ)`` (``∇U(θ)`` summed
over every client's full local gradient and the server's prior: the θ* phase's exchange) and
``curv_fn(θ, kind)`` (every client's curvature report, ``{i: array}``, for ``metric-from =
curvature``). Nothing else differs between engines, so a run is the same function of its seed on
all of them. The order:

1. θ*: the task's closed form, or the federated descent of :mod:`qlsd_flwr.protocol.theta_star`
   (needed by QLSD*/LSD*, and as the point where the curvature is taken). With a metric or
   ``gamma = auto`` the descent is preconditioned, accelerated and stepped by ``1/λ_max``, in
   stages that each take the curvature again, and checked in the metric taken at θ* (:mod:`qlsd_flwr.protocol.descent`).
2. ``M`` from the clients' curvature at θ* (:func:`qlsd_flwr.core.curvature.metric_from_curvature`),
   or from a ``.npy`` file, or the identity.
3. ``λ_max(M^{1/2} ∇²U(θ*) M^{1/2})`` by the Lanczos method on the clients' Hessian-vector products, when ``gamma =
   auto`` (``γ = c/λ_max``) or when a metric is used (the start-up check ``γ λ_max < 2``).
4. ``init = dispersed``: chain ``c`` starts at ``θ* + 2 M^{1/2} z_c`` (:mod:`qlsd_flwr.protocol.starts`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from qlsd_flwr.config import ConfigError, RunConfig, adapts
from qlsd_flwr.core import curvature as cv
from qlsd_flwr.core.metric import Identity, Metric
from qlsd_flwr.core.potential import Task
from qlsd_flwr.core.server_step import noise_factor
from qlsd_flwr.robust.reports import SURROGATE_WIDEN, ReportError, cap_surrogates, cap_total
from qlsd_flwr.protocol.curvature_exchange import (
    block_corrected,
    block_count,
    curvature_metric,
    lowrank_correction,
    lowrank_rank,
    merge_reports,
    needs_curvature,
    power_products,
    products_in,
    prior_curvature,
)
from qlsd_flwr.protocol.descent import DESCENT_STAGES, curvature_point  # noqa: F401 (re-exported)
from qlsd_flwr.protocol.theta_star import needs_theta_star, newton_decrement, resolve_theta_star
from qlsd_flwr.outputs.metric_file import metric_from_file  # the one file the preparation reads
from qlsd_flwr.outputs.progress import announce
from qlsd_flwr.protocol import build
from qlsd_flwr.bases import compression_basis
from qlsd_flwr.protocol.starts import chain_starts
from qlsd_flwr.robust.products import held_parts
from qlsd_flwr.protocol.traffic import Traffic, counted, phase

log = logging.getLogger("qlsd_flwr")

GradFn = Callable[[np.ndarray], np.ndarray]
CurvFn = Callable[[np.ndarray, str], dict]


@dataclass
class Prepared:
    """The outcome of :func:`prepare`: ``theta_star`` (for QLSD*/LSD*, else ``None``), the facts
    for the summary (``info``), the metric, the step ``gamma`` and the chains' starts ``theta0``
    (``(C, d)``, or ``None`` for the task's θ_0)."""

    theta_star: np.ndarray | None
    info: dict
    metric: Metric
    gamma: float
    theta0: np.ndarray | None = None
    surrogate: np.ndarray | None = None  # FSGLD: the clients' surrogate precisions λ_i at θ*, (b, d)

    def for_chain(self, c: int) -> "Prepared":
        """Chain ``c``'s share: its own start (``theta0`` of one row) and everything else."""
        import dataclasses

        return dataclasses.replace(self, theta0=None if self.theta0 is None else self.theta0[c:c + 1])


def uses_metric(cfg: RunConfig) -> bool:
    return cfg.metric != "identity"


def needs_preparation(cfg: RunConfig) -> bool:
    """Whether anything beyond θ* is settled before sampling."""
    return uses_metric(cfg) or cfg.gamma_auto or cfg.init == "dispersed" or lowrank_rank(cfg) > 0


def check(cfg: RunConfig, d: int) -> None:
    """The metric keys against the task's ``d``, and the run's memory (``ConfigError`` naming the key)."""
    from qlsd_flwr.config import check_memory

    check_memory(cfg, d)
    if cfg.metric == "dense" and d > cv.DENSE_MAX_DIM:
        raise ConfigError(f"metric: dense needs d ≤ {cv.DENSE_MAX_DIM} (this task has d = {d}); use diagonal")


def prepare(cfg: RunConfig, task: Task, theta0: np.ndarray, grad_fn: GradFn | None,
            curv_fn: CurvFn | None, chains: int | None = None, n_data=None, warm=None,
            log_concave: bool | None = None, supports=None, products_log_concave: bool | None = None) -> Prepared:
    """θ*, ``M``, ``γ`` and the chains' starts for ``cfg`` (see the module docstring). ``theta0``
    is the task's (or the user's) starting point; ``chains`` the number of chains to start
    (default ``num-chains``); ``n_data`` the clients' ``N_i`` (default the task's: a user's
    ServerApp knows them from the handshake), the scale of their curvature reports; ``warm`` where
    ``metric-from = adapt`` keeps its warm-up's state (``load()``, ``save(state)``, ``clear()``:
    :func:`qlsd_flwr.outputs.warmup.warmup_store`), or ``None``; ``log_concave`` whether the
    posterior is declared log-concave (default the task's; a user's ServerApp: its clients'
    handshakes and its prior), which sets ``gamma-c = auto``'s ``c``; ``products_log_concave`` which rule holds λ_max's
    products (:func:`qlsd_flwr.robust.products.factors`; default ``log_concave``; a user's ServerApp: the majority of
    its clients' handshakes, which one client cannot switch); ``supports`` the clients' declared supports
    (``downlink-support = data``: each client's blocks of vectors go on its own coordinates, and are counted so)."""
    check(cfg, task.dim)
    n_data = task.n_data if n_data is None else np.asarray(n_data, dtype=np.int64)
    C = int(cfg.num_chains if chains is None else chains)
    concave = task.log_concave if log_concave is None else bool(log_concave)
    rule = concave if products_log_concave is None else bool(products_log_concave)
    # the rule that holds λ_max's products (robust.products.factors), γ given or not
    counts: dict = {"log_concave": concave, "products_rule": "log-concave" if rule else "network"}
    if cfg.gamma_auto or cfg.kind.coupled:  # the c of γ = c/λ_max, and of DG-LMC's client step
        counts["gamma_c"] = cv.gamma_c(cfg.get("gamma-c"), concave)
    traffic = Traffic(cfg.b, task.dim, counts, say=lambda line: announce(line, cfg.progress), supports=supports)
    grad_fn, curv_fn = counted(grad_fn, curv_fn, traffic)
    if not needs_preparation(cfg):
        ts, info = resolve_theta_star(cfg, task, theta0, grad_fn)
        prep = _with_surrogates(cfg, task, Prepared(ts, info, Identity(), cfg.gamma), curv_fn, n_data)
        traffic.summary()
        info.update(counts)  # the counts with FSGLD's curvature exchange in them, and the preparation's seconds
        return prep
    info: dict = counts  # the counts go on as the exchanges are made
    d = task.dim
    file_metric = metric_from_file(cfg.metric, d) if cfg.metric.endswith(".npy") else None
    needs_point = needs_theta_star(cfg) or needs_curvature(cfg) or cfg.gamma_auto or cfg.init == "dispersed" \
        or lowrank_rank(cfg) > 0
    inputs = cv.KronInputs()  # K-FAC's input factors, asked for once (core.curvature.KRON_OUTPUTS)
    hvp = products_for(task, grad_fn, curv_fn, n_data, info)
    last: list = []  # the descent's ∇U(θ*), for the Newton decrement once M is taken there
    final: list = []  # the metric the descent's last check took at θ*: the run's, when it is at the point returned
    point = curvature_point(cfg, task, theta0, grad_fn, curv_fn, n_data, file_metric, info, inputs, hvp, last, final) \
        if needs_point else theta0
    if not np.all(np.isfinite(point)):
        raise ConfigError("theta-star: the descent to θ* left the finite numbers; give θ* in closed form, a smaller "
                          "gamma (the descent's step without gamma = auto), or metric = identity")
    # 2. the metric
    if needs_curvature(cfg):
        if curv_fn is None:
            raise ConfigError(f"metric-from = {cfg.get('metric-from')}: this path cannot ask its clients for their "
                              "curvature (the legacy Flower API); use the Message-API strategy, or metric = <file.npy>")
        metric, cinfo = final[1:] if final and final[0] is point else \
            curvature_metric(cfg, task, point, curv_fn, n_data, inputs)
        merge_reports(info, cinfo)
    else:
        metric = file_metric or Identity()
    top: list = []  # the corrected metric's top uncorrected Ritz vector: γ's Lanczos iteration starts there
    if block_count(cfg) > 0:  # first: it needs K-FAC's own root, which maps its block's span to itself
        metric = block_corrected(cfg, task, point, curv_fn, n_data, metric, info)
    if lowrank_rank(cfg) > 0 and not adapts(cfg):
        metric = lowrank_correction(cfg, task, point, curv_fn, n_data, metric, info, top)
    if last and needs_curvature(cfg):
        newton_decrement(cfg, last[0], metric, info)
    spread = metric.spread()
    info["metric_spread"] = spread
    if cfg.compressed and spread > cv.COMPRESSED_SPREAD_WARN and not build.whitens(cfg, task.dim):
        log.warning("metric: its scales span %s%.3g (above %.0e) and the messages are QSGD-compressed in θ's "
                    "coordinates (compression-basis = theta, which auto picks for K-FAC without metric-block and a "
                    "low-rank correction of another base): the "
                    "compression noise, set by each message's norm, is "
                    "multiplied by M in the flat directions and biases the chain there (measured: sd up to 59× on a "
                    "regression with spread 2e6 at s = 16); use compression-basis = metric (the QLSD family), block "
                    "(K-FAC with metric-block) or an uncompressed variant (docs/METRIC.md)",
                    "up to " if metric.has_correction else "", spread, cv.COMPRESSED_SPREAD_WARN)
    # 3. the step
    gamma = _step(cfg, grad_fn, point, metric, info, quiet=adapts(cfg), hvp=hvp,  # announced once, after the warm-up
                  start=top[0] if top else None)
    # 4. the starts
    starts = chain_starts(cfg, task, theta0, point, metric, C) if cfg.init == "dispersed" else None
    if starts is not None:
        info["init"] = "dispersed"
    # 5. metric-from = adapt: the warm-up refines M (and γ), and the chains continue from its end
    if adapts(cfg):
        metric, gamma, starts = _adapt(cfg, grad_fn, point, metric, gamma, starts, theta0, C, info, warm, hvp)
    info.update({"metric": metric.to_json(), "metric_kind": metric.kind, "compression_basis": compression_basis(
        cfg, task.dim), "gamma_used": gamma, "gamma_auto": bool(cfg.gamma_auto),
                 "temperature": cfg.temperature})
    ts = point if needs_theta_star(cfg) else None
    prep = _with_surrogates(cfg, task, Prepared(ts, info, metric, gamma, starts), curv_fn, n_data)
    traffic.summary()
    return prep


def _with_surrogates(cfg: RunConfig, task: Task, prep: Prepared, curv_fn: CurvFn | None, n_data) -> Prepared:
    """FSGLD: every client's diagonal curvature at θ*, validated and capped, as its surrogate's precision
    (:func:`qlsd_flwr.core.fsgld.surrogates_from_reports`); a refused report leaves that client's λ_i = 0."""
    if not cfg.kind.surrogate:
        return prep
    from qlsd_flwr.core import fsgld

    if curv_fn is None:
        raise ConfigError("variant: fsgld asks its clients for their curvature at θ* before sampling, which this "
                          "path cannot (the legacy Flower API); use the Message-API strategy")
    ok, refused = {}, {}
    for i, h in curv_fn(prep.theta_star, "diagonal").items():
        try:
            ok[int(i)] = cv.check_report(h, "diagonal", task.dim)
        except ReportError as exc:
            refused[str(i)] = str(exc)
            log.warning("client %s: curvature report refused: %s (fsgld: its surrogate is linear)", i, exc)
    prep.surrogate, scaled = fsgld.surrogates_from_reports(ok, n_data, cfg.b, task.dim)
    # the local step in each coordinate: γ times the metric's diagonal (exact for the identity or a diagonal metric)
    step = prep.gamma * prep.metric.diagonal(task.dim)
    held, bound = cap_surrogates(prep.surrogate, n_data, step, int(cfg.get("local-steps")),
                                 prior_curvature(task, prep.theta_star))
    if held:
        log.warning("fsgld: the surrogate precision of client(s) %s held: a lie, or the hold of an honest report, widens "
                    "the chain's variance by at most %.3g× in any coordinate (%g× but where a client reports most of a "
                    "coordinate's curvature; surrogate_held, surrogate_bound; docs/DEPLOYMENT.md §9b)",
                    held, bound, SURROGATE_WIDEN)
    capped = cap_total(prep.surrogate, step)
    if capped:
        log.warning("fsgld: the clients' summed surrogate precision Λ exceeds 1/h (h = γ × the metric's diagonal) in %d "
                    "coordinate(s) (a report far over the others', or gamma near the stability limit): scaled down there "
                    "to 1/h, which keeps "
                    "every client's local steps stable and the gradient unbiased (surrogate_total_capped)", capped)
    prep.info.update({"surrogate_reports": len(ok), "surrogate_rejected": refused, "surrogate_scaled": scaled,
                      "surrogate_held": held, "surrogate_bound": bound, "surrogate_total_capped": capped})
    return prep


def _step(cfg: RunConfig, grad_fn: GradFn | None, point: np.ndarray, metric: Metric, info: dict,
          iters: int = 60, tol: float = 1e-2, quiet: bool = False, *, hvp, start=None) -> float:
    """γ for ``metric``: ``c / λ_max(M^{1/2} ∇²U(θ*) M^{1/2})`` with ``gamma = auto``; otherwise the
    given γ, with a warning when it is beyond the estimated stability limit."""
    gamma = cfg.gamma
    if (cfg.gamma_auto or not metric.is_identity) and grad_fn is not None:
        saw_all = not info.get("block_inputs")  # metric-rank's Krylov space was kept off the block's directions
        with phase(grad_fn, "power_iteration"):
            lam, iters = cv.lambda_max(grad_fn, point, metric, cfg.seed, iters=iters, tol=tol,
                                       hvp=products_in(hvp, metric), start=start, start_saw_all=saw_all)
        begun = "random" if start is None else "ritz" if saw_all else "ritz+random"
        c = info.get("gamma_c", cv.GAMMA_AUTO_C)  # prepare's, from gamma-c (auto: by log-concavity)
        if quiet and not (cfg.gamma_auto and lam <= 0):  # the warm-up's own steps: no announcement
            return c / lam if cfg.gamma_auto else gamma
        info.update({"lambda_max": lam, "lambda_max_iterations": iters,
                     "lambda_max_start": begun})
        stable = c / lam if lam > 0 else None
        if cfg.gamma_auto:
            if stable is None:
                raise ConfigError(f"gamma = auto: the largest eigenvalue of the curvature at θ* is {lam:.3g} ≤ 0: the "
                                  "potential is flat or not convex there (θ* a saddle or a maximum, or false "
                                  "products from a client); give a numeric gamma")
            gamma = c / lam
            auto = str(cfg.get("gamma-c")).strip().lower() == "auto"
            noise = noise_factor(str(cfg.get("noise-correction")), gamma, metric.is_identity)  # 1: ULA's noise
            log.warning("gamma = auto: γ = %.4g = %g / λ_max, λ_max = %.4g (the largest eigenvalue of M^½ ∇²U(θ*) "
                        "M^½, %d exchanges of products (Lanczos)%s; metric %s; variance along the stiffest direction ×%.3g, ULA's "
                        "bias at this c%s%s)", gamma, c, lam, iters,
                        {"random": "", "ritz": " from metric-rank's top uncorrected Ritz vector",
                         "ritz+random": " from metric-rank's top uncorrected Ritz vector and a random one"}[begun],
                        metric.kind,
                        noise ** 2 / (1.0 - c / 2.0),
                        " with noise-correction's 1 − γ/2" if noise != 1.0 else "",
                        "" if not auto else "; gamma-c = auto: " + (
                            "a log-concave posterior" if info.get("log_concave") else
                            "a posterior not declared log-concave, such as a network's, takes half the step"))
        elif stable is not None and cfg.gamma * lam >= 2.0:
            log.warning("gamma = %g is beyond the stability limit 2/λ_max = %.3g of this metric (λ_max = %.4g, "
                        "estimated at θ*): the chain will diverge; choose gamma below it, e.g. %.3g (gamma = auto)",
                        cfg.gamma, 2.0 / lam, lam, stable)
    elif cfg.gamma_auto:
        raise ConfigError("gamma = auto: this path cannot reach its clients before sampling (the legacy Flower "
                          "API); give a numeric gamma")
    if not math.isfinite(gamma) or gamma <= 0:
        raise ConfigError(f"gamma: the chosen step {gamma!r} is not a positive number")
    return gamma


def products_for(task: Task, grad_fn, curv_fn, n_data, info: dict):
    """γ's ``λ_max`` iteration's ``∇²U u``: one exchange of the clients' own Hessian-vector products where the engine
    can ask for them (:func:`~qlsd_flwr.protocol.curvature_exchange.power_products`, a quarter of the uplink of two
    gradient exchanges; issue 37), otherwise central differences of their gradients (:func:`held_products`, also
    the fallback when a kept client gives no usable product); each client's part held to scale either way."""
    held = held_products(grad_fn, info)
    return power_products(task, curv_fn, n_data, info, getattr(grad_fn, "kept", None), held) or held


def held_products(grad_fn, info: dict):
    """γ's ``λ_max`` iteration's ``∇²U u`` with each client's part held to scale (:mod:`qlsd_flwr.robust.products`),
    bit for bit the sum of the central differences while no client is over it; those scaled are counted in
    ``info['products_clipped']`` and named in the log. ``None`` (the plain difference of ``grad_fn``) when
    ``grad_fn`` cannot give its clients' gradients one by one."""
    if not hasattr(grad_fn, "clients"):
        return None

    def hvp(th, u, eps):
        plus, minus = th + eps * u, th - eps * u
        gp, gm = grad_fn.clients(plus), grad_fn.clients(minus)
        parts = {i: (gp[i] - gm[i]) / (2.0 * eps) for i in gp}
        prior = (grad_fn.combine({}, plus) - grad_fn.combine({}, minus)) / (2.0 * eps)
        held, scaled = held_parts(parts, grad_fn.n_data, info, u, float(u @ prior))
        if not scaled:
            return (grad_fn.combine(gp, plus) - grad_fn.combine(gm, minus)) / (2.0 * eps)
        return sum(held[i] for i in sorted(held)) + prior

    return hvp


def _adapt(cfg: RunConfig, grad_fn: GradFn, point: np.ndarray, metric: Metric, gamma: float,
           starts: np.ndarray | None, theta0: np.ndarray, C: int, info: dict, warm, hvp):
    """The warm-up (:func:`qlsd_flwr.core.adapt.warmup`) from the chains' starts (or from the state
    ``warm`` kept of a warm-up that was stopped), then the step for the frozen metric; returns
    ``(M, γ, starts)``."""
    from qlsd_flwr.core.adapt import AdaptError, warmup

    begin = np.repeat(np.asarray(theta0, dtype=np.float64)[None, :], C, axis=0) if starts is None else starts
    restep = (lambda m: _step(cfg, grad_fn, point, m, info, iters=20, tol=5e-2, quiet=True, hvp=hvp)) if cfg.gamma_auto \
        else None
    rounds = int(cfg.get("adapt-rounds"))
    state = None if warm is None else warm.load(C, point.size, metric.kind, rounds)
    if state is not None:
        log.info("metric-from = adapt: continuing the warm-up from its round %d (%s)", state["r"], warm.path)
    try:
        with phase(grad_fn, "warmup"):
            metric, gamma, ends, ainfo = warmup(grad_fn, begin, metric, gamma, rounds, cfg.seed, cfg.temperature,
                                                restep, state, None if warm is None else warm.save,
                                                cfg.checkpoint_every)
    except AdaptError as exc:
        raise ConfigError(str(exc)) from None
    if warm is not None:
        warm.clear()
    info.update(ainfo)
    gamma = _step(cfg, grad_fn, point, metric, info, hvp=hvp)
    log.info("metric-from = adapt: %d warm-up rounds × %d chains on exact gradients, %d windows; the metric's "
             "scales now span %.3g", rounds, C, len(ainfo["adapt_windows"]), metric.spread())
    return metric, gamma, ends


def apply(cfg: RunConfig, prep: Prepared) -> RunConfig:
    """``cfg`` with the step the preparation chose (``gamma = auto``)."""
    import dataclasses

    if cfg.gamma_auto or cfg.gamma != prep.gamma:
        return dataclasses.replace(cfg, gamma=float(prep.gamma))
    return cfg
