"""The vectorised engine runs the same chain as the reference loop, bit for bit.

``run_local`` is the framework-free path already shown bitwise equal to the Flower paths; the
vectorised engine's chain 0 (seed ``seed + 0``) must equal its chain exactly
(``np.array_equal``: no tolerance), for every variant, on both backends, alone or side by
side with other configurations. The numba kernel's pieces (SplitMix64 subset draw, QSGD
quantisation, exact code lengths, numpy's pairwise norm) are also checked one by one against
the numpy functions the other engines use.
"""

import csv
import json

import numpy as np
import pytest

from qlsd_flwr.compression.codec import elias_bits, elias_bits_float
from qlsd_flwr.compression.format import QuantiseError
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.compression.qsgd_nb import quantise_block_nb, sumsq_nb
from qlsd_flwr.config import resolve
from qlsd_flwr.core import rng
from qlsd_flwr.engines import vectorised as V
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.engines.vectorised import numba_backend
from qlsd_flwr.tasks.gaussian import build_gaussian_task

TASK = build_gaussian_task(b=20, d=50, data_seed=0)

VARIANTS = [
    ({"variant": "qlsd-sharp", "s": "16"}, 300),
    ({"variant": "qlsd-star", "s": "256"}, 300),
    ({"variant": "qlsd-pp", "s": "16", "p": "0.5", "l": 50}, 300),
    ({"variant": "lsd-star"}, 300),
    ({"variant": "lsd-pp", "p": "0.25", "l": 50}, 300),
    ({"variant": "qlsd-sharp", "s": "256", "p": "0.25"}, 300),
    ({"variant": "qlsd", "s": "16"}, 300),  # the full-gradient oracle
    ({"variant": "qlsd", "s": "4", "p": "0.5"}, 300),
    ({"variant": "qlsd-star", "s": "16", "prior-var": 2.0, "prior-on": "server"}, 300),  # ∇U_0(θ) − ∇U_0(θ*)
    ({"variant": "qlsd-pp", "s": "16", "l": 30, "prior-var": 0.5, "prior-on": "server"}, 300),
]
_TASKS = {}


def task_for(over: dict):
    """The toy task, with the Gaussian prior the configuration names (built once)."""
    pv = over.get("prior-var")
    if pv not in _TASKS:
        _TASKS[pv] = build_gaussian_task(b=20, d=50, data_seed=0, **({} if pv is None else {"prior_var": pv}))
    return _TASKS[pv]


def _cfg(over: dict, K: int, chains: int = 1, **extra):
    return resolve({"num-rounds": K, "burn-in": K // 2, "seed": 3, "progress": False,
                    "num-chains": chains, "engine": "vectorised" if chains > 1 else "local",
                    **over, **extra})


@pytest.mark.parametrize("over, K", VARIANTS, ids=[
    f'{v["variant"]}-p{v.get("p", "1")}' + (f'-prior{v["prior-var"]}' if "prior-var" in v else "") for v, _ in VARIANTS])
def test_chain0_equals_reference_bitwise(over, K):
    task = task_for(over)
    ref = run_local(_cfg(over, K), task=task, write=False, keep_trace=True, progress=False)
    res = V.run_vectorised(_cfg(over, K, chains=2), task=task, write=False, keep_trace=True,
                           progress=False, backend="numba")
    assert res.backend == "numba"
    assert np.array_equal(res.trace[0], ref.trace)
    assert not np.array_equal(res.trace[1], ref.trace)  # chain 1 is another seed
    assert res.stats.subset_ties.sum() == 0


def test_numpy_backend_equals_reference_bitwise():
    # memory, partial participation (P(no client) = 0.92^20 ≈ 0.19 per round), active-fraction
    # rule, prior shared by the clients
    over = {"variant": "qlsd-pp", "s": "2", "p": "0.08", "l": 7, "aggregation": "active-fraction",
            "prior-var": 2.0, "prior-on": "clients"}
    task = build_gaussian_task(b=20, d=50, data_seed=0, prior_var=2.0)
    ref = run_local(_cfg(over, 80), task=task, write=False, keep_trace=True, progress=False)
    traces = {}
    for be in ("numpy", "numba"):
        res = V.run_vectorised(_cfg(over, 80, chains=2), task=task, write=False, keep_trace=True,
                               progress=False, backend=be)
        assert np.array_equal(res.trace[0], ref.trace), be
        traces[be] = res
    a, b = traces["numpy"], traces["numba"]  # every chain, the counts and the streamed statistics
    assert np.array_equal(a.trace, b.trace)
    for name in ("bits_exact", "bytes_payload", "n_active", "skipped", "sum_f", "sum_theta"):
        assert np.array_equal(getattr(a.stats, name), getattr(b.stats, name)), name
    assert a.stats.skipped.sum() > 0  # the active-fraction rule skipped some empty rounds


