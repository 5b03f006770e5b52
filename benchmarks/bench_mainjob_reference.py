"""A long full-batch HMC reference for the main job's posterior, and the total variation of a run's posterior
predictive to it (issue 37: "and it is the right posterior").

The main job's posterior (softmax regression on 4,000 MNIST digits, d = 7,850, prior N(0, I/5)) is log-concave.
HMC is run in the coordinates ``z`` where the Laplace approximation at the MAP is standard normal,
``θ = θ̂ + R⁻ᵀ z`` with ``∇²U(θ̂) = R Rᵀ`` (dense, exact: the softmax Hessian is its Gauss–Newton matrix), so a
step of about 1 and a dozen leapfrog steps cross the posterior. The chains run in lockstep (one triangular
solve for all of them), start from independent N(0, I) draws in ``z`` (dispersed at the posterior's own
scale), tune one step by dual averaging towards acceptance 0.8 in the warm-up, then keep every draw.

What it reports, on the main job's 1,000 test points:

* ``tv_halves``: the reference's own Monte Carlo error, the mean over test points of the total variation
  ``½ Σ_k |p̄_A(k | x) − p̄_B(k | x)|`` between the predictive of its first and second halves of chains;
* for each run folder given (``--runs``): ``tv`` between the run's predictive (every kept draw of every chain)
  and the whole reference's, and ``ratio = tv / tv_halves`` (the issue's target: ≤ 2); the same for the MAP
  plug-in, for scale.

    python benchmarks/bench_mainjob_reference.py --runs RUN_DIR [RUN_DIR ...]
    # the reference is kept in benchmarks/mainjob_reference.npz (its predictive only) and reused;
    # --rebuild runs HMC again (about 15 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.linalg import cho_factor, solve_triangular
from scipy.optimize import minimize

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.smoke import SMOKE, few, out, small  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.evaluation.reference import DualAveraging  # noqa: E402
from qlsd_flwr.experiments.mainjob import QLSD_MAIN  # noqa: E402
from qlsd_flwr.tasks import loading, registry  # noqa: E402
from qlsd_flwr.tasks.logistic import _logsumexp, _softmax  # noqa: E402

CACHE = out(HERE / "mainjob_reference.npz")  # QLSD_SMOKE: a scratch copy


class Posterior:
    """``U(θ) = Σ_j −log p(y_j | x_j, θ) + ‖θ‖²/(2 σ²)`` over every client's data, stacked."""

    def __init__(self, cfg):
        task = loading.load_task(cfg)
        self.Xa = np.vstack([c.Xa for c in task.clients])
        self.y = np.concatenate([c.y for c in task.clients])
        self.K = task.clients[0].n_classes
        self.F = self.Xa.shape[1]
        self.prec = 1.0 / float(task.prior.var)
        self.d = task.dim

    def value_and_grad(self, T: np.ndarray):
        """``T``: ``(d,)`` or ``(C, d)``; returns ``U`` ``(C,)`` and ``∇U`` ``(C, d)``."""
        T = np.atleast_2d(T)
        U, G = np.empty(len(T)), np.empty_like(T)
        for c, t in enumerate(T):
            Z = self.Xa @ t.reshape(self.F, self.K)
            U[c] = float(np.sum(_logsumexp(Z) - Z[np.arange(len(self.y)), self.y])) + 0.5 * self.prec * t @ t
            P = _softmax(Z)
            P[np.arange(len(self.y)), self.y] -= 1.0
            G[c] = (self.Xa.T @ P).ravel() + self.prec * t
        return U, G

    def hessian(self, t: np.ndarray) -> np.ndarray:
        """The exact Hessian at ``t``: ``H[(f,k),(g,l)] = Σ_j x̃_jf x̃_jg (p_jk δ_kl − p_jk p_jl) + δ/σ²``."""
        P = _softmax(self.Xa @ t.reshape(self.F, self.K))
        H = np.zeros((self.F, self.K, self.F, self.K))
        for k in range(self.K):
            for l in range(k, self.K):
                w = P[:, k] * ((k == l) - P[:, l])
                B = (self.Xa * w[:, None]).T @ self.Xa
                H[:, k, :, l] = B
                H[:, l, :, k] = B
        H = H.reshape(self.d, self.d)
        H[np.diag_indices(self.d)] += self.prec
        return H


