"""The metric against the identity: mixing and efficiency on real and ill-conditioned posteriors.

    python benchmarks/bench_metric.py --regressions   # ill-conditioned Bayesian regressions vs a MALA reference
    python benchmarks/bench_metric.py --logistic      # ESS per round and per second, logistic breast_cancer/digits
    python benchmarks/bench_metric.py --mainjob       # the main job's chains (vectorised engine), metric vs identity
    python benchmarks/bench_metric.py --mainjob-steps # the main job's step c against QSGD's s (kronecker metric)
    python benchmarks/bench_metric.py --mainjob-rank  # the main job of 2026-11-27 to 12-02 (metric-rank = 150) against its former settings
    python benchmarks/bench_metric.py --bnn           # the quickstart's wine network against full-batch HMC
    python benchmarks/bench_metric.py --bnn-digits    # an MLP on digits (d = 1,210) against full-batch HMC

Every run: the vectorised engine (the chains the Flower engines run, bit for bit), 4 chains from
dispersed starts (``init = dispersed``), ``gamma = auto`` (so each metric gets the same rule for its
step, ``0.25 / λ_max`` of its own preconditioned curvature). Results go to ``benchmarks/metric_*.json``
and ``benchmarks/RESULTS.md`` quotes them with the command and the machine.

**Regressions.** Bayesian linear regression ``y = Xβ + σε`` with correlated predictors (Toeplitz
correlation ``ρ^{|i−j|}``, columns scaled over ``scale_span``), Student-t(3, 2.5) priors on β and
``σ ~ HalfNormal(2)`` sampled as ``u = log σ`` (with its Jacobian), the data over 5 clients. The
reference is MALA run in the coordinates whitened by the Cholesky factor of the inverse Hessian at
the mode (``qlsd_flwr.evaluation.reference.mala`` on the transformed potential: Metropolis-adjusted,
so exact whatever the conditioning), 4 chains × 20,000 draws. Reported: the largest
``|mean − ref mean| / ref sd`` and the range of ``sd / ref sd`` over the coordinates, and R-hat.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.smoke import SMOKE, few, folder, small  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.core.potential import Task  # noqa: E402
from qlsd_flwr.core.priors import BlockPrior, LogHalfNormalPrior, StudentTPrior  # noqa: E402
from qlsd_flwr.engines.vectorised import run_vectorised  # noqa: E402


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    import os

    return {"commit": commit, "cpus": os.cpu_count(), "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


# ---- ill-conditioned regressions --------------------------------------------------------------------
class RegressionLocal:
    """``U_i(β, u) = Σ_j (y_j − x_jβ)² e^{−2u}/2 + u`` (Gaussian noise of sd ``σ = e^u``)."""

    def __init__(self, X, y):
        self.X, self.y = np.asarray(X, float), np.asarray(y, float)
        self.n_data, self.dim = len(y), X.shape[1] + 1

    def _parts(self, theta, idx):
        X, y = (self.X, self.y) if idx is None else (self.X[idx], self.y[idx])
        b, u = theta[:-1], theta[-1]
        return X, y - X @ b, np.exp(-2.0 * u)

    def grad_sum(self, theta, idx=None):
        X, r, w = self._parts(theta, idx)
        return np.concatenate([-(X.T @ r) * w, [len(r) - float(r @ r) * w]])

    def value(self, theta):
        X, r, w = self._parts(theta, None)
        return 0.5 * float(r @ r) * w + len(r) * theta[-1]

    def hessian(self, theta):
        X, r, w = self._parts(theta, None)
        p = X.shape[1]
        H = np.empty((p + 1, p + 1))
        H[:p, :p] = X.T @ X * w
        H[:p, p] = H[p, :p] = 2.0 * (X.T @ r) * w
        H[p, p] = 2.0 * float(r @ r) * w
        return H


def regression_task(p: int, rho: float, scale_span: float, n: int = 500, b: int = 5, seed: int = 0) -> Task:
    rng = np.random.default_rng(seed)
    R = rho ** np.abs(np.subtract.outer(np.arange(p), np.arange(p)))
    Z = rng.multivariate_normal(np.zeros(p), R, size=n)
    X = Z * np.geomspace(1.0, scale_span, p)
    beta = rng.normal(size=p) / np.geomspace(1.0, scale_span, p) * (rng.random(p) < 0.7)
    y = X @ beta + rng.normal(size=n)
    parts = np.array_split(np.arange(n), b)
    prior = BlockPrior([(slice(0, p), StudentTPrior(df=3.0, scale=2.5)), (slice(p, p + 1), LogHalfNormalPrior(2.0))],
                       dim=p + 1)
    return Task(name=f"regression-p{p}", dim=p + 1, clients=[RegressionLocal(X[i], y[i]) for i in parts],
                prior=prior, theta0=np.zeros(p + 1))


def mode_of(task: Task) -> np.ndarray:
    from scipy.optimize import minimize

    r = minimize(lambda t: (task.potential(t), task.grad_potential(t)), task.theta0, jac=True, method="BFGS",
                 options={"gtol": 1e-10, "maxiter": 10_000})
    return r.x


def full_hessian(task: Task, theta: np.ndarray) -> np.ndarray:
    # a potential without a dense Hessian (the logistic task) gives it as products with the identity
    H = sum(c.hessian(theta) if hasattr(c, "hessian") else c.hvp_batch(theta, np.eye(task.dim)) for c in task.clients)
    return H + np.diag(task.prior.curvature_diag(theta))


def reference(task: Task, draws: int = small(20_000, 100), seed: int = 1) -> np.ndarray:
    """MALA in whitened coordinates ``θ = θ* + L φ``, ``L Lᵀ = H(θ*)^{-1}``: ``(chains·draws, d)``."""
    from qlsd_flwr.evaluation.reference import mala

    ts = mode_of(task)
    L = np.linalg.cholesky(np.linalg.inv(full_hessian(task, ts)))

    class Whitened:
        dim, theta0, name = task.dim, np.zeros(task.dim), task.name + "-whitened"

        def potential(self, phi):
            return task.potential(ts + L @ phi)

        def grad_potential(self, phi):
            return L.T @ task.grad_potential(ts + L @ phi)

    res = mala(Whitened(), n_draws=draws, n_warmup=small(2000, 50), n_chains=4, seed=seed, cache=False, init_scale=1.0)
    phi = np.asarray(res.samples).reshape(-1, task.dim)
    return ts + phi @ L.T


def run_regressions(out: Path) -> dict:
    cases = [("p4-rho0.9-span30", 4, 0.9, 30.0), ("p10-rho0.95-span100", 10, 0.95, 100.0),
             ("p26-rho0.9-span300", 26, 0.9, 300.0)]
    rows = {}
    K, burn = small(4000, 30), small(1000, 10)
    for name, p, rho, span in few(cases):
        task = regression_task(p, rho, span)
        ts = mode_of(task)
        cond = float(np.linalg.cond(full_hessian(task, ts)))
        t = time.perf_counter()
        ref = reference(task)
        t_ref = time.perf_counter() - t
        m_ref, s_ref = ref.mean(axis=0), ref.std(axis=0)
        rows[name] = {"d": task.dim, "hessian_condition": cond, "reference_seconds": t_ref}
        from qlsd_flwr.protocol.divergence import DivergenceError

        # LSD++ (minibatches, SVRG anchors, no compression) with each metric, then QLSD++ with QSGD: its
        # noise scales with the message's norm, which the stiff coordinates set, and M multiplies it
        # where the target is flat
        # compression-basis = metric (issue 37): the same QLSD++ runs with each client quantising Sᵀ H_i
        for variant, metric, init, s, basis in few((
                ("lsd-pp", "identity", "dispersed", 64, "theta"), ("lsd-pp", "identity", "theta0", 64, "theta"),
                ("lsd-pp", "diagonal", "dispersed", 64, "theta"), ("lsd-pp", "dense", "dispersed", 64, "theta"),
                ("qlsd-pp", "dense", "dispersed", 64, "theta"), ("qlsd-pp", "dense", "dispersed", 64, "metric"),
                ("qlsd-pp", "dense", "dispersed", 16, "theta"), ("qlsd-pp", "dense", "dispersed", 16, "metric"))):
            cfg = resolve({"task": "gaussian", "num-clients": task.b, "dim": task.dim, "variant": variant, "s": str(s),
                           "compression-basis": basis,
                           "l": 20, "batch-fraction": 0.2, "metric": metric, "gamma": "auto", "init": init,
                           "num-chains": 4, "num-rounds": K, "burn-in": burn, "theta-star": "optimise",
                           "opt-rounds": small(5000, 100), "opt-accept-unconverged": True, "seed": 3, "progress": False,
                           "vectorised-backend": "numpy"})
            t = time.perf_counter()
            key = (f"{variant}{f' s={s}' if variant == 'qlsd-pp' else ''}"
                   f"{' (compression-basis = metric)' if basis == 'metric' and variant == 'qlsd-pp' else ''}, {metric}, "
                   f"init = {init}")
            try:
                res = run_vectorised(cfg, task=task, write=False, keep_trace=True)
            except DivergenceError as exc:
                rows[name][key] = {"diverged": str(exc)[:200]}
                print(name, key, "diverged", flush=True)
                continue
            wall = time.perf_counter() - t
            draws = res.trace[:, burn:, :]
            flat = draws.reshape(-1, task.dim)
            from qlsd_flwr.evaluation.reference import diagnostics_of

            diag = diagnostics_of(draws)
            z = np.abs(flat.mean(axis=0) - m_ref) / s_ref
            ratio = flat.std(axis=0) / s_ref
            rows[name][key] = {"gamma": res.summary["gamma"], "lambda_max": res.summary.get("lambda_max"),
                                  "max_mean_err_ref_sd": float(z.max()), "sd_ratio_min": float(ratio.min()),
                                  "sd_ratio_max": float(ratio.max()), "rhat_max": float(np.nanmax(diag["rhat"])),
                                  "ess_bulk_min": float(np.nanmin(diag["ess_bulk"])), "wall_seconds": wall}
            print(name, key, json.dumps(rows[name][key]), flush=True)
    result = {"machine": machine(), "command": "python benchmarks/bench_metric.py --regressions", "cases": rows}
    (out / "metric_regressions.json").write_text(json.dumps(result, indent=2))
    return result


# ---- logistic tasks and the main job: ESS per round and per second ------------------------------------
def run_predictive(out: Path, which: str) -> dict:
    from qlsd_flwr.evaluation import evaluate as E
    from qlsd_flwr.experiments.mainjob import QLSD_MAIN
    from qlsd_flwr.run.simulate import run

    # these modes measured the main job as it was until 2026-12-02 (600 rounds, c = 1, θ broadcast in float64):
    # pinned, so that each reproduces what it recorded (the main job now: bench_mainjob_reference.py --sweep)
    QLSD_MAIN = {**QLSD_MAIN, "gamma-c": 1.0, "num-rounds": 600, "burn-in": 150, "thin": 3, "downlink": "off",
                 "noise-correction": "off",  # ULA's noise, as the job then had (2026-12-06 13:30: metric)
                 "metric-block": 0, "metric-rank-exchanges": 32}  # the 512 products alone (until 2026-12-04)
    if which == "mainjob":  # the metrics at the former step settings (s = 2, c = 0.25)
        bases = {"mainjob": {**QLSD_MAIN, "engine": "vectorised", "s": "2", "gamma-c": 0.25}}
        metrics = [("identity (γ = 2e-3, the old default)", {"metric": "identity", "gamma": 2e-3}),
                   ("identity, gamma = auto", {"metric": "identity", "gamma": "auto"}),
                   ("diagonal", {"metric": "diagonal", "gamma": "auto"}),
                   ("kronecker", {"metric": "kronecker", "gamma": "auto"})]
    elif which == "mainjob_steps":  # the kronecker metric: the step's c against the compression's s
        bases = {"mainjob": {**QLSD_MAIN, "engine": "vectorised"}}
        metrics = [(f"s = {s_}, c = {c}" + (f", {k} rounds" if k != 600 else ""),
                    {"s": s_, "gamma-c": c, "num-rounds": k, "burn-in": k // 2, "thin": 3 * k // 600})
                   for s_, c, k in (("2", 0.25, 600), ("2", 0.5, 600), ("2", 1.0, 600), ("16", 0.25, 600),
                                    ("16", 0.5, 600), ("16", 1.0, 600), ("16", 1.0, 1200))]
    elif which == "mainjob_rank":  # metric-rank: the main job now against its former settings, one session
        bases = {"mainjob": {**QLSD_MAIN, "engine": "vectorised"}}
        former = {"metric-rank": 0, "opt-tol": 1e-6, "burn-in": 300}  # the main job before metric-rank
        metrics = [("identity, γ = 2e-3 (the former default chain)",
                    {**former, "metric": "identity", "gamma": 2e-3, "s": "2", "gamma-c": 0.25}),
                   ("kronecker (the former main job)", former),
                   ("kronecker, burn-in 150", {**former, "burn-in": 150}),
                   ("kronecker + metric-rank 150 (the main job now)", {}),
                   ("kronecker + metric-rank 150, 1,200 rounds", {"num-rounds": 1200, "burn-in": 300, "thin": 6})]
    else:
        common = {"task": "logistic", "num-clients": 10, "variant": "qlsd-pp", "s": "16", "l": 20, "num-chains": 4,
                  "num-rounds": 2000, "burn-in": 1000, "engine": "vectorised", "seed": 0}
        bases = {"breast_cancer": {**common, "dataset": "breast_cancer"}, "digits": {**common, "dataset": "digits"}}
        metrics = [("identity, gamma = auto", {"metric": "identity", "gamma": "auto"}),
                   ("diagonal", {"metric": "diagonal", "gamma": "auto"}),
                   ("kronecker", {"metric": "kronecker", "gamma": "auto"})]
    rows = {}
    # a smoke run: a few rounds, no low-rank correction, a short descent (the same code otherwise)
    smoke = {"num-rounds": 12, "burn-in": 4, "thin": 1, "metric-rank": 0, "opt-rounds": 30,
             "opt-accept-unconverged": True} if SMOKE else {}
    for task_name, base in few(bases).items():
        rows[task_name] = {}
        for label, ov in few(metrics):
            cfg = {**base, **ov, "init": "dispersed", "progress": False, "vectorised-backend": "numpy", "loo": "off",
                   "output-dir": str(folder("/tmp/bench_metric")), **smoke}
            t = time.perf_counter()
            q = run(cfg)
            wall = time.perf_counter() - t
            m = E.evaluate_run(q.run_dir)
            c = m["convergence"]
            K = int(cfg["num-rounds"])
            rows[task_name][label] = {
                "gamma": q.summary["gamma"], "lambda_max": q.summary.get("lambda_max"), "s": cfg.get("s"),
                "metric_rank": cfg.get("metric-rank", 0), "kappa_before": q.summary.get("lowrank_kappa_before"),
                "opt_rounds": q.summary.get("opt_rounds"),
                "gamma_c": cfg.get("gamma-c"), "bits_per_round": q.summary["per_round"].get("bits_exact"),
                "accuracy": m["accuracy"], "nnll": m["nnll"], "ece": m["ece"],
                "rhat_pred_max": c["rhat_pred_max"], "rhat_loglik": c["rhat_loglik"],
                "ess_bulk_pred_min": c["ess_bulk_pred_min"], "ess_bulk_loglik": c["ess_bulk_loglik"],
                "rhat_theta_max": q.summary["convergence"].get("rhat_max"),
                "ess_pred_min_per_round": c["ess_bulk_pred_min"] / K,
                "ess_pred_min_per_second": c["ess_bulk_pred_min"] / wall, "wall_seconds": wall, "rounds": K}
            print(task_name, label, json.dumps(rows[task_name][label]), flush=True)
    result = {"machine": machine(), "command": f"python benchmarks/bench_metric.py --{which.replace('_', '-')}", "tasks": rows}
    (out / f"metric_{which}.json").write_text(json.dumps(result, indent=2))
    return result


# ---- a small Bayesian network against HMC ------------------------------------------------------------
def digits_mlp(b: int = 4):
    """An MLP on scikit-learn's digits (64-16-10, tanh, d = 1,210, prior N(0, 1 I), float64): 1,500
    images over ``b`` clients, the other 297 held out. Returns ``(clients, prior_var, X_eval)``."""
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    from qlsd_flwr.tasks.torch_models import TorchPotential

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float64)
    perm = np.random.default_rng(0).permutation(len(y))
    train, held = perm[:1500], perm[1500:]

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))

    parts = np.array_split(train, b)
    clients = [TorchPotential(model(), X[p], y[p], dtype=torch.float64) for p in parts]
    return clients, 1.0, X[held]


def wine_net(b: int = 4):
    """The quickstart's wine network (13-16-3, tanh, d = 275, prior N(0, 5 I), float64) over ``b``
    clients, evaluated on its 178 inputs. Returns ``(clients, prior_var, X_eval)``."""
    import torch

    sys.path.insert(0, str(ROOT / "examples" / "quickstart-torch"))
    from qlsd_quickstart.task import PRIOR_VAR, load_partition, make_model

    from qlsd_flwr.tasks.torch_models import TorchPotential

    clients = [TorchPotential(make_model(), *load_partition(i, b, held_out=0.0), dtype=torch.float64) for i in range(b)]
    X = np.concatenate([load_partition(i, b, held_out=0.0)[0] for i in range(b)]).astype(np.float64)
    return clients, PRIOR_VAR, X


def run_bnn(out: Path, rounds: int = 4000, net: str = "wine", metrics=("identity", "diagonal"),
            adapt_rounds: int = 1000, chains: int = 4, gamma_c: float | None = None) -> dict:
    """A small network against full-batch HMC (4 chains × 2,000 draws after 500 warm-up, 20
    leapfrog steps): the predictive's agreement (same argmax) and total variation (Izmailov et al.
    2021) on the evaluation inputs, against the TV between the two halves of the HMC reference
    (chains 0–1 against 2–3). ``net``: ``wine`` (:func:`wine_net`) or ``digits`` (:func:`digits_mlp`);
    ``metrics``: the rows (``identity``, ``diagonal``, ``rank``: the diagonal metric corrected in 150
    directions, ``adapt``: the diagonal metric refined by
    ``adapt_rounds`` warm-up rounds, ``metric-from = adapt``); ``chains``: the sampler's chains (from
    dispersed starts; their two halves' TV to each other is the sampler's own Monte Carlo spread, reported
    beside); ``gamma_c``: ``gamma-c`` (the step's ``c`` in ``γ = c/λ_max``; the key's default if ``None``)."""
    from qlsd_flwr.core.potential import GaussianPrior
    from qlsd_flwr.evaluation.reference import hmc

    b = 4
    clients, prior_var, X = (wine_net if net == "wine" else digits_mlp)(b)
    task = Task(name=f"{net}-bnn-f64", dim=clients[0].dim, clients=clients, prior=GaussianPrior(var=prior_var),
                theta0=clients[0].theta0())

    def predictive(draws):
        return clients[0].predict_proba(draws.reshape(-1, task.dim)[:: max(1, len(draws.reshape(-1, task.dim)) // 800)], X)

    def tv(p, q):
        return float(0.5 * np.abs(p - q).sum(axis=1).mean())

    def agree(p, q):
        return float(np.mean(p.argmax(1) == q.argmax(1)))

    t = time.perf_counter()
    ref = hmc(task, n_draws=small(2000, 20), n_warmup=small(500, 10), n_chains=4, seed=1, n_leapfrog=20, cache=False,
              init_scale=0.5)
    t_ref = time.perf_counter() - t
    S = np.asarray(ref.samples)
    p_ref, p_a, p_b = predictive(S), predictive(S[:2]), predictive(S[2:])
    rows = {"hmc": {"seconds": t_ref, "acceptance": float(np.mean(ref.acceptance)),
                    "tv_between_halves": tv(p_a, p_b), "agreement_between_halves": agree(p_a, p_b)}}
    print("hmc", json.dumps(rows["hmc"]), flush=True)
    every = {"identity": ("identity, gamma = auto", {"metric": "identity"}), "diagonal": ("diagonal", {"metric": "diagonal"}),
             "rank": ("diagonal + metric-rank 150", {"metric": "diagonal", "metric-rank": 150}),
             "adapt": (f"diagonal, adapt ({adapt_rounds} warm-up rounds)",
                       {"metric": "diagonal", "metric-from": "adapt", "adapt-rounds": adapt_rounds})}
    for label, ov in (every[m] for m in few(metrics)):
        cfg = resolve({"task": "gaussian", "num-clients": b, "dim": task.dim, "variant": "qlsd-pp", "s": "16", "l": 20,
                       "batch-fraction": 0.25, "gamma": "auto", "init": "dispersed", "num-chains": chains,
                       **({"gamma-c": gamma_c} if gamma_c is not None else {}),
                       "num-rounds": rounds, "burn-in": rounds // 2, "theta-star": "optimise", "opt-rounds": small(2000, 50),
                       "opt-accept-unconverged": True, "seed": 3, "progress": False, "vectorised-backend": "numpy",
                       **ov})
        t = time.perf_counter()
        res = run_vectorised(cfg, task=task, write=False, keep_trace=True)
        wall = time.perf_counter() - t
        draws = res.trace[:, rounds // 2:]
        p = predictive(draws)
        rows[label] = {"gamma": res.summary["gamma"], "tv_to_hmc": tv(p, p_ref), "agreement_with_hmc": agree(p, p_ref),
                       "tv_ratio_to_hmc_halves": tv(p, p_ref) / rows["hmc"]["tv_between_halves"],
                       "tv_between_own_halves": (tv(predictive(draws[: chains // 2]), predictive(draws[chains // 2:]))
                                                 if chains >= 2 else None),
                       "tv_own_halves_to_hmc": ([tv(predictive(h), p_ref) for h in (draws[: chains // 2], draws[chains // 2:])]
                                                if chains >= 2 else None),
                       "chains": chains, "wall_seconds": wall, "rounds": rounds}
        print(label, json.dumps(rows[label]), flush=True)
    suffix = "" if net == "wine" else "_digits"
    result = {"machine": machine(),
              "command": f"python benchmarks/bench_metric.py --bnn{suffix.replace('_', '-')} --bnn-rounds {rounds}"
                         f" --bnn-metrics {','.join(metrics)}" + (f" --bnn-chains {chains}" if chains != 4 else "")
                         + (f" --bnn-gamma-c {gamma_c}" if gamma_c is not None else ""),
              "net": net, "dim": task.dim, "rows": rows}
    tag = "" if tuple(metrics) == ("identity", "diagonal") else "_" + "_".join(metrics)
    tag += f"_{chains}chains_{rounds}" if chains != 4 else ""  # the rounds too: another length is another file
    tag += f"_c{gamma_c:g}" if gamma_c is not None else ""
    (out / f"metric_bnn{suffix}{tag}.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regressions", action="store_true")
    ap.add_argument("--logistic", action="store_true")
    ap.add_argument("--mainjob", action="store_true")
    ap.add_argument("--mainjob-steps", action="store_true", help="the main job's step c against QSGD's s")
    ap.add_argument("--mainjob-rank", action="store_true", help="the main job now against its former settings")
    ap.add_argument("--bnn", action="store_true")
    ap.add_argument("--bnn-digits", action="store_true")
    ap.add_argument("--bnn-rounds", type=int, default=4000, help="rounds of each sampler run (--bnn, --bnn-digits)")
    ap.add_argument("--bnn-metrics", default="identity,diagonal",
                    help="comma-separated rows of --bnn/--bnn-digits: identity, diagonal, rank (diagonal + "
                         "metric-rank 150), adapt")
    ap.add_argument("--adapt-rounds", type=int, default=1000, help="the warm-up of the adapt row")
    ap.add_argument("--bnn-chains", type=int, default=4, help="the sampler's chains (--bnn, --bnn-digits)")
    ap.add_argument("--bnn-gamma-c", type=float, default=None, help="gamma-c of the sampler rows (default: the key's)")
    a = ap.parse_args()
    out = folder(ROOT / "benchmarks")
    a.bnn_rounds, a.adapt_rounds = small(a.bnn_rounds, 60), small(a.adapt_rounds, 20)
    if a.regressions:
        run_regressions(out)
    if a.logistic:
        run_predictive(out, "logistic")
    if a.mainjob:
        run_predictive(out, "mainjob")
    if a.mainjob_steps:
        run_predictive(out, "mainjob_steps")
    if a.mainjob_rank:
        run_predictive(out, "mainjob_rank")
    if a.bnn:
        run_bnn(out, rounds=a.bnn_rounds, metrics=a.bnn_metrics.split(","), adapt_rounds=a.adapt_rounds,
                chains=a.bnn_chains, gamma_c=a.bnn_gamma_c)
    if a.bnn_digits:
        run_bnn(out, rounds=a.bnn_rounds, net="digits", metrics=a.bnn_metrics.split(","), adapt_rounds=a.adapt_rounds,
                chains=a.bnn_chains, gamma_c=a.bnn_gamma_c)


if __name__ == "__main__":
    main()
