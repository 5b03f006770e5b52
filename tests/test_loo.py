"""The federated leave-one-out (key ``loo``, :mod:`qlsd_flwr.outputs.loo`): PSIS-LOO over the
training points with the data on the clients.

The reference is ``az.loo`` on the pooled ``S × N`` pointwise log-likelihood of the same draws as they travel
(float32, ``loo.DRAWS_DTYPE``), computed here from the whole data set in one process. PSIS smooths each point on its own, so the
clients' per-point values must equal it to float rounding (the sums differ only in the order of
additions: 1e-9 relative is generous for sums of a few hundred terms of size ≤ 10^3)."""

from __future__ import annotations

import json
import shutil
import warnings

import arviz as az
import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

import qlsd_flwr
from qlsd_flwr.outputs import loo as L
from qlsd_flwr.flower import QLSDStrategy, make_client_app
from qlsd_flwr.flower.inprocess import InProcessGrid
from qlsd_flwr.potentials import LogDensityPotential, NumpyPotential, TorchPotential
from qlsd_flwr.run.simulate import run
from qlsd_flwr.tasks.logistic import build_logistic_task

BASE = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-chains": 2, "num-rounds": 120,
        "burn-in": 40, "thin": 2, "gamma": 1e-3, "progress": False}


def task_of(cfg: dict):
    """The run's own task (its split: the clients' points in the run's order)."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.tasks import loading

    return loading.load_task(resolve(cfg))


def pooled_loo(task_clients, theta: np.ndarray):
    """``az.loo`` on the whole data set's pointwise log-likelihood at the draws ``theta`` (c, n, d), as they travel
    to the clients (float32)."""
    theta = theta.astype(L.DRAWS_DTYPE).astype(np.float64)
    c, n, d = theta.shape
    ll = np.concatenate([np.stack([cl.pointwise_log_lik(t) for t in theta.reshape(-1, d)]) for cl in task_clients],
                        axis=1).reshape(c, n, -1)
    idata = az.from_dict(posterior={"theta": theta}, log_likelihood={"y": ll})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return az.loo(idata, pointwise=True), ll


def assert_same_loo(got, ref):
    for key in ("elpd_loo", "se", "p_loo"):
        assert got[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-9), key
    assert got["n_samples"] == ref["n_samples"] and got["n_data_points"] == ref["n_data_points"]
    assert np.allclose(np.asarray(got["loo_i"]), np.asarray(ref["loo_i"]), rtol=1e-12, atol=1e-12)
    assert np.allclose(np.asarray(got["pareto_k"]), np.asarray(ref["pareto_k"]), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("engine", ["vectorised", "inprocess"])
def test_federated_psis_equals_az_loo_on_the_pooled_log_likelihood(tmp_path, engine):
    outs = {m: run({**BASE, "engine": engine, "loo": m, "output-dir": str(tmp_path), "run-name": m})
            for m in ("psis", "pointwise")}
    task = task_of(BASE)
    theta = az.from_netcdf(outs["psis"].run_dir / "samples.nc").posterior["theta"].values
    ref, ll = pooled_loo(task.clients, theta)
    got = qlsd_flwr.loo(outs["psis"].run_dir)
    assert_same_loo(got, ref)
    # pointwise: the file's log_likelihood is the pooled matrix, and az.loo takes the file as it is
    idata = az.from_netcdf(outs["pointwise"].run_dir / "samples.nc")
    assert np.array_equal(idata.posterior["theta"].values, theta)  # the LOO never touches the chain
    assert np.allclose(idata.log_likelihood["y"].values, ll, rtol=0, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert_same_loo(az.loo(idata, pointwise=True), ref)
        cmp = az.compare({"psis": got, "pointwise": qlsd_flwr.loo(outs["pointwise"].run_dir)})
    assert list(cmp["elpd_loo"]) == pytest.approx([ref["elpd_loo"]] * 2, rel=1e-9)
    s = json.loads((outs["psis"].run_dir / "summary.json").read_text())["loo"]
    S, N, d = theta.shape[0] * theta.shape[1], ll.shape[-1], theta.shape[-1]
    assert s["elpd_loo"] == pytest.approx(ref["elpd_loo"], rel=1e-9) and s["n_data_points"] == N
    assert s["bits_up"] == 64 * 3 * N and s["bits_down"] == 32 * S * d * 4  # what the docs state: float32 draws
    assert json.loads((outs["pointwise"].run_dir / "summary.json").read_text())["loo"]["bits_up"] == 64 * S * N
    assert s["offsets"] == [0, *np.cumsum(task.n_data).tolist()]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(30, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def test_a_users_torch_app_gets_the_same_loo_as_the_pooled_computation(tmp_path):
    """A user's own ServerApp (``QLSDStrategy``) and ClientApp (``TorchPotential``), in process."""
    from sklearn.datasets import load_breast_cancer

    X, y = load_breast_cancer(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    parts = np.array_split(np.arange(len(y)), 3)
    pots = [TorchPotential(_mlp(), X[p], y[p], dtype=torch.float64) for p in parts]
    app = make_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])])
    d = pots[0].dim
    named = ArrayRecord(pots[0].named_arrays())  # before any run: a run loads its draws into the models
    for mode in ("psis", "pointwise"):
        st = QLSDStrategy(num_clients=3, dim=d, variant="lsd-pp", gamma=1e-3, num_rounds=40, burn_in=10,
                          num_chains=2, prior_var=1.0, loo=mode, output_dir=str(tmp_path), run_name=mode,
                          progress=False, seed=1, plot=mode == "pointwise")
        st.start(InProcessGrid(app, 3, shuffle_seed=0), initial_arrays=named)
        assert st.summary_data["loo"]["mode"] == mode and "error" not in st.summary_data["loo"]
    theta = az.from_netcdf(tmp_path / "psis" / "samples.nc").posterior["theta"].values
    ref, ll = pooled_loo(pots, theta)
    # the per-example log-likelihood a TorchPotential reports is −cross-entropy, exactly log softmax
    pots[0]._load(theta[0, 0].astype(np.float32).astype(np.float64))
    logp = torch.log_softmax(pots[0].model(torch.as_tensor(X[parts[0]])), -1).detach().numpy()
    assert np.allclose(ll[0, 0, :len(parts[0])], logp[np.arange(len(parts[0])), y[parts[0]]], atol=1e-12)
    assert_same_loo(qlsd_flwr.loo(tmp_path / "psis"), ref)
    idata = az.from_netcdf(tmp_path / "pointwise" / "samples.nc")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert_same_loo(az.loo(idata, pointwise=True), ref)
    names = idata.posterior["theta_dim_0"].values.tolist()  # named from the model's named_parameters()
    assert names[:2] == ["0.weight[0,0]", "0.weight[0,1]"] and names[-2:] == ["2.bias[0]", "2.bias[1]"]
    axes = az.plot_trace(idata, var_names=["theta"], coords={"theta_dim_0": names[:2]})
    assert axes.shape == (1, 2)
    # az.compare takes this path's files (here the same model twice: the two LOOs are equal)
    cmp = az.compare({"pointwise": idata, "psis": qlsd_flwr.loo(tmp_path / "psis")})
    assert np.allclose(cmp["elpd_diff"], 0.0, rtol=0, atol=1e-9)
    # overview.png, drawn by the strategy itself (key plot), only where asked
    assert (tmp_path / "pointwise" / "overview.png").stat().st_size > 10_000
    assert not (tmp_path / "psis" / "overview.png").exists()


