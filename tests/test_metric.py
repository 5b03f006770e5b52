"""The metric M, the temperature T, gamma = auto and dispersed starts (core.metric, protocol.precondition).

The reference for a metric is exact: with exact gradients on a Gaussian target of precision P the
chain is the linear recursion e_{k+1} = B e_k + √(2γT) M^{1/2} Z with B = I − γ M P, whose
covariance after k rounds from a fixed start is Σ_k = B Σ_{k−1} Bᵀ + 2γT M (Σ_0 = 0) and whose
stationary covariance solves the discrete Lyapunov equation Σ = B Σ Bᵀ + 2γT M. The sample
covariance of C independent chains at round K has, for Gaussian draws, the standard error
√((Σ_jj Σ_ll + Σ_jl²)/(C − 1)) per entry; the tests allow 5 of those (the draws are Gaussian, so
that is a 1-in-10^6 event per entry).
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from scipy.linalg import solve_discrete_lyapunov

from qlsd_flwr import samplers
from qlsd_flwr.compression import fixed
from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.core import curvature as cv
from qlsd_flwr.core import server_step as sampler
from qlsd_flwr.core.metric import Diagonal
from qlsd_flwr.core.server_step import noise_factor
from qlsd_flwr.core.metric_codec import from_array, to_array
from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.engines.vectorised import run_vectorised
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.robust.reports import N_CLAIM_CAP, REPORT_CAP, ReportError
from qlsd_flwr.run.simulate import run


class MatrixGaussian:
    """``U_i(θ) = ½ (θ − μ_i)ᵀ A_i (θ − μ_i)``: one "data point" with a full precision matrix, its
    exact Hessian and its batched gradient (so that thousands of chains run in seconds)."""

    def __init__(self, A, mu):
        self.A, self.mu = np.asarray(A, float), np.asarray(mu, float)
        self.n_data, self.dim = 1, len(mu)
        self.log_concave = bool(np.all(np.linalg.eigvalsh((self.A + self.A.T) / 2) >= 0))  # gamma-c = auto's rule

    def grad_sum(self, theta, idx=None):
        return self.A @ (theta - self.mu)

    def grad_sum_batch(self, thetas, idx=None):
        return (thetas - self.mu) @ self.A  # A symmetric

    def value(self, theta):
        e = theta - self.mu
        return 0.5 * float(e @ self.A @ e)

    def hessian(self, theta):
        return self.A.copy()

    def curvature_diag(self, theta):
        return np.diag(self.A).copy()


def ill_conditioned_task(d: int = 3, cond: float = 1e3, rho: float = 0.8) -> Task:
    """Two clients whose summed precision P has condition number ≥ ``cond`` and correlations ``rho``."""
    scales = np.geomspace(1.0, np.sqrt(cond), d)  # sd ratios: P's diagonal spans cond
    R = np.full((d, d), rho) + (1 - rho) * np.eye(d)
    P = np.diag(scales) @ R @ np.diag(scales)
    A1 = 0.4 * P + 0.1 * np.diag(np.diag(P))  # the clients differ in shape, both positive-definite
    A2 = 0.6 * P
    P = A1 + A2
    mu1, mu2 = np.linspace(-1, 1, d), np.linspace(2, 0, d)
    theta_star = np.linalg.solve(P, A1 @ mu1 + A2 @ mu2)
    assert np.linalg.cond(P) >= cond and np.all(np.abs(P[~np.eye(d, dtype=bool)]) > 0)  # not diagonal
    return Task(name="matrix-gaussian", dim=d, clients=[MatrixGaussian(A1, mu1), MatrixGaussian(A2, mu2)],
                prior=GaussianPrior(), theta_star=theta_star, theta0=theta_star.copy())


def _exact(keys: dict, task: Task, chains: int, rounds: int, keep=False):
    """``chains`` chains of exact-gradient ULA (QLSD's full oracle, no compression, p = 1) from θ*."""
    cfg = resolve({"variant": "qlsd", "compressor": "identity", "num-clients": task.b, "dim": task.dim,
                   "num-chains": chains, "num-rounds": rounds, "burn-in": rounds - 1, "progress": False,
                   "vectorised-backend": "numpy", "theta-star": "closed-form", **keys})
    return run_vectorised(cfg, task=task, write=False, keep_trace=keep)


@pytest.mark.parametrize("metric,T", [("diagonal", 1.0), ("dense", 1.0), ("file", 0.5), ("identity", 1.0)])
def test_stationary_covariance_is_the_discrete_lyapunov_solution(metric, T, tmp_path):
    # the identity needs about κ rounds to forget its start: a milder target keeps it short
    task = ill_conditioned_task(cond=1e3 if metric != "identity" else 30.0)
    P = sum(c.A for c in task.clients)
    keys = {"gamma": "auto", "temperature": T}
    if metric == "file":  # an SPD metric that is not P^{-1} (nor diagonal): the recursion holds for any M;
        # P^{-1} bent by a fixed non-symmetric factor keeps κ(M^½ P M^½) near 2.5, so the start is forgotten soon
        A = np.linalg.cholesky(np.linalg.inv(P)) @ np.array([[1.0, 0.4, 0.0], [-0.3, 1.0, 0.5], [0.2, 0.0, 1.0]])
        G = A @ A.T
        np.save(tmp_path / "m.npy", G)
        keys["metric"] = str(tmp_path / "m.npy")
    else:
        keys["metric"] = metric
    M = {"diagonal": np.diag(1.0 / np.diag(P)), "dense": np.linalg.inv(P), "identity": np.eye(3)}.get(metric)
    if metric == "file":
        M = G
    # gamma = auto must be c / λ_max(M^½ P M^½); the rounds K are those after which the start is forgotten
    L = np.linalg.cholesky(M)
    lam = np.linalg.eigvalsh(L.T @ P @ L)
    rho = 1.0 - cv.GAMMA_AUTO_C * lam.min() / lam.max()  # B's spectral radius at that γ
    C, K = 2000, int(np.ceil(np.log(1e-5) / (2 * np.log(rho))))
    res = _exact(keys, task, C, K, keep=False)
    gamma = res.summary["gamma"]
    # Lanczos stops when its top Ritz value (a lower bound of λ_max) has a residual < 1 %: γ within a few %. u and
    # the products travel as rows of compression.fixed (16 bits at this spread): the quotient may pass λ_max by that
    # rounding (fixed.quotient_bound)
    spread = res.summary["metric_spread"]
    over = fixed.quotient_bound(spread, 3, fixed.width_for(spread), task.b)
    assert cv.GAMMA_AUTO_C / lam.max() <= gamma * (1 + over) and gamma == pytest.approx(cv.GAMMA_AUTO_C / lam.max(), rel=5e-2)
    B = np.eye(3) - gamma * M @ P
    sigma_inf = solve_discrete_lyapunov(B, 2 * gamma * T * M)
    sig = np.zeros((3, 3))
    for _ in range(K):
        sig = B @ sig @ B.T + 2 * gamma * T * M
    # K rounds reach the stationary law within 1e-3 of its own scale: the comparison is with Σ
    assert np.max(np.abs(sig - sigma_inf) / np.sqrt(np.outer(np.diag(sigma_inf), np.diag(sigma_inf)))) < 1e-3
    x = res.theta - task.theta_star  # the chains' last states, (C, d)
    S = np.cov(x.T)
    se = np.sqrt((np.outer(np.diag(sig), np.diag(sig)) + sig**2) / (C - 1))
    assert np.max(np.abs(S - sigma_inf) / se) < 5.0, (S, sigma_inf)
    assert np.max(np.abs(x.mean(axis=0)) / np.sqrt(np.diag(sig) / C)) < 5.0


@pytest.mark.parametrize("metric,T,whitened", [("dense", 1.0, False), ("file", 0.5, False), ("dense", 1.0, True)])
def test_noise_correction_makes_the_law_exact_where_the_metric_is_the_curvature(metric, T, whitened, tmp_path):
    """noise-correction = metric: the noise's covariance γ (2 − γ) T M (core.server_step.noise_factor). With
    M = P⁻¹ at γ ≈ 1 (gamma-c = 1) the chain's law is the posterior itself, where ULA's is about twice as wide; with
    another M it is the Lyapunov solution for that noise. Both against 2,000 chains, at five standard errors.
    ``whitened``: the messages quantised in the metric's coordinates (compression-basis = metric, the step's other
    branch, the main job's), at 2^30 levels, whose quantisation noise is far below the chains' error."""
    task = ill_conditioned_task(cond=1e3)
    P = sum(c.A for c in task.clients)
    M = np.linalg.inv(P)
    keys = {"gamma": "auto", "gamma-c": 1.0, "temperature": T, "metric": metric, "noise-correction": "metric"}
    if whitened:
        keys.update({"compressor": "qsgd", "s": str(2**30), "compression-basis": "metric"})
    if metric == "file":  # an SPD metric that is not P⁻¹ (as in the test above)
        A = np.linalg.cholesky(M) @ np.array([[1.0, 0.4, 0.0], [-0.3, 1.0, 0.5], [0.2, 0.0, 1.0]])
        M = A @ A.T
        np.save(tmp_path / "m.npy", M)
        keys["metric"] = str(tmp_path / "m.npy")
    C, K = 2000, 60
    res = _exact(keys, task, C, K)
    gamma = res.summary["gamma"]
    assert res.summary["noise_factor"] == pytest.approx(np.sqrt(1 - gamma / 2))
    B = np.eye(3) - gamma * M @ P
    sigma = solve_discrete_lyapunov(B, gamma * (2 - gamma) * T * M)
    ula = solve_discrete_lyapunov(B, 2 * gamma * T * M)
    if metric == "dense":  # M = P⁻¹: the corrected law is the posterior's at any γ (ULA's is 1/(1 − γ/2) times it)
        np.testing.assert_allclose(sigma, T * M, rtol=1e-9, atol=1e-12)
    x = res.theta - task.theta_star
    S = np.cov(x.T)
    se = np.sqrt((np.outer(np.diag(sigma), np.diag(sigma)) + sigma**2) / (C - 1))
    assert np.max(np.abs(S - sigma) / se) < 5.0, (S, sigma)
    assert np.max(np.abs(S - ula) / se) > 5.0  # the check tells the corrected law from ULA's


def test_noise_correction_is_refused_where_it_has_nothing_to_act_on():
    with pytest.raises(ConfigError, match="noise-correction: metric takes M⁻¹ as the curvature, and metric = identity "
                                          "has none; allowed with it: off"):
        resolve({"noise-correction": "metric"})
    with pytest.raises(ConfigError, match="noise-correction: metric scales the QLSD family's Langevin noise"):
        resolve({"variant": "fald", "metric": "diagonal", "noise-correction": "metric"})
    with pytest.raises(ConfigError, match="noise-correction: unknown value 'on'; allowed: off, metric"):
        resolve({"metric": "diagonal", "noise-correction": "on"})
    with pytest.raises(ConfigError, match=r"noise-correction: metric needs 0 < γ < 2 .* γ = 2.5; allowed with it: off"):
        resolve({"metric": "diagonal", "noise-correction": "metric", "gamma": 2.5})  # before any exchange
    assert noise_factor("off", 2.5) == 1.0 and noise_factor("metric", 0.5) == np.sqrt(0.75)
    assert noise_factor("metric", 0.5, identity=True) == 1.0  # a correction that left M the identity: ULA's noise


def test_a_mutated_step_fails_the_lyapunov_check():
    """The check above can fail: M applied twice to the noise (M in place of M^½) is caught."""
    task = ill_conditioned_task()
    P = sum(c.A for c in task.clients)
    M = np.diag(1.0 / np.diag(P))
    orig = Diagonal.apply_root
    try:
        Diagonal.apply_root = lambda self, z: self.m * z
        res = _exact({"gamma": "auto", "metric": "diagonal"}, task, 2000, 400)
    finally:
        Diagonal.apply_root = orig
    gamma = res.summary["gamma"]
    B = np.eye(3) - gamma * M @ P
    sigma = solve_discrete_lyapunov(B, 2 * gamma * M)
    S = np.cov((res.theta - task.theta_star).T)
    se = np.sqrt((np.outer(np.diag(sigma), np.diag(sigma)) + sigma**2) / 1999)
    assert np.max(np.abs(S - sigma) / se) > 5.0


def test_identity_metric_at_t1_is_the_papers_step_bit_for_bit():
    rng = np.random.default_rng(0)
    spec = sampler.ServerSpec(b=3, gamma=1e-2, p=np.ones(3), rule="unbiased", memory=False, alpha=np.zeros(3),
                              l=10, kind=samplers.ESTIMATORS["full"], prior=GaussianPrior(2.0), prior_on_server=True)
    st = sampler.init_state(spec, rng.normal(size=7))
    theta0 = st.theta.copy()
    g_hat = rng.normal(size=(3, 7))
    sampler.server_step(spec, st, 5, g_hat, np.ones(3, bool))
    from qlsd_flwr.core import rng as r

    g = np.zeros(7)
    for i in range(3):
        g = g + 1.0 * g_hat[i]
    g = g + theta0 / 2.0
    z = r.normal(5, r.Stream.NOISE, 0, 0, 7)
    assert np.array_equal(st.theta, theta0 - 1e-2 * g + np.sqrt(2e-2) * z)


@pytest.mark.parametrize("metric", ["diagonal", "dense"])
def test_engines_agree_bit_for_bit_with_a_metric_gamma_auto_and_dispersed_starts(metric, tmp_path):
    base = {"num-chains": 3, "num-rounds": 40, "burn-in": 5, "progress": False, "output-dir": str(tmp_path),
            "metric": metric, "gamma": "auto", "variant": "qlsd-pp", "init": "dispersed", "p": "0.6",
            "dim": 6, "num-clients": 4, "l": 7, "s": "4", "temperature": 0.7}
    a = run({**base, "engine": "inprocess", "run-name": "a"})
    b = run({**base, "engine": "vectorised", "run-name": "b"})
    sa, sb = load_samples(a.run_dir), load_samples(b.run_dir)
    assert sa.shape == (3, 35, 6) and np.array_equal(sa, sb)
    assert a.summary["gamma"] == b.summary["gamma"] and a.summary["metric_kind"] == metric
    one = run({**base, "engine": "local", "num-chains": 1, "run-name": "c"})
    c1 = run({**base, "engine": "vectorised", "num-chains": 1, "run-name": "d"})
    assert np.array_equal(load_samples(one.run_dir), load_samples(c1.run_dir))
    # the starts are dispersed: the chains' first draws are apart by about the posterior's scale
    first = sa[:, 0, :]
    assert np.min(np.abs(first[0] - first[1])) > 0


def test_summary_and_samples_record_the_metric_and_the_step(tmp_path):
    import h5netcdf

    out = run({"engine": "local", "num-rounds": 30, "burn-in": 5, "progress": False, "output-dir": str(tmp_path),
               "metric": "diagonal", "gamma": "auto", "dim": 4, "num-clients": 3, "run-name": "r"})
    s = json.loads((out.run_dir / "summary.json").read_text())
    assert isinstance(s["metric"], list) and len(s["metric"]) == 4 and all(m > 0 for m in s["metric"])
    assert isinstance(s["gamma"], float) and s["gamma"] > 0 and s["gamma_auto"] is True
    conf = json.loads((out.run_dir / "config.json").read_text())
    assert conf["resolved"]["gamma"] == s["gamma"]
    with h5netcdf.File(out.run_dir / "samples.nc", "r") as f:
        assert f.attrs["gamma"] == s["gamma"] and f.attrs["metric"] == "diagonal"


# ---- hostile curvature reports ------------------------------------------------------------------
def test_check_report_refuses_each_kind_of_bad_report_by_name():
    d = 4
    for bad, why in ((np.full(d, np.nan), "non-finite"), (np.array([1.0, -1.0, 1.0, 1.0]), "negative"),
                     (np.ones(d + 1), "shape"), ("text", "not an array"), (np.full(d, np.inf), "non-finite")):
        with pytest.raises(ReportError, match=why):
            cv.check_report(bad, "diagonal", d)
    A = np.eye(d)
    A[0, 1] = 1.0
    with pytest.raises(ReportError, match="symmetric"):
        cv.check_report(A, "dense", d)
    with pytest.raises(ReportError, match="semi-definite"):
        cv.check_report(-np.eye(d), "dense", d)
    assert cv.check_report(np.eye(d).ravel(), "dense", d).shape == (d, d)  # as it travels


def test_one_huge_report_is_scaled_to_its_share_and_cannot_dominate_the_metric():
    d, n = 3, np.array([10, 10, 10, 10])
    honest = {i: np.full(d, 10.0 * (1 + 0.1 * i)) for i in range(4)}
    ref, _ = cv.metric_from_curvature("diagonal", dict(honest), n, np.full(d, 1.0), d)
    hostile = {**honest, 3: np.full(d, 1e30)}
    got, info = cv.metric_from_curvature("diagonal", hostile, n, np.full(d, 1.0), d)
    assert info["curvature_scaled"] == [3]
    # one client weighs at most REPORT_CAP × an honest client's curvature: M shrinks by a bounded factor
    assert np.all(got.m > ref.m / (REPORT_CAP + 1))
    assert np.all(np.isfinite(got.m)) and np.all(got.m > 0)


def _curvature_mod(kind: str, report: str | None = None):
    """A client mod that rewrites client 1's curvature reply (after the client computed it); ``report``:
    only replies of that kind (``"hvp"``: the Hessian-vector products of ``metric-rank``; ``"kronecker-block"``:
    ``metric-block``'s blocks, as square roots)."""
    from flwr.app import ConfigRecord

    from qlsd_flwr.compression import fixed, root
    from qlsd_flwr.flower.records import RECORD, from_content

    dim: list = []  # d, from the first request that carries θ (a later one at the same point names it by number)

    def mod(msg, ctx, call_next):
        out = call_next(msg, ctx)
        fields, _ = from_content(msg.content)
        if "theta" in fields and not dim:
            dim.append(np.size(fields["theta"]))
        if fields.get("phase") != "curvature" or int(ctx.node_config["partition-id"]) != 1 \
                or report not in (None, fields.get("kind")):
            return out
        rec = dict(out.content[RECORD])
        if fields.get("kind") == "hvp":  # products travel as rows of compression.fixed, in the block's width
            h, bits = fixed.decode(rec["payload"], dim[0]), fixed.width_of(rec["payload"])
            rec["payload"] = {
                "nan": lambda: fixed.encode(np.full_like(h, np.nan), bits),
                "negative": lambda: fixed.encode(-h - 1.0, bits), "huge": lambda: fixed.encode(h * 1e12 + 1e12, bits),
                "short": lambda: fixed.encode(h, bits)[:-2],
                # a width the request did not name
                "narrow": lambda: fixed.encode(h, fixed.BITS if bits == fixed.NARROW else fixed.NARROW)}[kind]()
            out.content[RECORD] = ConfigRecord(rec)
            return out
        if fields.get("kind") == "kronecker-block":  # metric-block's blocks travel as square roots (compression.root)
            buf = rec["payload"]
            m = int(np.frombuffer(buf, dtype="<u4", count=1, offset=1)[0])
            B = root.decode(buf, m)
            piv = bytearray(buf)
            piv[9:13] = piv[13:17]  # the first pivot repeated: not an ordering of the rows
            rec["payload"] = {"nan": lambda: root.encode(np.full_like(B, np.nan)), "negative": lambda: bytes(piv),
                              "huge": lambda: root.encode(B * 1e12 + 1e12), "short": lambda: buf[:-2]}[kind]()
            out.content[RECORD] = ConfigRecord(rec)
            return out
        h = np.frombuffer(rec["payload"], dtype="<f8").astype(np.float64)
        width = "<f8"
        bad = {"nan": np.full_like(h, np.nan), "negative": -h - 1.0, "huge": h * 1e12 + 1e12,
               "short": h[:-1]}[kind]
        rec["payload"] = bad.astype(width).tobytes()
        out.content[RECORD] = ConfigRecord(rec)
        return out

    return mod


@pytest.mark.parametrize("kind", ["nan", "negative", "huge", "short"])
def test_a_hostile_curvature_reply_through_flower_is_refused_or_bounded(kind, tmp_path, caplog):
    from qlsd_flwr.run.simulate import run_inprocess

    o = {"engine": "inprocess", "num-rounds": 20, "burn-in": 5, "progress": False, "output-dir": str(tmp_path),
         "metric": "diagonal", "gamma": "auto", "dim": 5, "num-clients": 4, "run-name": kind}
    cfg = resolve(o)
    caplog.set_level(logging.WARNING, logger="qlsd_flwr")
    strat = run_inprocess(cfg, o, mods=[_curvature_mod(kind)])
    s = strat.server.summary_data
    m = np.array(s["metric"])
    assert np.all(np.isfinite(m)) and np.all(m > 0)
    honest = run({**o, "engine": "local", "run-name": kind + "-honest"}).summary
    if kind == "huge":
        assert s["curvature_scaled"] == [1] and s["curvature_rejected"] == {}
        assert np.all(m > np.array(honest["metric"]) / (REPORT_CAP + 1))
    else:
        assert list(s["curvature_rejected"]) == ["1"] and "curvature report refused" in caplog.text
    assert np.all(np.isfinite(load_samples(strat.run_dir)))


# ---- configurations -----------------------------------------------------------------------------
def test_metric_keys_name_the_bad_value(tmp_path):
    with pytest.raises(ConfigError, match="metric: unknown value 'diag'.*identity, diagonal, dense"):
        resolve({"metric": "diag"})
    with pytest.raises(ConfigError, match="metric: no such file"):
        resolve({"metric": str(tmp_path / "none.npy")})
    np.save(tmp_path / "bad.npy", np.array([1.0, -2.0]))
    with pytest.raises(ConfigError, match="bad.npy"):
        run({"metric": str(tmp_path / "bad.npy"), "dim": 2, "num-clients": 2, "engine": "local",
             "num-rounds": 3, "burn-in": 0, "progress": False, "output-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="dense needs d ≤"):
        run({"metric": "dense", "dim": 2001, "num-clients": 2, "engine": "local", "num-rounds": 3,
             "burn-in": 0, "progress": False, "output-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="gamma must be"):
        resolve({"gamma": "fast"})
    with pytest.raises(ConfigError, match="temperature must be"):
        resolve({"temperature": 0})
    with pytest.raises(ValueError, match="vectorised-backend = numba runs the paper's step only"):
        run({"metric": "diagonal", "engine": "vectorised", "vectorised-backend": "numba", "num-rounds": 3,
             "burn-in": 0, "progress": False, "output-dir": str(tmp_path)})


def test_active_fraction_with_unequal_p_is_refused_without_a_control_variate():
    p = ",".join(str(x) for x in np.linspace(0.1, 0.95, 20))
    for variant in ("qlsd", "qlsd-sharp"):
        with pytest.raises(ConfigError, match="active-fraction.*biases.*unbiased.*accept-biased-aggregation"):
            resolve({"variant": variant, "aggregation": "active-fraction", "p": p})
    resolve({"variant": "qlsd", "aggregation": "active-fraction", "p": p, "accept-biased-aggregation": True})
    resolve({"variant": "qlsd-pp", "aggregation": "active-fraction", "p": p})  # control variate: fine
    resolve({"variant": "qlsd", "aggregation": "active-fraction", "p": "0.3"})  # equal p: unbiased


def test_the_weight_warning_no_longer_recommends_a_biased_rule():
    from qlsd_flwr.protocol import build
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    task = build_gaussian_task(20, 50, 0)
    p = ",".join(["0.001"] + ["0.5"] * 19)
    why = build.participation_warnings(resolve({"variant": "qlsd", "p": p, "gamma": 1e-2}), task)
    assert why and all("active-fraction" not in w for w in why)
    why = build.participation_warnings(resolve({"variant": "qlsd-star", "p": p, "gamma": 1e-2}), task)
    assert any("active-fraction" in w for w in why)


def test_divergence_suggests_the_estimated_step_not_a_blind_tenth(tmp_path):
    from qlsd_flwr.protocol.divergence import DivergenceError

    with pytest.raises(DivergenceError) as info:
        run({"engine": "local", "metric": "diagonal", "gamma": 5.0, "num-rounds": 200, "burn-in": 0,
             "progress": False, "output-dir": str(tmp_path), "dim": 5, "num-clients": 4})
    msg = str(info.value)
    assert "estimated from this target's curvature" in msg and "gamma = auto" in msg
    assert "e.g. gamma=0.25" in msg  # c / λ_max with λ_max = 1 under the curvature metric (Gaussian task)


# ---- the convergence report on a user's own ServerApp ---------------------------------------------
def _user_run(tmp_path, name, **kw):
    from qlsd_flwr.flower import QLSDStrategy, make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.tasks.gaussian import GaussianLocal, client_data

    B, D = 4, 5
    app = make_client_app(lambda c: GaussianLocal(client_data(int(c.node_config["partition-id"]), D, 0)))
    strategy = QLSDStrategy(num_clients=B, dim=D, output_dir=str(tmp_path), run_name=name, progress=False,
                            variant="qlsd-pp", s=8, l=10, num_chains=4, init="dispersed", prior_var=4.0, **kw)
    strategy.start(InProcessGrid(app, B, shuffle_seed=1))
    return json.loads((tmp_path / name / "summary.json").read_text())["convergence"]


def test_the_convergence_report_fires_on_a_user_app_that_has_not_mixed(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="qlsd_flwr")
    rep = _user_run(tmp_path, "stuck", gamma=1e-6, num_rounds=60, burn_in=10)
    assert rep["verdict"] == "NOT MIXED" and rep["rhat_max"] > 1.5 and rep["starts"] == "dispersed"
    assert "NOT MIXED" in caplog.text and rep["worst_names"][0] in caplog.text
    import h5netcdf

    with h5netcdf.File(tmp_path / "stuck" / "samples.nc", "r") as f:
        assert f.attrs["convergence_verdict"] == "NOT MIXED"


def test_the_convergence_report_is_quiet_on_a_user_app_that_has_mixed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="qlsd_flwr")
    # 1,200 kept rounds: R-hat about 1.008 (seeds 0, 1, 2: 1.007–1.010), far enough from 1.05 that the last
    # bits of another machine's libm cannot cross it (500 rounds gave 1.0499: too close to call)
    rep = _user_run(tmp_path, "mixed", gamma="auto", metric="diagonal", num_rounds=1500, burn_in=300)
    assert rep["verdict"] == "MIXED" and rep["rhat_max"] <= 1.03 and rep["stationary"]
    assert "NOT MIXED" not in caplog.text


def test_a_trending_window_is_called_not_stationary():
    from qlsd_flwr.outputs import convergence as cv

    rng = np.random.default_rng(0)
    n, c, d = 400, 4, 3
    still = rng.normal(size=(n, c, d))
    drift = still + np.linspace(0, 3, n)[:, None, None]  # every chain drifts the same way: R-hat cannot see it
    assert cv.theta_report(still)["stationary"]
    rep = cv.verdict(cv.theta_report(drift))
    assert not rep["stationary"] and rep["verdict"] == "NOT MIXED" and "not stationary" in rep["message"]


# ---- the Kronecker (K-FAC) metric of one dense softmax layer ----------------------------------------
def _kron_reports(F=4, K=3):
    """Three clients' K-FAC factors (20 inputs each, with the bias's 1) and a shuffled layout."""
    rng = np.random.default_rng(0)
    perm = rng.permutation(F * K)
    reports = {}
    for i in range(3):
        X = np.hstack([rng.normal(size=(20, F - 1)), np.ones((20, 1))])
        p = rng.dirichlet(np.ones(K), size=20)
        reports[i] = {"G": X.T @ X, "A": np.diag(p.sum(0)) - p.T @ p, "perm": perm}
    return reports


def _kron_metric(F=4, K=3):
    d = F * K
    return cv.metric_from_kronecker(_kron_reports(F, K), np.full(3, 20), np.full(d, 0.5), d), d


def test_the_kronecker_metric_is_the_inverse_of_g_kron_a_plus_the_prior_and_its_root_squares_to_it():
    (m, info), d = _kron_metric()
    M = np.stack([m.apply(e) for e in np.eye(d)], axis=1)
    R = np.stack([m.apply_root(e) for e in np.eye(d)], axis=1)
    assert np.allclose(M, M.T, atol=1e-12) and np.linalg.eigvalsh(M).min() > 0
    assert np.allclose(R @ R.T, M, atol=1e-12)
    # M^{-1}, in the layer's (F̃, K) order, is G ⊗ Ā + λ_0 I with G and Ā as the clients' sums give them
    k = m.kron
    n_total = 60.0
    G = sum(r["G"] for r in _kron_reports().values())
    A = sum(r["A"] for r in _kron_reports().values()) / n_total
    H = np.kron(G, A) + 0.5 * np.eye(d)
    Minv = np.linalg.inv(M)[np.ix_(k.perm, k.perm)]
    assert np.allclose(Minv, H, rtol=1e-9, atol=1e-9 * np.abs(H).max())
    # as a checkpoint stores it
    again = from_array(to_array(m), d)
    assert np.array_equal(again.apply(np.arange(d, dtype=float)), m.apply(np.arange(d, dtype=float)))


def test_a_kfac_report_claiming_another_layer_is_refused_before_its_g_is_built(monkeypatch):
    """A client sets F̃ in its report, and G travels as a square root: a rank-0 root of F̃ = d (K = 1) is a few kB, yet
    would make the server build a d × d matrix (the review's: 63 kB, 2 GB at peak on the main job). The exchange votes
    on the reports' layers from their float32 numbers first: the foreign one is refused, its G never decoded."""
    from qlsd_flwr.compression import root
    from qlsd_flwr.protocol import curvature_exchange as ce
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve({"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "metric": "kronecker",
                   "progress": False})
    task = load_task(cfg)
    d, theta = task.dim, np.zeros(task.dim)
    honest = {i: cv.local_curvature(c, theta, "kronecker", 0, i) for i, c in enumerate(task.clients)}
    hostile = np.concatenate([[d, 1], [1.0], np.arange(d)]).astype("<f4").tobytes() + root.encode(np.zeros((d, d)))
    assert cv.kron_layout(hostile, d)[:2] == (d, 1)  # a well-formed report of another layer
    sizes, real = [], root.decode
    monkeypatch.setattr(root, "decode", lambda buf, m: sizes.append(m) or real(buf, m))
    _, info = ce.curvature_metric(cfg, task, theta, lambda th, kind: {**honest, 2: hostile}, task.n_data)
    assert info["curvature_rejected"] == {"2": cv.FOREIGN_LAYOUT} and sizes == [d // 2] * 3


def test_kronecker_reports_are_checked_and_a_foreign_layout_is_refused():
    d, F, K = 6, 3, 2
    G, A = np.eye(F), np.eye(K) * 0.2
    lay = np.array([1, 0, 2, 3, 4, 5])  # a layout that is not the identity: its perm travels
    good = cv.kron_report(G, A, lay)
    assert cv.check_report(good, "kronecker", d)["G"].shape == (F, F)
    # the identity layout travels without its perm (−K in the head), d float32 numbers fewer, and reads as sent
    ident = cv.kron_report(G, A, np.arange(d))
    assert len(good) - len(ident) == 4 * d and np.frombuffer(ident, "<f4", count=2)[1] == -K
    got = cv.check_report(ident, "kronecker", d)
    assert np.array_equal(got["perm"], np.arange(d)) and np.array_equal(got["G"], cv.check_report(good, "kronecker", d)["G"])
    shown = np.concatenate([[F, K], A.ravel(), np.arange(d)]).astype("<f4").tobytes() + ident[4 * (2 + K * K):]
    assert cv.kron_layout(ident, d) == cv.kron_layout(shown, d)  # the same vote as the identity perm sent
    with pytest.raises(ReportError, match="expected at least"):
        cv.check_report(ident[:4 * (2 + K * K) - 1], "kronecker", d)
    with pytest.raises(ReportError, match="sizes"):  # only K's sign says "no perm": a negative F̃ is refused
        cv.check_report(np.float32(-F).tobytes() + ident[4:], "kronecker", d)
    head = np.frombuffer(good, dtype="<f4", count=2 + K * K + d).copy()

    def with_head(h):
        return h.astype("<f4").tobytes() + good[4 * head.size:]

    nan_a, neg_a, four = head.copy(), head.copy(), head.copy()
    nan_a[2] = np.nan
    neg_a[2:2 + K * K] = -np.eye(K).ravel()
    four[0] = 4
    for bad, why in ((cv.kron_report(G, A, np.zeros(d)), "ordering"), (with_head(four), "sizes"),
                     (with_head(neg_a), "A is not positive semi-definite"), (good[:-1], "G: expected"),
                     (with_head(nan_a), "non-finite"), (good[:5], "bytes"), (np.zeros(40), "bytes"),
                     (cv.kron_report(np.full((F, F), np.nan), A, np.arange(d)), "G: a row's scale")):
        with pytest.raises(ReportError, match=why):
            cv.check_report(bad, "kronecker", d)
    # G travels as a square root: whatever a client sends decodes to a semi-definite G (here: nothing of −I)
    assert np.array_equal(cv.check_report(cv.kron_report(-G, A, np.arange(d)), "kronecker", d)["G"], np.zeros((F, F)))
    reps = {i: cv.check_report(good, "kronecker", d) for i in range(3)}
    other = head.copy()
    other[-d:] = np.arange(d)[::-1]  # another layout: refused, as the identity one would be here
    reps[3] = cv.check_report(with_head(other), "kronecker", d)
    _, info = cv.metric_from_kronecker(reps, np.full(4, 10), np.full(d, 1.0), d)
    assert list(info["curvature_rejected"]) == ["3"]


def test_engines_agree_bit_for_bit_with_the_kronecker_metric(tmp_path):
    base = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-chains": 2, "num-rounds": 25,
            "burn-in": 5, "progress": False, "output-dir": str(tmp_path), "metric": "kronecker", "gamma": "auto",
            "init": "dispersed", "variant": "qlsd-pp", "s": "8", "l": 5, "p": "0.7"}
    a = run({**base, "engine": "inprocess", "run-name": "a"})
    b = run({**base, "engine": "vectorised", "run-name": "b"})
    assert np.array_equal(load_samples(a.run_dir), load_samples(b.run_dir))
    assert a.summary["metric"]["kind"] == "kronecker" and a.summary["gamma"] == b.summary["gamma"]


# ---- priors the modeller chooses -----------------------------------------------------------------
def test_each_prior_s_gradient_and_curvature_are_its_value_s_derivatives():
    from qlsd_flwr.core.priors import BlockPrior, FunctionPrior, LogHalfNormalPrior, StudentTPrior

    priors = [StudentTPrior(3.0, 2.5, 0.5), LogHalfNormalPrior(2.0), GaussianPrior(3.0, 1.0),
              FunctionPrior(lambda t: float(np.sum(t**4)), lambda t: 4 * t**3, lambda t: 12 * t**2),
              BlockPrior([(slice(0, 3), StudentTPrior(4.0, 1.0)), (slice(3, 5), LogHalfNormalPrior(1.5))], dim=5)]
    theta = np.array([0.3, -1.2, 2.0, 0.1, -0.4])
    h = 1e-5  # central differences: error O(h²·U''') ≈ 1e-9 here, rounding O(1e-16/h) ≈ 1e-11
    for pr in priors:
        fd = np.array([(pr.value(theta + h * e) - pr.value(theta - h * e)) / (2 * h) for e in np.eye(5)])
        assert np.allclose(pr.grad(theta), fd, rtol=1e-6, atol=1e-7), pr
        fd2 = np.array([(pr.grad(theta + h * e)[j] - pr.grad(theta - h * e)[j]) / (2 * h) for j, e in enumerate(np.eye(5))])
        assert np.allclose(pr.curvature_diag(theta), np.maximum(fd2, 0.0), rtol=1e-6, atol=1e-6), pr


def test_a_student_t_prior_on_the_server_through_the_public_api_is_the_task_plugin_s_chain(tmp_path):
    from qlsd_flwr.core.priors import StudentTPrior
    from qlsd_flwr.flower import QLSDStrategy, make_client_app
    from qlsd_flwr.flower.inprocess import InProcessGrid
    from qlsd_flwr.tasks.gaussian import GaussianLocal, build_gaussian_task, client_data

    B, D = 4, 5
    prior = StudentTPrior(df=3.0, scale=0.5)
    app = make_client_app(lambda c: GaussianLocal(client_data(int(c.node_config["partition-id"]), D, 0)))
    kw = dict(variant="qlsd-pp", s=8, l=10, p=0.75, gamma=2e-3, num_rounds=30, burn_in=5, seed=3)
    strategy = QLSDStrategy(num_clients=B, dim=D, output_dir=str(tmp_path), run_name="user", progress=False,
                            prior=prior, **kw)
    strategy.start(InProcessGrid(app, B, shuffle_seed=1))
    task = build_gaussian_task(B, D, 0)
    task.prior = prior
    ref = run({"num-clients": B, "dim": D, "engine": "local", "progress": False, "output-dir": str(tmp_path),
               "run-name": "ref", **{k.replace("_", "-"): (str(v) if k in ("s", "p") else v) for k, v in kw.items()}},
              task=task)
    assert np.array_equal(load_samples(strategy.run_dir), load_samples(ref.run_dir))
    flat = run({"num-clients": B, "dim": D, "engine": "local", "progress": False, "output-dir": str(tmp_path),
                "run-name": "flat", **{k.replace("_", "-"): (str(v) if k in ("s", "p") else v) for k, v in kw.items()}})
    assert not np.array_equal(load_samples(flat.run_dir), load_samples(ref.run_dir))  # the prior acted
    with pytest.raises(ValueError, match="give one or the other"):
        QLSDStrategy(num_clients=B, dim=D, prior=prior, prior_var=2.0, write=False)
    with pytest.raises(ValueError, match="lacks grad"):
        QLSDStrategy(num_clients=B, dim=D, prior=type("P", (), {"value": lambda s, t: 0.0, "is_flat": False})(),
                     write=False)


def test_a_wide_metric_with_compression_is_named(caplog, tmp_path):
    task = ill_conditioned_task(cond=1e6)
    caplog.set_level(logging.WARNING, logger="qlsd_flwr")
    # quantising in θ's coordinates is named; in the metric's (what auto picks for a small dense M) the
    # compression's noise has M's shape, and an uncompressed chain has none
    for variant, basis, named in (("qlsd-star", "theta", True), ("qlsd-star", "auto", False), ("lsd-star", "theta", False)):
        caplog.clear()
        cfg = resolve({"variant": variant, "num-clients": 2, "dim": 3, "num-rounds": 3, "burn-in": 0, "s": "64",
                       "metric": "dense", "gamma": "auto", "progress": False, "vectorised-backend": "numpy",
                       "theta-star": "closed-form", "compression-basis": basis})
        run_vectorised(cfg, task=task, write=False)
        assert ("the compression noise" in caplog.text) is named


def test_a_drifting_held_out_log_likelihood_is_called_not_stationary(tmp_path):
    from qlsd_flwr.evaluation.evaluate import add_predictive_to_report
    from qlsd_flwr.outputs import convergence as cv

    rng = np.random.default_rng(1)
    still = rng.normal(size=(400, 4, 3))
    rep = cv.verdict(cv.theta_report(still))
    assert rep["stationary"]
    pred = {"rhat_pred_max": 1.01, "rhat_pred_p99": 1.0, "ess_bulk_pred_min": 300.0, "rhat_loglik": 1.0,
            "ess_bulk_loglik": 400.0}
    for drift, stationary in ((0.0, True), (3.0, False)):
        (tmp_path / "summary.json").write_text(json.dumps({"convergence": rep}))
        ll = rng.normal(size=(4, 400)) + np.linspace(0, drift, 400)
        add_predictive_to_report(tmp_path, pred, {}, ll)
        got = json.loads((tmp_path / "summary.json").read_text())["convergence"]
        assert got["stationary"] is stationary and (got["verdict"] == "MIXED") is stationary


def test_curvature_reports_that_would_overflow_or_misclaim_their_size_cannot_break_the_metric():
    d = 4
    huge = np.full(d, 1e200)
    with pytest.raises(ReportError, match="above"):
        cv.check_report(huge, "diagonal", d)
    with pytest.raises(ReportError, match="above"):
        cv.check_report(np.full((d, d), 1.5e308), "dense", d)
    # a client claiming N_i = 10^12 is scaled as if it held at most N_CLAIM_CAP × the median N
    honest = {i: np.full(d, 10.0) for i in range(3)}
    ref, _ = cv.metric_from_curvature("diagonal", dict(honest), np.array([10, 10, 10]), np.ones(d), d)
    got, info = cv.metric_from_curvature("diagonal", {**honest, 3: np.full(d, 1e13)}, np.array([10, 10, 10, 10**12]),
                                         np.ones(d), d)
    assert info["curvature_scaled"] == [3] and np.all(got.m > ref.m / (REPORT_CAP * N_CLAIM_CAP + 1))
    # a tiny report in a direction nothing else constrains keeps M finite
    tiny = {0: np.array([5e-324, 0, 0, 0]), 1: np.array([0, 1.0, 1.0, 1.0])}
    m, _ = cv.metric_from_curvature("diagonal", tiny, np.array([5, 5]), np.zeros(d), d)
    assert np.all(np.isfinite(m.m)) and np.all(m.m > 0)
    # Kronecker reports with the same layout but another layer shape are refused, not summed
    F, K = 3, 2
    a = cv.kron_report(np.eye(F), np.eye(K), np.arange(F * K))
    b = cv.kron_report(np.eye(K), np.eye(F), np.arange(F * K))
    reps = {0: cv.check_report(a, "kronecker", F * K), 1: cv.check_report(a, "kronecker", F * K),
            2: cv.check_report(b, "kronecker", F * K)}
    _, info = cv.metric_from_kronecker(reps, np.full(3, 5), np.ones(F * K), F * K)
    assert list(info["curvature_rejected"]) == ["2"]


@pytest.mark.ray
def test_the_curvature_exchange_and_gamma_auto_through_flower_s_ray_engine(tmp_path, attached_ray):
    from qlsd_flwr.run.simulate import run_ray

    o = {"engine": "ray", "num-chains": 2, "num-rounds": 15, "burn-in": 3, "progress": False, "dim": 6,
         "num-clients": 4, "metric": "diagonal", "gamma": "auto", "init": "dispersed", "variant": "qlsd-pp",
         "s": "8", "l": 5, "output-dir": str(tmp_path), "run-name": "ray", "client-cpus": 1.0}
    strat = run_ray(resolve(o), o)
    ref = run({**o, "engine": "vectorised", "run-name": "vec"})
    assert np.array_equal(load_samples(strat.run_dir), load_samples(ref.run_dir))
    assert strat.summary_data["gamma"] == ref.summary["gamma"] and strat.summary_data["curvature_reports"] == 4


def _bad_grad(client: int, kind: str, which=lambda n: True):
    """A client mod: client ``client``'s θ* phase gradients become ``kind`` (``short``: 8 bytes short,
    ``nan``) on the replies ``which(n)`` selects (``n``: its n-th θ* phase reply)."""
    from flwr.app import ConfigRecord

    from qlsd_flwr.flower.records import RECORD, from_content

    seen = [0]

    def mod(msg, ctx, call_next):
        out = call_next(msg, ctx)
        if from_content(msg.content)[0].get("phase") == "grad" and int(ctx.node_config["partition-id"]) == client:
            seen[0] += 1
            if which(seen[0]):
                rec = dict(out.content[RECORD])
                g = np.frombuffer(rec["payload"], dtype="<f8")
                rec["payload"] = (g[:-1] if kind == "short" else np.full_like(g, np.nan)).astype("<f8").tobytes()
                out.content[RECORD] = ConfigRecord(rec)
        return out

    return mod


@pytest.mark.parametrize("kind", ["short", "nan"])
def test_a_client_whose_theta_star_gradients_are_never_usable_is_left_out_and_the_run_goes_on(kind, tmp_path):
    # it was a stop (one client could end every run): now each bad reply is counted and asked again,
    # and a client with no usable term is left out; the descent then finds the other clients' mode
    from qlsd_flwr.run.simulate import run_inprocess

    o = {"engine": "inprocess", "variant": "qlsd-star", "theta-star": "optimise", "num-rounds": 5, "burn-in": 0,
         "dim": 4, "num-clients": 3, "progress": False, "output-dir": str(tmp_path), "loo": "off"}
    strat = run_inprocess(resolve(o), o, mods=[_bad_grad(2, kind)])
    s = strat.summary_data
    assert s["excluded"] == {"2": 0} and s["rejected"]["phase_reply"] == 2  # the reply and its second ask
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    task = build_gaussian_task(3, 4, 0)
    rest = task.clients[:2]
    mode = sum(c.y_sum for c in rest) / sum(c.n_data for c in rest)
    assert np.allclose(strat.server.spec.theta_star, mode, atol=1e-3 / np.sqrt(sum(c.n_data for c in rest)))


def test_one_bad_theta_star_reply_is_counted_and_asked_again(tmp_path):
    from qlsd_flwr.run.simulate import run_inprocess

    o = {"engine": "inprocess", "variant": "qlsd-star", "theta-star": "optimise", "num-rounds": 5, "burn-in": 0,
         "dim": 4, "num-clients": 3, "progress": False, "output-dir": str(tmp_path), "loo": "off", "run-name": "a"}
    bad = run_inprocess(resolve(o), o, mods=[_bad_grad(1, "nan", lambda n: n == 3)])
    ref = run_inprocess(resolve({**o, "run-name": "b"}), {**o, "run-name": "b"})
    assert bad.summary_data["rejected"] == {"phase_reply": 1} and not bad.summary_data.get("excluded")
    assert np.array_equal(load_samples(bad.run_dir), load_samples(ref.run_dir))  # the second ask was good


def test_qsgd_and_partial_participation_under_a_diagonal_metric_match_the_gaussian_theory(tmp_path):
    """The toy Gaussian's theory (tests/gaussian_theory.py) extended to a diagonal metric ``m``.

    QLSD* on ``U_i = Σ_j ‖θ − y_ij‖²/2`` sends ``x_i = N_i e_k`` (``e = θ − θ*``), so with weights
    ``B_i/p_i`` and QSGD noise ``c_i`` coordinate ``j`` follows
    ``e' = r_j e − γ m_j ε_j + √(2γ m_j) Z``, ``r_j = 1 − γ m_j N``, ``E ε_j² = P v_j + C_j``,
    ``P = Σ_i (1/p_i − 1) N_i²``, ``C_j = Σ_i E c_ij²/p_i``. Hence ``v_j a_j = 2γ m_j + γ² m_j² C_j``
    with ``a_j = 1 − r_j² − γ² m_j² P``. Without compression ``C = 0`` (exact); with QSGD
    ``Σ_j C_j ≤ ω Q S`` (``Q = Σ_i N_i²/p_i``, ``S = Σ_j v_j``), so the total variance ``S`` lies in
    ``[S_0, S_0 / (1 − max_j(γ² m_j² / a_j) ω Q)]``, ``S_0 = Σ_j 2γ m_j / a_j``. The chains are
    independent: the standard error of the mean over chains of each chain's total variance is the
    sample's spread over √C."""
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    b, d, p, s = 5, 8, 0.5, 16
    task = build_gaussian_task(b, d, 0)
    Ni = np.array(task.meta["client_sizes"], dtype=float)
    N = Ni.sum()
    m = np.linspace(0.5, 2.0, d) / N
    np.save(tmp_path / "m.npy", m)
    gamma = 0.4
    omega = min(d / s**2, np.sqrt(d) / s)
    r = 1 - gamma * m * N
    P = np.sum((1 / p - 1) * Ni**2)
    a = 1 - r**2 - gamma**2 * m**2 * P
    S0 = np.sum(2 * gamma * m / a)
    S_up = S0 / (1 - np.max(gamma**2 * m**2 / a) * omega * np.sum(Ni**2 / p))
    assert np.all(a > 0) and S_up / S0 < 1.1  # a narrow band: the test can tell a wrong M from a right one
    for variant, lo, hi in (("lsd-star", S0, S0), ("qlsd-star", S0, S_up)):
        cfg = resolve({"variant": variant, "num-clients": b, "dim": d, "p": str(p), "s": str(s), "gamma": gamma,
                       "metric": str(tmp_path / "m.npy"), "num-chains": 48, "num-rounds": 1500, "burn-in": 1499,
                       "progress": False, "vectorised-backend": "numpy", "theta-star": "closed-form"})
        res = run_vectorised(cfg, task=task, write=False, keep_trace=True)
        e = res.trace[:, 100:, :] - task.theta_star  # after 100 rounds the start (θ_0 = 0) is forgotten: r ≤ 0.8
        per_chain = (e**2).mean(axis=1).sum(axis=1)  # each chain's total variance (the mean is known exactly)
        mean, se = per_chain.mean(), per_chain.std(ddof=1) / np.sqrt(len(per_chain))
        assert lo - 5 * se <= mean <= hi + 5 * se, (variant, mean, se, lo, hi)
    # the same check fails for the step without its metric (γ m replaced by γ/N: all m_j alike)
    cfg = resolve({"variant": "lsd-star", "num-clients": b, "dim": d, "p": str(p), "gamma": gamma / N,
                   "num-chains": 48, "num-rounds": 1500, "burn-in": 1499, "progress": False,
                   "vectorised-backend": "numpy", "theta-star": "closed-form"})
    res = run_vectorised(cfg, task=task, write=False, keep_trace=True)
    e = res.trace[:, 100:, :] - task.theta_star
    per_chain = (e**2).mean(axis=1).sum(axis=1)
    assert abs(per_chain.mean() - S0) > 5 * per_chain.std(ddof=1) / np.sqrt(len(per_chain))


def test_the_descent_refuses_a_reply_of_the_wrong_width_and_a_client_refuses_a_bad_precision(tmp_path):
    # issue 37: the descent to the curvature point sends θ as float32 and takes the gradients back as 12- or 16-bit
    # fixed-point rows (descent.DescentWidth); a float32 reply there is refused, counted and asked again (the run is
    # the one without it), and a request with another precision is refused by the client
    from flwr.app import ConfigRecord

    from qlsd_flwr.compression import fixed
    from qlsd_flwr.flower.records import RECORD, from_content
    from qlsd_flwr.protocol.gradients import gradient_of, precision_of
    from qlsd_flwr.run.simulate import run_inprocess

    seen = [0]

    def widen(msg, ctx, call_next):
        out = call_next(msg, ctx)
        fields = from_content(msg.content)[0]
        if fields.get("phase") == "grad" and fields.get("precision") in (12, 16) and int(ctx.node_config["partition-id"]) == 1:
            seen[0] += 1
            if seen[0] == 2:
                rec = dict(out.content[RECORD])
                rec["payload"] = fixed.encode(fixed.decode(rec["payload"], 62), 32)  # the same row, as float32
                out.content[RECORD] = ConfigRecord(rec)
        return out

    o = {"engine": "inprocess", "task": "logistic", "dataset": "breast_cancer", "num-clients": 3, "prior-var": 0.05,
         "metric": "diagonal", "gamma": "auto", "num-rounds": 4, "burn-in": 0, "progress": False, "loo": "off",
         "output-dir": str(tmp_path), "run-name": "a"}
    bad = run_inprocess(resolve(o), o, mods=[widen])
    ref = run_inprocess(resolve({**o, "run-name": "b"}), {**o, "run-name": "b"})
    assert seen[0] >= 2 and bad.summary_data["rejected"] == {"phase_reply": 1}
    assert np.array_equal(load_samples(bad.run_dir), load_samples(ref.run_dir))
    g = np.linspace(-3.0, 1.0, 62)
    assert np.array_equal(gradient_of(fixed.encode(g, 16), 62, 16), fixed.rounded(g, 16)[0])
    assert np.max(np.abs(gradient_of(fixed.encode(g, 16), 62, 16) - g)) <= 3.0 / 65534 * (1 + 1e-6)
    nan_scale = bytes([16]) + np.full(1, np.nan, "<f4").tobytes() + np.zeros(62, "<i2").tobytes()
    for payload, why in ((fixed.encode(g, 32), "expected a 16-bit fixed-point row"),  # float32 where 16 was asked
                         (fixed.encode(np.stack([g, g]), 16), "2 rows, above the 1 allowed"),
                         (fixed.encode(g[:61], 16), "not whole rows of 62"), (nan_scale, "scale is negative or not finite"),
                         (b"", "not a block of rows"), (np.zeros(62).tobytes(), "not a block of rows")):
        with pytest.raises(ValueError, match=why):
            gradient_of(payload, 62, 16)
    with pytest.raises(ValueError, match="expected 248 bytes of float32"):
        gradient_of(np.zeros(62).tobytes(), 62, 32)  # a float64 reply
    # 12 bits: two levels in three bytes, offset by 2,048; a level of −2,048 (the raw 0) or padding that is not a
    # zero level is refused, and so is a 16-bit row where 12 was asked
    assert np.array_equal(gradient_of(fixed.encode(g, 12), 62, 12), fixed.rounded(g, 12)[0])
    assert np.max(np.abs(gradient_of(fixed.encode(g, 12), 62, 12) - g)) <= 3.0 / 4094 * (1 + 1e-6)
    odd = fixed.encode(g[:61], 12)
    low = bytearray(fixed.encode(g, 12))
    low[5:8] = b"\x00\x00\x00"  # the first two levels' raw 0: −2,048
    pad = bytearray(odd)
    pad[-1] = 0  # the padding's high byte: no longer the zero level
    for payload, d, why in ((fixed.encode(g, 16), 62, "expected a 12-bit fixed-point row, got a 16-bit one"),
                            (bytes(low), 62, "out of range"), (odd[:-1], 61, "not whole rows of 61")):
        with pytest.raises(ValueError, match=why):
            gradient_of(payload, d, 12)
    with pytest.raises(ValueError, match="padding is not zero"):
        gradient_of(bytes(pad), 61, 12)
    assert np.array_equal(gradient_of(odd, 61, 12), fixed.rounded(g[:61], 12)[0])
    for p in (8, "32", True, None):
        with pytest.raises(ValueError, match="'precision' must be one of 12, 16, 32, 64"):
            precision_of({"precision": p})
    assert precision_of({}) == 64 and precision_of({"precision": 32}) == 32 and precision_of({"precision": 16}) == 16
    assert precision_of({"precision": 12}) == 12
