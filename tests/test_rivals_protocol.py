"""The rivals on the round protocol (issue 23): FALD, VR-FALD*, DG-LMC and FSGLD. The law of the chain
the engines run, the Flower path equal to the framework-free one, several chains, and what the
keys refuse.

* On the toy Gaussian with partial participation (p_i from 0.5 to 0.9), three local steps and half
  the noise common, the chain of the protocol path (the very messages the Flower apps exchange)
  matches the law :func:`laws_fald.gaussian_stationary` derives for it (the expectation
  over every active set) within 4 batch-means standard errors, each coordinate's mean and variance.
  The participation's gradient noise widens FALD's variance 6 to 76 times the posterior's, by 12 to
  23 standard errors: the check tells the two apart. VR-FALD*'s control variate at θ* removes that
  noise at the mode (its law is within a standard error of the posterior's variance) and is as far
  from FALD's.
* DG-LMC's chain (clients updating their z_i when active, the server drawing θ | z exactly) matches
  :func:`laws_dglmc.gaussian_stationary` with partial participation, whose θ-variance is
  the augmented model's (ρ > 0) plus ULA's on z, more than 10 standard errors from the posterior's.
* FSGLD's chain, its surrogates the clients' Taylor expansions at θ* with curvature reports off by
  factors 0.3 to 2.5, matches :func:`laws_fsgld.gaussian_stationary` for those surrogates
  (the law with the conducive gradient's spread), more than 4 standard errors from the law with
  exact surrogates in every coordinate's variance.
* The in-process Flower path gives the local engine's chain bit for bit, with QSGD-coded messages
  too, and chain c of a several-chain run is the one-chain run with seed + c.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import laws_dglmc
import laws_fald
import laws_fsgld
from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.core.oracles import ClientState
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.client import handle
from qlsd_flwr.robust.reports import cap_total
from qlsd_flwr.run.simulate import run_inprocess
from qlsd_flwr.tasks import loading

P_I = [0.9, 0.6, 0.8, 0.5]
TOY = {"task": "gaussian", "num-clients": 4, "dim": 3, "prior-var": 5.0, "local-steps": 3, "tau": 0.5,
       "p": ",".join(map(str, P_I)), "engine": "local", "progress": False}


def _batch_se(x: np.ndarray, n: int = 40) -> np.ndarray:
    return np.std([b.mean(axis=0) for b in np.array_split(x, n)], axis=0, ddof=1) / np.sqrt(n)


def _assert_cov(trace: np.ndarray, mean, cov) -> tuple[np.ndarray, np.ndarray]:
    """Every mean, variance and covariance (the upper triangle, row by row) within 4 batch-means standard
    errors of the law's; returns that triangle of ``cov`` and its standard errors."""
    d = trace.shape[1]
    se = _batch_se(trace)
    assert np.all(np.abs(trace.mean(axis=0) - mean) <= 4 * se), ((trace.mean(axis=0) - mean) / se)
    x = trace - mean
    prods = np.stack([x[:, j] * x[:, k] for j in range(d) for k in range(j, d)], axis=1)
    want = np.array([cov[j, k] for j in range(d) for k in range(j, d)])
    se_c = _batch_se(prods)
    assert np.all(np.abs(prods.mean(axis=0) - want) <= 4 * se_c), ((prods.mean(axis=0) - want) / se_c)
    return want, se_c


def _toy_stats(variant: str):
    """The toy task of these tests: ``(task, N_i, ȳ_i)``."""
    probe = loading.load_task(resolve({**TOY, "variant": variant}))
    return probe, probe.n_data.astype(float), np.stack([c.y.mean(axis=0) for c in probe.clients])


def _assert_law(trace: np.ndarray, mean, var) -> tuple[np.ndarray, np.ndarray]:
    """Every coordinate's mean and variance (about ``mean``) within 4 batch-means standard errors of the
    law's; returns the two standard errors ``(se, se_v)`` for the checks that the test can fail."""
    se = _batch_se(trace)
    assert np.all(np.abs(trace.mean(axis=0) - mean) <= 4 * se), ((trace.mean(axis=0) - mean) / se)
    e2 = (trace - mean) ** 2
    se_v = _batch_se(e2)
    assert np.all(np.abs(e2.mean(axis=0) - var) <= 4 * se_v), ((e2.mean(axis=0) - var) / se_v)
    return se, se_v


@pytest.mark.parametrize("variant", ["fald", "vr-fald-star"])
def test_the_protocol_chain_matches_the_exact_law_under_partial_participation(variant):
    probe, n, ybar = _toy_stats(variant)
    h = 0.05 / (n.sum() + 1 / 5.0)
    o = {**TOY, "variant": variant, "gamma": h, "num-rounds": 5000, "burn-in": 100}
    r = run_local(resolve(o), write=False, keep_trace=True)
    trace = r.trace[200:]
    anchor = probe.posterior_mean if variant == "vr-fald-star" else None  # θ* in closed form
    m, v = laws_fald.gaussian_stationary(n, ybar, h, 3, 0.5, 5.0, anchor=anchor, p=P_I)
    se, se_v = _assert_law(trace, m, v)
    # the other sampler's law is many standard errors away: the check can fail
    _, other = laws_fald.gaussian_stationary(n, ybar, h, 3, 0.5, 5.0, anchor=None if anchor is not None else
                                        probe.posterior_mean, p=P_I)
    assert np.min(np.abs(np.asarray(other) - v) / se_v) > 10, np.abs(np.asarray(other) - v) / se_v
    assert r.summary["rejected"] == {}


