"""The preparation's curvature exchanges (:mod:`qlsd_flwr.protocol.precondition`): ``M`` from the clients'
curvature reports, the low-rank correction from their Hessian-vector products (``metric-rank``), and the
facts each exchange adds to the run's summary."""

from __future__ import annotations

import functools
import logging
from typing import Callable

import numpy as np

from qlsd_flwr.compression import fixed
from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core import curvature as cv
from qlsd_flwr.core.metric import Metric, MetricError
from qlsd_flwr.core.potential import Task
from qlsd_flwr.robust.products import held_parts
from qlsd_flwr.robust.krylov import CARRY, PASSES, KrylovShares
from qlsd_flwr.robust.reports import FACTOR_SHARE, REPORT_CAP, ReportError

log = logging.getLogger("qlsd_flwr")

CurvFn = Callable[[np.ndarray, str], dict]
#: the width of metric-block's input directions as they travel (:mod:`qlsd_flwr.compression.fixed`): 16 bits, each
#: direction's entries within 1.5e-5 of its largest. The block is made exact on the directions as sent (the server
#: and every client take ``Q̂`` from the same rounded rows), so their rounding moves only which subspace is made
#: exact; on the main job float32 rows and 16-bit rows gave the same TV to the reference within its Monte Carlo
#: error (issue 37; RESULTS, "The preparation at 12 bits"), for 2.5e7 fewer bits
BLOCK_ROWS = 16


def lowrank_rank(cfg: RunConfig) -> int:
    """``metric-rank``: how many directions the low-rank correction maps to 1 (0: none)."""
    return int(cfg.get("metric-rank") or 0)


def prior_curvature(task: Task, theta: np.ndarray | None = None) -> np.ndarray:
    """The diagonal of ``∇²U_0`` at ``θ`` (the prior's curvature; zero for a flat prior or one that
    does not say)."""
    pr = task.prior
    theta = np.zeros(task.dim) if theta is None else theta
    if hasattr(pr, "curvature_diag"):
        h = np.asarray(pr.curvature_diag(theta), dtype=np.float64)
        return np.where(np.isfinite(h) & (h > 0), h, 0.0)
    return np.zeros(task.dim)


def curvature_metric(cfg: RunConfig, task: Task, point: np.ndarray, curv_fn: CurvFn, n_data: np.ndarray,
                     inputs: cv.KronInputs | None = None):
    """``M`` from one curvature exchange at ``point``: each report checked (refused ones counted and named),
    bounded per datum and summed with the prior's (:mod:`qlsd_flwr.core.curvature`); ``(metric, facts)``.
    ``inputs`` (K-FAC only) keeps the clients' input factors across the exchanges of one preparation: once it
    holds any, the clients are asked for their output factor alone (:data:`~qlsd_flwr.core.curvature.KRON_OUTPUTS`);
    when a client that replies has none on record, the exchange is made again with full reports."""
    kind = cv.KRON_OUTPUTS if cfg.metric == "kronecker" and inputs else cfg.metric
    reports, refused = curv_fn(point, kind), {}
    if kind == cv.KRON_OUTPUTS and any(int(i) not in inputs for i in reports):
        # a client answered that has no first report on record (it missed or failed that exchange): everyone's
        # full report once more, so that it is not left without curvature for the rest of the preparation
        kind = cfg.metric
        reports = curv_fn(point, kind)
    ok = {}
    if kind == "kronecker":  # the clients vote on the layer before any G is decoded (cv.kron_layout)
        reports = _majority_layout(reports, task.dim, refused)
    for i, h in reports.items():
        try:
            if kind == cv.KRON_OUTPUTS:
                ok[int(i)] = inputs.complete(int(i), h, task.dim)
                continue
            ok[int(i)] = cv.check_report(h, kind, task.dim)
            if inputs is not None and cfg.metric == "kronecker":
                inputs[int(i)] = (ok[int(i)]["G"], ok[int(i)]["perm"])
        except ReportError as exc:
            refused[int(i)] = str(exc)
            log.warning("client %s: curvature report refused: %s (curvature_rejected)", i, exc)
    try:
        if cfg.metric == "kronecker":
            metric, cinfo = cv.metric_from_kronecker(ok, n_data, prior_curvature(task, point), task.dim)
        else:
            metric, cinfo = cv.metric_from_curvature(cfg.metric, ok, n_data, prior_curvature(task, point), task.dim)
    except MetricError as exc:
        raise ConfigError(str(exc)) from None
    cinfo["curvature_rejected"] = {**{str(i): why for i, why in sorted(refused.items())},
                                   **cinfo.get("curvature_rejected", {})}
    why = cinfo.pop("curvature_scaled_why", {})
    for i in cinfo["curvature_scaled"]:
        log.warning("client %d: curvature report %s (curvature_scaled)", i,
                    why.get(i, f"scaled down to {REPORT_CAP:g} × the clients' per-datum curvature"))
    return metric, cinfo


