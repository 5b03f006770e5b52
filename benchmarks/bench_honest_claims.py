"""The honest maxima behind ``robust.claims.FACTOR_CLAIM`` and ``robust.products.FACTOR_PRODUCT``: how far an
honest client's full gradient, and its Hessian-vector product, per datum, sit from the other clients' (issue 38).

A θ* claim (VR-FALD*, FSGLD) and a VR-FALD* ``ref_grad`` are a client's whole gradient ``∇U_i(θ)`` at one point:
θ* or a posterior draw θ_k. The server judges each by its per-datum norm ``v_i = ‖∇U_i(θ)‖ / N_i`` against the
lower median of the clients' ``v``. This script measures ``max_i v_i / median`` for honest clients on the
built-in tasks: the toy Gaussian (clients' centres 5 apart, 10 to 200 points each) and Bayesian logistic
regression on breast_cancer and digits with Dirichlet(α) label splits (α = 0.5 and 0.1: a few points of
one label on some clients; a split flwr-datasets cannot make is skipped and said), 5 to 20 clients, three
data seeds; at θ* (found by the package's descent) and at
draws of an LSD++ chain (``gamma = auto``, diagonal metric, 400 rounds, every 10th of the last 200). The
products: each client's central difference at θ* along the top eigenvector of ``∇²U`` and 5 random directions,
as the power iteration of ``gamma = auto`` forms them. FSGLD's preparation (``gamma = auto``, one local step, the
identity and a diagonal metric):
which honest clients ``robust.reports.cap_surrogates`` holds, and the widening that costs them
(``fsgld_held``, ``fsgld_widening``), beside the widening a client's whole curvature would give if its report were
refused (``fsgld_refused_widening``: ``λ = 0``, what no rule can change). The curvature reports' and the low-rank correction's
products' use of ``robust.reports.FACTOR_SHARE``'s allowance (``loo_metric_*``, ``loo_lowrank``).

    python benchmarks/bench_honest_claims.py            # writes benchmarks/honest_claims.json
    python benchmarks/bench_honest_claims.py --shares   # writes benchmarks/honest_products.json (1 min)
    python benchmarks/bench_honest_claims.py --networks # writes benchmarks/honest_networks.json (12 min)

``--shares``: the constants of ``robust.products``' share rule. For each client, at every product of the power
iteration from a random start at θ* (30), along 5 random directions, and (since 2026-12-04) at every vector of the
Lanczos iteration γ now takes from a random start (30 products) and its top Ritz vector after each, its part of the Rayleigh quotient
``q_i = uᵀ ∇²U_i u`` over the others' and the prior's, ``q_{−i}``; the largest ``q_i / q_{−i}``, the largest
per datum (``q_i N_{−i} / (q_{−i} N_i)``), and the largest per datum among the parts over ``q_{−i}`` (what
``FACTOR_SHARE_DATUM`` must clear for the rule to hold no honest part).

``--networks``: the same statistics, and the products' per datum over their median, for models not declared
log-concave (an MLP on MNIST over dominant-label and Dirichlet splits, the quickstart's wine network), where a part is
judged only where the others' sum is positive: ``robust.products.SHARE_NETWORK`` and why the per-datum clip is off there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.protocol import build, precondition
from qlsd_flwr.tasks import loading

HERE = Path(__file__).resolve().parent
RULE = {True: "log-concave", False: "network"}  # info['products_rule'] for a model (not) log-concave


def cases(smoke: bool):
    seeds = (0,) if smoke else (0, 1, 2)
    out = [{"task": "gaussian", "num-clients": b, "dim": d, "prior-var": 5.0, "data-seed": s}
           for b, d in ((5, 5), (20, 50)) for s in seeds]
    for ds in ("breast_cancer", "digits"):
        for alpha in (0.5, 0.1):
            for b in ((5,) if smoke else (5, 10, 20)):
                out += [{"task": "logistic", "dataset": ds, "partition": "dirichlet", "partition-alpha": alpha,
                         "num-clients": b, "data-seed": s} for s in seeds]
    if smoke:
        return out[:3]
    from qlsd_flwr.experiments.mainjob import QLSD_MAIN  # the main job's data: MNIST, one dominant label per client

    return out + [{k: QLSD_MAIN[k] for k in ("task", "dataset", "model", "partition", "num-clients", "prior-var", "opt-tol")}]


def ratios(task, theta: np.ndarray) -> float:
    """``max_i v_i / lower median of v`` at ``theta``."""
    v = np.array([np.linalg.norm(c.grad_sum(theta)) / c.n_data for c in task.clients])
    med = np.sort(v)[(len(v) - 1) // 2]
    return float(v.max() / med) if med > 0 else float("inf")


def central_products(task, theta: np.ndarray, u: np.ndarray) -> tuple[list, np.ndarray]:
    """Each client's Hessian-vector product at ``theta`` along ``u`` and the prior's, as the power iteration forms
    them (central differences, ``core.curvature.fd_step``)."""
    from qlsd_flwr.core.curvature import fd_step

    eps = fd_step(theta) / max(float(np.max(np.abs(u))), 1e-300)
    h = [(c.grad_sum(theta + eps * u) - c.grad_sum(theta - eps * u)) / (2 * eps) for c in task.clients]
    return h, (task.prior.grad(theta + eps * u) - task.prior.grad(theta - eps * u)) / (2 * eps)


def product_ratio(task, theta: np.ndarray, seed: int = 0) -> float:
    """``max_i v_i / lower median`` of the clients' Hessian-vector products per datum at ``theta``, as the power
    iteration forms them (central differences, ``core.curvature.fd_step``), along the top eigenvector of the
    whole ``∇²U`` (30 power iterations) and 5 random directions: the worst."""
    def parts(u):
        return central_products(task, theta, u)[0]

    gen = np.random.default_rng(seed)
    u = gen.normal(size=theta.shape)
    for _ in range(30):
        w = sum(parts(u / np.linalg.norm(u)))
        u = w / np.linalg.norm(w)
    worst = 0.0
    for direction in [u] + [gen.normal(size=theta.shape) for _ in range(5)]:
        h = parts(direction / np.linalg.norm(direction))
        v = np.array([np.linalg.norm(hi) / c.n_data for hi, c in zip(h, task.clients)])
        worst = max(worst, float(v.max() / np.sort(v)[(len(v) - 1) // 2]))
    return worst


def share_ratios(task, theta: np.ndarray, seed: int = 0, concave: bool | None = None) -> dict:
    """The share rule's honest statistics at ``theta`` (module docstring, ``--shares``); with ``concave`` given, also
    at how many of the vectors ``robust.products.held_parts`` (with that model's constants) holds some client."""
    from qlsd_flwr.robust.products import held_parts

    n = np.array([c.n_data for c in task.clients], dtype=np.float64)

    def parts(u):
        return central_products(task, theta, u)

    gen = np.random.default_rng(seed)
    directions, u = [], gen.normal(size=theta.shape)
    for _ in range(30):
        u = u / np.linalg.norm(u)
        directions.append(u)
        h, prior = parts(u)
        u = sum(h) + prior
    directions += [gen.normal(size=theta.shape) for _ in range(5)]

    def whole(v):  # the federation's product: the clients' parts and the prior's
        h, prior = parts(v)
        return sum(h) + prior

    directions += _lanczos_directions(whole, gen.normal(size=theta.shape), 30)
    share = per_datum = needed = lowest = product = 0.0
    held = 0
    for u in directions:
        u = u / np.linalg.norm(u)
        h, prior = parts(u)
        if concave is not None:
            held += held_parts(dict(enumerate(h)), n, {"products_rule": RULE[concave]}, u, float(u @ prior))[1]
        v = np.array([np.linalg.norm(x) for x in h]) / n  # the per-datum clip's statistic (robust.products)
        product = max(product, float(v.max() / np.sort(v)[(len(v) - 1) // 2]))
        q = np.array([u @ x for x in h])
        for i in range(len(q)):
            others = q.sum() - q[i] + u @ prior
            if not others > 0:  # the rule judges no part there (a network's curvature can be negative)
                continue
            r = float(q[i] / others)
            p = r * (n.sum() - n[i]) / n[i]
            share, per_datum, lowest = max(share, r), max(per_datum, p), min(lowest, r)
            if r > 1.0:
                needed = max(needed, p)
    return {"share": share, "share_per_datum": per_datum, "share_per_datum_over_1": needed, "share_lowest": lowest,
            "product_per_datum": product, **({} if concave is None else {"held_at_theta_star": held})}


def _lanczos_directions(product, v, steps: int) -> list:
    """The vectors γ's Lanczos iteration asks products at (since 2026-12-04; :func:`qlsd_flwr.core.spectral.lambda_max`
    from a random start, run to ``steps`` products without stopping): its orthonormal basis and, after each step, its
    top Ritz vector, where the value it returns is read."""
    from scipy.linalg import eigh_tridiagonal

    V, alpha, beta, out = [v / np.linalg.norm(v)], [], [], []
    for j in range(min(steps, v.size)):
        w = product(V[-1])
        alpha.append(float(V[-1] @ w))
        B = np.array(V)
        w = w - B.T @ (B @ w)
        w = w - B.T @ (B @ w)
        t, S = eigh_tridiagonal(np.array(alpha), np.array(beta)) if j else (np.array(alpha), np.ones((1, 1)))
        out.append(S[:, -1] @ B)
        b = float(np.linalg.norm(w))
        if b <= 1e-12 * abs(float(t[-1])):
            break
        beta.append(b)
        V.append(w / b)
    return V[:len(alpha)] + out


def shares_main(smoke: bool) -> None:
    rows = []
    for over in cases(smoke):
        try:
            cfg = resolve({**over, "variant": "lsd-star", "theta-star": "optimise", "gamma": "auto",
                           "metric": "diagonal", "num-rounds": 1, "burn-in": 0, "progress": False, "loo": "off",
                           "plot": False})
            task = loading.load_task(cfg)
        except ConfigError as exc:
            print(f"{json.dumps(over)}: skipped ({exc})", flush=True)
            continue
        specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, build.blocks_for(cfg, task))
                 for i in range(cfg.b)]
        prep = precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs))
        r = {"case": over, **share_ratios(task, prep.theta_star)}
        rows.append(r)
        print(f"{json.dumps(over)}: q_i/q_-i {r['share']:.3g}, per datum {r['share_per_datum']:.3g}, per datum "
              f"where over 1 {r['share_per_datum_over_1']:.3g}", flush=True)
    worst = {k: max(r[k] for r in rows) for k in ("share", "share_per_datum", "share_per_datum_over_1")}
    print(f"honest maximum over {len(rows)} cases: q_i/q_-i {worst['share']:.3g}, per datum "
          f"{worst['share_per_datum']:.3g}, per datum where over 1 {worst['share_per_datum_over_1']:.3g} "
          "(robust.products.FACTOR_SHARE_DATUM)")
    if not smoke:
        (HERE / "honest_products.json").write_text(json.dumps({"worst": worst, "rows": rows}, indent=1))


