"""Compression in the metric's coordinates (``compression-basis = metric``, issue 37).

With ``M = S Sᵀ`` (``S``: the metric's root, the Cholesky factor of a dense ``M``), each client quantises
``Sᵀ H_i − η_i`` and the server steps ``θ − γ S g + √(2γT) S Z``. In the coordinates ``φ = S⁻¹ θ`` that is the
paper's QLSD on the potential ``Ũ(φ) = U(S φ)``, whose gradient is ``Sᵀ ∇U``, with the identity metric: the
compression's error has the identity's shape in φ, so ``M``'s in θ, as the Langevin noise does, and the
paper's analysis holds in φ with the preconditioned condition number. The tests:

* **the derivation, path by path**: the chain equals (to rounding) ``S φ_k`` for the chain QLSD++ runs on
  the φ-task with the identity metric, the same seed, the same participation, minibatches and dither;
* **what it buys**: on an ill-conditioned Gaussian with coarse QSGD (``s = 2``), the stationary variance
  along the flattest direction is the exact-gradient chain's (the discrete Lyapunov solution of
  ``test_metric.py``, plus the compression's own variance, which in φ is bounded as the paper's) within
  Monte Carlo error, where quantising in θ's coordinates inflates it many times;
* every engine gives the same chain (local, vectorised numpy, in-process Flower with two chains), and a
  resumed run is bitwise (``test_reliability.py``'s cases include one).
"""

from __future__ import annotations

import numpy as np
import pytest

from qlsd_flwr.config import resolve
from qlsd_flwr.core.potential import Task
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.engines.vectorised import run_vectorised
from test_metric import MatrixGaussian, ill_conditioned_task

KEYS = {"variant": "qlsd-pp", "num-clients": 2, "dim": 3, "progress": False, "plot": False, "loo": "off",
        "theta-star": "closed-form", "p": "0.7,1", "l": 5, "vectorised-backend": "numpy"}


def _metric_file(tmp_path, P):
    """An SPD metric that is not ``P⁻¹``: the inverse bent by a fixed factor (κ of ``Sᵀ P S`` about 2.5)."""
    B = np.eye(P.shape[0]) + 0.3 * np.triu(np.ones_like(P), 1)
    M = B @ np.linalg.inv(P) @ B.T
    path = tmp_path / "m.npy"
    np.save(path, M)
    return path, np.linalg.cholesky(0.5 * (M + M.T))


def test_the_chain_is_qlsd_in_the_metrics_coordinates_path_by_path(tmp_path):
    task = ill_conditioned_task(d=3, cond=1e4)
    P = sum(c.A for c in task.clients)
    path, S = _metric_file(tmp_path, P)
    Q = S.T @ P @ S  # the preconditioned precision: the φ-task's
    gamma = 0.5 / np.linalg.eigvalsh(Q)[-1]
    keys = {**KEYS, "num-rounds": 400, "burn-in": 0, "s": "4", "gamma": gamma, "num-chains": 2}
    whitened = run_vectorised(resolve({**keys, "metric": str(path), "compression-basis": "metric"}), task=task,
                              write=False, keep_trace=True)
    inv = np.linalg.inv(S)
    phi_task = Task(name="phi", dim=3, clients=[MatrixGaussian(S.T @ c.A @ S, inv @ c.mu) for c in task.clients],
                    prior=task.prior, theta_star=inv @ task.theta_star, theta0=inv @ task.theta0)
    phi = run_vectorised(resolve({**keys, "metric": "identity"}), task=phi_task, write=False, keep_trace=True)
    mapped = phi.trace @ S.T
    scale = float(np.abs(whitened.trace).max())
    assert np.allclose(whitened.trace, mapped, rtol=0, atol=1e-9 * scale), np.abs(whitened.trace - mapped).max()
    # and the θ-basis chain is another chain: the quantisation acts on other vectors
    theta_basis = run_vectorised(resolve({**keys, "metric": str(path), "compression-basis": "theta"}), task=task,
                                 write=False, keep_trace=True)
    assert np.abs(theta_basis.trace - mapped).max() > 1e-3 * scale


def _flat_variance(trace, direction):
    x = trace @ direction
    batches = [b.mean() for c in x for b in np.array_split(c, 10)]  # for the batch-means error of the mean
    return float(np.var(x, ddof=1)), float(np.std(batches, ddof=1) / np.sqrt(len(batches)))