def test_one_dimension_runs_the_reference_chain():
    # at d = 1 numpy sums (b, 1) arrays over axis 0 pairwise; the kernel would not: auto picks numpy
    task = build_gaussian_task(b=20, d=1, data_seed=0)
    o = {"variant": "qlsd-pp", "s": "16", "dim": 1}
    ref = run_local(_cfg(o, 200), task=task, write=False, keep_trace=True, progress=False)
    res = V.run_vectorised(_cfg(o, 200, chains=2), task=task, write=False, keep_trace=True, progress=False)
    assert res.backend == "numpy" and np.array_equal(res.trace[0], ref.trace)
    with pytest.raises(ValueError, match="dim >= 2"):
        V.run_vectorised(_cfg(o, 10, chains=2), task=task, write=False, progress=False, backend="numba")


def test_side_by_side_equals_separate_runs():
    base = {"seed": 5}
    combos = [{"variant": "qlsd-sharp", "s": "16"}, {"variant": "qlsd-star", "s": "65536", "gamma": 2e-4},
              {"variant": "lsd-star"}, {"variant": "qlsd-pp", "s": "4", "l": 30}]
    cfgs = [_cfg({**base, **c}, 90, chains=3) for c in combos]
    many = V.run_side_by_side(cfgs, task=TASK, keep_trace=True, progress=False)
    for cfg, m in zip(cfgs, many):
        one = V.run_vectorised(cfg, task=TASK, write=False, keep_trace=True, progress=False)
        assert np.array_equal(one.trace, m.trace)
        assert np.array_equal(one.stats.bits_exact, m.stats.bits_exact)
    with pytest.raises(ValueError, match="differ in"):
        V.run_side_by_side([cfgs[0], _cfg({**base, **combos[1], "p": "0.5"}, 90, chains=3)], task=TASK)


def test_output_folder_and_metrics(tmp_path):
    import arviz as az

    over = {"variant": "qlsd-star", "s": "16", "output-dir": str(tmp_path)}
    cfg = _cfg({**over, "run-name": "vec", "thin": 3}, 60, chains=3)
    res = V.run_vectorised(cfg, task=TASK, progress=False)
    run = tmp_path / "vec"
    assert res.run_dir == run
    idata = az.from_netcdf(run / "samples.nc")
    post = idata.posterior["theta"]
    assert post.sizes["chain"] == 3 and post.sizes["theta_dim_0"] == 50
    assert post.sizes["draw"] == len(range(31, 61, 3)) == res.stats.n_kept
    assert (run / "config.json").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["engine"] == "vectorised" and summary["num_chains"] == 3
    assert summary["per_chain_round"]["n_active"] == 20.0
    # the streamed statistic equals the one computed from the stored draws
    f = np.linalg.norm(post.values, axis=-1).mean(axis=1)
    np.testing.assert_allclose(res.stats.mean_f(), f, rtol=1e-13)
    # one chain: metrics.csv agrees with the reference engine's, round by round
    single = _cfg({**over, "run-name": "one"}, 60)
    V.run_vectorised(single, task=TASK, progress=False)
    run_local(resolve({**single.raw, "run-name": "ref"}), task=TASK, progress=False)
    rows = {name: list(csv.DictReader(open(tmp_path / name / "metrics.csv"))) for name in ("one", "ref")}
    assert len(rows["one"]) == len(rows["ref"]) == 60
    for a, b in zip(rows["one"], rows["ref"]):
        for col in ("round", "n_active", "bits_exact", "bytes_payload"):
            assert int(float(a[col])) == int(float(b[col])), col
        assert float(a["bits_bound"]) == pytest.approx(float(b["bits_bound"]), rel=1e-12)


@pytest.mark.parametrize("encoding", ["auto", "elias", "packed"])
def test_kernel_counts_the_bits_of_every_encoding(encoding):
    # the numba kernel's bit and byte counts, through its own encoding mapping, equal the numpy
    # backend's (which calls QSGD.code_length_bits_batch), chain by chain and message by message
    over = {"variant": "qlsd-sharp", "s": "4", "p": "0.5", "encoding": encoding}
    a, b = (V.run_vectorised(_cfg(over, 40, chains=2), task=TASK, write=False, progress=False, backend=be)
            for be in ("numba", "numpy"))
    for name in ("bits_exact", "bytes_payload", "n_active"):  # integers: exactly
        assert np.array_equal(getattr(a.stats, name), getattr(b.stats, name)), name
    # the analytic bound is a float sum over 800 messages, added in another order by each backend
    np.testing.assert_allclose(a.stats.bits_bound, b.stats.bits_bound, rtol=800 * 2**-52)
    assert a.stats.bits_exact.sum() > 0


