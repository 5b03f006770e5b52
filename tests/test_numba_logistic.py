"""The vectorised engine's compiled kernel on the logistic task (``backend="numba"``, on request).

Its gradient sums each row's products in its own order and takes libm's ``exp``; the reference
(:meth:`LogisticLocal.grad_sum`) calls BLAS and numpy's ``exp``. So the tests here hold the
kernel to the reference within bounds derived from float rounding, not bit for bit; everything
else in the kernel (streams, quantisation, memory, server step) is the code the Gaussian path
shares and is tested bit for bit in ``test_vectorised.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from qlsd_flwr.config import resolve
from qlsd_flwr.engines.vectorised import run_vectorised
from qlsd_flwr.engines.vectorised.kernel import _logistic_grad_rows
from qlsd_flwr.tasks.loading import load_task

U = np.finfo(np.float64).eps / 2  # the unit roundoff


def _cfg(**o):
    return resolve({"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-rounds": 200,
                    "burn-in": 50, "num-chains": 3, "engine": "vectorised", "progress": False,
                    "gamma": 1e-4, "l": 20, "seed": 4, "p": "0.7", **o})


@pytest.mark.parametrize("dataset, b", [("breast_cancer", 4), ("digits", 5)])
def test_the_compiled_logistic_gradient_is_the_reference_within_its_rounding_bound(dataset, b):
    # each coordinate is Σ_j x_jq r_jk with r = softmax − e_y. Both sides round the n products
    # and their sum (error ≤ γ_n Σ_j |x_jq||r_jk|, γ_n = n·u/(1 − n·u)) and compute r from
    # K logits of p+1 products each, an exp, a sum and a division; a logit error ε moves
    # softmax by at most 2ε relative, so |δr_jk| ≤ c·(p+1+K)·u·(|logits|+1)·(p_jk + [k=y]).
    # The bound below sums both sides' errors with c = 4.
    task = load_task(_cfg(dataset=dataset, **{"num-clients": b}))
    gen = np.random.default_rng(0)
    z = np.empty(task.clients[0].n_classes)
    checked = 0
    for pot in task.clients:
        X, y, K, p1 = pot.Xa, pot.y, pot.n_classes, pot.n_features + 1
        for scale in (0.01, 1.0):
            theta = gen.normal(scale=scale, size=pot.dim)
            W = theta.reshape(p1, K)
            for n in (1, max(1, pot.n_data // 3), pot.n_data):
                idx = np.sort(gen.choice(pot.n_data, n, replace=False))
                ref = pot.grad_sum(theta, idx)
                got = np.empty(pot.dim)
                _logistic_grad_rows(X, y, 0, idx, n, False, theta, K, z, got)
                logits = X[idx] @ W
                prob = np.exp(logits - logits.max(1, keepdims=True))
                prob /= prob.sum(1, keepdims=True)
                mag = prob + (np.arange(K) == y[idx][:, None])
                # |δr_jk| ≤ (p+1+K+8)·u·(max_k |logit_jk| + 1)·(p_jk + [k=y]), |logit| ≤ |x|·|W|
                row_err = (p1 + K + 8) * U * ((np.abs(X[idx]) @ np.abs(W)).max(1, keepdims=True) + 1)
                bound = 4 * ((n + 2) * U * (np.abs(X[idx]).T @ mag)
                             + np.abs(X[idx]).T @ (row_err * mag)).ravel()
                assert np.all(np.abs(got - ref) <= bound), (dataset, n, scale)
                checked += 1
    assert checked == 6 * b


@pytest.mark.parametrize("variant, prior_on", [("qlsd-pp", "server"), ("qlsd-pp", "clients"), ("lsd-pp", "server"),
                                               ("qlsd-star", "clients"), ("qlsd-sharp", "clients"), ("qlsd", "server")])
def test_the_compiled_logistic_chains_follow_the_reference_chains(variant, prior_on):
    # the numpy backend's chains are the reference (bit for bit the Flower engines'). The
    # compiled gradient differs from it by a few ulps (above), which the chains carry; the
    # task's Gaussian prior (variance 0.02) makes the posterior strongly log-concave, and at
    # this γ the Langevin map contracts, so the difference stays at the rounding scale. With
    # prior-on = clients the oracles' prior terms (w_i ∇U_0 at θ and at the anchor) are
    # exercised too. One quantised message can also round its float32 norm the
    # other way (chance ~2^24·1e-15 per message): ĝ then moves by 2^-24 relative, θ by about
    # γ·‖ĝ‖·2^-24 ≈ 1e-4·100·6e-8. The tolerance, 1e-8·max|θ|, covers that and is far below
    # what any wrong term would make (the chains move by ~1e-2 a round).
    cfg = _cfg(variant=variant, **{"prior-on": prior_on}, **({"theta-star": "optimise", "opt-accept-unconverged": True}
                                                             if variant == "qlsd-star" else {}))
    fast = run_vectorised(cfg, write=False, keep_trace=True, backend="numba")
    ref = run_vectorised(cfg, write=False, keep_trace=True, backend="numpy")
    assert fast.backend == "numba" and ref.backend == "numpy"
    assert fast.trace.shape == ref.trace.shape == (3, 200, 62)
    assert np.max(np.abs(fast.trace - ref.trace)) <= 1e-8 * np.max(np.abs(ref.trace))
    assert np.max(np.abs(ref.trace[:, -1] - ref.trace[:, 0])) > 1e-3  # the chains did move
    for key in ("bits_exact", "n_active"):  # the same messages and draws
        assert np.array_equal(getattr(fast.stats, key), getattr(ref.stats, key)), key


def test_auto_keeps_the_bitwise_numpy_backend_for_logistic_and_numba_names_what_it_needs():
    cfg = _cfg(**{"num-rounds": 5, "burn-in": 0})
    assert run_vectorised(cfg, write=False).backend == "numpy"
    with pytest.raises(ValueError, match="Gaussian task with dim >= 2 or the logistic task"):
        run_vectorised(resolve({"task": "mnist", "dataset": "mnist_subset", "model": "mlp", "num-clients": 2,
                                "num-rounds": 2, "burn-in": 0, "engine": "vectorised", "progress": False}),
                       write=False, backend="numba")


def test_the_run_config_key_chooses_the_backend(tmp_path):
    # engine = "vectorised" runs read vectorised-backend; a bad value is one line naming the key
    from qlsd_flwr.keys import ConfigError
    from qlsd_flwr.run.simulate import run

    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-rounds": 6, "burn-in": 0,
         "engine": "vectorised", "progress": False, "output-dir": str(tmp_path)}
    assert run({**o, "vectorised-backend": "numba", "run-name": "a"}).detail.backend == "numba"
    assert run({**o, "run-name": "b"}).detail.backend == "numpy"  # auto: the bitwise path here
    gauss = {"num-clients": 3, "dim": 4, "num-rounds": 6, "burn-in": 0, "engine": "vectorised", "progress": False,
             "output-dir": str(tmp_path)}
    assert run({**gauss, "run-name": "c"}).detail.backend == "numba"
    assert run({**gauss, "vectorised-backend": "numpy", "run-name": "d"}).detail.backend == "numpy"
    with pytest.raises(ConfigError, match="vectorised-backend: unknown value 'fast'; allowed: auto, numba, numpy"):
        resolve({"vectorised-backend": "fast"})


def test_a_checkpoint_resumes_only_on_its_backend_and_the_refusal_names_the_key(tmp_path, monkeypatch):
    # (bitwise kill-and-resume of this backend: test_reliability's case vectorised-numba-logistic)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    from test_reliability import run_and_kill

    from qlsd_flwr.run.simulate import run

    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-rounds": 40, "burn-in": 0,
         "engine": "vectorised", "progress": False, "output-dir": str(tmp_path), "run-name": "r",
         "vectorised-backend": "numba", "checkpoint-every": 4}
    run_and_kill(o, 20, block_rounds=4)
    with pytest.raises(ValueError, match=r"written by the numba backend, this run uses numpy; "
                                         r"set vectorised-backend = 'numba'"):
        run({"resume": str(tmp_path / "r"), "vectorised-backend": "numpy"})
    out = run({"resume": str(tmp_path / "r"), "vectorised-backend": "numba"})
    assert out.detail.backend == "numba" and out.summary["rounds"] == 40
