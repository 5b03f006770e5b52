"""The compressed downlink (``downlink = qsgd``, issue 37; :mod:`qlsd_flwr.core.downlink`).

* **Its law**: with exact client gradients on a Gaussian target, ``(θ_k, w_k)`` is a linear recursion driven by
  the Langevin noise and the broadcast's quantisation noise, which is zero-mean and white; θ's stationary
  covariance solves a discrete Lyapunov equation (:func:`~qlsd_flwr.core.downlink.stationary_covariance`) whose
  noise covariance ``Q`` is the mean of QSGD's exact conditional variance over the coded vectors (replayed from the
  chain). The chain has no other bias (the law is the discretised chain's own), so the only tolerance is Monte
  Carlo error: each eigen-direction's variance within 4 batch-means standard errors, and the mean within 4 of its
  own. The same chain is far from the law without the broadcast's noise (so the test can fail).
* **Every path gives the same chain** (the protocol on the local engine, its direct twin, in-process Flower with
  two chains, clients missing rounds, the vectorised engine's numpy backend on both its paths), with fewer
  downlink bits than ``downlink = off`` and the vectorised engine counting what Flower's server sends, round by
  round; ``off`` leaves today's chains as they were (``tests/golden.py``). Kill-and-resume is in
  ``test_reliability.py``.
* **Hostile downlink bytes** are refused by the client, naming the field, before its state changes.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.core import downlink as D
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.protocol.broadcast import downlink_of
from test_metric import ill_conditioned_task


@pytest.mark.parametrize("alpha", [1.0, 0.8, 0.571, 0.2, 0.05])
def test_the_lag_never_narrows_the_stable_steps(alpha):
    """Jury's test on the 2 × 2 block: stable exactly for γλ < 4/α − 2, which is ≥ ULA's 2."""
    top = 4 / alpha - 2
    for g in np.linspace(0.01, min(top, 50) * 1.5, 200):
        if abs(g - top) > 1e-6 * top:
            assert D.stable(g, alpha) == (g < top), (g, alpha)


def _replayed_noise(cfg, task, trace, burn: int) -> np.ndarray:
    """``Q``: the mean over rounds ``k ≥ burn`` of QSGD's conditional variance of the vector each round coded,
    ``θ_k − w_{k−1}`` (``ef21-p``) or ``θ_k`` (``none``), the ``w``s rebuilt exactly as the server built them."""
    dl, s = downlink_of(cfg), int(cfg.get("downlink-s"))
    thetas = np.vstack([task.theta0[None], trace[:-1]])  # θ_0 .. θ_{K−1}
    w, Q, n = None, np.zeros(task.dim), 0
    for k, theta in enumerate(thetas):
        coded = theta if dl.feedback == "none" else None if w is None else theta - w
        if k >= burn and coded is not None:
            var = D.subtractive_variance if dl.dither == "subtractive" else D.qsgd_variance
            Q, n = Q + var(coded, s), n + 1
        w = dl.send(theta, w, cfg.seed, k)[0]
    return np.diag(Q / n)


@pytest.mark.parametrize("feedback, s, c, dither", [("ef21-p", 2, 0.9, "stochastic"), ("ef21-p", 8, 0.9, "stochastic"),
                                                     ("none", 2, 0.5, "stochastic"), ("ef21-p", 2, 0.9, "subtractive")])
def test_the_chain_has_its_derived_stationary_law(feedback, s, c, dither):
    """(``downlink-dither = subtractive``: the same law with ``Q`` the subtractive dither's ``(N/s)²/12``.)"""
    task = ill_conditioned_task(d=3, cond=30)
    P = sum(cl.A for cl in task.clients)
    gamma = c / np.linalg.eigvalsh(P)[-1]
    K, burn = 16000, 1000
    cfg = resolve({"variant": "qlsd", "compressor": "identity", "num-clients": 2, "dim": 3, "num-rounds": K,
                   "burn-in": 0, "progress": False, "plot": False, "loo": "off", "theta-star": "closed-form",
                   "gamma": gamma, "p": "1", "downlink": "qsgd", "downlink-s": s, "downlink-feedback": feedback,
                   "downlink-dither": dither, "seed": 3})
    trace = run_local(cfg, task=task, write=False, keep_trace=True, wire=False).trace
    dl = downlink_of(cfg)
    assert dl.dither == dither
    Q = _replayed_noise(cfg, task, trace, burn)
    want = D.stationary_covariance(gamma, P, np.eye(3), dl.alpha(3), Q, feedback=feedback)
    exact = D.stationary_covariance(gamma, P, np.eye(3), 1.0, np.zeros((3, 3)), feedback="none")  # no broadcast noise
    _, V = np.linalg.eigh(P)
    z = (trace[burn:] - task.theta_star) @ V  # the eigen-directions' coordinates
    batches = np.array([[np.mean(b ** 2) for b in np.array_split(z[:, j], 40)] for j in range(3)])
    se = batches.std(axis=1, ddof=1) / np.sqrt(40)
    got = (z ** 2).mean(axis=0)
    want_d, exact_d = np.diag(V.T @ want @ V), np.diag(V.T @ exact @ V)
    assert np.all(np.abs(got - want_d) < 4 * se), (got / want_d, (got - want_d) / se)
    if s == 2:  # coarse codes: the law without the broadcast's noise is far off (so this test can fail)
        assert (np.abs(got - exact_d) / se).max() > 8, got / exact_d
    means = np.array([[b.mean() for b in np.array_split(z[:, j], 40)] for j in range(3)])
    assert np.all(np.abs(means.mean(axis=1)) < 4 * means.std(axis=1, ddof=1) / np.sqrt(40))


@pytest.mark.parametrize("metric, s", [("inverse", 2), ("diagonal", 2), ("diagonal", 8)])
def test_the_corrected_chain_has_its_derived_stationary_law(metric, s, tmp_path):
    """``downlink-correction = metric``: with ``M = P⁻¹`` the broadcast leaves the chain exactly ULA's (the law without
    the broadcast's noise), however coarse the code; with ``M ≠ P⁻¹`` (the inverse of ``P``'s diagonal) its law is
    :func:`~qlsd_flwr.core.downlink.transition`'s with ``β``; at ``s = 2`` the law without the correction is far off
    (so the test can fail)."""
    task = ill_conditioned_task(d=3, cond=30)
    P = sum(cl.A for cl in task.clients)
    M = np.linalg.inv(P) if metric == "inverse" else np.diag(1.0 / np.diag(P))
    np.save(tmp_path / "m.npy", M)
    gamma = 0.9 / np.linalg.eigvals(M @ P).real.max()
    K, burn = 16000, 1000
    cfg = resolve({"variant": "qlsd", "compressor": "identity", "num-clients": 2, "dim": 3, "num-rounds": K,
                   "burn-in": 0, "progress": False, "plot": False, "loo": "off", "theta-star": "closed-form",
                   "gamma": gamma, "p": "1", "downlink": "qsgd", "downlink-s": s, "downlink-correction": "metric",
                   "metric": str(tmp_path / "m.npy"), "seed": 3})
    trace = run_local(cfg, task=task, write=False, keep_trace=True, wire=False).trace
    beta, alpha = min(1.0, 1.0 / gamma), downlink_of(cfg).alpha(3)
    Q = _replayed_noise(cfg, task, trace, burn)
    want = D.stationary_covariance(gamma, P, M, alpha, Q, beta=beta)
    if metric == "inverse":  # the derivation: exactly ULA's law, the broadcast's noise gone
        assert np.allclose(want, D.stationary_covariance(gamma, P, M, 1.0, np.zeros((3, 3)), feedback="none"))
    _, V = np.linalg.eigh(P)
    z = (trace[burn:] - task.theta_star) @ V
    batches = np.array([[np.mean(b ** 2) for b in np.array_split(z[:, j], 40)] for j in range(3)])
    se = batches.std(axis=1, ddof=1) / np.sqrt(40)
    got = (z ** 2).mean(axis=0)
    assert np.all(np.abs(got - np.diag(V.T @ want @ V)) < 4 * se), (got, np.diag(V.T @ want @ V), se)
    if s == 2:
        off = np.diag(V.T @ D.stationary_covariance(gamma, P, M, alpha, Q) @ V)  # β = 0: no correction
        assert (np.abs(got - off) / se).max() > 8, got / off
    means = np.array([[b.mean() for b in np.array_split(z[:, j], 40)] for j in range(3)])
    assert np.all(np.abs(means.mean(axis=1)) < 4 * means.std(axis=1, ddof=1) / np.sqrt(40))


def test_the_correction_keeps_every_step_ulas_stable():
    """Jury's test with the correction (``b = γβ ≤ 1``): stable exactly for ``γλ < 2((1 − α)(1 − b) + 1)/α``, ≥ 2."""
    for alpha in (1.0, 0.571, 0.2):
        for b in (0.0, 0.3, 1.0):
            top = 2 * ((1 - alpha) * (1 - b) + 1) / alpha
            assert top >= 2
            for g in np.linspace(0.01, min(top, 50) * 1.5, 150):
                if abs(g - top) > 1e-6 * top:
                    assert D.stable(g, alpha, b) == (g < top), (g, alpha, b)


BASE = {"task": "gaussian", "num-clients": 4, "dim": 5, "num-rounds": 30, "burn-in": 5, "variant": "qlsd-pp", "l": 4,
        "p": "0.6,1,0.8,0.7", "gamma": 1e-3, "s": "4", "progress": False, "plot": False, "loo": "off", "seed": 2,
        "downlink": "qsgd", "downlink-s": 8}


def _bits_down(run_dir) -> int:
    with open(run_dir / "metrics.csv", newline="") as f:
        return sum(int(r["bits_down"]) for r in csv.DictReader(f))


@pytest.mark.parametrize("feedback, dither", [("ef21-p", "stochastic"), ("none", "stochastic"),
                                             ("ef21-p", "subtractive")])
def test_every_path_runs_the_same_chain_with_fewer_downlink_bits(feedback, dither, tmp_path):
    """(With ``downlink-dither = subtractive`` each client takes its chain's dither out: two chains, seeds 2 and 3.)"""
    from qlsd_flwr.run.simulate import run_inprocess

    o = {**BASE, "downlink-feedback": feedback, "downlink-dither": dither, "output-dir": str(tmp_path)}
    wire = run_local(resolve({**o, "run-name": "wire"}), keep_trace=True)
    direct = run_local(resolve(o), write=False, keep_trace=True, wire=False)
    assert np.array_equal(wire.trace, direct.trace)
    assert not any(wire.summary.get("rejected", {}).values())  # the clients that missed a round got w in full
    o2 = {**o, "num-chains": 2, "engine": "inprocess", "run-name": "flower"}
    strat = run_inprocess(resolve(o2), o2, shuffle_seed=5, strategy_kwargs={"keep_trace": True})
    assert np.array_equal(np.asarray(strat.trace)[:, 0], wire.trace)
    chain1 = run_local(resolve({**o, "seed": 3}), write=False, keep_trace=True, wire=False)
    assert np.array_equal(np.asarray(strat.trace)[:, 1], chain1.trace)
    off = run_local(resolve({**o, "downlink": "off", "run-name": "off"}), keep_trace=True)
    assert not np.array_equal(off.trace, wire.trace)  # the clients evaluate at w_k, not θ_k
    assert _bits_down(wire.run_dir) < _bits_down(off.run_dir)
    assert wire.summary["bits"]["downlink"]["sampling"] == _bits_down(wire.run_dir)


@pytest.mark.parametrize("variant,feedback,extra", [
    ("qlsd-pp", "ef21-p", {}), ("qlsd-star", "none", {}), ("lsd-pp", "ef21-p", {}),
    ("qlsd-pp", "ef21-p", {"downlink-dither": "subtractive"}),
    # the logistic task's batched oracles (grad_sum_clients) and a metric's basis (each client's Sᵀ H_i at w_k)
    ("qlsd-pp", "ef21-p", {"task": "logistic", "dataset": "breast_cancer", "dim": None, "metric": "diagonal",
                           "gamma": "auto", "compression-basis": "metric", "prior-var": 0.05})])
def test_the_vectorised_engine_runs_the_protocols_chains_and_counts_its_bits(variant, feedback, extra, tmp_path,
                                                                             monkeypatch):
    from qlsd_flwr.engines.vectorised import numpy_backend, run_vectorised
    from qlsd_flwr.run.simulate import run_inprocess

    o = {k: v for k, v in {**BASE, "variant": variant, "downlink-feedback": feedback, "norm-bound": "off",
                           "output-dir": str(tmp_path), **extra}.items() if v is not None}
    local = run_local(resolve(o), write=False, keep_trace=True, wire=False).trace
    o3 = {**o, "num-chains": 3, "engine": "inprocess", "run-name": "flower"}
    flower = run_inprocess(resolve(o3), o3, shuffle_seed=4, strategy_kwargs={"keep_trace": True})
    chains = np.asarray(flower.trace).transpose(1, 0, 2)  # (chain, round, d)
    assert np.array_equal(chains[0], local) and not np.array_equal(chains[1], chains[0])
    for batched in (True, False):
        monkeypatch.setattr(numpy_backend.NumpyGeneric, "BATCHED", batched)
        v = run_vectorised(resolve({**o3, "engine": "vectorised", "run-name": f"vectorised-{batched}"}),
                           keep_trace=True)
        assert v.backend == "numpy" and np.array_equal(v.trace, chains), batched
        assert _column(v.run_dir, "bits_down") == _column(flower.run_dir, "bits_down"), batched
        assert v.summary["bits"]["downlink"]["sampling"] == _bits_down(v.run_dir)
    if "metric" in extra:  # downlink-correction = auto takes the lag's term out with that metric: on every path above
        beta = json.loads((flower.run_dir / "summary.json").read_text())["downlink_correction_beta"]
        assert v.summary["downlink_correction_beta"] == beta == 1.0
        plain = run_local(resolve({**o, "downlink-correction": "off"}), write=False, keep_trace=True, wire=False).trace
        assert not np.array_equal(plain, local)


def _column(run_dir, name) -> list[int]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(float(r[name])) for r in csv.DictReader(f)]


