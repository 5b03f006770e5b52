"""The rivals against the QLSD family (issue 23): posterior error against rounds, uplink and
downlink bits, on two of the comparison's three tasks.

``--task gaussian``: the heterogeneous toy Gaussian (``build_gaussian_task(20, 50)``: 20 clients of
very unequal sizes and means, prior N(0, 5 I)), whose posterior is known exactly.
``--task logistic``: breast_cancer over 10 clients of a Dirichlet(0.5) split, prior N(0, 0.02 I),
against MALA in coordinates whitened by the Hessian at the mode (4 × 20,000 draws; its two halves'
disagreement is reported as the floor).

Every sampler runs for the same rounds, 4 chains from the task's θ_0 = 0, and moves θ by the same
drift per round (``γ = 0.25/λ_max`` of the posterior's Hessian; the local-step samplers take ``K = 5``
steps of ``γ/5``):

* the QLSD family on the vectorised engine (bit for bit the Flower engines' chains): QLSD++ and
  QLSD* with QSGD ``s = 16``, LSD++ uncompressed;
* FALD (``K = 5``, τ = 0.5) raw and QSGD-coded (``s = 16``), VR-FALD* (reference θ*, and refreshed
  with ``q = 0.1``: its uplink adds every client's ``∇U_i(θ_k)`` in the refresh rounds, its downlink
  the new θ_r and ``∇U(θ_r)`` to every client once per reference installed), and DG-LMC
  (``K = 5`` ULA steps on each z_i, ``ρ = γ/10`` and ``ρ = γ``, raw and QSGD-coded) **through the round
  protocol** (the local engine: the messages the Flower apps exchange, their bits counted by the
  server);
* FSGLD (one client a round with ``f_i = N_i/N``, ``K = 5`` steps of ``γ/5``) through the round
  protocol, its surrogates each client's Taylor expansion at θ* (``variant = fsgld``), raw and
  QSGD-coded; and its framework-free core with the paper's surrogates, Laplace fits at each
  client's own mode (exact on the Gaussian), uplink counted as float64 (``64 d`` bits a message;
  its surrogates ``2 · 64 d`` per client once);
* the centralised reference on the pooled data (ULA; on the logistic task the ``sgld`` variant
  with full batches);
* FedAvg, a point estimate: FALD's drift with its noise off (``temperature = 1e-12``), i.e. ``K = 5``
  full-batch gradient steps on each client's MAP objective, averaged with the weights ``N_i/N``; its
  error is that of its iterate at each budget (its variance ratio 0: a point has no spread; on the
  network, the plug-in predictive's TV from HMC's posterior predictive).

Downlink: θ (float64) to every active client each round (FSGLD: θ and its aggregated surrogate).
Measured after each budget of rounds (the second half of the rounds so far kept): the largest
``|mean − reference| / sd`` over θ's coordinates (pooled over chains) and the mean ratio of the
sample variance to the reference's.

    python benchmarks/bench_rivals.py [--task gaussian|logistic] [--rounds 2000] [--out benchmarks/rivals_<task>.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.smoke import SMOKE, small  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import laws_dglmc  # noqa: E402  (the rivals' exact laws: tests/laws_dglmc.py)

B, D, PV, CHAINS, K = 20, 50, 5.0, 4, 5
ONLY = ""  # --only: the samplers rerun (the others' rows are the recorded file's, RECORDED)
RECORDED: dict = {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", choices=("gaussian", "logistic", "wine"), default="gaussian")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="rerun only the samplers whose name holds this text; the other "
                                                "rows are kept from the file at --out (same task and rounds)")
    ap.add_argument("--replot", action="store_true", help="redraw the figure from the recorded file at --out "
                                                           "(no run)")
    a = ap.parse_args()
    if a.replot:
        recorded = Path(a.out or f"benchmarks/rivals_{a.task}.json")  # read where it lies; a smoke run writes elsewhere
        plot(json.loads(recorded.read_text()), Path(smoke_out(str(recorded))).with_suffix(".png"))
        return
    out_path = smoke_out(a.out or f"benchmarks/rivals_{a.task}.json")
    global ONLY, RECORDED
    ONLY = a.only
    if ONLY:  # the recorded file (read where it lies, also in a smoke run, which writes elsewhere)
        recorded = Path(a.out or f"benchmarks/rivals_{a.task}.json")
        if not recorded.is_file():
            raise SystemExit(f"--only: no recorded results at {recorded} to keep the other samplers' rows from")
        RECORDED = json.loads(recorded.read_text())
    {"gaussian": gaussian, "logistic": logistic, "wine": wine}[a.task](small(a.rounds, 16), out_path)


class Bench:
    """The runs of one task: every sampler's 4 chains, their errors after each budget of rounds."""

    def __init__(self, task, cfg: dict, R: int, ref_mean, ref_var, label: str, errors=None, own_task: bool = False):
        self.task, self.cfg, self.R = task, cfg, R
        self.own_task = own_task  # the runs take this task object (a network built here), not the config's
        if errors is not None:
            self.errors = errors
        self.ref_mean, self.ref_var = np.asarray(ref_mean), np.asarray(ref_var)
        self.budgets = [R // 8, R // 4, R // 2, R]
        self.tmp = tempfile.mkdtemp()
        self.out = {"machine": platform.processor() or platform.machine(), "task": label, "rounds": R,
                    "b": task.b, "d": task.dim, "chains": CHAINS,
                    "command": "python benchmarks/bench_rivals.py " + " ".join(sys.argv[1:]), "samplers": {}}
        if ONLY:  # a partial rerun: the recorded file's command and reference, and a note of the rerun
            if RECORDED.get("rounds") != R and not SMOKE:
                raise SystemExit(f"--only: the file at --out has rounds = {RECORDED.get('rounds')}, not {R}")
            self.out.update({k: RECORDED[k] for k in ("command", "reference") if k in RECORDED})
            self.out["reruns"] = [*RECORDED.get("reruns", []), {
                "only": ONLY, "command": "python benchmarks/bench_rivals.py " + " ".join(sys.argv[1:]),
                "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}]

    def errors(self, draws: np.ndarray) -> dict:
        sd = np.sqrt(self.ref_var)
        x = draws.reshape(-1, draws.shape[-1])
        return {"mean_err_sd": float(np.max(np.abs(x.mean(0) - self.ref_mean) / sd)),
                "var_ratio": float(np.mean(x.var(0) / self.ref_var))}

    def skip(self, name: str) -> bool:
        """With ``--only``: a sampler not named keeps its recorded row (from the file being rewritten)."""
        if not ONLY or ONLY in name:
            return False
        if name not in RECORDED.get("samplers", {}):
            raise SystemExit(f"--only {ONLY!r}: the recorded file has no row {name!r} to keep; rerun it too")
        self.out["samplers"][name] = RECORDED["samplers"][name]
        return True

    def record(self, name: str, traces: np.ndarray, up: float, down: float, once: float = 0.0,
               seconds: float = 0.0, how: str = "protocol", point: bool = False):
        rows = []
        for r in self.budgets:  # a point estimate: its iterate at round r (its variance ratio is 0)
            rows.append({"rounds": r, "uplink_bits": once + up * r, "downlink_bits": down * r,
                         **self.errors(traces[:, r - 1:r] if point else traces[:, r // 2:r])})
        self.out["samplers"][name] = {"rows": rows, "uplink_bits_per_round": up, "downlink_bits_per_round": down,
                                      "once_bits": once, "seconds": seconds, "how": how}
        print(name, json.dumps(rows[-1]), flush=True)

    def protocol(self, name: str, over: dict, engine: str = "local", point: bool = False):
        """``CHAINS`` chains through the round protocol (engine ``local``: one chain each, seeds 0..3;
        ``vectorised``: all at once), every round's draw kept, the bits as counted by the server;
        ``point``: one run whose iterate at each budget is a point estimate (FedAvg)."""
        from qlsd_flwr.outputs.recorder import load_samples
        from qlsd_flwr.run.simulate import run

        if self.skip(name):
            return
        t = time.perf_counter()
        base = {**self.cfg, "num-rounds": self.R, "burn-in": 0, "thin": 1, "loo": "off", "plot": False,
                "progress": False, "output-dir": self.tmp, "engine": engine, **over}
        seeds = [None] if engine == "vectorised" else [0] if point else range(CHAINS)
        draws, bits, active, refreshed = [], 0.0, 0.0, 0.0
        for c in seeds:
            o = {**base, "num-chains": CHAINS} if c is None else {**base, "seed": c}
            o["run-name"] = f"{name}-{c}".replace(" ", "_").replace("/", "_")
            if self.own_task:
                from qlsd_flwr.config import resolve
                from qlsd_flwr.engines.local import run_local
                from qlsd_flwr.engines.vectorised.driver import run_vectorised

                go = run_vectorised if engine == "vectorised" else run_local
                r = go(resolve({k: v for k, v in o.items() if k != "engine"}), task=self.task, write=True)
            else:
                r = run(o)
            draws.append(load_samples(r.run_dir))
            bits += float(r.summary["totals"]["bits_exact"])
            active += float(r.summary["totals"]["n_active"])
            facts = r.summary.get("reference_refresh")  # VR-FALD* with q: every kept client's ∇U_i(θ_k) up,
            if facts:  # and the new θ_r with ∇U(θ_r) down to each client once per installed reference
                bits += float(facts["uplink_bits"])
                refreshed += float(facts["installed"])
        draws = np.concatenate(draws)
        d = self.task.dim
        # downlink: θ (float64) to every active client each round; VR-FALD* also θ* and ∇U(θ*) once a client,
        # FSGLD θ*, ∇U(θ*), λ_i and Λ (its uplink once: the claim and the curvature, 2 · 64 d a client)
        anchor = {"vr-fald-star": 2, "qlsd-star": 2, "lsd-star": 2, "fsgld": 4}.get(over.get("variant"), 0) \
            * 64.0 * d * self.task.b
        runs = len(seeds) if engine != "vectorised" else CHAINS
        self.record(name, draws, bits / (self.R * runs),
                    (64 * d * active + 2 * 64.0 * d * self.task.b * refreshed) / (self.R * runs), 0.0,
                    time.perf_counter() - t, point=point)
        self.out["samplers"][name]["once_downlink_bits"] = anchor
        if over.get("variant") == "fsgld":
            self.out["samplers"][name]["once_bits"] = 2 * 64.0 * d * self.task.b

    def core(self, name: str, one_chain, up: float, down: float, once: float = 0.0):
        if self.skip(name):
            return
        t = time.perf_counter()
        traces = np.stack([one_chain(c) for c in range(CHAINS)])
        self.record(name, traces, up, down, once, time.perf_counter() - t, how="framework-free core")

    def save(self, path: Path):
        path.write_text(json.dumps(self.out, indent=1))
        plot(self.out, path.with_suffix(".png"))


def gaussian(R: int, path: Path) -> None:
    from qlsd_flwr.core import fald, fsgld
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    task = build_gaussian_task(B, D, 0, prior_var=PV)
    n = np.array([c.n_data for c in task.clients], dtype=float)
    P = n.sum() + 1 / PV
    cfg = {"task": "gaussian", "num-clients": B, "dim": D, "prior-var": PV, "gamma": 0.25 / P}
    bench = Bench(task, cfg, R, task.posterior_mean, task.posterior_var, f"toy Gaussian (b = {B}, d = {D})")
    start = task.theta0  # θ_0 = 0, as every run starts: far from the posterior (burn-in)
    _family(bench)
    rival_runs(bench, 0.25 / P)
    # DG-LMC's own stationary law (core.dglmc, exact): how far ρ alone puts it from the posterior
    from qlsd_flwr.core import dglmc

    ybar = np.stack([c.y.mean(axis=0) for c in task.clients])
    g = 0.25 / P
    for name, entry in bench.out["samplers"].items():
        if name.startswith("DG-LMC") and "QSGD" not in name:
            rho = g / 10 if "γ/10" in name else g
            m, v = laws_dglmc.gaussian_stationary(n, ybar, rho, dglmc.local_step(g, rho, 0.25), K, PV)
            entry["exact_law"] = {"mean_err_sd": float(np.max(np.abs(m - task.posterior_mean)
                                                             / np.sqrt(task.posterior_var))),
                                  "var_ratio": float(np.mean(v / task.posterior_var))}
    mu, lam = fsgld.gaussian_surrogates(task)
    bench.core("FSGLD (K = 5, Laplace surrogates)",
               lambda c: fsgld.run(task, mu, lam, n / n.sum(), 0.25 / (K * P), K, R, seed=c, theta0=start), 64 * D,
               3 * 64 * D, once=B * 2 * 64 * D)
    pooled = build_gaussian_task(B, D, 0, prior_var=PV, pooled=True)
    bench.core("ULA, pooled data (centralised)",
               lambda c: fald.run(pooled, 0.25 / P, 1, R, tau=1.0, seed=c, theta0=start), 0.0, 0.0)
    bench.save(path)


def _family(bench: Bench) -> None:
    """The QLSD family on the vectorised engine (bit for bit the Flower engines' chains)."""
    for name, variant in (("QLSD++ (s = 16)", "qlsd-pp"), ("QLSD* (s = 16)", "qlsd-star"),
                          ("LSD++ (float64)", "lsd-pp")):
        bench.protocol(name, {"variant": variant, "s": "16", "l": 100}, engine="vectorised")


def rival_runs(bench: Bench, gamma: float) -> None:
    """FALD, VR-FALD*, DG-LMC and FSGLD through the round protocol (local engine), raw and QSGD-coded."""
    common = {"local-steps": K, "tau": 0.5, "gamma": gamma / K}
    bench.protocol("FALD (K = 5, τ = 0.5)", {"variant": "fald", **common})
    bench.protocol("FALD (K = 5, τ = 0.5), QSGD s = 16", {"variant": "fald", "compressor": "qsgd", "s": "16", **common})
    bench.protocol("VR-FALD* (K = 5, at θ*)", {"variant": "vr-fald-star", **common})
    bench.protocol("VR-FALD* (K = 5, at θ*), QSGD s = 16", {"variant": "vr-fald-star", "compressor": "qsgd", "s": "16",
                                                           **common})
    bench.protocol("VR-FALD* (K = 5, θ_r refreshed, q = 0.1)", {"variant": "vr-fald-star", "q": 0.1, **common})
    for rho, label in ((gamma / 10, "γ/10 (auto)"), (gamma, "γ")):
        bench.protocol(f"DG-LMC (K = 5, ρ = {label})", {"variant": "dg-lmc", "local-steps": K, "gamma": gamma,
                                                       "rho": rho})
    bench.protocol("DG-LMC (K = 5, ρ = γ), QSGD s = 16", {"variant": "dg-lmc", "local-steps": K, "gamma": gamma,
                                                         "rho": gamma, "compressor": "qsgd", "s": "16"})
    # FedAvg, the point estimate a user would otherwise ship: FALD's drift with the noise off (T = 1e-12),
    # i.e. K full-batch gradient steps of γ/(K w_i) on each client's MAP objective U_i + w_i U_0 (per example:
    # the learning rate γN/K), averaged with the weights N_i/N; its iterate at each budget
    bench.protocol("FedAvg (K = 5 local GD steps; a point estimate)",
                   {"variant": "fald", "local-steps": K, "gamma": gamma / K, "temperature": 1e-12}, point=True)
    fs = {"variant": "fsgld", "local-steps": K, "gamma": gamma / K}
    bench.protocol("FSGLD (K = 5, Taylor at θ*)", fs)
    bench.protocol("FSGLD (K = 5, Taylor at θ*), QSGD s = 16", {**fs, "compressor": "qsgd", "s": "16"})


def wine(R: int, path: Path) -> None:
    """The quickstart's wine network (13-16-3, tanh, d = 275, prior N(0, 5 I)) over 4 clients, against
    full-batch HMC (benchmarks/bench_metric.py's reference: 4 chains × 2,000 draws, 20 leapfrog
    steps). The error is the predictive's total variation from HMC's on the 178 inputs (the
    parameters themselves are not identifiable), against the TV between HMC's two halves."""
    from bench_metric import wine_net

    from qlsd_flwr.core.potential import GaussianPrior, Task
    from qlsd_flwr.evaluation.reference import hmc

    b = 4
    clients, prior_var, X = wine_net(b)
    task = Task(name="wine-bnn-f64", dim=clients[0].dim, clients=clients, prior=GaussianPrior(var=prior_var),
                theta0=clients[0].theta0())

    def predictive(draws):
        flat = np.asarray(draws).reshape(-1, task.dim)
        return clients[0].predict_proba(flat[:: max(1, len(flat) // 800)], X)

    def tv(p, q):
        return float(0.5 * np.abs(p - q).sum(axis=1).mean())

    t = time.perf_counter()
    ref = hmc(task, n_draws=small(2000, 20), n_warmup=small(500, 10), n_chains=4, seed=1, n_leapfrog=20, cache=False,
              init_scale=0.5)
    S = np.asarray(ref.samples)
    p_ref, halves = predictive(S), tv(predictive(S[:2]), predictive(S[2:]))

    def errors(draws):
        d = tv(predictive(draws), p_ref)
        return {"tv_to_hmc": d, "tv_ratio_to_hmc_halves": d / halves}

    cfg = {"task": "gaussian", "num-clients": b, "dim": task.dim, "theta-star": "optimise",
           "opt-rounds": small(2000, 50), "opt-accept-unconverged": True, "vectorised-backend": "numpy"}
    bench = Bench(task, cfg, R, 0.0, 1.0, f"wine network (b = {b}, d = {task.dim})", errors=errors, own_task=True)
    bench.out["reference"] = {"method": "HMC, 4 x 2,000 draws, 20 leapfrog steps", "seconds": time.perf_counter() - t,
                              "acceptance": float(np.mean(ref.acceptance)), "tv_between_halves": halves}
    print("reference", json.dumps(bench.out["reference"]), flush=True)
    # the step: gamma = auto's for QLSD++ (c/λ_max by the federated power iteration), the same for all
    bench.protocol("QLSD++ (s = 16)", {"variant": "qlsd-pp", "s": "16", "l": 20, "batch-fraction": 1.0,
                                       "gamma": "auto"}, engine="vectorised")
    run_dir = Path(bench.tmp) / "QLSD++_(s_=_16)-None"
    gamma = (float(json.loads((run_dir / "summary.json").read_text())["gamma"]) if run_dir.exists()
             else float(RECORDED["reference"]["gamma"]))  # --only without QLSD++: the recorded γ
    bench.cfg["gamma"] = gamma
    bench.out["reference"]["gamma"] = gamma
    bench.protocol("LSD++ (float64)", {"variant": "lsd-pp", "l": 20, "batch-fraction": 1.0}, engine="vectorised")
    rival_runs(bench, gamma)
    bench.save(path)


def logistic(R: int, path: Path) -> None:
    """breast_cancer, 10 clients of a Dirichlet(0.5) split, the paper's prior N(0, 0.02 I), against
    MALA in whitened coordinates (benchmarks/bench_metric.py's reference, 4 × 20,000 draws)."""
    from scipy.optimize import minimize

    from bench_metric import mode_of, reference
    from qlsd_flwr.config import resolve
    from qlsd_flwr.core import fsgld
    from qlsd_flwr.tasks import loading

    b = 10
    cfg = {"task": "logistic", "dataset": "breast_cancer", "num-clients": b, "partition": "dirichlet",
           "partition-alpha": 0.5, "theta-star": "optimise", "opt-rounds": small(5000, 200),
           **({"opt-accept-unconverged": True} if SMOKE else {})}  # θ*'s descent takes γ/5 for VR-FALD*
    task = loading.load_task(resolve(cfg))
    d = task.dim
    t = time.perf_counter()
    ref = reference(task, draws=small(20_000, 100))
    t_ref = time.perf_counter() - t
    half = len(ref) // 2
    ts = mode_of(task)
    eye = np.eye(d)
    H_i = [c.hvp_batch(ts, eye) for c in task.clients]  # the logistic Hessian is its Gauss-Newton product
    H = sum(H_i) + np.diag(task.prior.curvature_diag(ts))
    lam = np.linalg.eigvalsh(H)
    gamma = 0.25 / float(lam[-1])
    bench = Bench(task, {**cfg, "gamma": gamma}, R, ref.mean(0), ref.var(0),
                  f"logistic breast_cancer (b = {b}, d = {d}, Dirichlet 0.5)")
    # the reference's own Monte Carlo error: its two halves against each other, in the same units
    sd = np.sqrt(ref.var(0))
    bench.out["reference"] = {"method": "MALA, whitened, 4 x 20,000 draws", "seconds": t_ref,
                              "halves_mean_err_sd": float(np.max(np.abs(ref[:half].mean(0) - ref[half:].mean(0)) / sd)),
                              "halves_var_ratio": float(np.mean(ref[:half].var(0) / ref[half:].var(0))),
                              "hessian_condition": float(lam[-1] / lam[0]), "gamma": gamma}
    print("reference", json.dumps(bench.out["reference"]), flush=True)
    _family(bench)
    rival_runs(bench, gamma)
    bench.protocol("SGLD, pooled data, full batch (centralised ULA)", {"variant": "sgld", "batch-fraction": 1.0},
                   engine="vectorised")
    start = task.theta0
    # FSGLD's surrogates: each client's Laplace fit at the mode of U_i + U_0/b (its share of the prior)
    mu, lam_s = [], []
    for c in task.clients:
        def f(x, c=c):
            return (c.value(x) + task.prior.value(x) / b, c.grad_sum(x) + task.prior.grad(x) / b)
        m = minimize(f, ts, jac=True, method="BFGS", options={"gtol": 1e-9, "maxiter": 10_000}).x
        mu.append(m)
        lam_s.append(np.diag(c.hvp_batch(m, eye)) + task.prior.curvature_diag(m) / b)
    n = task.n_data.astype(float)
    bench.core("FSGLD (K = 5, Laplace surrogates)",
               lambda c: fsgld.run(task, np.array(mu), np.array(lam_s), n / n.sum(), gamma / K, K, R, seed=c,
                                   theta0=start), 64 * d, 3 * 64 * d, once=b * 2 * 64 * d)
    bench.save(path)


def total_bits(sampler: dict, row: dict) -> float:
    """Both ways, one chain, all clients: the row's uplink (its one-time part included), its downlink, and
    the downlink sent once (θ*, ∇U(θ*), the surrogates)."""
    return row["uplink_bits"] + row.get("downlink_bits", 0.0) + sampler.get("once_downlink_bits", 0.0)


def plot(out: dict, path: Path) -> None:
    """Error against total bits (uplink and downlink, the one-time exchanges included), one line per sampler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tv = "tv_to_hmc" in next(iter(out["samplers"].values()))["rows"][0]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = plt.get_cmap("tab20").colors  # one colour a sampler (12 of them), markers by family
    for j, (name, s) in enumerate(out["samplers"].items()):
        x = [max(total_bits(s, r), 1.0) for r in s["rows"]]
        style = {"color": colours[(2 * j) % 20 if j < 10 else (2 * j + 1) % 20], "label": name,
                 "marker": "s" if "QLSD" in name or "LSD" in name else "^" if "FALD" in name else "o",
                 "linestyle": "--" if "QSGD" in name or "s = 16" in name else "-"}
        if tv:  # the network: the predictive's TV from HMC's, and that over HMC's own halves' TV
            axes[0].plot(x, [r["tv_to_hmc"] for r in s["rows"]], **style)
            axes[1].plot(x, [r["tv_ratio_to_hmc_halves"] for r in s["rows"]], **style)
            continue
        axes[0].plot(x, [r["mean_err_sd"] for r in s["rows"]], **style)
        axes[1].plot(x, [abs(r["var_ratio"] - 1) for r in s["rows"]], **style)
    names = ("predictive TV from HMC", "TV / TV between HMC's halves") if tv else \
        ("max |mean − exact| / sd", "|variance ratio − 1|")
    for ax, what in zip(axes, names):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("total bits, uplink + downlink (all clients, one chain)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8)
    zero = any(total_bits(s, r) == 0 for s in out["samplers"].values() for r in s["rows"])
    fig.suptitle(f"{out['task']}: error against total bits, both ways ({out['chains']} chains"
                 + ("; the centralised chain sends nothing: drawn at 1 bit)" if zero else ")"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("plot:", path)


if __name__ == "__main__":
    main()