def _majority_layout(reports: dict, d: int, refused: dict) -> dict:
    """K-FAC's first reports whose layer (``F̃``, ``K``, ``perm``, read from their float32 numbers alone) is the one
    most give; the others, and those whose numbers do not read, go to ``refused`` with the reason, logged."""
    keys = {}
    for i, h in reports.items():
        try:
            keys[int(i)] = cv.kron_layout(h, d)
        except ReportError as exc:
            refused[int(i)] = str(exc)
            log.warning("client %s: curvature report refused: %s (curvature_rejected)", i, exc)
    common = cv.common_layout(keys) if keys else None
    for i in sorted(k for k in keys if keys[k] != common):
        refused[i] = cv.FOREIGN_LAYOUT
        log.warning("client %s: curvature report refused: %s (curvature_rejected)", i, cv.FOREIGN_LAYOUT)
    return {i: h for i, h in reports.items() if int(i) in keys and keys[int(i)] == common}


def needs_curvature(cfg: RunConfig) -> bool:
    """Whether the metric comes from the clients' curvature reports."""
    return cfg.metric in ("diagonal", "dense", "kronecker")


def lowrank_correction(cfg: RunConfig, task: Task, point: np.ndarray, curv_fn: CurvFn | None, n_data, metric: Metric,
             info: dict, start: list | None = None) -> Metric:
    """``metric-rank = k``: the metric corrected along the ``k`` directions where ``M^½ᵀ ∇²U(θ*) M^½`` is
    farthest from 1 (:mod:`qlsd_flwr.core.lowrank`), in ``metric-rank-exchanges`` exchanges of products; with
    ``metric-block``, ``metric`` is the block's (:class:`qlsd_flwr.core.kron_block.Blocked`), and these directions are
    found orthogonal to its own and correct it further. From the clients' Hessian-vector products, each client's
    share held to the leave-one-out rule (:mod:`qlsd_flwr.robust.krylov`: a client scaled has the correction made
    again with its products scaled from the start, and a third time without them if it is over the rule again).
    ``start``, a list, receives the corrected metric's top uncorrected Ritz pair, where the Lanczos iteration for ``γ``
    starts (:func:`qlsd_flwr.core.lowrank.correction`)."""
    from qlsd_flwr.core import lowrank as lr

    if curv_fn is None:
        raise ConfigError("metric-rank: this path cannot ask its clients for Hessian-vector products (the legacy "
                          "Flower API); use metric-rank = 0")
    prior_c = prior_curvature(task, point)
    d = task.dim

    bits = fixed.width_for(metric.spread())  # 12- or 16-bit rows unless the block's entries span too many scales
    info["lowrank_bits"] = bits
    scales: dict[int, float] = {}  # clients held by the leave-one-out rule in an earlier pass (robust.krylov)
    for attempt in range(PASSES):
        shares = KrylovShares()

        def products(W, shares=shares):  # the block as it travels, so the prior's part multiplies what the clients' did
            W = fixed.rounded(W, bits)
            held = lr.held_products(curv_fn(point, "hvp", W, bits), n_data, W.shape[0], d, info, log)
            held = {i: (h * scales[i] if i in scales else h) for i, h in held.items()}
            shares.add(W, held, W * prior_c)
            return lr.summed(held, W.shape[0], d) + W * prior_c

        found: list = []  # this pass's top uncorrected Ritz pair
        low, linfo = lr.correction(products, metric.apply_root, metric.apply_root_t, d, lowrank_rank(cfg), cfg.seed,
                                   exchanges=int(cfg.get("metric-rank-exchanges")),
                                   gram=lambda shares=shares: shares.gram(n_data), start=found,
                                   avoid=metric.directions() if hasattr(metric, "directions") else None)
        info["lowrank_loo_share"] = max(float(info.get("lowrank_loo_share", 0.0)), shares.share_max)
        info.pop("lowrank_unjudged", None)  # this pass's, not an earlier one's
        if shares.unjudged:
            info["lowrank_unjudged"] = shares.unjudged
        info["lowrank_passes"] = attempt + 1
        if not shares.scales:
            break
        last, out = attempt == PASSES - 1, attempt == PASSES - 2
        for i, s_i in sorted(shares.scales.items()):
            # the next pass takes a held client's products at CARRY times the scale found here, so that its new
            # Krylov space rarely finds it over again; a client over the rule in two passes is left out of the last
            scales[i] = 0.0 if out else scales.get(i, 1.0) * s_i * (1.0 if last else CARRY)
            log.warning("client %d: its Hessian-vector products would move the metric's correction by more than "
                        "1 + %g N_i/N_−i in some direction of its space; %s (lowrank_held)", i, FACTOR_SHARE,
                        f"scaled by {s_i:.3g}" if last else "left out of the correction, made again" if out else
                        f"scaled by {scales[i]:.3g}, and the correction is made again")
        if last:
            break
    if scales:
        info["lowrank_held"] = {str(i): v for i, v in sorted(scales.items())}
    info.update(linfo)
    if low is None:
        if linfo["lowrank_exchanges"] == 0:  # lowrank.correction asked nothing: metric-block's directions span θ
            log.info("metric-rank: metric-block's directions span every direction; nothing is left to correct")
        else:
            log.warning("metric-rank: no direction of the curvature converged in %d exchanges; the metric is left as "
                        "it was", linfo["lowrank_exchanges"])
        return metric
    if linfo["lowrank_ritz_min"] <= 0:  # the curvature at θ* is not positive-definite: not a convex model there
        info.update({"lowrank_rank": 0, "lowrank_skipped": "the curvature at θ* is not positive-definite"})
        log.warning("metric-rank: the curvature at θ* has a direction of curvature %.3g ≤ 0, so the model is not "
                    "convex there, and a metric and a step taken from θ*'s curvature can be far too large elsewhere "
                    "(measured on an MLP on digits: 23× the HMC halves' total variation, against 4.4× without the "
                    "correction; benchmarks/RESULTS.md); the metric is left uncorrected (lowrank_skipped)",
                    linfo["lowrank_ritz_min"])
        return metric
    log.info("metric-rank: %d directions corrected (%d Hessian-vector exchanges of %d vectors); the preconditioned "
             "curvature's condition number over the directions found: %.3g before, %.3g over those left",
             linfo["lowrank_rank"], linfo["lowrank_exchanges"], linfo["lowrank_block"], linfo["lowrank_kappa_before"],
             linfo["lowrank_kappa_left"])
    if start is not None:
        start.extend(found)
    # on top of metric-block's (found orthogonal to its directions, so the two commute: core.kron_block.Blocked)
    return metric.corrected(*low)