@pytest.mark.parametrize("variant", ["fald", "vr-fald-star"])
def test_a_diagonal_metric_preconditions_the_local_steps_coordinate_by_coordinate(variant, tmp_path):
    # with M = diag(m) every local step is x − (h/w_i) m ⊙ ∇Ũ_i(x) + √(2h) √m ⊙ noise: on the toy Gaussian each
    # coordinate j is FALD with the step h m_j, whose law fald.gaussian_stationary derives; the identity's law
    # is more than 10 standard errors away in FALD's variance where m_j ≠ 1
    probe, n, ybar = _toy_stats(variant)
    m = np.array([0.4, 1.0, 2.0])
    np.save(tmp_path / "m.npy", m)
    h = 0.05 / (n.sum() + 1 / 5.0)
    o = {**TOY, "variant": variant, "gamma": h, "num-rounds": 5000, "burn-in": 100, "metric": str(tmp_path / "m.npy")}
    r = run_local(resolve(o), write=False, keep_trace=True)
    trace = r.trace[200:]
    anchor = probe.posterior_mean if variant == "vr-fald-star" else None
    laws = [laws_fald.gaussian_stationary(n, ybar[:, j:j + 1], h * m[j], 3, 0.5, 5.0, p=P_I,
                                     anchor=None if anchor is None else anchor[j:j + 1]) for j in range(3)]
    mean = np.array([float(np.ravel(a)[0]) for a, _ in laws])
    var = np.array([float(np.ravel(v)[0]) for _, v in laws])
    se, se_v = _assert_law(trace, mean, var)
    if variant == "fald":
        _, identity = laws_fald.gaussian_stationary(n, ybar, h, 3, 0.5, 5.0, p=P_I)
        assert np.all((np.abs(np.asarray(identity) - var) / se_v)[[0, 2]] > 10)
    assert r.summary["rejected"] == {}


def _rotated(m: np.ndarray) -> np.ndarray:
    """``Q diag(m) Qᵀ`` for a fixed rotation ``Q``: a dense SPD metric far from diagonal."""
    q, _ = np.linalg.qr(np.array([[1.0, 0.8, -0.3], [0.2, 1.0, 0.6], [-0.5, 0.1, 1.0]]))
    return q @ np.diag(m) @ q.T


@pytest.mark.parametrize("variant", ["fald", "vr-fald-star"])
def test_a_dense_metric_preconditions_the_local_steps_and_the_chain_has_the_matrix_law(variant, tmp_path):
    # with a dense M = L Lᵀ every local step is x − (h/w_i) M ∇Ũ_i(x) + √(2h) L (noise): the round is a linear
    # Gaussian recursion in d dimensions whose law fald.gaussian_stationary_metric derives (the matrix form of
    # the scalar law, the expectation over every active set; it equals the scalar law for diagonal M). Checked:
    # every coordinate's mean, variance and every covariance within 4 batch-means standard errors; for FALD
    # the off-diagonal covariances are seen, and the identity's law is more than 10 standard errors away
    probe, n, ybar = _toy_stats(variant)
    M = _rotated(np.array([0.4, 1.0, 2.0]))
    np.save(tmp_path / "m.npy", M)
    h = 0.05 / (n.sum() + 1 / 5.0)
    o = {**TOY, "variant": variant, "gamma": h, "num-rounds": 5000, "burn-in": 100, "metric": str(tmp_path / "m.npy")}
    r = run_local(resolve(o), write=False, keep_trace=True)
    assert r.summary["metric_kind"] == "dense"
    trace = r.trace[200:]
    anchor = probe.posterior_mean if variant == "vr-fald-star" else None
    mean, cov = laws_fald.gaussian_stationary_metric(n, ybar, h, 3, 0.5, 5.0, M, anchor=anchor, p=P_I)
    want, se_c = _assert_cov(trace, mean, cov)
    if variant == "fald":  # the covariances the metric and the shared active set make are seen
        assert np.max(np.abs(want[[1, 2, 4]]) / se_c[[1, 2, 4]]) > 4
        _, identity = laws_fald.gaussian_stationary_metric(n, ybar, h, 3, 0.5, 5.0, np.eye(3), p=P_I)
        other = np.array([identity[j, k] for j in range(3) for k in range(j, 3)])
        assert np.max(np.abs(other - want) / se_c) > 10, np.abs(other - want) / se_c
    assert r.summary["rejected"] == {}


def test_dg_lmc_with_a_diagonal_metric_couples_in_its_norm_coordinate_by_coordinate(tmp_path):
    # with M = diag(m) the coupling is ‖z − θ‖²_{M⁻¹}/(2ρ): the clients' steps are z − γ_i (m ⊙ ∇U_i(z) + (z − θ)/ρ)
    # + √(2γ_i) √m ⊙ ξ and θ | z is drawn with precision Σ_i 1/(ρ m_j) + 1/σ_0² in coordinate j, so each
    # coordinate is DG-LMC with (γ_i m_j, ρ m_j), whose law dglmc.gaussian_stationary derives; the identity's
    # variance is more than 5 standard errors away where m_j ≠ 1 (6 and 15 seen)
    from qlsd_flwr.core import dglmc

    probe, n, ybar = _toy_stats("dg-lmc")
    P = n.sum() + 1 / 5.0
    gamma, rho, m = 0.25 / P, 6.0 / P, np.array([0.4, 1.0, 2.0])
    np.save(tmp_path / "m.npy", m)
    o = {**TOY, "variant": "dg-lmc", "gamma": gamma, "rho": rho, "num-rounds": 5000, "burn-in": 100,
         "metric": str(tmp_path / "m.npy")}
    r = run_local(resolve(o), write=False, keep_trace=True)
    trace = r.trace[200:]
    g_i = dglmc.local_step(gamma, rho, 0.25)
    laws = [laws_dglmc.gaussian_stationary(n, ybar[:, j:j + 1], rho * m[j], g_i * m[j], 3, 5.0, p=P_I) for j in range(3)]
    mean = np.array([float(np.ravel(a)[0]) for a, _ in laws])
    var = np.array([float(np.ravel(v)[0]) for _, v in laws])
    se, se_v = _assert_law(trace, mean, var)
    _, identity = laws_dglmc.gaussian_stationary(n, ybar, rho, g_i, 3, 5.0, p=P_I)
    assert np.all((np.abs(np.asarray(identity) - var) / se_v)[[0, 2]] > 5), np.abs(np.asarray(identity) - var) / se_v
    assert r.summary["rejected"] == {}