def network_cases(smoke: bool) -> list:
    """``--networks``: an MLP on MNIST (dominant-label and Dirichlet splits) and the quickstart's wine network."""
    mnist = {"task": "mnist", "dataset": "mnist_subset", "model": "mlp"}
    wine = {"task": "mnist", "dataset": "wine_mlp:load", "model": "wine_mlp:make"}
    out = [{**wine, "partition": p, "num-clients": b} for p in ("dirichlet", "iid") for b in (4, 10)]
    if smoke:
        return out[:1]
    out += [{**mnist, "partition": "dominant_label", "num-clients": b, "data-seed": s} for b in (4, 10, 20) for s in (0, 1)]
    return out + [{**mnist, "partition": "dirichlet", "partition-alpha": a, "num-clients": b}
                  for a in (0.5, 0.1) for b in (10, 20)]


def networks_main(smoke: bool) -> None:
    """``--networks``: the honest maxima behind ``robust.products``' rule for models not declared log-concave,
    and whether the rule held any honest part there (``products_clipped`` of the preparation, the descent's included)."""
    sys.path.insert(0, str(HERE.parent / "examples"))  # the wine network's plug-in
    rows = []
    for over in network_cases(smoke):
        cfg = resolve({**over, "variant": "lsd-star", "theta-star": "optimise", "gamma": "auto", "metric": "diagonal",
                       "opt-accept-unconverged": True, "num-rounds": 1, "burn-in": 0, "progress": False, "loo": "off",
                       "plot": False})
        task = loading.load_task(cfg)
        specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, build.blocks_for(cfg, task))
                 for i in range(cfg.b)]
        prep = precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs))
        concave = bool(task.log_concave)

        def lam_under(rule: bool) -> tuple[float, int]:  # γ's λ_max at θ* with the rule for a model (not) log-concave
            from qlsd_flwr.core import curvature as cv
            from qlsd_flwr.protocol.curvature_exchange import products_in

            grad_fn, curv_fn = build.direct_exchanges(cfg, task, specs)
            info = {"products_rule": RULE[rule]}
            hvp = precondition.products_for(task, grad_fn, curv_fn, np.array([c.n_data for c in task.clients]), info)
            lam, _ = cv.lambda_max(grad_fn, prep.theta_star, prep.metric, cfg.seed, hvp=products_in(hvp, prep.metric))
            return lam, int(info.get("products_clipped", 0))

        (lam_now, held_now), (lam_convex, held_convex) = lam_under(concave), lam_under(True)
        r = {"case": over, "dim": task.dim, "log_concave": concave, **share_ratios(task, prep.theta_star, 0, concave),
             "products_clipped": int(prep.info.get("products_clipped", 0)), "gamma": prep.gamma,
             "held_in_gamma": held_now,
             "claims_at_theta_star": ratios(task, prep.theta_star),  # robust.claims.FACTOR_CLAIM's statistic  # in γ's own iteration at θ* (the preparation's count has the descent's too)
             # what the log-concave constants (the rule before 2026-12-07) do at the same θ*: γ ÷ the honest sum's
             "held_by_log_concave_rule": held_convex, "gamma_log_concave_rule_ratio": lam_now / lam_convex}
        rows.append(r)
        print(f"{json.dumps(over)}: products per datum {r['product_per_datum']:.3g}× the median; q_i/q_-i "
              f"{r['share']:.3g} (lowest {r['share_lowest']:.3g}), per datum where over 1 {r['share_per_datum_over_1']:.3g}; "
              f"held at θ*: {r['held_at_theta_star']} of the vectors; in the whole preparation (the descent's from θ_0 "
              f"included) {r['products_clipped']}, in γ's own iteration {r['held_in_gamma']}; under the log-concave rule at θ*: {r['held_by_log_concave_rule']} held, γ × "
              f"{r['gamma_log_concave_rule_ratio']:.3f}; claims per datum at θ* {r['claims_at_theta_star']:.3g}× the "
              "median", flush=True)
    worst = {k: max(r[k] for r in rows) for k in ("product_per_datum", "share", "share_per_datum_over_1",
                                                  "held_at_theta_star", "products_clipped", "held_in_gamma")}
    worst["share_lowest"] = min(r["share_lowest"] for r in rows)
    worst["gamma_log_concave_rule_ratio"] = max(r["gamma_log_concave_rule_ratio"] for r in rows)
    worst["claims_at_theta_star"] = max(r["claims_at_theta_star"] for r in rows)
    print(f"honest maximum over {len(rows)} network cases: a part over the others' {worst['share']:.3g} (SHARE_NETWORK); "
          f"products per datum {worst['product_per_datum']:.3g}× the median (the log-concave clip's statistic), per "
          f"datum where a part passed the others' {worst['share_per_datum_over_1']:.3g}; lowest part {worst['share_lowest']:.3g}; held at θ* (γ's λ_max) at most "
          f"{worst['held_at_theta_star']} vectors a case, in γ's own iteration {worst['held_in_gamma']}; in a whole preparation "
          f"at most {worst['products_clipped']}; the "
          f"log-concave rule would make γ up to {worst['gamma_log_concave_rule_ratio']:.3f}× the honest sum's; θ* claims per "
          f"datum up to {worst['claims_at_theta_star']:.3g}× the median (robust.claims.FACTOR_CLAIM)")
    if not smoke:
        (HERE / "honest_networks.json").write_text(json.dumps({"worst": worst, "rows": rows}, indent=1))