def test_the_keys_are_refused_where_they_do_not_apply():
    with pytest.raises(ConfigError, match="downlink-correction: metric takes M⁻¹ as the curvature, and metric = "
                                          "identity has none; allowed with it: auto, off"):
        resolve({**BASE, "downlink-correction": "metric"})
    with pytest.raises(ConfigError, match="downlink-correction: unknown value 'yes'; allowed: auto, metric, off"):
        resolve({**BASE, "downlink-correction": "yes"})
    assert resolve({**BASE, "metric": "diagonal", "downlink-correction": "metric"}).get("downlink-correction") == "metric"
    with pytest.raises(ConfigError, match="downlink: qsgd compresses the broadcast of the QLSD family"):
        resolve({**BASE, "variant": "fald"})
    from qlsd_flwr.engines.vectorised import run_vectorised

    with pytest.raises(ValueError, match="vectorised-backend = numba sends θ in full; downlink = qsgd runs on: auto, "
                                         "numpy"):
        run_vectorised(resolve({**BASE, "engine": "vectorised"}), write=False, backend="numba")
    with pytest.raises(ConfigError, match="vectorised-backend: numba sends θ in full; with downlink = qsgd allowed: "
                                          "auto, numpy"):
        resolve({**BASE, "engine": "vectorised", "vectorised-backend": "numba"})
    with pytest.raises(ConfigError, match="downlink-feedback: unknown value 'ef21'; allowed: ef21-p, none"):
        resolve({**BASE, "downlink-feedback": "ef21"})
    with pytest.raises(ConfigError, match="downlink-dither: unknown value 'uniform'; allowed: stochastic, subtractive"):
        resolve({**BASE, "downlink-dither": "uniform"})