def block_count(cfg: RunConfig) -> int:
    """``metric-block``: how many of K-FAC's top input directions its curvature is made exact on (0: none)."""
    return int(cfg.get("metric-block") or 0)


def block_corrected(cfg: RunConfig, task: Task, point: np.ndarray, curv_fn: CurvFn | None, n_data, metric: Metric,
                    info: dict) -> Metric:
    """``metric-block = k``: K-FAC's ``metric`` made exact on its top ``k`` input directions
    (:mod:`qlsd_flwr.core.kron_block`): one exchange, the directions down as float32 rows and each client's block
    up; each block checked (refused ones counted in ``curvature_rejected`` and left out) and held by the rules for
    dense reports."""
    from qlsd_flwr.core import kron_block as kb

    if curv_fn is None:
        raise ConfigError("metric-block: this path cannot ask its clients for curvature reports (the legacy Flower "
                          "API); use metric-block = 0")
    kron = metric.kron
    F, K = kron.den.shape
    k = min(block_count(cfg), F)
    if k * K > kb.MAX_DIM:
        raise ConfigError(f"metric-block: {k} input directions × {K} outputs is a block of {k * K} dimensions, above "
                          f"{kb.MAX_DIM} (its report would be (kK)²/2 numbers a client); use metric-block ≤ "
                          f"{kb.MAX_DIM // K}")
    V = fixed.rounded(kb.pack(kron.qg[:, F - k:], task.dim), BLOCK_ROWS)  # as the clients read it
    refused, ok = {}, {}
    for i, h in sorted(curv_fn(point, kb.KRON_BLOCK, V, BLOCK_ROWS).items()):
        try:
            ok[int(i)] = kb.check_block(h, k * K)
        except ReportError as exc:
            refused[str(i)] = str(exc)
            log.warning("client %s: metric-block report refused: %s (curvature_rejected)", i, exc)
    rej = info.setdefault("curvature_rejected", {})
    for i, why in refused.items():
        rej.setdefault(i, why)
    if not ok:
        raise ConfigError("metric-block: no valid block report from the clients; use metric-block = 0")
    info["block_clients"] = sorted(ok)  # they hold the directions: compression-basis = block's basis goes by reference
    try:
        blocked = kb.correction(kron, kb.unpack(V, F), ok, n_data, prior_curvature(task, point), info)
    except MetricError as exc:  # as metric-rank's skipped correction: the base metric stands, and the run says so
        info["block_skipped"] = str(exc)
        log.warning("%s; the metric is left as K-FAC's (block_skipped)", exc)
        return metric
    for i in info["block_scaled"]:
        log.warning("client %d: metric-block report held to the others' (over %g × the clients' per-datum curvature, "
                    "or 1 + %g N_i/N_−i times the prior's and the others' in some direction; block_scaled)", i,
                    REPORT_CAP, FACTOR_SHARE)
    log.info("metric-block: K-FAC exact on its top %d input directions (%d dimensions); the preconditioned "
             "curvature there spans %.3g to %.3g", k, k * K, info["block_t_min"], info["block_t_max"])
    return blocked


