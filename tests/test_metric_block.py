"""``metric-block``: K-FAC made exact on its top input directions from one block report a client
(:mod:`qlsd_flwr.core.kron_block`; issue 37)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from qlsd_flwr.compression import fixed, root
from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.core import curvature as cv
from qlsd_flwr.core import kron_block as kb
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.protocol.curvature_exchange import BLOCK_ROWS
from qlsd_flwr.robust.reports import FACTOR_SHARE
from qlsd_flwr.run.simulate import run
from stop_resume import stopped_and_resumed
from test_metric import _curvature_mod
from qlsd_flwr.tasks import loading


def _digits(theta_scale=0.05):
    cfg = resolve({"task": "logistic", "dataset": "digits", "num-clients": 4, "progress": False})
    task = loading.load_task(cfg)
    theta = theta_scale * np.random.default_rng(0).normal(size=task.dim)
    reps = {i: cv.check_report(cv.local_curvature(c, theta, "kronecker", 0, i), "kronecker", task.dim)
            for i, c in enumerate(task.clients)}
    prior = np.full(task.dim, 1.0 / float(task.prior.var))
    kfac, _ = cv.metric_from_kronecker(reps, task.n_data, prior, task.dim)
    H = sum(c.hvp_batch(theta, np.eye(task.dim)) for c in task.clients) + np.diag(prior)
    return task, theta, kfac, 0.5 * (H + H.T), prior


def _with_block(task, theta, kfac, prior, k, T=None):
    """The corrected metric from the clients' blocks for the directions ``Q_k`` (times ``T``: another basis of
    the same span), sent as the exchange sends them, in 16-bit rows (curvature_exchange.BLOCK_ROWS)."""
    F = kfac.kron.den.shape[0]
    Q = kfac.kron.qg[:, F - k:] if T is None else kfac.kron.qg[:, F - k:] @ T
    V = fixed.rounded(kb.pack(Q, task.dim), BLOCK_ROWS)
    K = kfac.kron.den.shape[1]
    reports = {i: kb.check_block(kb.local_block(c, theta, V), k * K) for i, c in enumerate(task.clients)}
    info: dict = {}
    return kb.correction(kfac.kron, kb.unpack(V, F), reports, task.n_data, prior, info), info


def test_the_block_makes_the_metric_the_exact_curvature_on_its_directions_and_k_equal_to_the_inputs_is_the_hessian():
    """On ``S = span(Q_k) ⊗ R^K`` the metric's inverse is the Hessian's restriction (``M`` is ``H_S^{−1}`` there and
    K-FAC elsewhere), and with every input direction it is ``∇²U``'s inverse: the whitened curvature is ``I``
    (the directions in 16-bit rows and the blocks as 12-bit square roots, as they travel: each entry of a client's root
    within ``R_ff/2L`` makes each entry of ``Σ B_i`` within ``Σ tr B_i / L``, 0.1 of ``H``'s largest here at 12 bits'
    ``L``; measured 4.1e-4, and the whitened curvature within 1e-2 of 1, so the tolerances are 1.6e-3 and 3.2e-2:
    16 times those of 16-bit roots, which measured 2.1e-5 and 4.4e-4). The block is exact on the directions as sent,
    whatever their rounding: both ends take ``Q̂`` from the same rows."""
    task, theta, kfac, H, prior = _digits()
    F, K = kfac.kron.den.shape
    d = task.dim
    Minv_dense = lambda m: np.linalg.inv(np.stack([m.apply(e) for e in np.eye(d)], axis=1))  # noqa: E731
    full, info = _with_block(task, theta, kfac, prior, F)
    assert info["block_dim"] == d and info["block_scaled"] == []
    Mi = Minv_dense(full)
    assert np.max(np.abs(Mi - H)) <= 16e-4 * np.max(np.abs(H))
    R = np.stack([full.apply_root(e) for e in np.eye(d)], axis=1)
    w = np.linalg.eigvalsh(R.T @ H @ R)
    assert abs(w[0] - 1) < 32e-3 and abs(w[-1] - 1) < 32e-3
    k = 12
    part, info = _with_block(task, theta, kfac, prior, k)
    P = kb.directions(kfac.kron, kfac.kron.qg[:, F - k:], np.eye(k * K))  # an orthonormal basis of S in θ's order
    Mi = Minv_dense(part)
    assert np.max(np.abs(P.T @ Mi @ P - P.T @ H @ P)) <= 16e-4 * np.max(np.abs(H))
    # off S it is K-FAC's: a direction orthogonal to S (an eigenvector of K-FAC outside it) keeps K-FAC's curvature
    e = kb.directions(kfac.kron, kfac.kron.qg[:, :1], np.eye(K))[:, 0]
    assert abs(e @ Mi @ e - e @ Minv_dense(kfac) @ e) <= 1e-6 * abs(e @ Minv_dense(kfac) @ e)
    # and it is a better preconditioner than K-FAC: a smaller condition number of the whitened Hessian
    def kappa(m):
        Rm = np.stack([m.apply_root(x) for x in np.eye(d)], axis=1)
        ev = np.linalg.eigvalsh(Rm.T @ H @ Rm)
        return ev[-1] / ev[0]
    assert kappa(part) < kappa(kfac)
    # the server works in the orthonormal basis of what the clients received: another basis of the same span (Q_k T,
    # T far from I) gives the same metric, and the wrong transform of the blocks (T for T⁻¹) would not
    T = np.triu(np.random.default_rng(2).uniform(0.5, 2.0, size=(k, k)))
    other, _ = _with_block(task, theta, kfac, prior, k, T)
    x = np.random.default_rng(3).normal(size=d)
    # (the two bases' blocks round differently as 12-bit roots, and their directions as 16-bit rows: 1.7e-3 measured,
    # 1.1e-4 with 16-bit roots and float32 rows)
    assert np.max(np.abs(other.apply(x) - part.apply(x))) <= 16e-3 * np.max(np.abs(part.apply(x)))


def test_a_spike_within_the_per_datum_cap_is_held_by_the_leave_one_out_rule():
    """A client that spends its per-datum allowance on one direction (its block plus a rank-1 spike of 3× its trace
    along the others' weakest direction: under the per-datum cap) is held to ``1 + FACTOR_SHARE N_i/N_{−i}`` times
    the prior's and the others' curvature there, as a dense report is (issue 38's rule)."""
    task, theta, kfac, H, prior = _digits()
    F, K = kfac.kron.den.shape
    k = 6
    V = kb.pack(kfac.kron.qg[:, F - k:], task.dim)
    reports = {i: kb.check_block(kb.local_block(c, theta, V), k * K) for i, c in enumerate(task.clients)}
    rest = sum(reports[i] for i in reports if i != 1)
    w, U = np.linalg.eigh(rest)
    spike = reports[1] + 3.0 * np.trace(reports[1]) * np.outer(U[:, 0], U[:, 0])
    lied = {**reports, 1: spike}
    info: dict = {}
    kb.correction(kfac.kron, kb.unpack(V, F), lied, task.n_data, prior, info)
    assert info["block_scaled"] == [1]
    n = np.asarray(task.n_data, dtype=float)
    allow = FACTOR_SHARE * n[1] / (n.sum() - n[1])
    floor = 1.0 / float(task.prior.var)  # the isotropic prior's part on S (orthonormal directions)
    v = U[:, 0]
    assert v @ lied[1] @ v <= allow * (floor + v @ rest @ v) * (1 + 1e-9) < v @ spike @ v


def test_engines_agree_bit_for_bit_and_the_exchange_is_counted(tmp_path):
    base = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-chains": 2, "num-rounds": 20,
            "burn-in": 5, "progress": False, "output-dir": str(tmp_path), "metric": "kronecker", "metric-block": 8,
            "gamma": "auto", "init": "dispersed", "variant": "qlsd-pp", "s": "8", "l": 5, "loo": "off"}
    a = run({**base, "engine": "inprocess", "run-name": "a"})
    b = run({**base, "engine": "vectorised", "run-name": "b"})
    assert np.array_equal(load_samples(a.run_dir), load_samples(b.run_dir))
    s = a.summary
    # the clients' basis went by reference to each client (they all hold the block's directions): no client answered
    # resync for it, and the vectorised engine counts what Flower's server sent
    assert s["block_clients"] == [0, 1, 2, 3] and not s.get("rejected")
    assert s["bits"]["downlink"] == b.summary["bits"]["downlink"]
    assert s["gamma"] == b.summary["gamma"] and s["block_dim"] == 16 and s["metric"]["lowrank"]["rank"] == 16
    plain = run({**base, "engine": "vectorised", "metric-block": 0, "run-name": "plain"})
    m, d, b_ = 16, 62, 4
    cur, cur0 = s["bits"]["preparation"]["curvature"], plain.summary["bits"]["preparation"]["curvature"]
    # the block exchange: each client's square root up (compression.root), of rank 8: with K = 2 outputs each point's
    # A_j = p_j(1 − p_j)(1, −1)(1, −1)ᵀ has rank 1, so B_i has rank k = 8 of its 16, raw or coded, whichever is
    # shorter (at least its head, pivots and scales); θ* and the directions down
    up = cur["uplink"] - cur0["uplink"]
    assert b_ * 8 * (9 + 4 * m + 4 * 8) <= up <= b_ * root.message_bits(8, m) < b_ * 32 * m * (m + 1) // 2
    rows = -(-8 * 31 // d)  # the 8 input directions of breast_cancer's 31 inputs (with the bias) as rows of d
    # the directions as 16-bit rows; θ* not again: the clients hold it from K-FAC's report there (PhaseExchanges.ask)
    assert cur["downlink"] - cur0["downlink"] == b_ * fixed.message_bits(rows, d, BLOCK_ROWS) and BLOCK_ROWS == 16
    assert s["prep_points_held"]["curvature"] - plain.summary["prep_points_held"].get("curvature", 0) == 32 * d
    assert cur["exchanges"] == cur0["exchanges"] + 1
    assert plain.summary["lambda_max"] > s["lambda_max"]  # K-FAC made exact where it was most wrong: a larger step
    # stopped after round 12 and resumed: the checkpoint carries the corrected metric, and the chain is the
    # uninterrupted one bit for bit (no client is asked for its block again)
    one = run({**base, "engine": "local", "num-chains": 1, "run-name": "one"})
    resumed = stopped_and_resumed({**base, "engine": "local", "num-chains": 1, "run-name": "r", "checkpoint-every": 1},
                                  tmp_path / "r")
    assert resumed.summary["gamma"] == one.summary["gamma"]
    assert np.array_equal(load_samples(resumed.run_dir), load_samples(one.run_dir))


def test_the_basis_by_reference_reaches_chains_that_start_late_without_a_resync(tmp_path):
    """With clients missing rounds, a node's chains first meet the basis at different rounds: the first builds it from
    the block's directions (then dropped from the node's Context), the later ones find it built and take it. No
    client answers resync, and in-process Flower runs the vectorised engine's chains bit for bit, bits included."""
    base = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-chains": 3, "num-rounds": 12,
            "burn-in": 2, "progress": False, "output-dir": str(tmp_path), "metric": "kronecker", "metric-block": 8,
            "gamma": "auto", "variant": "qlsd-pp", "s": "8", "l": 5, "loo": "off", "p": "0.5"}
    a = run({**base, "engine": "inprocess", "run-name": "a"})
    b = run({**base, "engine": "vectorised", "run-name": "b"})
    assert not a.summary.get("rejected")
    assert np.array_equal(load_samples(a.run_dir), load_samples(b.run_dir))
    assert a.summary["bits"]["downlink"] == b.summary["bits"]["downlink"]


def test_metric_rank_on_top_of_the_block_corrects_off_it_and_the_two_are_one_correction(tmp_path):
    """``metric-block`` then ``metric-rank``: the products' Krylov space is kept orthogonal to the block's directions,
    so the directions found correct the block's metric off its own (``Corrected`` on ``Blocked``): their ``U``
    orthonormal and orthogonal to the block's, the block unchanged, ``M = S Sᵀ`` for the root the chain uses, the same
    metric as one dense correction of K-FAC by both sets of directions (the form before 2026-12-06), and the whitened
    curvature better conditioned than under the block alone (the exact Hessian at θ*). Engines bit for bit."""
    from qlsd_flwr.protocol import build, precondition

    def prepared(**over):
        cfg = resolve({"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "progress": False,
                       "variant": "qlsd-star", "metric": "kronecker", "gamma": "auto", "metric-block": 8, **over})
        task = loading.load_task(cfg)
        specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, build.blocks_for(cfg, task))
                 for i in range(cfg.b)]
        return task, precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs))

    task, block = prepared()
    _, both = prepared(**{"metric-rank": 10, "metric-rank-exchanges": 2})
    d, lo, blk = task.dim, both.metric.low, both.metric.base
    r = both.info["lowrank_rank"]
    assert 0 < r <= 10 and lo.u.shape == (d, r) and isinstance(blk, kb.Blocked) and block.metric.low is None
    assert all(np.array_equal(getattr(blk, a), getattr(block.metric, a)) for a in ("qh", "v", "t"))
    U = np.concatenate([blk.directions(), lo.u], axis=1)
    assert np.abs(U.T @ U - np.eye(16 + r)).max() < 1e-12
    S = np.stack([both.metric.apply_root(e) for e in np.eye(d)], axis=1)
    M = np.stack([both.metric.apply(e) for e in np.eye(d)], axis=1)
    assert np.abs(S @ S.T - M).max() <= 1e-12 * np.abs(M).max()
    from qlsd_flwr.core.metric import Kronecker

    one = Kronecker(blk.kron).corrected(U, np.concatenate([blk.t, lo.t]))
    assert np.abs(np.stack([one.apply(e) for e in np.eye(d)], axis=1) - M).max() <= 1e-12 * np.abs(M).max()
    H = sum(c.hvp_batch(both.theta_star, np.eye(d)) for c in task.clients) + np.eye(d) / float(task.prior.var)

    def kappa(m):
        R = np.stack([m.apply_root(e) for e in np.eye(d)], axis=1)
        ev = np.linalg.eigvalsh(R.T @ H @ R)
        return ev[-1] / ev[0]

    assert np.array_equal(both.theta_star, block.theta_star) and kappa(both.metric) < kappa(block.metric)
    base = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-chains": 2, "num-rounds": 10,
            "burn-in": 2, "progress": False, "output-dir": str(tmp_path), "metric": "kronecker", "metric-block": 8,
            "metric-rank": 10, "metric-rank-exchanges": 2, "gamma": "auto", "variant": "qlsd-pp", "s": "8", "loo": "off"}
    a = run({**base, "engine": "inprocess", "run-name": "a"})
    b = run({**base, "engine": "vectorised", "run-name": "b"})
    assert np.array_equal(load_samples(a.run_dir), load_samples(b.run_dir))
    assert a.summary["metric"]["lowrank"]["rank"] == 16 + a.summary["lowrank_rank"]
    assert a.summary["bits"]["preparation"]["products"]["exchanges"] == 2
    # a block over every input direction leaves nothing to correct: no exchange is asked for (not a Krylov space
    # made of rounding noise inside the block's span)
    from qlsd_flwr.core import lowrank as lr

    def never(W):
        raise AssertionError("no products should be asked for")

    low, info = lr.correction(never, lambda x: x, lambda x: x, 5, 3, 0, avoid=np.eye(5))
    assert low is None and info["lowrank_exchanges"] == 0