def test_the_subtractive_dither_leaves_a_uniform_error_whatever_the_vector():
    """``downlink-dither = subtractive`` (:func:`~qlsd_flwr.core.downlink.subtractive_quantise`): over the dither, each
    coordinate's error ``C(x)_j − x_j`` has mean 0 and variance ``(N/s)²/12`` (a level's width, uniform), whatever
    ``x_j``, where QSGD's is ``f (1 − f)`` levels² (so the test can tell them apart); the client's ``w`` is the
    server's, bit for bit, and its code is QSGD's, the same levels' range."""
    s, d, n = 4, 6, 20000
    x = np.array([0.0, 1e-3, 0.37, -0.37, 1.0, -2.5])
    N = float(np.float32(np.linalg.norm(x)))
    rng = np.random.default_rng(0)
    U = rng.random((n, d))
    err = np.array([D.subtractive_value(D.subtractive_quantise(x, u, s), u) for u in U]) - x
    assert np.all(np.abs(err.mean(axis=0)) < 4 * np.sqrt((N / s) ** 2 / 12 / n))
    var = err.var(axis=0)
    want = (N / s) ** 2 / 12
    assert np.all(np.abs(var / want - 1) < 4 * np.sqrt(0.8 / n)), var / want  # Var of U² / (1/12)² is 0.8
    assert np.all(np.abs(err) <= N / s / 2 * (1 + 1e-12))
    assert np.abs(D.qsgd_variance(x, s)[3] / want - 1) > 0.5  # QSGD's own, at 0.37: another law
    rule = D.Downlink(D.broadcast_code(s), "ef21-p", "subtractive")
    w0 = rng.standard_normal(d)
    w1, code = rule.send(w0 + x, w0, 7, 3)
    assert np.array_equal(rule.receive(w0, code, d, 7, 3), w1)
    assert not np.array_equal(rule.receive(w0, code, d, 8, 3), w1)  # another chain's dither: another point
    assert D.subtractive_quantise(np.zeros(d), U[0], s).levels.tolist() == [0] * d
    # where d > 144 s² the dither's own error exceeds QSGD's bound, and α takes it: the lag θ − w still contracts
    big, coarse = 7850, D.Downlink(D.broadcast_code(2), "ef21-p", "subtractive")
    assert coarse.alpha(big) == 1.0 / (1.0 + big / 48.0) < D.Downlink(D.broadcast_code(2)).alpha(big)
    theta, w = rng.standard_normal(big), np.zeros(big)
    lags = []
    for k in range(60):
        w = coarse.send(theta, w, 1, k)[0]
        lags.append(float(np.linalg.norm(theta - w)))
    assert lags[-1] < 0.9 * np.linalg.norm(theta) and max(lags) <= 1.01 * np.linalg.norm(theta), lags[::10]
    with pytest.raises(ValueError):
        D.subtractive_quantise(np.array([np.inf, 0.0]), U[0, :2], s)