def test_dg_lmc_with_a_dense_metric_draws_theta_in_its_eigenbasis_and_has_the_rotated_law(tmp_path):
    # M = Q diag(0.4, 1, 2) Qᵀ, every client in every round: the toy Gaussian's potentials and prior are
    # isotropic, so in M's eigenbasis ψ = Qᵀθ every coordinate k is DG-LMC with (γ_i s_k, ρ s_k) on the rotated
    # data Qᵀȳ_i, independent of the others; θ = Qψ has mean Q m̃ and covariance Q diag(ṽ) Qᵀ. Every mean,
    # variance and covariance within 4 batch-means standard errors; the identity's law is far in some
    from qlsd_flwr.core import dglmc

    probe, n, ybar = _toy_stats("dg-lmc")
    P = n.sum() + 1 / 5.0
    gamma, rho, s = 0.25 / P, 6.0 / P, np.array([0.4, 1.0, 2.0])
    M = _rotated(s)
    Q = np.linalg.eigh(M)[1]
    s = np.linalg.eigh(M)[0]
    np.save(tmp_path / "m.npy", M)
    o = {**TOY, "variant": "dg-lmc", "p": "1", "gamma": gamma, "rho": rho, "num-rounds": 5000, "burn-in": 100,
         "metric": str(tmp_path / "m.npy")}
    r = run_local(resolve(o), write=False, keep_trace=True)
    trace = r.trace[200:]
    g_i, rotated = dglmc.local_step(gamma, rho, 0.25), ybar @ Q
    laws = [laws_dglmc.gaussian_stationary(n, rotated[:, k:k + 1], rho * s[k], g_i * s[k], 3, 5.0) for k in range(3)]
    mean = Q @ np.array([float(np.ravel(a)[0]) for a, _ in laws])
    cov = Q @ np.diag([float(np.ravel(v)[0]) for _, v in laws]) @ Q.T
    want, se_c = _assert_cov(trace, mean, cov)
    _, identity = laws_dglmc.gaussian_stationary(n, ybar, rho, g_i, 3, 5.0)
    other = np.array([identity if j == k else 0.0 for j in range(3) for k in range(j, 3)])
    assert np.max(np.abs(other - want) / se_c) > 8, np.abs(other - want) / se_c
    assert r.summary["rejected"] == {}


def _metric_bytes(code: int, arrays: dict, magic: bytes = b"QM") -> bytes:
    """A metric's tagged encoding made by hand (qlsd_flwr.core.metric.Metric.to_bytes's layout)."""
    out = [magic, struct.pack("<BB", code, len(arrays))]
    for name, a in arrays.items():
        a = np.asarray(a, dtype="<f8")
        out += [struct.pack("<BB", len(name), a.ndim), name.encode(), struct.pack(f"<{a.ndim}I", *a.shape), a.tobytes()]
    return b"".join(out)