@pytest.mark.parametrize("kind", ["nan", "short", "negative", "huge"])
def test_a_hostile_block_report_is_refused_or_held_to_its_share(kind, tmp_path, caplog):
    """A block that does not decode (short, or its pivots not an ordering: "negative", as a root cannot be) or is not
    finite is refused and counted;
    one ×1e12 + 1e12 is held so that it raises the whitened curvature on ``S`` by at most ``1 + FACTOR_SHARE N_i/N_{−i}``."""
    from qlsd_flwr.run.simulate import run_inprocess

    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "engine": "inprocess", "num-rounds": 10,
         "burn-in": 2, "progress": False, "output-dir": str(tmp_path), "metric": "kronecker", "metric-block": 6,
         "gamma": "auto", "run-name": kind, "loo": "off"}
    caplog.set_level(logging.WARNING, logger="qlsd_flwr")
    s = run_inprocess(resolve(o), o, mods=[_curvature_mod(kind, report=kb.KRON_BLOCK)]).server.summary_data
    honest = run({**o, "engine": "local", "run-name": kind + "-honest"}).summary
    if kind == "huge":
        n = np.asarray(loading.load_task(resolve(o)).n_data, dtype=float)
        allow = 1.0 + FACTOR_SHARE * n[1] / (n.sum() - n[1])
        assert 1 in s["block_scaled"] and "block_scaled" in caplog.text
        assert s["block_t_max"] <= allow * honest["block_t_max"] * (1 + 1e-9)
    else:
        assert list(s["curvature_rejected"]) == ["1"] and "metric-block report refused" in caplog.text
        assert s["block_dim"] == 12  # the others' blocks made the metric
    assert np.isfinite(s["gamma"])