def _client(feedback="ef21-p"):
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol import build
    from qlsd_flwr.tasks import loading

    cfg = resolve({**BASE, "downlink-feedback": feedback, "downlink-support": "all"})  # supports: test_downlink_support
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 5, task.prior)
    return cfg, task, spec, ClientState()


def _code(spec, x, seed=0, k=1):
    return spec.downlink.send(np.asarray(x, float), np.zeros(5), seed, k)[1]


@pytest.mark.parametrize("bad, words", [
    ("a string", "must be bytes"),
    (b"\x00\x01", "does not decode"),
    (np.ones(5).tobytes(), "does not decode"),
])
def test_hostile_downlink_bytes_at_a_client_change_nothing(bad, words):
    from qlsd_flwr.protocol.client import handle

    _, task, spec, st = _client()
    first = {"phase": "sample", "round": 0, "client": 0, "theta": np.ones(5), "anchor_version": 1, "eta_count": 0,
             "anchor_is_theta": 1}
    assert handle(spec, task.clients[0], st, 0, first, 5)["status"] == "ok"
    assert st.w_round == 0 and np.array_equal(st.w, np.ones(5)) and np.array_equal(st.anchor, np.ones(5))
    before = (st.w.copy(), st.w_round, st.eta.copy(), st.eta_count)
    nxt = {"phase": "sample", "round": 1, "client": 0, "anchor_version": 1, "eta_count": 1}
    with pytest.raises(ValueError, match=words):
        handle(spec, task.clients[0], st, 0, {**nxt, "theta_code": bad}, 5)
    assert np.array_equal(st.w, before[0]) and st.w_round == before[1] and np.array_equal(st.eta, before[2])
    with pytest.raises(ValueError, match="neither 'theta' nor 'theta_code'"):
        handle(spec, task.clients[0], st, 0, nxt, 5)
    good = _code(spec, np.arange(5.0))
    assert handle(spec, task.clients[0], st, 0, {**nxt, "theta_code": good}, 5)["status"] == "ok"
    assert st.w_round == 1 and not np.array_equal(st.w, before[0])
    # a code for round 3 when it holds round 1's w: it cannot apply it, and asks for w in full
    late = {**nxt, "round": 3, "eta_count": 2, "theta_code": good}
    w1 = st.w.copy()
    assert handle(spec, task.clients[0], st, 0, late, 5)["status"] == "resync"
    assert np.array_equal(st.w, w1) and st.w_round == 1