_NOT_ORTHOGONAL = {"qg": [[1.0, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], "qa": [[1.0]], "den": [[1.0], [1.0], [1.0]],
                   "perm": [0.0, 1.0, 2.0]}


@pytest.mark.parametrize("variant, bad, words", [
    ("fald", _metric_bytes(1, {"m": [1.0, -1.0, 1.0]}), "finite positive"),
    ("fald", _metric_bytes(1, {"m": [1.0, np.nan, 1.0]}), "not finite"),
    ("fald", _metric_bytes(1, {"m": np.ones(4)}), "needs 3 numbers"),
    ("fald", np.ones(10**4).tobytes(), "more than any metric"),
    ("fald", _metric_bytes(2, {"M": [[1.0, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]}), "symmetric"),
    ("fald", _metric_bytes(2, {"M": np.diag([1.0, -1.0, 1.0])}), "positive-definite"),
    ("fald", _metric_bytes(3, _NOT_ORTHOGONAL), "Kronecker"),
    ("fald", _metric_bytes(1, {"m": np.ones(3)}, magic=b"QX"), "tag"),
    ("fald", _metric_bytes(7, {"m": np.ones(3)}), "unknown kind code 7"),
    ("fald", _metric_bytes(1, {"x": np.ones(3)}), "where 'm' was expected"),
    ("fald", _metric_bytes(1, {"m": np.ones(3)})[:-4], "ends early"),
    ("fald", _metric_bytes(1, {"m": np.ones(3)}) + b"\0", "after the metric's end"),
    ("fald", "a string", "not str"),
    # dimensions whose product wraps around a 64-bit integer
    ("fald", b"QM\x01\x01\x01\x02m" + struct.pack("<2I", 2**32 - 1, 2**32 - 1), "larger than d = 3 allows"),
    ("fald", _metric_bytes(2, {"M": np.full((3, 3), 1.7e308)}), "positive-definite|too large"),
    # a low-rank correction of the identity (rank 1, t = 2, the direction e_0): DG-LMC takes none
    ("dg-lmc", _metric_bytes(4, {"u": [[1.0], [0.0], [0.0]], "t": [2.0]}) + b"QM\0\0", "low-rank correction"),
])
def test_a_bad_metric_from_the_server_installs_nothing_and_a_client_without_it_asks_again(variant, bad, words):
    from qlsd_flwr.core.metric import Dense
    from qlsd_flwr.protocol.wire import metric_to_bytes

    cfg = resolve({**TOY, "variant": variant, "metric": "diagonal"})
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 3, task.prior)
    assert spec.metric == "sent"
    st = ClientState()
    fields = {"phase": "sample", "round": 0, "client": 0, "theta": np.zeros(3), "anchor_version": -1, "eta_count": 0,
              "local": _f8(1e-3, 0.5, 1.0, 1.0)}
    with pytest.raises(ValueError, match=words):
        handle(spec, task.clients[0], st, 0, {**fields, "metric": bad}, 3)
    assert st.metric is None
    assert handle(spec, task.clients[0], st, 0, fields, 3)["status"] == "resync"  # it lost (or never had) M
    good = Dense(_rotated(np.array([0.5, 1, 2])))
    assert handle(spec, task.clients[0], st, 0, {**fields, "metric": metric_to_bytes(good)}, 3)["status"] == "ok"
    assert st.metric.kind == good.kind and np.array_equal(st.metric.m, good.m)


class _Tempered:
    """``κ U_i``: client ``i``'s points with per-datum precision ``κ`` (its curvature per unit of weight then
    differs from the others', so VR-FALD*'s reference matters)."""

    def __init__(self, base, kappa: float):
        self.base, self.kappa, self.y, self.n_data, self.dim = base, float(kappa), base.y, base.n_data, base.dim

    def grad_sum(self, theta, idx=None):
        return self.kappa * self.base.grad_sum(theta, idx)

    def value(self, theta):
        return self.kappa * self.base.value(theta)


def test_vr_fald_star_refreshes_its_reference_on_the_protocol_and_matches_the_law_of_theta_and_the_reference():
    # κ = (0.3, 0.3, 2.5, 2.5) and weights N_i/N: a_i/w_i differ, so the reference θ_r matters. θ* is given 15
    # posterior sd off the mode (as an unconverged descent leaves it). With q = 0.3 a refresh round asks every
    # kept client (p_i = 1 that round), each reply carries ∇U_i(θ_k), and θ_r = θ_k from the next round: the
    # chain matches fald.gaussian_stationary_refresh (the law of (θ, θ_r)) within 4 batch-means standard
    # errors, and the law with θ_r fixed at θ* is more than 8 standard errors away in every coordinate's mean
    import dataclasses

    o = {**TOY, "variant": "vr-fald-star", "q": 0.3, "num-rounds": 5000, "burn-in": 100}
    base = loading.load_task(resolve(o))
    kappa = np.array([0.3, 0.3, 2.5, 2.5])
    n = base.n_data.astype(float)
    ybar = np.stack([c.y.mean(axis=0) for c in base.clients])
    P = float(np.sum(kappa * n)) + 1 / 5.0
    mode = (kappa[:, None] * n[:, None] * ybar).sum(axis=0) / P
    off = mode + 15 / np.sqrt(P)
    task = dataclasses.replace(base, clients=[_Tempered(c, k) for c, k in zip(base.clients, kappa)], theta_star=off,
                               posterior_mean=mode, posterior_var=np.full(3, 1 / P), theta0=mode)
    h = 0.05 / P
    r = run_local(resolve({**o, "gamma": h}), task=task, write=False, keep_trace=True)
    trace = r.trace[200:]
    m, v = laws_fald.gaussian_stationary_refresh(n, ybar, h, 3, 0.5, 5.0, 0.3, p=P_I, kappa=kappa)
    se, se_v = _assert_law(trace, m, v)
    fixed, _ = laws_fald.gaussian_stationary(n, ybar, h, 3, 0.5, 5.0, anchor=off, p=P_I, kappa=kappa)
    assert np.min(np.abs(fixed - m) / se) > 8, np.abs(fixed - m) / se
    facts = r.summary["reference_refresh"]  # about q · 5000 refresh rounds (a binomial count), each installed
    assert abs(facts["rounds"] - 1500) <= 4 * np.sqrt(5000 * 0.3 * 0.7) and facts["installed"] == facts["rounds"]
    assert facts["incomplete"] == 0 and facts["uplink_bits"] == 64 * 3 * 4 * facts["rounds"]
    assert r.summary["rejected"] == {} and "excluded" not in r.summary


def test_a_client_told_to_expect_a_metric_gets_the_identity_when_the_correction_found_none():
    # metric-rank > 0 tells the clients a metric comes; a correction that found no direction leaves the
    # identity, which is sent as empty bytes (else the clients would answer resync every round)
    from qlsd_flwr.protocol.server import QLSDServer

    cfg = resolve({**TOY, "variant": "fald", "metric-rank": 2, "gamma": 1e-4, "num-rounds": 5, "burn-in": 0})
    task = loading.load_task(cfg)
    server = QLSDServer(cfg, task)
    server.begin(None, {})  # no preparation: the identity
    assert server.spec.metric.is_identity and server.settings[0]["metric"] == "sent"
    st = ClientState()
    i = server.begin_round()[0]
    spec = build.client_spec(cfg, i, task.clients[i].n_data, 3, task.prior)
    fields = server.fields_for(i)
    assert fields["metric"] == b""
    assert handle(spec, task.clients[i], st, 0, fields, 3)["status"] == "ok" and st.metric.is_identity


def test_a_dense_metric_with_a_low_rank_correction_travels_and_checkpoints_whole():
    from qlsd_flwr.core.metric import Dense
    from qlsd_flwr.core.metric_codec import from_array, to_array
    from qlsd_flwr.protocol.wire import metric_of, metric_to_bytes

    M = Dense(_rotated(np.array([0.5, 1.0, 2.0])))
    u = np.linalg.qr(np.array([[1.0, 0.2], [0.3, 1.0], [0.5, -0.4]]))[0]
    C = M.corrected(u, np.array([2.0, 0.5]))
    z = np.array([1.0, -2.0, 0.5])
    for back in (from_array(to_array(C), 3), metric_of(metric_to_bytes(C), 3)):
        assert back.kind == "dense" and np.array_equal(back.apply(z), C.apply(z))
        assert np.array_equal(back.apply_root(z), C.apply_root(z))


def test_a_refresh_reply_without_a_usable_gradient_is_refused_and_the_reference_stays():
    # a refresh round's reply must carry ∇U_i(θ_k) as 8d finite bytes; one that does not is refused whole
    # (counted as malformed), and the round installs no reference (counted incomplete): θ_r and the claims
    # stay, so the clients' control variates stay exact
    from qlsd_flwr.protocol.server import QLSDServer
    from qlsd_flwr.protocol.wire import arr_to_bytes

    cfg = resolve({**TOY, "variant": "vr-fald-star", "q": 1.0, "p": "1", "gamma": 1e-4, "num-rounds": 5, "burn-in": 0})
    task = loading.load_task(cfg)
    specs = [build.client_spec(cfg, i, c.n_data, 3, task.prior) for i, c in enumerate(task.clients)]
    states = [ClientState() for _ in specs]
    for bad in (None, b"x" * 8, arr_to_bytes(np.full(3, np.nan)), arr_to_bytes(np.ones(4)), [1.0, 2.0, 3.0]):
        server = QLSDServer(cfg, task)
        server.begin(task.posterior_mean, {})
        server.set_claims([task.clients[i].grad_sum(task.posterior_mean) for i in range(4)])
        before = (server.spec.theta_star.copy(), server.claims.claims.copy())
        for i in server.begin_round():
            rep = handle(specs[i], task.clients[i], states[i], cfg.seed, server.fields_for(i), 3)
            assert "ref_grad" in rep
            if i == 2:
                rep = {k: v for k, v in rep.items() if k != "ref_grad"} if bad is None else {**rep, "ref_grad": bad}
            server.accept(i, rep)
        server.end_round()
        assert server.rejected == {"malformed": 1} and server.ts_info["reference_refresh"]["incomplete"] == 1
        assert np.array_equal(server.spec.theta_star, before[0]) and np.array_equal(server.claims.claims, before[1])
    # every reply whole: θ_r = θ_0 (the round's θ), and the next message carries it as the anchor
    server = QLSDServer(cfg, task)
    server.begin(task.posterior_mean, {})
    server.set_claims([task.clients[i].grad_sum(task.posterior_mean) for i in range(4)])
    theta0 = server.state.theta.copy()
    for i in server.begin_round():
        server.accept(i, handle(specs[i], task.clients[i], states[i], cfg.seed, server.fields_for(i), 3))
    server.end_round()
    assert server.ts_info["reference_refresh"]["installed"] == 1 and np.array_equal(server.spec.theta_star, theta0)
    server.begin_round()
    assert np.array_equal(server.fields_for(0)["anchor"], theta0)


def test_dg_lmc_on_the_protocol_matches_its_exact_law_under_partial_participation():
    from qlsd_flwr.core import dglmc

    probe, n, ybar = _toy_stats("dg-lmc")
    P = n.sum() + 1 / 5.0
    gamma, rho = 0.25 / P, 6.0 / P
    o = {**TOY, "variant": "dg-lmc", "gamma": gamma, "rho": rho, "num-rounds": 5000, "burn-in": 100}
    r = run_local(resolve(o), write=False, keep_trace=True)
    trace = r.trace[200:]
    m, v = laws_dglmc.gaussian_stationary(n, ybar, rho, dglmc.local_step(gamma, rho, 0.25), 3, 5.0, p=P_I)
    se, se_v = _assert_law(trace, m, v)
    assert np.min(np.abs(probe.posterior_var - v) / se_v) > 10, np.abs(probe.posterior_var - v) / se_v  # not π
    assert r.summary["rejected"] == {}


def test_fsgld_on_the_protocol_matches_its_exact_law_with_the_surrogates_the_clients_reported():
    from qlsd_flwr.core import fsgld

    o = {**TOY, "variant": "fsgld", "p": "1", "local-steps": 2, "num-rounds": 16000, "burn-in": 100}
    task = loading.load_task(resolve(o))
    n = task.n_data.astype(float)
    ybar = np.stack([c.y.mean(axis=0) for c in task.clients])
    P = n.sum() + 1 / 5.0
    scale = np.array([0.3, 0.3, 2.5, 2.5])  # each client's curvature report, off by this factor (under the cap)
    for i, c in enumerate(task.clients):
        c.curvature_diag = (lambda th, v=float(scale[i] * c.n_data): np.full(th.shape, v))
    h = 0.2 / P
    r = run_local(resolve({**o, "gamma": h}), task=task, write=False, keep_trace=True)
    trace = r.trace[200:]
    ts = task.posterior_mean  # θ* in closed form: the surrogates' centre
    lam = np.repeat((scale * n)[:, None], 3, axis=1)
    mu = ts - n[:, None] * (ts - ybar) / lam  # μ_i = θ* − ∇U_i(θ*)/λ_i
    m, v = laws_fsgld.gaussian_stationary(n, ybar, mu, lam, n / n.sum(), h, 2, 5.0)
    se, se_v = _assert_law(trace, m, v)
    _, exact = laws_fsgld.gaussian_stationary(n, ybar, *fsgld.gaussian_surrogates(task), n / n.sum(), h, 2, 5.0)
    assert np.min(np.abs(exact - v) / se_v) > 4, np.abs(exact - v) / se_v  # the surrogates' error shows
    assert r.summary["rejected"] == {}


@pytest.mark.parametrize("over", [
    {"variant": "fald", "p": "0.5", "local-steps": 3, "tau": 0.3},
    {"variant": "vr-fald-star", "p": "0.7", "local-steps": 2, "compressor": "qsgd", "s": "8",
     "theta-star": "optimise", "prior-var": 5.0},
    {"variant": "dg-lmc", "p": "0.6", "local-steps": 3, "compressor": "qsgd", "s": "8", "prior-var": 5.0},
    {"variant": "fsgld", "local-steps": 2, "compressor": "qsgd", "s": "8", "theta-star": "optimise", "prior-var": 5.0},
    # a diagonal metric for the local steps (from the curvature at θ*), sent with each client's first message
    {"variant": "fsgld", "local-steps": 2, "metric": "diagonal", "prior-var": 5.0},
    {"variant": "vr-fald-star", "p": "0.7", "local-steps": 2, "metric": "diagonal", "gamma": "auto", "prior-var": 5.0},
    # a dense metric and a low-rank correction (their arrays travel as bytes, rebuilt on the client), and
    # DG-LMC's coupling in a diagonal metric's norm
    {"variant": "fald", "p": "0.5", "local-steps": 2, "metric": "dense", "prior-var": 5.0, "dim": 8},
    {"variant": "fsgld", "local-steps": 2, "metric": "diagonal", "metric-rank": 2, "prior-var": 5.0, "dim": 8},
    {"variant": "dg-lmc", "p": "0.6", "local-steps": 2, "metric": "dense", "prior-var": 5.0},
    {"task": "logistic", "variant": "vr-fald-star", "p": "0.7", "local-steps": 2, "metric": "kronecker", "gamma": "auto",
     "num-rounds": 15},
    # VR-FALD*'s reference refreshed (q): ref_grad in the refresh rounds' replies, QSGD-coded messages
    {"variant": "vr-fald-star", "p": "0.6", "q": 0.3, "local-steps": 2, "compressor": "qsgd", "s": "8", "prior-var": 5.0},
])
def test_inprocess_flower_gives_the_local_chain_bit_for_bit(over, tmp_path):
    o = {"num-rounds": 30, "burn-in": 0, "progress": False, "gamma": 4.9e-4, "output-dir": str(tmp_path), **over}
    strat = run_inprocess(resolve(o), o, shuffle_seed=123, strategy_kwargs={"keep_trace": True})
    local = run_local(resolve(o), write=False, keep_trace=True, progress=False).trace
    np.testing.assert_array_equal(np.array(strat.trace), local)
    s = strat.summary_data
    assert s["totals"]["n_rejected"] == 0 and s["variant"] == over["variant"]
    if over.get("compressor") == "qsgd":  # QSGD-coded: far fewer bits than 64 a coordinate
        assert 0 < s["totals"]["bits_exact"] < 0.5 * 64 * 50 * s["totals"]["n_replied"]


@pytest.mark.parametrize("over", [
    {"variant": "fald", "p": "0.5", "local-steps": 3, "tau": 0.3},
    {"variant": "vr-fald-star", "p": "0.7", "local-steps": 2, "compressor": "qsgd", "s": "8", "prior-var": 5.0},
    {"variant": "dg-lmc", "p": "0.6", "local-steps": 3, "compressor": "qsgd", "s": "8", "prior-var": 5.0},
    {"variant": "fsgld", "local-steps": 2, "compressor": "qsgd", "s": "8", "prior-var": 5.0},
])
def test_the_vectorised_engine_runs_each_chain_as_the_local_engine_does_bit_for_bit(over, tmp_path):
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.run.simulate import run

    o = {"num-rounds": 20, "burn-in": 0, "progress": False, "gamma": 4.9e-4, "num-chains": 2, "loo": "off",
         "output-dir": str(tmp_path), "dim": 10, **over}
    v = run({**o, "engine": "vectorised"})
    assert v.summary["engine"] == "vectorised" and v.summary["backend"] == "numpy"
    draws = load_samples(v.run_dir)
    for c in range(2):
        one = run_local(resolve({**o, "num-chains": 1, "seed": c, "engine": "local"}), write=False,
                        keep_trace=True, progress=False).trace
        np.testing.assert_array_equal(draws[c], one)


def test_a_rival_runs_side_by_side_with_the_qlsd_family_on_the_same_seeds():
    from qlsd_flwr.engines.vectorised.driver import run_side_by_side, run_vectorised

    o = {"num-rounds": 15, "burn-in": 0, "progress": False, "num-chains": 2, "dim": 10, "engine": "vectorised"}
    cfgs = [resolve({**o, "variant": "qlsd-pp"}), resolve({**o, "variant": "fald", "local-steps": 2})]
    both = run_side_by_side(cfgs, keep_trace=True)
    for cfg, res in zip(cfgs, both):
        np.testing.assert_array_equal(res.trace, run_vectorised(cfg, write=False, keep_trace=True).trace)
    with pytest.raises(ValueError, match="numba runs the QLSD family only"):
        run_vectorised(cfgs[1], write=False, backend="numba")


@pytest.mark.parametrize("variant, over", [("vr-fald-star", {}), ("dg-lmc", {}), ("fsgld", {}),
                                           # each chain refreshes its own reference (refresh_chains, ref_grad)
                                           ("vr-fald-star", {"q": 0.4}),
                                           # the metric travels once in a several-chain message (metric_chains)
                                           ("fald", {"metric": "dense", "prior-var": 5.0})])
def test_chain_c_of_a_several_chain_run_is_the_one_chain_run_with_seed_plus_c(tmp_path, variant, over):
    o = {"variant": variant, "p": "1" if variant == "fsgld" else "0.6", "local-steps": 2, "num-chains": 3, "num-rounds": 25, "burn-in": 0,
         "progress": False, "gamma": 4.9e-4, "output-dir": str(tmp_path), **over}
    strat = run_inprocess(resolve(o), o, shuffle_seed=5, strategy_kwargs={"keep_trace": True})
    trace = np.array(strat.trace)
    for c in range(3):
        one = run_local(resolve({**o, "num-chains": 1, "seed": c, "engine": "local"}), write=False,
                        keep_trace=True, progress=False)
        np.testing.assert_array_equal(trace[:, c], one.trace)
        if "q" in over:  # each chain counts its own refreshes, as its one-chain run does
            assert strat.summary_data["reference_refresh_per_chain"][c] == one.summary["reference_refresh"]


@pytest.mark.parametrize("over, words", [
    ({"variant": "dg-lmc", "metric-rank": 4}, "metric-rank: dg-lmc's exact θ | z draw takes its metric in the"),
    ({"aggregation": "active-fraction", "p": "0.5"}, "aggregation: fald averages its clients with the weights"),
    ({"variant": "dg-lmc", "temperature": 0.5}, "temperature: dg-lmc samples T = 1 only"),
    ({"variant": "dg-lmc", "rho": -1.0}, "rho"),
    ({"variant": "fsgld", "p": "0.5"}, "p: fsgld asks one client a round"),
    ({"q": 0.3}, "q: only vr-fald-star refreshes a reference point"),
    ({"variant": "qlsd-pp", "q": 0.3}, "qlsd-pp takes q = 0"),
])
def test_what_the_rivals_do_not_take_is_refused_by_key(over, words):
    with pytest.raises(ConfigError, match=words):
        resolve({"variant": "fald", **over})
    # DG-LMC takes any aggregation: it weighs no reply by 1/p_i
    assert resolve({"variant": "dg-lmc", "aggregation": "active-fraction", "p": "0.5"}).oracle == "dglmc"
    # the FALD family's local steps take every metric; DG-LMC's coupling every one but a low-rank corrected one
    for v, metric, rank in [("fald", "dense", 0), ("vr-fald-star", "kronecker", 0), ("fsgld", "diagonal", 4),
                            ("dg-lmc", "diagonal", 0), ("dg-lmc", "dense", 0), ("dg-lmc", "kronecker", 0)]:
        assert resolve({"variant": v, "metric": metric, "metric-rank": rank}).metric == metric


def test_compressor_auto_follows_the_variant_and_qsgd_codes_any_variant():
    assert resolve({"variant": "qlsd-pp"}).compressed and not resolve({"variant": "fald"}).compressed
    assert resolve({"variant": "fald", "compressor": "qsgd"}).compressed
    assert not resolve({"variant": "qlsd", "compressor": "identity"}).compressed
    assert resolve({"variant": "lsd-pp", "compressor": "qsgd"}).compressed


def _f8(*x) -> bytes:
    return np.array(x, dtype="<f8").tobytes()


@pytest.mark.parametrize("local, words", [
    (None, "'local' must be four numbers"),
    (_f8(1e-3, 0.5, 1.0), "'local' must be four numbers"),
    ([1e-3, 0.5, 1.0, 1.0], "'local' must be four numbers"),
    (_f8(1e-3, 1.5, 1.0, 1.0), "out of range"),
    (_f8(float("nan"), 0.5, 1.0, 1.0), "out of range"),
    (_f8(1e-3, 0.5, 0.0, 1.0), "out of range"),
    (_f8(1e-3, 0.5, float("inf"), 1.0), "out of range"),
    (_f8(1e-3, 0.5, 1.0, 0.0), "out of range"),
])
def test_a_server_message_with_a_bad_local_field_is_refused_before_the_state_changes(local, words):
    # VR-FALD*: nothing of the message (θ*, ∇U(θ*)) is installed before the round's numbers are checked
    cfg = resolve({**TOY, "variant": "vr-fald-star"})
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 3, task.prior)
    st = ClientState()
    fields = {"phase": "sample", "round": 0, "client": 0, "theta": np.zeros(3), "anchor_version": 0, "eta_count": 0,
              "anchor": np.ones(3), "anchor_total": np.zeros(3), "local": local}
    if local is None:
        fields.pop("local")
    with pytest.raises(ValueError, match=words):
        handle(spec, task.clients[0], st, 0, fields, 3)
    assert st.anchor is None and st.anchor_total is None and st.anchor_version == -1
    ok = handle(spec, task.clients[0], st, 0, {**fields, "local": _f8(1e-3, 0.5, 1.0, 1.0)}, 3)
    assert ok["status"] == "ok" and st.anchor_version == 0 and "anchor_grad" in ok