def test_log_density_and_numpy_potentials_give_pointwise_log_likelihoods():
    rng = np.random.default_rng(0)
    x = rng.normal(size=20)

    def log_lik(theta, batch):
        return -0.5 * (batch - theta[0]) ** 2 - 0.5 * np.log(2 * np.pi)

    pot = LogDensityPotential(log_lik, x, dim=1, batch_size=7)
    want = -0.5 * (x - 0.3) ** 2 - 0.5 * np.log(2 * np.pi)
    assert np.allclose(pot.pointwise_log_lik(np.array([0.3])), want, atol=1e-14)
    npot = NumpyPotential(lambda t, i: np.zeros(1), lambda t: 0.0, n_data=20, dim=1,
                          pointwise_log_lik=lambda t: -0.5 * (x - t[0]) ** 2 - 0.5 * np.log(2 * np.pi))
    assert np.allclose(npot.pointwise_log_lik(np.array([0.3])), want, atol=1e-14)
    bad = NumpyPotential(lambda t, i: np.zeros(1), lambda t: 0.0, n_data=20, dim=1,
                         pointwise_log_lik=lambda t: np.zeros(19))
    with pytest.raises(ValueError, match=r"pointwise_log_lik returned shape \(19,\), expected \(20,\)"):
        bad.pointwise_log_lik(np.zeros(1))
    plain = NumpyPotential(lambda t, i: np.zeros(1), lambda t: 0.0, n_data=20, dim=1)
    with pytest.raises(L.LooError, match="no pointwise_log_lik"):
        L.pointwise(plain, np.zeros((3, 1)))