def test_round_0_is_a_code_from_zero_which_every_client_holds(tmp_path):
    """Under ``ef21-p`` every chain's memory starts at ``w_{−1} = 0`` (core.downlink): round 0 sends each client a
    code, not θ_0 in full, and the client builds the server's ``w_0`` from it bit for bit; a client that first hears
    of a chain past round 0 cannot, and asks for ``w`` in full."""
    from qlsd_flwr.protocol.client import handle

    _, task, spec, st = _client()
    theta0 = np.array([3.0, -1.0, 0.5, 2.0, -4.0])
    w0, code = spec.downlink.send(theta0, None, 0, 0)
    assert code is not None and 8 * len(code) < 64 * 5 and not np.array_equal(w0, theta0)
    first = {"phase": "sample", "round": 0, "client": 0, "theta_code": code, "anchor_version": 1, "eta_count": 0,
             "anchor_is_theta": 1}
    assert handle(spec, task.clients[0], st, 0, first, 5)["status"] == "ok"
    assert st.w_round == 0 and np.array_equal(st.w, w0) and np.array_equal(st.anchor, w0)
    _, _, _, fresh = _client()
    late = {**first, "round": 2, "theta_code": spec.downlink.send(theta0, w0, 0, 2)[1]}
    assert handle(spec, task.clients[0], fresh, 0, late, 5)["status"] == "resync" and fresh.w is None
    # on the wire: round 0's message to each active client is a code (96 bits at d = 5), θ in full is 64 d = 320: half of
    # 64 d a client is passed as soon as one of them is sent θ in full
    run = run_local(resolve({**BASE, "output-dir": str(tmp_path)}), keep_trace=True)
    with open(run.run_dir / "metrics.csv", newline="") as f:
        row0 = next(csv.DictReader(f))
    d = run.summary["d"]
    assert int(row0["n_active"]) > 0 and int(float(row0["bits_down"])) < 64 * d * int(row0["n_active"]) / 2  # d = 5