def test_a_vr_fald_star_message_with_a_bad_anchor_installs_nothing():
    cfg = resolve({**TOY, "variant": "vr-fald-star"})
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 3, task.prior)
    st = ClientState()
    fields = {"phase": "sample", "round": 0, "client": 0, "theta": np.zeros(3), "anchor_version": 0, "eta_count": 0,
              "anchor": np.ones(4), "anchor_total": np.full(3, 7.0), "local": _f8(1e-3, 0.5, 1.0, 1.0)}
    with pytest.raises(ValueError, match="shape"):
        handle(spec, task.clients[0], st, 0, fields, 3)
    assert st.anchor is None and st.anchor_total is None and st.anchor_version == -1


def test_dg_lmc_s_z_mirror_and_the_client_s_z_agree_and_a_bad_rho_from_the_server_is_refused():
    cfg = resolve({**TOY, "variant": "dg-lmc", "gamma": 1e-4, "rho": 1e-3, "num-rounds": 20, "burn-in": 0})
    r = run_local(cfg, write=False, keep_trace=True)
    for i, st in enumerate(r.clients):  # z_i on the client equals the server's mirror, bit for bit
        assert st.eta is not None and np.array_equal(st.eta, r.server.eta_i[i])
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 3, task.prior)
    st = ClientState()
    fields = {"phase": "sample", "round": 0, "client": 0, "theta": np.zeros(3), "anchor_version": -1,
              "eta_count": 5, "eta": np.ones(3), "local": _f8(1e-4, -1.0, 1.0, 1.0)}
    with pytest.raises(ValueError, match="ρ_i > 0"):
        handle(spec, task.clients[0], st, 0, fields, 3)
    assert st.eta is None and st.eta_count == 0  # the mirror it was sent is not installed