def merge_reports(info: dict, cinfo: dict) -> None:
    """The facts of one curvature exchange added to the run's: every exchange's refused and scaled
    clients (a client refused in an early stage of the descent stays on record)."""
    info["curvature_reports"] = cinfo.get("curvature_reports", 0)
    info["curvature_exchanges"] = info.get("curvature_exchanges", 0) + 1
    rej = info.setdefault("curvature_rejected", {})
    for i, why in cinfo.get("curvature_rejected", {}).items():
        rej.setdefault(i, why)
    info["curvature_scaled"] = sorted(set(info.get("curvature_scaled", [])) | set(cinfo.get("curvature_scaled", [])))


def power_products(task: Task, curv_fn: CurvFn | None, n_data, info: dict, kept=None, fallback=None):
    """γ's ``λ_max`` iteration's ``∇²U u`` (:func:`qlsd_flwr.core.spectral.lambda_max`'s ``hvp``) as one exchange of
    Hessian-vector products, ``u`` and the clients' products as rows of ``bits`` (:mod:`qlsd_flwr.compression.fixed`;
    :func:`products_in` sets it from the metric the iteration is for), where ``curv_fn`` can ask for them; ``None``
    otherwise. Against two float64 gradient exchanges at ``θ ± εu`` this sends a quarter of the uplink in float32
    rows, an eighth in 16-bit ones (issue 37), and the product is the client's own (exact where its potential has
    ``hvp_batch``). Each client's product
    is checked (:func:`qlsd_flwr.core.lowrank.check_block`: refused and counted as ``products_rejected``) and held
    per datum to scale (:mod:`qlsd_flwr.robust.products`: ``products_clipped``, the clients named in the log).
    A sum without one of the ``kept()`` clients would read the curvature too small and the step too large: when a
    kept client's product is missing or refused, that product is taken by ``fallback(θ, u, ε)`` instead (the
    clients' gradients, whose exchange asks again and leaves out a client that still fails; counted as
    ``products_fallback``). The prior's part is the server's, the central difference of its gradient."""
    if curv_fn is None:
        return None
    from qlsd_flwr.core import lowrank as lr

    d = task.dim

    def hvp(th, u, eps, bits=32):
        U = fixed.rounded(u, bits)
        parts = {}
        for i, h in sorted(curv_fn(th, "hvp", U, bits).items()):
            try:
                parts[int(i)] = lr.check_block(h, 1, d)[0]
            except ReportError as exc:
                log.warning("client %s: λ_max's Hessian-vector product refused: %s (products_rejected)", i, exc)
                info["products_rejected"] = int(info.get("products_rejected", 0)) + 1
        missing = sorted(set(kept()) - set(parts)) if kept is not None else []
        if missing and fallback is not None:
            log.warning("λ_max (gamma = auto): no usable product from client(s) %s; this product from the clients' "
                        "gradients instead (products_fallback)", missing)
            info["products_fallback"] = int(info.get("products_fallback", 0)) + 1
            return fallback(th, u, eps)
        step = eps * U[0]
        prior = (task.prior.grad(th + step) - task.prior.grad(th - step)) / (2.0 * eps)
        held, _ = held_parts(parts, n_data, info, U[0], float(U[0] @ prior))
        return sum((held[i] for i in sorted(held)), np.zeros(d)) + prior

    hvp.widths = True  # products_in may choose its rows' width
    return hvp