def loo_metric(task, theta: np.ndarray, kind: str) -> float:
    """The honest clients' largest use of :data:`~qlsd_flwr.robust.reports.FACTOR_SHARE`: ``max_i`` of the excess
    by which client ``i``'s curvature raises the prior's and the other clients' in some direction (every coordinate
    for ``diagonal``, the largest generalised eigenvalue for ``dense``), over its allowance ``FACTOR_SHARE ·
    N_i/N_{−i}``; above 1 the metric's rule would hold an honest client down."""
    from qlsd_flwr.core.curvature import local_curvature
    from qlsd_flwr.protocol.curvature_exchange import prior_curvature
    from qlsd_flwr.robust.reports import loo_excess, share_allowance

    if kind == "kronecker":  # K-FAC's reports, held on the whole G ⊗ Ā + λ_0 I (robust.reports.kron_loo_excess)
        from qlsd_flwr.core.curvature import check_report
        from qlsd_flwr.robust.reports import clamped_counts, kron_loo_excess

        reps = {i: check_report(local_curvature(c, theta, kind, 0, i), kind, task.dim) for i, c in enumerate(task.clients)}
        sizes = [c.n_data for c in task.clients]
        allow = share_allowance(sizes, reps)
        lam0 = float(np.mean(prior_curvature(task, theta)))
        return max(x / allow[i] for i, (x, _) in kron_loo_excess(reps, lam0, clamped_counts(sizes, reps)).items())
    reps = {i: np.asarray(local_curvature(c, theta, kind, 0, i), dtype=np.float64) for i, c in enumerate(task.clients)}
    floor = prior_curvature(task, theta)
    floor = np.diag(floor) if kind == "dense" else floor
    allow = share_allowance([c.n_data for c in task.clients], reps)
    total = floor + sum(reps[i] for i in sorted(reps))
    return max(float(np.max(loo_excess(h, total - h))) / allow[i] for i, h in reps.items())