@pytest.mark.parametrize("bad,why", [
    (lambda a: a[:-1], "numbers, expected"),
    (lambda a: np.where(np.arange(a.size) == 3, np.nan, a), "not finite"),
    (lambda a: np.where(np.arange(a.size) == 3, 1e300, a), "beyond 1e150"),
    (lambda a: b"\x00" * 7, "not whole float64 numbers"),
    (lambda a: "text", "payload of type str"),
])
def test_a_bad_loo_reply_leaves_the_loo_out_with_the_reason_and_the_chain_alone(tmp_path, bad, why):
    out = run({**BASE, "engine": "vectorised", "loo": "off", "output-dir": str(tmp_path), "run-name": "r"})
    nc = out.run_dir / "samples.nc"
    before = nc.read_bytes()
    task = task_of(BASE)
    honest = L.local_ask(task.clients, "psis")

    def ask(draws, reff):
        got = honest(draws, reff)
        got[2] = bad(got[2])
        got.pop(3)  # and one client that never answers
        return got

    s = L.attach(out.run_dir, "psis", task.n_data, ask, {})
    assert why in s["refused"]["2"] and s["refused"]["3"] == "no reply" and "error" in s
    assert nc.read_bytes() == before  # nothing written: a LOO over part of the data would mislead
    assert json.loads((out.run_dir / "summary.json").read_text())["loo"]["refused"] == s["refused"]
    with pytest.raises(L.LooError, match="no LOO in this file"):
        qlsd_flwr.loo(out.run_dir)


def test_a_client_answers_a_malformed_loo_request_with_an_error_not_a_crash():
    from flwr.app import ConfigRecord, RecordDict

    from qlsd_flwr.flower import loo_phase
    from qlsd_flwr.flower.records import ARRAYS, RECORD

    pot = build_logistic_task("breast_cancer", b=2).clients[0]

    def req(mode="psis", draws=None, reff=1.0):
        return RecordDict({RECORD: ConfigRecord({"report": "loo", "mode": mode, "reff": reff, "client": 0}),
                           ARRAYS: ArrayRecord({"draws": Array(np.zeros((2, pot.dim)) if draws is None else draws)})})

    assert loo_phase.answer(pot, req(), 0)["status"] == "ok"
    for content, why in ((req(mode="all"), "mode 'all'"), (req(draws=np.zeros((2, 3))), "draws of shape"),
                         (req(draws=np.zeros((1, pot.dim))), "1 kept draw(s)"),
                         (req(draws=np.zeros((0, pot.dim))), "0 kept draw(s)"),
                         (RecordDict({RECORD: ConfigRecord({"report": "loo"})}), "KeyError")):
        r = loo_phase.answer(pot, content, 0)
        assert r["status"] == "error" and why in r["error"], r