def test_the_key_is_refused_by_name_where_it_cannot_apply_and_a_bad_message_is_refused_by_the_client():
    for bad in ({"metric": "diagonal", "metric-block": 4}, {"metric": "dense", "metric-block": 4},
                {"metric-block": -1}, {"metric": "kronecker", "metric-block": 100000}):
        with pytest.raises(ConfigError, match="metric-block"):
            resolve(bad)
    for q in (0, 33, 2.5):
        with pytest.raises(ConfigError, match="metric-rank-exchanges"):
            resolve({"metric": "kronecker", "metric-rank": 4, "metric-rank-exchanges": q})
    for rows in (np.zeros((1, 20)), np.full((1, 20), np.nan), np.ones((1, 21)), np.vstack([np.zeros(10), np.ones(10)])):
        with pytest.raises(ValueError, match="vectors"):
            kb.unpack(rows.reshape(1, -1), 10)
    Q = np.linalg.qr(np.random.default_rng(1).normal(size=(10, 3)))[0]
    assert np.array_equal(kb.unpack(kb.pack(Q, 20), 10), Q)
    # the client bounds the block the server's directions would make before building it: no more directions than
    # its layer has inputs, no block over MAX_DIM dimensions
    task = loading.load_task(resolve({"task": "logistic", "dataset": "breast_cancer", "num-clients": 4}))
    with pytest.raises(ValueError, match="input directions"):
        kb.local_block(task.clients[0], np.zeros(task.dim), kb.pack(np.ones((31, 32)), task.dim))
    with pytest.raises(ConfigError, match="metric-block"):  # DG-LMC's exact draw takes an uncorrected metric
        resolve({"variant": "dg-lmc", "metric": "kronecker", "metric-block": 4})
    with pytest.raises(cv.ReportError, match="not a square-root report"):
        kb.check_block(np.zeros(5), 3)
    with pytest.raises(cv.ReportError, match="of a 3 × 3 matrix"):  # a root of another size
        kb.check_block(root.encode(np.eye(4)), 3)