def products_in(hvp, metric: Metric):
    """``hvp`` for the ``λ_max`` of ``metric`` (``M^½ᵀ ∇²U M^½``): :func:`power_products`' rows 12 bits wide where the
    metric's scales span at most :data:`~qlsd_flwr.compression.fixed.SPREAD_12`, 16 up to
    :data:`~qlsd_flwr.compression.fixed.SPREAD_16`, float32 beyond (:func:`~qlsd_flwr.compression.fixed.width_for`);
    any other ``hvp`` (central differences of float64 gradients) as it is.

    Why these widths are enough there: a row's entries are rounded within ``σ/2L`` of its largest, ``σ``. For ``b`` clients
    with semi-definite curvature that moves the Rayleigh quotient ``vᵀ M^½ᵀ ∇²U u`` (``u = M^½ v``) by at most
    ``(1 + b) √(spread d)/2L`` of ``λ_max`` (:func:`~qlsd_flwr.compression.fixed.quotient_bound`, which the tests hold γ
    to), a worst case of aligned errors; independent errors of mean zero move it by about one entry's worth a row,
    ``‖u‖ σ_h/(2L√3)``, at most ``√spread/(2L√3)`` each: 3e-3 on the main job (spread 9.3e4; measured: λ_max
    2.2019255 against float32's 2.2019184), 9e-3 at ``SPREAD_16``, the size of the Lanczos iteration's own stop rule
    (1e-2). That estimate still bounds each entry's error by its row's largest: measured, the rounding moves λ_max
    far less. At 12 bits (``L = 2047``) the estimate reaches 1e-2 at a spread of 5e3 and 0.045 at ``SPREAD_12``, but on
    the main job (spread 5.9e4, the same metric, 15 exchanges) λ_max read 2.184505 with 12-bit rows, 2.183280 with
    16-bit ones and 2.183722 with float32 rows: 3.6e-4 and 2.0e-4 of it, 28 and 50 times inside the stop rule (issue
    37, 2026-12-07; ``benchmarks/RESULTS.md``, "The preparation at 12 bits"). At a spread of 1e10 the same rows lost the stiff coordinates (λ_max 3× too small;
    ``tests/test_lowrank.py``)."""
    if not getattr(hvp, "widths", False):
        return hvp
    return functools.partial(hvp, bits=fixed.width_for(metric.spread()))