@pytest.mark.parametrize("basis", ["metric", "theta"])
def test_quantising_in_the_metrics_coordinates_keeps_the_flat_directions_right(basis, tmp_path):
    """κ = 1e4 and 1-bit QSGD (``s = 2``). In φ the chain is QLSD++ on a target of condition number about 2.5,
    whose compression variance per step is at most ω ‖Sᵀ H‖² spread over the coordinates; along the
    flattest θ-direction its stationary variance stays within 25 % of the exact-gradient chain's (the
    Lyapunov solution at this γ; the Monte Carlo error of 32 chains × 1,500 rounds is a few %). Quantising
    in θ's coordinates the error has the stiff coordinates' scale, which ``M`` multiplies by up to κ in the
    flat direction: measured, several times the variance."""
    task = ill_conditioned_task(d=3, cond=1e4)
    P = sum(c.A for c in task.clients)
    path, S = _metric_file(tmp_path, P)
    M = S @ S.T
    gamma = 0.25 / np.linalg.eigvalsh(S.T @ P @ S)[-1]
    keys = {**KEYS, "num-rounds": 1700, "burn-in": 200, "s": "2", "gamma": gamma, "num-chains": 32, "p": "1",
            "metric": str(path), "compression-basis": basis}
    res = run_vectorised(resolve(keys), task=task, write=False, keep_trace=True)
    trace = res.trace[:, 200:]
    # the exact-gradient chain θ' = θ − γ M P (θ − θ*) + √(2γ) S z: Σ = A Σ Aᵀ + 2γ M, A = I − γ M P
    A = np.eye(3) - gamma * M @ P
    sigma = 2 * gamma * M
    for _ in range(20000):
        sigma = A @ sigma @ A.T + 2 * gamma * M
    w, V = np.linalg.eigh(P)
    flat = V[:, 0]  # the posterior's widest direction
    want = float(flat @ sigma @ flat)
    got, _ = _flat_variance(trace, flat)
    ratio = got / want
    if basis == "metric":
        assert 0.9 < ratio < 1.25, ratio
    else:
        assert ratio > 2.0, ratio


def test_every_engine_runs_the_same_whitened_chain_and_the_metric_travels_once(tmp_path):
    from qlsd_flwr.run.simulate import run_inprocess

    o = {"task": "gaussian", "num-clients": 4, "dim": 5, "num-rounds": 25, "burn-in": 5, "variant": "qlsd-pp", "l": 4,
         "p": "0.6,1,0.8,0.7", "metric": "diagonal", "gamma": "auto", "s": "4", "progress": False, "plot": False,
         "loo": "off", "seed": 2, "output-dir": str(tmp_path)}
    cfg = resolve({**o, "num-chains": 2, "engine": "vectorised"})
    assert cfg.get("compression-basis") == "auto"  # the default: the metric's basis for a diagonal M
    vec = run_vectorised(cfg, write=False, keep_trace=True)
    one = run_local(resolve({**o, "run-name": "local"}), keep_trace=True)
    assert np.array_equal(one.trace, vec.trace[0])
    o2 = {**o, "num-chains": 2, "engine": "inprocess", "run-name": "flower"}
    strat = run_inprocess(resolve(o2), o2, shuffle_seed=3, strategy_kwargs={"keep_trace": True})
    assert np.array_equal(np.asarray(strat.trace), vec.trace.transpose(1, 0, 2))
    theta = run_local(resolve({**o, "run-name": "theta", "compression-basis": "theta"}), keep_trace=True)
    assert not np.array_equal(theta.trace, one.trace)
    # the diagonal metric (5 numbers and the encoding's header) goes to each client with its first message
    import csv

    down = np.array([int(r["bits_down"]) for r in csv.DictReader(open(one.run_dir / "metrics.csv"))])
    down_theta = np.array([int(r["bits_down"]) for r in csv.DictReader(open(theta.run_dir / "metrics.csv"))])
    assert (down - down_theta).min() >= 0 and 0 < (down - down_theta).sum() <= 4 * 8 * (5 * 8 + 64)


@pytest.mark.parametrize("bad, words", [
    ("a string", "not str"),
    (b"QX\x01\x01", "tag"),
    (np.ones(3).tobytes(), "tag"),
])
def test_hostile_metric_bytes_at_a_whitening_client_install_nothing(bad, words):
    """A QLSD++ client told to quantise in the metric's coordinates refuses malformed metric bytes before any
    of its state changes, answers resync while it has no metric, and whitens with a good one."""
    from qlsd_flwr.core.metric import Diagonal
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol import build
    from qlsd_flwr.protocol.client import handle
    from qlsd_flwr.protocol.wire import metric_to_bytes
    from qlsd_flwr.tasks import loading

    cfg = resolve({"task": "gaussian", "num-clients": 2, "dim": 3, "variant": "qlsd-pp", "metric": "diagonal",
                   "progress": False})
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, 3, task.prior)
    assert spec.whitened
    st = ClientState()
    fields = {"phase": "sample", "round": 0, "client": 0, "theta": np.zeros(3), "anchor_version": 0, "eta_count": 0,
              "anchor": np.zeros(3)}
    with pytest.raises(ValueError, match=words):
        handle(spec, task.clients[0], st, 0, {**fields, "metric": bad}, 3)
    assert st.metric is None and st.anchor is None and st.eta is None  # nothing installed
    assert handle(spec, task.clients[0], st, 0, fields, 3)["status"] == "resync"  # no metric: it asks again
    good = Diagonal(np.array([0.5, 1.0, 4.0]))
    reply = handle(spec, task.clients[0], st, 0, {**fields, "metric": metric_to_bytes(good)}, 3)
    assert reply["status"] == "ok" and np.array_equal(st.metric.m, good.m)
