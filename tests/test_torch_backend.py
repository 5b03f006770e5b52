"""The vectorised engine's torch backend (``vectorised-backend = torch``): its parts against the numpy
reference, its chains against the numpy backend's and against a closed-form posterior, its outputs,
and what it refuses. These run on the CPU; ``benchmarks/bench_torch_backend.py --device cuda`` runs the
same comparisons on a GPU (``benchmarks/RESULTS.md``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.core import rng
from qlsd_flwr.engines.vectorised import torch_twins
from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.engines.vectorised import run_vectorised
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.tasks.torch_models import TorchPotential

CPU = torch.device("cpu")
MLP = {"task": "mnist", "dataset": "digits", "model": "mlp", "num-clients": 4, "engine": "vectorised",
       "progress": False, "num-chains": 2, "p": "0.7", "gamma": 1e-4, "batch-fraction": 0.2, "l": 7,
       "burn-in": 0, "loo": "off"}


def test_the_streams_are_the_references_bit_for_bit():
    seeds = np.array([0, 1, 12345, 2**40 + 3, 2**62 + 11], dtype=np.int64)
    clients = np.arange(7)
    for stream in (rng.Stream.PARTICIPATION, rng.Stream.MINIBATCH, rng.Stream.DITHER, rng.Stream.NOISE):
        ks = torch_twins.seed_keys(seeds, int(stream), CPU)
        for k in (0, 1, 99_999, 2**31 + 5):
            ref = rng.uniform(seeds[:, None], stream, k, clients[None, :], 33, offset=0)
            got = torch_twins.uniform(torch_twins.keys(ks, k, torch.as_tensor(clients)), 33).numpy()
            assert np.array_equal(ref.view(np.uint64), got.view(np.uint64)), (stream, k)
            assert np.all((got >= 0.0) & (got < 1.0))
        block = torch_twins.keys_block(ks, 99_998, 3, torch.as_tensor(clients))  # a block's keys at once
        assert torch.equal(block[1], torch_twins.keys(ks, 99_999, torch.as_tensor(clients)))
    ks = torch_twins.seed_keys(seeds, int(rng.Stream.MINIBATCH), CPU)
    for N, n in ((50, 7), (50, 49), (8, 8), (8, 20)):
        ref = rng.subset(seeds[:, None], rng.Stream.MINIBATCH, 3, clients[None, :], N, n)
        got = torch_twins.subset(torch_twins.keys(ks, 3, torch.as_tensor(clients)), N, n).numpy()
        assert np.array_equal(np.broadcast_to(ref, got.shape), got), (N, n)
    # the normals: the same uniforms through the device's log1p and cos (equal to a few ulps)
    ref = rng.normal(seeds, rng.Stream.NOISE, 4, 0, 1000)
    ks = torch_twins.seed_keys(seeds, int(rng.Stream.NOISE), CPU)
    got = torch_twins.normal(torch_twins.keys(ks, 4, torch.zeros(1, dtype=torch.int64))[:, 0], 1000).numpy()
    assert np.allclose(got, ref, rtol=1e-13, atol=1e-13)


def test_the_qsgd_twin_gives_the_references_levels_norms_and_code_lengths():
    gen = np.random.default_rng(3)
    V = gen.standard_normal((6, 500)) * np.exp(3 * gen.standard_normal((6, 1)))
    V[1, ::2] = 0.0  # gaps in the Elias code
    V[2] = 0.0  # C(0) = 0
    V[3] *= 1e-300  # a float32 norm that underflows: sent as zero
    U = gen.random(V.shape)
    for s in (1, 2, 16, 256):
        for enc in ("auto", "elias", "packed"):
            q = QSGD(s=s, encoding=enc)
            norms, levels = q.quantise_batch(V, U)
            n32, lv, ok = torch_twins.quantise(torch.as_tensor(V), torch.as_tensor(U), s)
            assert ok.all()
            assert np.array_equal(lv.numpy(), levels), (s, enc)
            assert np.array_equal(n32.numpy().view(np.uint32), norms.view(np.uint32))
            assert np.array_equal(torch_twins.dequantise(n32, lv, s).numpy(), q.dequantise_batch(norms, levels))
            code = torch_twins.CodeLength(500, s, enc, CPU)
            assert np.array_equal(code(lv).numpy(), q.code_length_bits_batch(levels)), (s, enc)
    V[4, 7] = np.nan  # the reference raises; the twin flags the row
    assert torch_twins.quantise(torch.as_tensor(V), torch.as_tensor(U), 4)[2].tolist() == [True] * 4 + [False, True]
    with pytest.raises(ValueError, match="allowed: auto, elias, packed"):
        torch_twins.CodeLength(10, 2, "rice", CPU)


def test_an_uncompressed_chain_follows_the_numpy_backend_within_float_rounding(tmp_path):
    # LSD++ (no quantisation), with a diagonal metric and a temperature (the step's general form; the plain
    # one runs in the tests below): the same draws, minibatches and steps; the gradients are the model's
    # float32 sums in vmap's order, so the chains agree to float32 rounding carried over the rounds (1e-5 of
    # |θ|'s scale bounds 30 rounds of relative errors of about 1e-7 a gradient at γ·L ≈ 0.1), not bit for bit
    m = np.exp(np.random.default_rng(1).uniform(-1.0, 1.0, 7510))  # a diagonal metric from a file (d = 7,510)
    np.save(tmp_path / "m.npy", m)
    cfg = resolve({**MLP, "variant": "lsd-pp", "num-rounds": 30, "metric": str(tmp_path / "m.npy"), "temperature": 0.9})
    t = run_vectorised(cfg, write=False, keep_trace=True, backend="torch")
    n = run_vectorised(cfg, write=False, keep_trace=True, backend="numpy")
    assert t.backend == "torch" and n.backend == "numpy"
    scale = np.max(np.abs(n.trace))
    assert np.max(np.abs(t.trace - n.trace)) <= 1e-5 * scale
    assert np.max(np.abs(n.trace[:, -1] - n.trace[:, 0])) > 1e-3 * scale  # the chains moved
    for key in ("n_active", "bits_exact"):  # the same participants and messages
        assert np.array_equal(getattr(t.stats, key), getattr(n.stats, key)), key


@pytest.mark.parametrize("over", [
    {"variant": "lsd-star", "theta-star": "optimise", "opt-rounds": 20, "opt-accept-unconverged": True},  # at θ*
    {"variant": "qlsd", "compressor": "identity", "prior-on": "clients"},  # the full oracle, the prior shared
    {"variant": "qlsd-sharp", "compressor": "identity", "aggregation": "active-fraction", "p": "0.3"},  # skips
], ids=["star", "full-prior-on-clients", "minibatch-active-fraction"])
def test_every_oracle_and_aggregation_follows_the_numpy_backend(over):
    # the other estimators and rules, uncompressed (as above: float rounding, the same messages and skips)
    cfg = resolve({**MLP, "num-rounds": 15, **over})
    t = run_vectorised(cfg, write=False, keep_trace=True, backend="torch")
    n = run_vectorised(cfg, write=False, keep_trace=True, backend="numpy")
    assert np.max(np.abs(t.trace - n.trace)) <= 1e-5 * np.max(np.abs(n.trace))
    for key in ("n_active", "bits_exact", "skipped"):
        assert np.array_equal(getattr(t.stats, key), getattr(n.stats, key)), key
    if over.get("aggregation"):
        assert n.stats.skipped.sum() > 0  # an empty round was skipped, in both


def _linear_gaussian(b=4, n=20, d=3, var=4.0, seed=0):
    """A linear-Gaussian model as torch potentials: ``U_ij = (x_jᵀθ − y_j)²/2``, prior N(0, var I). The
    posterior is N(m, A⁻¹) with ``A = Σ XᵀX + I/var``, ``m = A⁻¹ Σ Xᵀy``."""
    gen = np.random.default_rng(seed)
    Xs = [gen.standard_normal((n, d)) for _ in range(b)]
    ys = [X @ np.array([1.0, -2.0, 0.5]) + gen.standard_normal(n) for X in Xs]
    model = nn.Linear(d, 1, bias=False).double()

    def loss(out, y):
        return 0.5 * (out[:, 0] - y) ** 2

    pots = [TorchPotential(model, X, y, loss=loss) for X, y in zip(Xs, ys)]
    A = sum(X.T @ X for X in Xs) + np.eye(d) / var
    m = np.linalg.solve(A, sum(X.T @ y for X, y in zip(Xs, ys)))
    return Task(name="linear", dim=d, clients=pots, prior=GaussianPrior(var=var), theta_star=m,
                theta0=np.zeros(d)), m, A


def test_qlsd_pp_on_the_torch_backend_has_the_posterior_mean_of_a_linear_gaussian_model():
    # The potential is quadratic and every estimate unbiased (SVRG, QSGD, Bernoulli(p) with 1/p weights, the
    # memory), so the chain's stationary mean is m exactly, for any γ: the tolerance is its Monte Carlo
    # error alone (5 standard errors from batch means; the variance carries the step's bias, the mean none)
    task, m, A = _linear_gaussian()
    lam = np.linalg.eigvalsh(A)
    gamma = 0.1 / lam[-1]
    K, burn = 1500, 300
    cfg = resolve({"variant": "qlsd-pp", "s": "4", "p": "0.6", "num-clients": 4, "batch-fraction": 0.5,
                   "l": 5, "gamma": gamma, "num-rounds": K, "burn-in": 0, "num-chains": 4,
                   "engine": "vectorised", "progress": False, "prior-var": 4.0, "loo": "off"})
    res = run_vectorised(cfg, task=task, write=False, keep_trace=True, backend="torch")
    draws = res.trace[:, burn:]  # (C, K', d)
    tau = 1.0 / (gamma * lam[0])  # the slowest coordinate's relaxation time, in rounds
    batch = int(4 * tau)
    means = draws[:, : (draws.shape[1] // batch) * batch].reshape(draws.shape[0], -1, batch, 3).mean(axis=2)
    means = means.reshape(-1, 3)
    se = means.std(axis=0, ddof=1) / np.sqrt(means.shape[0])
    assert means.shape[0] >= 16
    assert np.all(np.abs(draws.mean(axis=(0, 1)) - m) <= 5 * se), (draws.mean(axis=(0, 1)), m, se)
    sd = np.sqrt(np.diag(np.linalg.inv(A)))
    assert np.all(se < 0.1 * sd)  # the check can fail: its error is a tenth of a posterior sd
    # the variance: the step inflates it by about γλ/2 ≤ 5 % (and QSGD's noise a little more); its Monte Carlo
    # error is about 11 % (≈ 160 effective draws), so [0.7, 1.45] is the bias plus three errors either side
    ratio = draws.var(axis=(0, 1)) / sd**2
    assert np.all((ratio > 0.7) & (ratio < 1.45)), ratio


def test_a_written_run_keeps_the_same_draws_as_the_trace_and_says_which_backend(tmp_path):
    o = {**MLP, "variant": "qlsd-pp", "s": "4", "num-rounds": 30, "burn-in": 10, "thin": 4,
         "output-dir": str(tmp_path), "run-name": "t", "convergence-criterion": "theta"}
    ref = run_vectorised(resolve(o), write=False, keep_trace=True, backend="torch")
    res = run_vectorised(resolve(o), write=True, backend="torch")
    kept = np.arange(30)[(np.arange(1, 31) > 10) & ((np.arange(1, 31) - 11) % 4 == 0)]
    assert np.array_equal(load_samples(res.run_dir), ref.trace[:, kept])
    assert res.summary["backend"] == "torch" and res.summary["torch_device"] == "cpu"
    assert res.summary["totals"]["bits_exact"] == int(ref.stats.bits_exact.sum())
    assert (res.run_dir / "metrics.csv").read_text().count("\n") == 31


def test_what_the_torch_backend_does_not_cover_is_refused_with_the_key():
    with pytest.raises(ValueError, match="metric = identity or diagonal"):
        run_vectorised(resolve({**MLP, "variant": "qlsd-pp", "num-rounds": 2, "metric": "dense"}),
                       write=False, backend="torch")
    with pytest.raises(ValueError, match="needs torch potentials"):
        run_vectorised(resolve({"engine": "vectorised", "num-rounds": 2, "burn-in": 0, "progress": False}), write=False,
                       backend="torch")
    with pytest.raises(ValueError, match="runs the QLSD family"):
        run_vectorised(resolve({**MLP, "variant": "fald", "num-rounds": 2}), write=False, backend="torch")
    # named from the configuration alone, so that auto on a GPU leaves encoding = arith to the numpy backend
    from qlsd_flwr.engines.vectorised import torch_scope
    from qlsd_flwr.tasks import loading

    cfg = resolve({**MLP, "variant": "qlsd-pp", "encoding": "arith"})
    assert "encoding = 'arith' runs on: auto, numpy" in torch_scope.unsupported(cfg, loading.load_task(cfg))
    cfg = resolve({**MLP, "variant": "qlsd-pp", "metric": "diagonal", "noise-correction": "metric"})
    assert "noise-correction = metric runs on: auto, numpy" in torch_scope.unsupported(cfg, loading.load_task(cfg))
    # on the CPU, auto keeps the numpy backend: its chains are the reference's bit for bit
    assert run_vectorised(resolve({**MLP, "variant": "qlsd-pp", "num-rounds": 2}), write=False).backend == "numpy"
    with pytest.raises(ConfigError, match="auto, numba, numpy, torch"):
        resolve({"vectorised-backend": "cuda"})


def test_cuda_without_a_gpu_is_an_error_not_a_fallback():
    if torch.cuda.is_available():  # this machine has a GPU: the error path is not reachable here
        assert run_vectorised(resolve({**MLP, "variant": "qlsd-pp", "num-rounds": 2, "device": "cuda"}),
                              write=False).backend == "torch"
        return
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        run_vectorised(resolve({**MLP, "variant": "qlsd-pp", "num-rounds": 2, "device": "cuda"}), write=False)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_checkpoint_array_of_another_shape_is_a_one_line_error_before_anything_is_restored(backend):
    # a damaged or foreign checkpoint (another num-chains, num-clients or model) must not reach the rounds as an
    # IndexError; ζ and ∇U_i(ζ), which a fresh runner does not hold yet, are checked against θ's shape too
    from qlsd_flwr.engines.vectorised.driver import Sequential, _parts, _restore
    from qlsd_flwr.engines.vectorised.numpy_backend import NumpyGeneric
    from qlsd_flwr.engines.vectorised.results import ChainStats
    from qlsd_flwr.engines.vectorised.torch_backend import TorchChains
    from qlsd_flwr.errors import CheckpointError
    from qlsd_flwr.tasks import loading

    cfg = resolve({**MLP, "variant": "qlsd-pp", "num-rounds": 4})
    task = loading.load_task(cfg)
    pt = _parts(cfg, task, write=False)
    st = ChainStats(2, task.dim)
    r = (TorchChains if backend == "torch" else NumpyGeneric)(cfg, task, *pt[:4], st, theta0=pt[4])
    good = {f"run_{n}": a for n, a in r.checkpoint_arrays().items()}
    good["run_zeta"] = good["run_theta"].copy()
    good["run_anchor_grad"] = np.zeros((2, 4, task.dim))
    _restore(Sequential([r]), st, good, {}, "ck.npz")  # the right shapes are taken
    for name in ("run_theta", "run_zeta", "run_anchor_grad", "run_eta_i"):
        bad = {**good, name: good[name][..., :5]}
        with pytest.raises(CheckpointError, match=rf"ck.npz: array '{name}' has shape .*, this run's is"):
            _restore(Sequential([r]), st, bad, {}, "ck.npz")