def test_the_loo_key_is_checked_and_off_writes_nothing(tmp_path):
    from qlsd_flwr.config import ConfigError, resolve

    with pytest.raises(ConfigError, match="loo.*psis, pointwise, off"):
        resolve({"loo": "yes"})
    out = run({**BASE, "engine": "vectorised", "loo": "off", "output-dir": str(tmp_path), "run-name": "r"})
    assert "loo" not in az.from_netcdf(out.run_dir / "samples.nc").groups()
    assert "loo" not in json.loads((out.run_dir / "summary.json").read_text())


def test_the_gaussian_loo_matches_its_closed_form():
    """For the toy Gaussian under a flat prior the LOO predictive of point j is Gaussian in closed form
    (N(ȳ_{−j}, (1 + 1/(N−1)) I)); exact draws from the posterior N(ȳ, I/N) give PSIS-LOO within its
    Monte Carlo error of that closed form (k̂ small: one point barely moves the posterior)."""
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    task = build_gaussian_task(b=3, d=2, data_seed=0)  # flat prior (the default)
    y = np.concatenate([c.y for c in task.clients])
    N, d = y.shape
    rng = np.random.default_rng(0)
    # the draws' sample mean and covariance set to the posterior's exactly: every point shares the same
    # draws, so their errors in the first two moments would move all N terms together
    z = rng.normal(size=(4000, d))
    z = (z - z.mean(0)) @ np.linalg.inv(np.linalg.cholesky(np.cov(z.T, bias=True))).T
    theta = (y.mean(0) + z / np.sqrt(N)).reshape(4, 1000, d)
    ref, _ = pooled_loo(task.clients, theta)
    ymj = (y.sum(0) - y) / (N - 1)
    var = 1 + 1 / (N - 1)
    exact = -0.5 * np.sum((y - ymj) ** 2, axis=1) / var - 0.5 * d * np.log(2 * np.pi * var)
    sent = theta.reshape(-1, d).astype(L.DRAWS_DTYPE)  # as the request carries them
    parts = [L.client_reply(c, sent, L.reff_of(az.from_dict(posterior={"theta": theta}).posterior),
                            "psis").reshape(3, -1) for c in task.clients]
    got = L.elpd_from_points(np.concatenate(parts, axis=1), 4000)
    assert_same_loo(got, ref)
    assert np.max(np.asarray(got["pareto_k"])) < 0.5
    # what remains is importance sampling's Monte Carlo error. To first order the estimate of the sum is
    # N − mean_s Σ_j r_sj with r_sj = w_sj / E w_j and w_sj = 1/p(y_j | θ_s) (the draws are shared, so
    # the terms are summed before taking the sd): its sd is sd_s(Σ_j r_sj)/√S; 4 sd
    _, ll_all = pooled_loo(task.clients, theta)
    w = np.exp(-ll_all.reshape(-1, N) - (-ll_all.reshape(-1, N)).max(0))
    r = w / w.mean(0)
    tol = 4 * r.sum(1).std() / np.sqrt(r.shape[0])
    assert tol < 0.5 * float(got["p_loo"])  # sharp enough to tell elpd_loo from lppd
    assert abs(float(got["elpd_loo"]) - exact.sum()) < tol


def test_draws_too_heavy_for_one_message_leave_the_loo_out_naming_the_remedy(tmp_path, monkeypatch):
    out = run({**BASE, "engine": "vectorised", "loo": "off", "output-dir": str(tmp_path), "run-name": "r"})
    monkeypatch.setattr(L, "DOWNLINK_MAX_BYTES", 1000)
    asked = []
    s = L.attach(out.run_dir, "psis", task_of(BASE).n_data, lambda draws, reff: asked.append(1) or {}, {})
    assert not asked and "MiB" in s["error"] and "loo = off" in s["error"]


def _edited(honest, client: int, edit):
    """The asker ``honest`` with ``client``'s psis reply (``(3, N_i)``: loo_i, lppd_i, k̂) changed in place by
    ``edit``."""
    def ask(draws, reff):
        got = honest(draws, reff)
        a = np.frombuffer(bytes(got[client]), dtype="<f8").reshape(3, -1).copy()
        edit(a)
        got[client] = a.astype("<f8").tobytes()
        return got

    return ask