def loo_lowrank(cfg, task, theta: np.ndarray, specs) -> float:
    """The honest clients' largest use of the low-rank correction's allowance (``robust.krylov``): the correction at
    ``theta`` on a diagonal metric from the clients' reports (the main job's K-FAC on its own case), ``metric-rank``
    50 (150 on the main job's case; at most d − 1), its ``lowrank_loo_share``; above 1 an honest client is held."""
    from qlsd_flwr.protocol.curvature_exchange import curvature_metric, lowrank_correction

    main = "model" in cfg.raw and cfg.raw.get("dataset") == "mnist_subset"
    c2 = resolve({**cfg.raw, "metric": "kronecker" if main else "diagonal",
                  "metric-rank": min(150 if main else 50, task.dim - 1)})
    _, curv_fn = build.direct_exchanges(c2, task, specs)
    n = np.array([c.n_data for c in task.clients])
    metric, _ = curvature_metric(c2, task, theta, curv_fn, n, None)
    info: dict = {}
    lowrank_correction(c2, task, theta, curv_fn, n, metric, info)
    return float(info.get("lowrank_loo_share", 0.0))


def fsgld_honest(over: dict) -> dict:
    """FSGLD's preparation on the case, with the identity metric and with a diagonal one (which makes ``c`` about
    ``γ``'s in every coordinate, the sparse ones included): the clients held by ``cap_surrogates``, the variance
    widening that costs them (``core.fsgld_widening.widening`` at ``t = h (λ − H)``), the worst over clients and
    coordinates, and the bound the rule then gives a lie (``surrogate_bound``)."""
    out: dict = {}
    for metric in ("identity", "diagonal"):
        r = _fsgld_honest({**over, "metric": metric})
        for k, v in r.items():
            out[k] = v if k not in out else (sorted(set(out[k]) | set(v)) if isinstance(v, list) else max(out[k], v))
    return out