@pytest.mark.parametrize("variant", ["fald", "vr-fald-star", "dg-lmc", "fsgld"])
def test_gamma_auto_chooses_the_rivals_step_from_the_curvature(variant):
    # gamma = auto: c/λ_max of ∇²U at θ*, estimated by the federated power iteration before sampling, as
    # for the QLSD family (the Gaussian's λ_max is its posterior precision P); FALD's local steps are
    # γ/w_i, DG-LMC's γ_i = (1/γ + 1/(c ρ))⁻¹ with ρ = γ/10
    cfg = resolve({**TOY, "variant": variant, "gamma": "auto", "num-rounds": 20, "burn-in": 0,
                   **({"p": "1"} if variant == "fsgld" else {})})
    r = run_local(cfg, write=False, keep_trace=True)
    P = float(1 / loading.load_task(cfg).posterior_var[0])
    assert r.summary["gamma"] == pytest.approx(0.25 / P, rel=1e-3)
    assert np.all(np.isfinite(r.trace)) and r.summary["rejected"] == {}


def test_dg_lmc_s_z_start_at_the_chain_s_theta0_and_travel_with_the_first_message():
    # as in core.dglmc.run: z_i = θ_0, so that dispersed starts stay dispersed (z_i = 0 would pull every
    # chain's first draw of θ | z to the same place)
    from qlsd_flwr.protocol.server import QLSDServer

    cfg = resolve({**TOY, "variant": "dg-lmc", "gamma": 1e-4, "num-rounds": 5, "burn-in": 0})
    server = QLSDServer(cfg, loading.load_task(cfg))
    theta0 = np.array([1.0, -2.0, 3.0])
    server.begin(None, {}, theta0)
    assert np.array_equal(server.state.eta_i, np.tile(theta0, (4, 1)))
    active = server.begin_round()
    assert active and all(np.array_equal(server.fields_for(i)["eta"], theta0) for i in active)


