"""Counter-based streams: reproducible, order-free, vectorised identically, and uniform."""

import numpy as np
from scipy import stats

from qlsd_flwr.core import rng


def test_same_key_same_numbers_any_order():
    keys = [(k, i) for k in range(3) for i in range(4)]
    forward = {key: rng.uniform(7, rng.Stream.DITHER, *key, 5) for key in keys}
    backward = {key: rng.uniform(7, rng.Stream.DITHER, *key, 5) for key in reversed(keys)}
    for key in keys:
        np.testing.assert_array_equal(forward[key], backward[key])
    assert not np.array_equal(forward[(0, 0)], forward[(0, 1)])


def test_vectorised_equals_scalar_bitwise():
    rounds = np.arange(6)[:, None]
    clients = np.arange(5)[None, :]
    seeds = np.array([3, 4])[:, None, None]
    batch = rng.uniform(seeds, rng.Stream.MINIBATCH, rounds, clients, 9)
    for c, s in enumerate([3, 4]):
        for k in range(6):
            for i in range(5):
                np.testing.assert_array_equal(batch[c, k, i], rng.uniform(s, rng.Stream.MINIBATCH, k, i, 9))
    nb = rng.normal(seeds, rng.Stream.NOISE, rounds, clients, 4)
    np.testing.assert_array_equal(nb[1, 2, 3], rng.normal(4, rng.Stream.NOISE, 2, 3, 4))


def test_python_int_keys_equal_the_numpy_keys_bitwise():
    # rng.key takes Python ints (one stream per client message) without numpy; the array path is
    # the same SplitMix64 chain in uint64 arithmetic: the keys must agree bit for bit, wrap-around too
    vals = [0, 1, 7, 2**31 - 1, 2**32 + 5, 2**53 + 1, 2**63, 2**64 - 1]
    for stream in rng.Stream:
        for seed in vals:
            fast = np.array([[int(rng.key(seed, stream, r, c)) for c in vals] for r in vals], dtype=np.uint64)
            arrays = rng.key(np.uint64(seed), stream, np.array(vals, dtype=np.uint64)[:, None],
                             np.array(vals, dtype=np.uint64)[None, :])
            np.testing.assert_array_equal(fast, arrays)
    # one stream's uniforms run compiled (rng.unif_nb); a batch of streams runs numpy
    for seed, r, c, n, offset in ((0, 0, 0, 50, 0), (9, 17, 3, 7, 0), (2**40, 12345, 19, 300, 50),
                                  (2**64 - 1, 2**63, 5, 3, 2**40)):
        one = rng.uniform(seed, rng.Stream.DITHER, r, c, n, offset)
        batch = rng.uniform(np.uint64(seed), rng.Stream.DITHER, np.array([r], dtype=np.uint64),
                            np.array([c], dtype=np.uint64), n, offset)[0]
        np.testing.assert_array_equal(one.view(np.uint64), batch.view(np.uint64))


def test_streams_differ():
    u1 = rng.uniform(0, rng.Stream.DITHER, 0, 0, 100)
    u2 = rng.uniform(0, rng.Stream.NOISE, 0, 0, 100)
    u3 = rng.uniform(1, rng.Stream.DITHER, 0, 0, 100)
    u4 = rng.uniform(0, rng.Stream.DITHER, 1, 0, 100)
    u5 = rng.uniform(0, rng.Stream.DITHER, 0, 1, 100)
    for u in (u2, u3, u4, u5):
        assert not np.any(u1 == u)


def test_uniform_and_normal_distribution():
    # KS tests at level 1e-4 (deterministic seeds: a failure means a broken generator).
    u = rng.uniform(11, rng.Stream.DITHER, np.arange(200)[:, None], 0, 500).ravel()
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    z = rng.normal(11, rng.Stream.NOISE, np.arange(200)[:, None], 0, 500).ravel()
    assert stats.kstest(z, "norm").pvalue > 1e-4
    # neighbouring keys are uncorrelated: |corr| below 5 standard errors
    x = rng.uniform(0, rng.Stream.DITHER, np.arange(20000), 0, 1)[:, 0]
    y = rng.uniform(0, rng.Stream.DITHER, np.arange(20000), 1, 1)[:, 0]
    assert abs(np.corrcoef(x, y)[0, 1]) < 5 / np.sqrt(20000)


def test_subset_uniform_without_replacement():
    n_total, n, reps = 10, 3, 20000
    idx = rng.subset(5, rng.Stream.MINIBATCH, np.arange(reps), 2, n_total, n)
    assert idx.shape == (reps, n)
    assert np.all(np.diff(idx, axis=1) > 0)  # sorted and distinct
    counts = np.bincount(idx.ravel(), minlength=n_total)
    # each index is included with probability n/N: chi-square goodness of fit
    expected = np.full(n_total, reps * n / n_total)
    assert stats.chisquare(counts, expected).pvalue > 1e-4
    full = rng.subset(5, rng.Stream.MINIBATCH, 0, 0, 4, 4)
    np.testing.assert_array_equal(full, np.arange(4))