def _fsgld_honest(over: dict) -> dict:
    from qlsd_flwr.core import fsgld_widening
    from qlsd_flwr.core.curvature import local_curvature
    from qlsd_flwr.protocol.curvature_exchange import prior_curvature

    cfg = resolve({**over, "variant": "fsgld", "theta-star": "optimise", "gamma": "auto", "progress": False,
                   "loo": "off", "plot": False})
    task = loading.load_task(cfg)
    specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, build.blocks_for(cfg, task))
             for i in range(cfg.b)]
    prep = precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs))
    H = np.stack([local_curvature(c, prep.theta_star, "diagonal", cfg.seed, i) for i, c in enumerate(task.clients)])
    n = np.array([c.n_data for c in task.clients], dtype=np.float64)
    f, h = (n / n.sum())[:, None], prep.gamma * prep.metric.diagonal(task.dim)
    c = h * (prior_curvature(task, prep.theta_star) + H.sum(axis=0))
    held = fsgld_widening.widening(h * (prep.surrogate - H), c, f, 1)
    refused = fsgld_widening.widening(-h * H, c, f, 1)
    bound = prep.info["surrogate_bound"]
    return {"fsgld_held": prep.info["surrogate_held"], "fsgld_widening": float(held.max()),
            "fsgld_refused_widening": float(refused.max()), "fsgld_c_max": float(c.max()),
            "fsgld_lie_bound": float(bound) if np.isfinite(bound) else 1e308}