def test_a_code_without_downlink_settings_is_refused():
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol import build
    from qlsd_flwr.protocol.client import handle
    from qlsd_flwr.tasks import loading

    cfg = resolve({**BASE, "downlink": "off"})
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 5, task.prior)
    _, _, dl_spec, _ = _client()
    msg = {"phase": "sample", "round": 1, "client": 0, "anchor_version": 0, "eta_count": 0,
           "theta_code": _code(dl_spec, np.ones(5))}
    with pytest.raises(ValueError, match="'theta_code' without downlink settings"):
        handle(spec, task.clients[0], ClientState(), 0, msg, 5)


def test_a_flag_or_bundle_that_does_not_fit_is_refused_by_name():
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol import build
    from qlsd_flwr.protocol.client import handle
    from qlsd_flwr.protocol.wire import unbundle_request
    from qlsd_flwr.tasks import loading

    cfg = resolve({**BASE, "downlink": "off"})
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 5, task.prior)
    msg = {"phase": "sample", "round": 0, "client": 0, "theta": np.ones(5), "anchor_version": 0, "eta_count": 0,
           "anchor_is_theta": 1}
    st = ClientState()
    with pytest.raises(ValueError, match="'anchor_is_theta' is for QLSD"):
        handle(spec, task.clients[0], st, 0, msg, 5)
    assert st.anchor is None and st.w is None
    bundle = {"phase": "sample", "round": 1, "client": 0, "chains": [0, 1], "theta_chains": [1],
              "anchor_version": [0, 0], "eta_count": [0, 0], "theta_code_chains": [0], "theta_code": [b"x"]}
    with pytest.raises(ValueError, match="theta_chains names chains but the message carries no theta"):
        unbundle_request(bundle, 5)
    per = unbundle_request({**bundle, "theta": np.ones((1, 5))}, 5)
    assert "theta" not in per[0] and per[0]["theta_code"] == b"x" and np.array_equal(per[1]["theta"], np.ones(5))


def test_a_vectorised_checkpoints_w_is_checked_before_it_is_used():
    """The vectorised engine's chains' ``w`` from a checkpoint (``protocol.downlink.ChainsBroadcast``): the right
    shape of finite float64 numbers, present under ``ef21-p``, absent with ``downlink = off``; else one line
    naming ``downlink_w``."""
    from qlsd_flwr.protocol.downlink import ChainsBroadcast

    cfg = resolve({**BASE, "engine": "vectorised", "num-chains": 2})
    good = np.zeros((2, 5))
    on = ChainsBroadcast(cfg, [2, 3])
    for bad in (np.zeros((2, 4)), np.full((2, 5), np.nan), good.astype(np.float32), None):
        with pytest.raises(ConfigError, match="checkpoint: .*'downlink_w'") as err:
            on.restore(bad, good.shape)
        assert "\n" not in str(err.value) and on.w is None
    on.restore(good, good.shape)
    assert np.array_equal(on.w, good) and on.w is not good
    off = ChainsBroadcast(resolve({**BASE, "engine": "vectorised", "downlink": "off"}), [2])
    with pytest.raises(ConfigError, match="'downlink_w' is the state of a run with downlink = qsgd"):
        off.restore(good[:1], (1, 5))
    off.restore(None, (1, 5))
    assert not off.on and off.w is None