@pytest.mark.parametrize("bad, words", [
    ({"surrogate": np.full(3, -1.0)}, "0 ≤ λ_i ≤ Λ"),
    ({"surrogate": np.full(3, 9.0), "surrogate_total": np.full(3, 1.0)}, "0 ≤ λ_i ≤ Λ"),
    ({"surrogate_total": np.full(3, np.nan)}, "finite"),
    ({"surrogate": np.ones(4)}, "shape"),
    ({"surrogate": None}, "bytes of float64"),
])
def test_an_fsgld_message_with_a_bad_surrogate_installs_nothing(bad, words):
    cfg = resolve({**TOY, "variant": "fsgld", "p": "1"})
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 3, task.prior)
    st = ClientState()
    fields = {"phase": "sample", "round": 0, "client": 0, "theta": np.zeros(3), "anchor_version": 0, "eta_count": 0,
              "anchor": np.ones(3), "anchor_total": np.zeros(3), "surrogate": np.full(3, 2.0),
              "surrogate_total": np.full(3, 5.0), "local": _f8(1e-3, 0.5, 1.0, 1.0)}
    with pytest.raises(ValueError, match=words):
        handle(spec, task.clients[0], st, 0, {**fields, **bad}, 3)
    assert st.anchor is None and st.anchor_total is None and st.surrogate is None and st.anchor_version == -1
    ok = handle(spec, task.clients[0], st, 0, fields, 3)
    assert ok["status"] == "ok" and np.array_equal(st.surrogate, np.full(3, 2.0)) and "anchor_grad" in ok