def measure(over: dict) -> dict:
    cfg = resolve({**over, "variant": "lsd-star", "theta-star": "optimise", "gamma": "auto", "metric": "diagonal",
                   "num-rounds": 400, "burn-in": 200, "progress": False, "loo": "off", "plot": False})
    task = loading.load_task(cfg)
    specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, build.blocks_for(cfg, task))
             for i in range(cfg.b)]
    prep = precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs))
    run = run_local(cfg, task=task, write=False, keep_trace=True, progress=False, wire=False)
    draws = run.trace[200::10]
    at_draws = [ratios(task, th) for th in draws]
    sizes = [int(c.n_data) for c in task.clients]
    n_med = float(np.sort(sizes)[(len(sizes) - 1) // 2])
    return {"case": over, "n_min": min(sizes), "n_max": max(sizes), "n_over_median": max(sizes) / n_med,
            "at_theta_star": ratios(task, prep.theta_star),
            "at_draws_max": max(at_draws), "at_draws_median": float(np.median(at_draws)),
            "products_at_theta_star": product_ratio(task, prep.theta_star),
            "loo_metric_diagonal": loo_metric(task, prep.theta_star, "diagonal"),
            "loo_metric_dense": loo_metric(task, prep.theta_star, "dense") if task.dim <= 100 else None,
            "loo_metric_kronecker": loo_metric(task, prep.theta_star, "kronecker") if over["task"] != "gaussian" else None,
            "loo_lowrank": loo_lowrank(cfg, task, prep.theta_star, specs),
            **(fsgld_honest(over) if task.dim <= 1000 else {})}


def main() -> None:
    import argparse
    import os

    ap = argparse.ArgumentParser(description="The honest maxima behind robust.claims.FACTOR_CLAIM; writes "
                                 "benchmarks/honest_claims.json (QLSD_SMOKE: three cases, nothing written).")
    ap.add_argument("--shares", action="store_true", help="only robust.products' share rule: writes "
                    "benchmarks/honest_products.json")
    ap.add_argument("--networks", action="store_true", help="only robust.products' constants for models not declared "
                    "log-concave: writes benchmarks/honest_networks.json")
    smoke = bool(os.environ.get("QLSD_SMOKE"))
    args = ap.parse_args()
    if args.networks:
        return networks_main(smoke)
    if args.shares:
        return shares_main(smoke)
    rows = []
    for over in cases(smoke):
        try:
            r = measure(over)
        except ConfigError as exc:  # a Dirichlet(0.1) split that leaves a client empty: flwr-datasets gives up
            print(f"{json.dumps(over)}: skipped ({exc})", flush=True)
            continue
        rows.append(r)
        print(f"{json.dumps(r['case'])}: N_i {r['n_min']}–{r['n_max']}, max v_i / median: θ* {r['at_theta_star']:.3g}, "
              f"draws {r['at_draws_max']:.3g} (median {r['at_draws_median']:.3g}); products at θ* "
              f"{r['products_at_theta_star']:.3g}; curvature over its share's allowance: diagonal "
              f"{r['loo_metric_diagonal']:.3g}, dense {r['loo_metric_dense'] or float('nan'):.3g}, kronecker "
              f"{r['loo_metric_kronecker'] or float('nan'):.3g}, low-rank products {r['loo_lowrank']:.3g}; fsgld held "
              f"{r.get('fsgld_held')}, widening {r.get('fsgld_widening', float('nan')):.4g} (a refused report's "
              f"{r.get('fsgld_refused_widening', float('nan')):.4g})", flush=True)
    worst = max(max(r["at_theta_star"], r["at_draws_max"]) for r in rows)
    worst_products = max(r["products_at_theta_star"] for r in rows)
    worst_n = max(r["n_over_median"] for r in rows)  # the claims' clamp, REPORT_CAP × the lower median
    used = [max(r["loo_metric_diagonal"], r["loo_metric_dense"] or 0.0, r["loo_metric_kronecker"] or 0.0) for r in rows]
    worst_metric, held = max(used), sum(u > 1.0 for u in used)
    worst_lowrank = max(r["loo_lowrank"] for r in rows)
    fs = [r for r in rows if "fsgld_widening" in r]
    fsgld = {"fsgld_cases": len(fs), "fsgld_cases_held": sum(bool(r["fsgld_held"]) for r in fs),
             "fsgld_worst_widening": max(r["fsgld_widening"] for r in fs),
             "fsgld_worst_refused_widening": max(r["fsgld_refused_widening"] for r in fs),
             "fsgld_cases_lie_bound_over_2": sum(r["fsgld_lie_bound"] > 2.0 + 1e-9 for r in fs)}
    print(f"honest maximum over {len(rows)} cases of max_i v_i / median: claims {worst:.3g} (FACTOR_CLAIM), "
          f"Hessian-vector products {worst_products:.3g} (FACTOR_PRODUCT); curvature over its allowance "
          f"{worst_metric:.3g} (FACTOR_SHARE; {held} case(s) above 1), the low-rank correction's products "
          f"{worst_lowrank:.3g} (robust.krylov); largest N_i over the lower median {worst_n:.3g} "
          f"(the claims' clamp, REPORT_CAP); FSGLD: honest clients held in {fsgld['fsgld_cases_held']} of "
          f"{fsgld['fsgld_cases']} cases, widening at most {fsgld['fsgld_worst_widening']:.4g} (a refused report: "
          f"{fsgld['fsgld_worst_refused_widening']:.4g}; robust.reports.SURROGATE_WIDEN), a lie's bound above 2 in "
          f"{fsgld['fsgld_cases_lie_bound_over_2']} (a client with most of a coordinate's curvature)")
    if not smoke:
        (HERE / "honest_claims.json").write_text(json.dumps({"worst": worst, "worst_products": worst_products,
                                                            "worst_metric": worst_metric, "metric_held": held,
                                                            "worst_lowrank": worst_lowrank, "worst_n_over_median": worst_n, **fsgld,
                                                            "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