@pytest.mark.parametrize("encoding", ["auto", "elias", "packed"])
def test_compiled_quantise_and_code_length_match_qsgd(encoding):
    # the compiled twins the kernel calls, against QSGD's numpy reference: ĝ, levels, bits, errors
    gen = np.random.default_rng(0)
    for d in (1, 2, 7, 50, 129, 300):
        for s in (1, 2, 3, 15, 16, 255, 2**16, 2**20):
            comp = QSGD(s=s, encoding=encoding)
            for scale in (1e-30, 1.0, 1e30):
                v = gen.standard_normal(d) * scale * (gen.random(d) < 0.7)
                u = rng.uniform(7, rng.Stream.DITHER, s, d, d)
                norms, levels = comp.quantise_batch(v[None], u[None])
                ref = comp.dequantise_batch(norms, levels)[0]
                gh, lev, n32 = np.empty(d), np.empty(d), np.empty(1, np.float32)
                assert quantise_block_nb(v, u, s, lev, gh, n32) == 0
                assert np.array_equal(gh, ref) and np.array_equal(lev, levels[0])
                assert n32.view(np.uint32)[0] == norms[0, 0].view(np.uint32)
                bits = comp._packed_bits(d)
                if encoding != "packed":
                    eb = elias_bits(lev, np.array([d]))
                    assert elias_bits_float(lev, np.empty(d, np.int64)) == eb  # the kernel's twin
                    bits = eb if encoding == "elias" else min(eb, bits)
                assert bits == int(comp.code_length_bits_batch(levels)[0]), (d, s, scale)
    bad = np.array([1.0, np.nan])
    assert quantise_block_nb(bad, np.zeros(2), 4, np.empty(2), np.empty(2), np.empty(1, np.float32)) == \
        QuantiseError.NON_FINITE
    big = np.array([3e38, 3e38])
    assert quantise_block_nb(big, np.zeros(2), 4, np.empty(2), np.empty(2), np.empty(1, np.float32)) == \
        QuantiseError.NORM_OVERFLOW


def test_compiled_random_streams_match_rng():
    # keys, the dither's exact int→float conversion and the subset draw, against rng
    for seed, stream, k, i in ((9, 3, 0, 0), (9, 3, 17, 3), (4, 2, 12345, 19), (2**40, 4, 7, 0)):
        kk = np.uint64(rng.key_rc_nb(np.uint64(rng.key_seed_nb(np.uint64(seed), np.uint64(stream))), k, i))
        assert kk == rng.key(seed, stream, k, i)
    for k, i in ((0, 0), (17, 3), (12345, 19)):
        u, lo = np.empty(64), np.empty(64, np.int64)
        rng.dither_nb(rng.key(9, rng.Stream.DITHER, k, i), 64, u, lo)
        assert np.array_equal(u, rng.uniform(9, rng.Stream.DITHER, k, i, 64))
    buf = [np.empty(300, np.int64) for _ in range(5)]
    for N, n in ((2, 1), (10, 1), (10, 9), (31, 3), (198, 19), (300, 150), (300, 299)):
        for k in range(40):
            assert rng.subset_nb(rng.key(4, rng.Stream.MINIBATCH, k, 2), N, n, *buf) == 0
            assert np.array_equal(buf[4][:n], rng.subset(4, rng.Stream.MINIBATCH, k, 2, N, n))


def test_pairwise_norm_matches_numpy():
    gen = np.random.default_rng(1)
    for n in list(range(1, 140)) + [255, 256, 257, 1000, 4099, 100_003]:
        v = gen.standard_normal(n) * np.exp(gen.uniform(-20, 20, n))
        assert sumsq_nb(v, 0, n) == np.sum((v * v)[None], axis=-1)[0]


def test_noise_path_chosen_gives_the_reference_chain(monkeypatch):
    """Whichever Langevin-noise path the engine takes on this machine (the kernel's libm
    Box–Muller where it equals numpy's bit for bit, numpy otherwise: numba's and numpy's
    ``log1p``/``cos`` differ by 1 ulp on some CPUs), chain 0 is the reference chain; and the
    numpy fallback, forced, is too. What is tested is the chain, not which path ran."""
    cfg = _cfg({"variant": "qlsd-star", "s": "16"}, 50, chains=2)
    ref = run_local(_cfg({"variant": "qlsd-star", "s": "16"}, 50), task=TASK, write=False,
                    keep_trace=True, progress=False)
    a = V.run_vectorised(cfg, task=TASK, write=False, keep_trace=True, progress=False)
    assert np.array_equal(a.trace[0], ref.trace)
    if a.extra["noise"] == "kernel":  # taken only where its bits are numpy's, on fresh draws too
        seeds = np.arange(7, 10, dtype=np.uint64)
        got = np.empty((3, 999))
        rng.normal_rows_nb(seeds, np.uint64(int(rng.Stream.NOISE)), 11, 0, got)
        assert np.array_equal(got, rng.normal(seeds, rng.Stream.NOISE, 11, 0, 999))
    monkeypatch.setitem(numba_backend._NOISE_CHECK, "ok", False)
    b = V.run_vectorised(cfg, task=TASK, write=False, keep_trace=True, progress=False)
    assert b.extra["noise"] == "numpy"
    assert np.array_equal(b.trace, a.trace)


def test_diverging_chain_raises_like_the_reference():
    over = {"variant": "qlsd-star", "s": "16", "gamma": 0.01}  # γN ≈ 15: unstable
    with pytest.raises(ValueError, match="QSGD"):
        run_local(_cfg(over, 400), task=TASK, write=False, progress=False, wire=False)
    with pytest.raises(ValueError, match="QSGD"):
        V.run_vectorised(_cfg(over, 400, chains=2), task=TASK, write=False, progress=False)