def test_a_torch_softmax_layer_reports_the_block_the_logistic_task_does():
    """``TorchPotential.kron_inputs`` (one ``nn.Linear``): the same inputs and outputs as the logistic task's for the
    same model, so the same block (the torch model's float32 logits: to 1e-5); another model is refused by name."""
    import torch
    from torch import nn

    from qlsd_flwr.potentials import TorchPotential
    from qlsd_flwr.tasks.logistic import LogisticLocal

    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(40, 5)).astype(np.float32), rng.integers(0, 3, 40)
    torch.manual_seed(0)
    pot = TorchPotential(nn.Linear(5, 3), X, y)
    lin = pot.model
    W = np.vstack([lin.weight.detach().numpy().T, lin.bias.detach().numpy()[None, :]]).astype(np.float64)  # (F̃, K)
    ref = LogisticLocal(X.astype(np.float64), y, 3)
    Q = np.linalg.qr(rng.normal(size=(6, 4)))[0]
    V = kb.pack(Q, 18)
    theta = np.concatenate([p.detach().numpy().ravel() for p in lin.parameters()]).astype(np.float64)
    ours, theirs = (kb.check_block(kb.local_block(p, th, V), 12) for p, th in ((pot, theta), (ref, W.ravel())))
    assert np.max(np.abs(ours - theirs)) <= 1e-4 * np.max(np.abs(theirs))  # each as its 16-bit root travels
    with pytest.raises(ValueError, match="metric = kronecker"):
        kb.local_block(TorchPotential(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), X, y),
                       np.zeros(39), V)