def _client_one_lies(tmp_path):
    """A short classification run (loo off) and two askers for its LOO: the honest clients', and the
    same with client 1 adding 50 to each of its points' loo_i and lppd_i."""
    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 3, "engine": "vectorised", "num-rounds": 40,
         "burn-in": 20, "gamma": 1e-4, "progress": False, "loo": "off", "plot": False, "output-dir": str(tmp_path),
         "run-name": "r"}
    out = run(o)
    task = task_of(o)
    honest = L.local_ask(task.clients, "psis")

    def plus_50(a):
        a[:2] += 50.0  # loo_i and lppd_i, +50 a point

    lying = _edited(honest, 1, plus_50)

    return out, task, honest, lying


def test_a_log_probability_above_zero_is_refused_on_a_classification_task(tmp_path):
    """Issue 38: +50 a point on a classification task gave elpd +4,947, accepted. A probability is at most 1, so
    every log-likelihood and log predictive of a discrete likelihood is ≤ 0: the reply is refused, naming why,
    and the LOO left out; the honest replies of the same run pass the same check (and a Gaussian's log
    densities, which may be positive, are never held to it)."""
    out, task, honest, lying = _client_one_lies(tmp_path)

    s = L.attach(out.run_dir, "psis", task.n_data, lying, {}, ceiling=0.0)
    assert "a log-probability of" in s["refused"]["1"] and "at most 1" in s["refused"]["1"] and "error" in s
    ok = L.attach(out.run_dir, "psis", task.n_data, honest, {}, ceiling=0.0)
    assert "error" not in ok and ok["elpd_loo"] < 0


def test_an_excluded_clients_points_are_left_out_of_the_loo_and_named(tmp_path):
    """Issue 38: after the norm guard excluded a client, the LOO still took that client's points, computed
    by it, unflagged. Now its reply is not used (here it lies, +50 a point), its points are left out and
    named, and the other clients' points give exactly the LOO of the full run less that client's terms."""
    out, task, honest, lying = _client_one_lies(tmp_path)

    other = tmp_path / "copy"
    shutil.copytree(out.run_dir, other)  # a LOO group is written once per file: one folder each
    full = L.attach(out.run_dir, "psis", task.n_data, honest, {}, ceiling=0.0)
    loo_i = np.asarray(L.load(out.run_dir).loo_i, dtype=np.float64)
    s = L.attach(other, "psis", task.n_data, lying, {"excluded": {"1": 12}}, ceiling=0.0)
    assert "error" not in s and "refused" not in s, s
    assert s["left_out"] == {"1": "excluded from round 12"}
    assert s["points_left_out"] == task.n_data[1] and s["n_data_points"] == sum(task.n_data) - task.n_data[1]
    assert s["clients"] == [0, 2] and s["offsets"][-1] == s["n_data_points"]
    lo, hi = full["offsets"][1], full["offsets"][2]
    assert np.isclose(s["elpd_loo"], full["elpd_loo"] - loo_i[lo:hi].sum(), rtol=1e-12, atol=1e-9)
    assert json.loads((other / "summary.json").read_text())["loo"]["left_out"] == s["left_out"]
    group = az.from_netcdf(other / "samples.nc")["loo"]
    assert list(group.attrs["clients"]) == [0, 2] and list(group.attrs["offsets"]) == s["offsets"]
    # several chains: a client excluded in any chain is left out, each chain's round named
    many = L.excluded_clients({"excluded": {"0": {"2": 5}, "3": {"2": 9, "0": 0}}})
    assert many == {0: "excluded before sampling (chain 3)",
                    2: "excluded from round 5 (chain 0), from round 9 (chain 3)"}
    assert L.excluded_clients({}) == {}