def test_fsgld_asks_one_client_a_round_by_its_data_share_and_sends_theta_star_with_its_surrogate_once():
    from qlsd_flwr.core import fsgld

    o = {**TOY, "variant": "fsgld", "p": "1", "gamma": 1e-4, "num-rounds": 400, "burn-in": 0}
    cfg = resolve(o)
    task = loading.load_task(cfg)
    server = run_local(cfg, write=False, keep_trace=True)
    n = task.n_data.astype(float)
    picks = np.array([fsgld.choose(n / n.sum(), cfg.seed, k) for k in range(400)])
    counts = np.bincount(picks, minlength=4)
    # a binomial count per client: within 4 sd of 400 f_i
    assert np.all(np.abs(counts - 400 * n / n.sum()) <= 4 * np.sqrt(400 * n / n.sum() * (1 - n / n.sum()))), counts
    assert server.summary["rejected"] == {} and server.summary["missed_rounds"] == {}
    assert server.summary["surrogate_reports"] == 4 and server.summary["surrogate_rejected"] == {}
    for i, st in enumerate(server.clients):  # the surrogate each was sent: its own Hutchinson diagonal (N_i here)
        if counts[i]:
            np.testing.assert_allclose(st.surrogate, n[i], rtol=1e-6)
            np.testing.assert_allclose(st.surrogate_total, n.sum(), rtol=1e-6)


def test_fsgld_caps_the_summed_surrogate_precision_at_one_over_gamma():
    # one client's report may pass the per-datum cap (its claimed N_i and 10× the others' per datum): its λ
    # stiffens every client's local step through Λ, so Λ is held to 1/γ (any λ keeps the gradient unbiased)

    lam = np.array([[1.0, 2.0], [1.0, 2.0], [500.0, 2.0]])
    assert cap_total(lam.copy(), h=1e-3) == 0  # Λ = (502, 6): under 1/h = 1000
    capped = lam.copy()
    assert cap_total(capped, h=1e-2) == 1  # Λ_0 = 502 > 100: scaled to 100 in that coordinate only
    assert capped[:, 0].sum() == pytest.approx(100.0) and np.array_equal(capped[:, 1], lam[:, 1])
    assert np.allclose(capped[:, 0] / capped[0, 0], lam[:, 0] / lam[0, 0])  # the clients' shares kept


def test_fsgld_counts_its_surrogate_exchange_and_skips_a_round_when_no_client_is_kept():
    from qlsd_flwr.protocol.server import QLSDServer

    cfg = resolve({**TOY, "variant": "fsgld", "p": "1", "gamma": 1e-4, "num-rounds": 5, "burn-in": 0})
    r = run_local(cfg, write=False)
    assert r.summary["prep_exchanges"] >= 1 and r.summary["prep_uplink_bits"] >= 4 * 64 * 3  # the curvature reports
    task = loading.load_task(cfg)
    from qlsd_flwr.protocol import precondition

    specs = [build.client_spec(cfg, i, task.clients[i].n_data, 3, task.prior) for i in range(4)]
    prep = precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs))
    server = QLSDServer(cfg, task)
    server.begin(prep.theta_star, prep.info, None, prep)
    server.set_claims([c.grad_sum(prep.theta_star) for c in task.clients])
    server.leave_out(range(4))
    before = server.state.theta.copy()
    assert server.begin_round() == []
    row = server.end_round()
    assert row["skipped"] == 1 and np.array_equal(server.state.theta, before)