def test_the_block_kept_in_its_structure_is_the_dense_correction_and_its_bytes_are_checked():
    """:class:`kb.Blocked` applies ``R (I + P C Pᵀ)`` through K-FAC's factors and one ``m × m`` product: the same
    ``M``, root and transposed root as K-FAC corrected by the ``d × m`` dense directions ``U = P V`` (the form until
    2026-12-06) to rounding (1e-12 of the largest entry); its bytes (kind 5, also as a correction's base) give back the
    very arrays and so the same numbers bit for bit (a resumed chain is the one that ran); bytes whose directions are
    not orthonormal, whose rotation is not orthogonal (to within ``0.1 / max t``) or whose values are outside
    ``[RITZ_FLOOR, T_MAX]`` are refused by name; a checkpoint in the form before (a dense correction) is named as
    such."""
    from qlsd_flwr.core.metric import MetricError
    from qlsd_flwr.core.metric_codec import from_array, from_bytes, to_array

    task, theta, kfac, H, prior = _digits()
    blk, _ = _with_block(task, theta, kfac, prior, 7)
    dense = kfac.corrected(blk.directions(), blk.t)
    x = np.random.default_rng(4).normal(size=(3, task.dim))
    for f in ("apply", "apply_root", "apply_root_t"):
        a, b = getattr(blk, f)(x), getattr(dense, f)(x)
        assert np.abs(a - b).max() <= 1e-12 * np.abs(b).max(), f
    assert blk.spread() == dense.spread() and blk.largest() == dense.largest() and blk.to_json() == dense.to_json()
    u = np.linalg.qr(np.random.default_rng(5).normal(size=(task.dim, 3)))[0]
    u = np.linalg.qr(u - blk.directions() @ (blk.directions().T @ u))[0]
    for m in (blk, blk.corrected(u, np.array([0.5, 2.0, 3.0]))):
        back = from_array(to_array(m), task.dim)
        assert type(back) is type(m) and type(back.base) is type(m.base)
        assert all(np.array_equal(getattr(back, f)(x), getattr(m, f)(x)) for f in ("apply", "apply_root", "apply_root_t"))
    # (t below the server's floor makes 1/t overflow; a huge t leaves M near 0 along v, where V's error of 1e-9, inside
    # a fixed tolerance, would make it indefinite)
    rot = np.eye(blk.t.size) + 1e-9 * np.random.default_rng(6).normal(size=(blk.t.size,) * 2)
    big = np.full_like(blk.t, 1e9)
    assert from_bytes(to_array(kb.Blocked(blk.kron, blk.qh, blk.v, big)).tobytes(), task.dim).t.max() == 1e9
    for bad in ({"qh": 2.0 * blk.qh}, {"v": blk.v + 1e-3}, {"t": -blk.t}, {"t": np.full_like(blk.t, 5e-324)},
                {"t": np.full_like(blk.t, 1e13)}, {"v": blk.v @ rot, "t": big}):
        arrays = {**blk.arrays(), **bad}
        with pytest.raises(MetricError, match="block-corrected Kronecker"):
            from_bytes(type("M", (kb.Blocked,), {"arrays": lambda self, a=arrays: a})(blk.kron, blk.qh, blk.v,
                                                                                      blk.t).to_bytes(), task.dim)
    from qlsd_flwr.core.metric_codec import older_block_form

    assert older_block_form(to_array(dense), blk, task.dim) and not older_block_form(to_array(blk), blk, task.dim)
    assert not older_block_form(to_array(kfac.corrected(u, np.ones(3))), kfac, task.dim)