def test_a_gaussian_log_density_above_its_peak_is_refused_and_honest_ones_pass(tmp_path):
    """Issue 38: the LOO's bound implied by the model beyond log p ≤ 0. The toy Gaussian's likelihood
    ``N(y; θ, I)`` never exceeds its peak ``−(d/2) log 2π`` (a density may be positive elsewhere, so 0 is no
    bound there): a reply above it is refused naming the peak, with every mode; the honest replies pass, and the
    ceiling the engines pass is that peak."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.outputs.loo import log_lik_ceiling
    from qlsd_flwr.robust.loo import LooError, check_reply

    o = {"task": "gaussian", "dim": 5, "num-clients": 4, "num-chains": 2, "num-rounds": 120, "burn-in": 40,
         "gamma": 1e-3, "progress": False, "engine": "vectorised", "loo": "off", "output-dir": str(tmp_path),
         "run-name": "g"}
    cfg = resolve(o)
    assert cfg.task == "gaussian"
    peak = log_lik_ceiling(cfg)
    assert peak == pytest.approx(-0.5 * int(cfg.get("dim")) * np.log(2 * np.pi))
    out = run(o)
    task = task_of(o)
    honest = L.local_ask(task.clients, "psis")

    def above_peak(a):
        a[0, 0] = peak + 1.0  # one point's elpd_loo just above the density's peak

    lying = _edited(honest, 0, above_peak)

    other = tmp_path / "copy"
    shutil.copytree(out.run_dir, other)
    ok = L.attach(out.run_dir, "psis", task.n_data, honest, {}, ceiling=peak)
    assert "error" not in ok and "refused" not in ok
    s = L.attach(other, "psis", task.n_data, lying, {}, ceiling=peak)
    assert "the density's peak" in s["refused"]["0"] and "error" in s
    with pytest.raises(LooError, match="density's peak"):
        check_reply(np.full(4, peak + 1e-3), 2, 2, "pointwise", peak)
    assert check_reply(np.full(4, peak), 2, 2, "pointwise", peak).shape == (2, 2)


@pytest.mark.parametrize("reff", [1.0, 0.37])
def test_the_clients_psis_is_arviz_s_bit_for_bit(reff):
    """:mod:`qlsd_flwr.outputs.psis` (a client's smoothing, numpy alone) against ``az.psislw`` on the
    same rows: light and heavy tails (k̂ from below 0 to above 1), a tail too short to fit (k̂ = inf,
    S = 20), a constant row, the bit-for-bit equality that lets a client skip importing ArviZ."""
    from qlsd_flwr.outputs.psis import psislw

    rng = np.random.default_rng(5)
    rows = [rng.normal(size=(6, 400)), 3 * rng.standard_t(2, size=(6, 400)), rng.standard_cauchy((3, 400)),
            rng.exponential(size=(2, 400)) * 40, rng.normal(size=(3, 20)), np.zeros((1, 400))]
    for lw in rows:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want_lw, want_k = az.psislw(lw, reff)
        got_lw, got_k = psislw(lw, reff)
        assert got_lw.shape == want_lw.shape and got_k.shape == want_k.shape
        assert np.array_equal(got_lw, want_lw, equal_nan=True) and np.array_equal(got_k, want_k, equal_nan=True)
    k = np.concatenate([psislw(lw, reff)[1] for lw in rows[:4]])
    assert k.min() < 0.5 and k.max() > 1.0  # the rows reach both sides of k̂ = 0.7


def test_a_clients_loo_reply_does_not_import_arviz():
    """A client answers the LOO request (psis) in a fresh process without importing ArviZ or xarray
    (2.5 s of CPU per message on a SuperNode's flwr-clientapp otherwise)."""
    import subprocess
    import sys

    code = """
import sys
import numpy as np
from qlsd_flwr.outputs import loo
from qlsd_flwr.tasks.logistic import build_logistic_task
pot = build_logistic_task(b=2, dataset="breast_cancer").clients[0]
draws = np.random.default_rng(0).normal(scale=0.01, size=(50, pot.dim))
r = loo.reply_fields(pot, "psis", draws, 1.0)
assert r["status"] == "ok", r
print(sorted(m for m in ("arviz", "xarray") if m in sys.modules))
"""
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr[-2000:]
    assert cp.stdout.strip().splitlines()[-1] == "[]", cp.stdout