def reference(draws: int, warmup: int, chains: int, leapfrog: int, seed: int = 0) -> dict:
    cfg = resolve({**QLSD_MAIN, "engine": "local", "num-chains": 1})
    post = Posterior(cfg)
    t0 = time.perf_counter()
    res = minimize(lambda t: tuple(x[0] for x in post.value_and_grad(t)), np.zeros(post.d), jac=True,
                   method="L-BFGS-B", options={"maxiter": small(20000, 20), "gtol": 1e-9, "ftol": 1e-15})
    mode = res.x
    gnorm = float(np.linalg.norm(post.value_and_grad(mode)[1]))
    R = cho_factor(post.hessian(mode), lower=True)[0]
    # float32 in LAPACK's order: a solve reads the factor once (memory-bound; 245 MB), no copy. HMC stays exact: the
    # map z -> θ and its gradient are deterministic functions of z, so the leapfrog is still reversible and
    # volume-preserving and the accept step uses U(θ) in float64; rounding only costs acceptance
    R = np.asfortranarray(np.tril(R), dtype=np.float32)
    print(f"MAP: U = {res.fun:.6f}, |grad| = {gnorm:.2e}; Hessian factored ({time.perf_counter() - t0:.0f} s)",
          flush=True)

    def to_theta(Z):  # θ = θ̂ + R⁻ᵀ z, all chains in one solve
        return mode + solve_triangular(R, Z.T.astype(np.float32), lower=True, trans="T", check_finite=False).T

    def vg(Z):
        U, G = post.value_and_grad(to_theta(Z))
        return U, solve_triangular(R, G.T.astype(np.float32), lower=True, check_finite=False).T.astype(np.float64)

    rng = np.random.default_rng(seed)
    Z = rng.standard_normal((chains, post.d))
    U, G = vg(Z)
    da, h = DualAveraging(0.5, 0.8), 0.5
    kept, acc = [], []
    X_te, y_te, _, _ = registry.test_set(cfg)
    Xt = np.hstack([np.asarray(X_te, np.float64).reshape(len(X_te), -1), np.ones((len(X_te), 1))])
    pred_sum = np.zeros((chains, len(Xt), post.K))
    t0 = time.perf_counter()
    for it in range(warmup + draws):
        hj = h * (1.0 + 0.1 * (2.0 * rng.uniform() - 1.0))
        p0 = rng.standard_normal(Z.shape)
        p, Y, Gy = p0 - 0.5 * hj * G, Z.copy(), G
        for j in range(leapfrog):
            Y = Y + hj * p
            Uy, Gy = vg(Y)
            p = p - (hj if j < leapfrog - 1 else 0.5 * hj) * Gy
        log_r = (U + 0.5 * np.sum(p0 ** 2, axis=1)) - (Uy + 0.5 * np.sum(p ** 2, axis=1))
        a = np.exp(np.minimum(0.0, np.nan_to_num(log_r, nan=-np.inf)))
        take = rng.uniform(size=chains) < a
        Z[take], U[take], G[take] = Y[take], Uy[take], Gy[take]
        if it < warmup:
            h = da.update(float(np.mean(a)))
            if it == warmup - 1:
                h = da.final
        else:
            acc.append(float(np.mean(a)))
            T = to_theta(Z)
            for c in range(chains):
                pred_sum[c] += _softmax(Xt @ T[c].reshape(post.F, post.K))
            kept.append(T[:, :8].copy())
        if (it + 1) % 50 == 0:
            print(f"  HMC {it + 1}/{warmup + draws}: step {h:.3f}, acceptance {np.mean(a):.2f}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    half = chains // 2
    pa, pb = pred_sum[:half].sum(0) / (half * draws), pred_sum[half:].sum(0) / ((chains - half) * draws)
    p_map = _softmax(Xt @ mode.reshape(post.F, post.K))
    import arviz as az

    trace8 = np.stack(kept, axis=1)  # (chains, draws, 8): the first coordinates, for R-hat and ESS
    rhat = float(np.max(az.rhat(az.convert_to_dataset(trace8)).to_array().values))
    return {"p_all": pred_sum.sum(0) / (chains * draws), "p_a": pa, "p_b": pb, "p_map": p_map,
            "acceptance": float(np.mean(acc)), "step": float(h), "leapfrog": leapfrog, "draws": draws,
            "warmup": warmup, "chains": chains, "rhat_first8": rhat, "seconds": time.perf_counter() - t0,
            "map_grad_norm": gnorm}


def tv(p, q) -> float:
    """Mean over test points of ``½ Σ_k |p(k | x) − q(k | x)|``."""
    return float(np.mean(0.5 * np.abs(p - q).sum(axis=1)))


def run_predictive(run_dir: Path) -> np.ndarray:
    from qlsd_flwr.outputs.recorder import load_samples

    cfg = resolve(json.loads((run_dir / "config.json").read_text())["config"])
    X_te, _, _, _ = registry.test_set(cfg)
    Xt = np.hstack([np.asarray(X_te, np.float64).reshape(len(X_te), -1), np.ones((len(X_te), 1))])
    S = load_samples(run_dir)
    S = S.reshape(-1, S.shape[-1])
    K = 10
    return np.mean([_softmax(Xt @ t.reshape(-1, K)) for t in S], axis=0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--chains", type=int, default=8)
    ap.add_argument("--leapfrog", type=int, default=8)
    ap.add_argument("--runs", nargs="*", default=[], help="run folders (qlsd-pp/ of a main job) to compare")
    ap.add_argument("--rebuild", action="store_true", help="run HMC again even if the cache exists")
    ap.add_argument("--sweep", nargs="*", default=[],
                    help="main-job overrides, each a JSON object (e.g. '{\"gamma-c\": 0.5}'), key=value[,key=value] or "
                         "'base' (none), each run without Ray (the Ray engine's chains bit for bit) and compared: TV, "
                         "R-hat, ESS, bits")
    ap.add_argument("--out", default=None, help="with --sweep: a JSON file under benchmarks/ for the rows")
    a = ap.parse_args(argv)
    if CACHE.exists() and not a.rebuild:
        ref = dict(np.load(CACHE, allow_pickle=False))
        meta = json.loads(str(ref.pop("meta")))
    else:
        got = reference(small(a.draws, 4), small(a.warmup, 2), small(a.chains, 2), small(a.leapfrog, 2))
        meta = {k: v for k, v in got.items() if not k.startswith("p_")}
        ref = {k: v for k, v in got.items() if k.startswith("p_")}
        np.savez_compressed(CACHE, meta=json.dumps(meta), **ref)
    base = tv(ref["p_a"], ref["p_b"])
    print(json.dumps({"reference": meta, "tv_halves": base,
                      "map_plugin": {"tv": tv(ref["p_map"], ref["p_all"]), "ratio": tv(ref["p_map"], ref["p_all"]) / base}},
                     indent=1))
    for r in a.runs:
        p = run_predictive(Path(r))
        print(json.dumps({"run": str(r), "tv": tv(p, ref["p_all"]), "ratio": tv(p, ref["p_all"]) / base}))
    rows = [sweep_row(_overrides(spec), ref, base) for spec in few(a.sweep)]  # QLSD_SMOKE: one row through the code
    if rows and a.out:
        out(HERE / a.out).write_text(json.dumps({"command": "python benchmarks/bench_mainjob_reference.py --sweep ...",
                                                 "tv_halves": base, "rows": rows}, indent=1))


def _overrides(spec: str) -> dict:
    """One ``--sweep`` entry: a JSON object, ``key=value[,key=value]`` (values as the run config reads text) or
    ``base`` (the main job as it is)."""
    if spec.strip().startswith("{"):
        return json.loads(spec)
    if spec.strip() == "base":
        return {}
    return dict(item.split("=", 1) for item in spec.split(","))


def sweep_row(over: dict, ref: dict, base: float) -> dict:
    """The main job with ``over`` (on the vectorised engine's numpy backend, the Ray engine's chains bit for bit):
    its predictive's TV to the reference (÷ the reference's halves'), the
    held-out verdict's R-hat and ESS, the calibration, the bits and the wall time."""
    from benchmarks.smoke import folder
    from qlsd_flwr.evaluation import evaluate as E
    from qlsd_flwr.experiments.mainjob import QLSD_MAIN
    from qlsd_flwr.run.simulate import run

    smoke = {"num-rounds": 12, "burn-in": 4, "thin": 1, "metric-rank": 0, "opt-rounds": 30,
             "opt-accept-unconverged": True} if SMOKE else {}
    cfg = {**QLSD_MAIN, "vectorised-backend": "numpy", "progress": False, "loo": "off",
           "output-dir": str(folder("/tmp/bench_mainjob_reference")), **over, **smoke}
    if "engine" not in over:  # the Ray engine's chains, bit for bit, without Ray (the coded broadcast too, on numpy)
        cfg["engine"] = "vectorised"
    t = time.perf_counter()
    q = run(cfg)
    wall = time.perf_counter() - t
    m = E.evaluate_run(q.run_dir)
    c = m["convergence"]
    p = run_predictive(Path(q.run_dir))
    b = q.summary.get("bits", {})
    row = {"over": over, "gamma": q.summary["gamma"], "tv": tv(p, ref["p_all"]), "ratio": tv(p, ref["p_all"]) / base,
           "accuracy": m["accuracy"], "nnll": m["nnll"], "ece": m["ece"], "rhat_pred_max": c["rhat_pred_max"],
           "rhat_loglik": c["rhat_loglik"], "ess_bulk_pred_min": c["ess_bulk_pred_min"], "wall_seconds": round(wall, 1),
           "bits_preparation_up": b.get("uplink", {}).get("preparation"),
           "bits_sampling_up": b.get("uplink", {}).get("sampling"),
           "bits_sampling_down": b.get("downlink", {}).get("sampling"), "bits_total": b.get("total")}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
