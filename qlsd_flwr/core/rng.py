"""Counter-based random streams keyed by ``(seed, stream, round, client)``.

Every random number in a run is a pure function of its key and its position, never of
the order in which work happens. That is what makes a chain bitwise reproducible whatever
order Ray schedules clients in, and what lets the Flower path, the in-process path and the
vectorised engine draw *the same* numbers: they call the same functions here, the engine
just passes arrays of rounds/clients instead of scalars.

The generator is SplitMix64 (Steele, Lea & Flood 2014): the ``j``-th output of a stream with
key ``κ`` is ``mix(κ + (j+1)·G)``, with ``G`` the 64-bit golden-ratio increment and ``mix`` the
SplitMix64 finaliser. SplitMix64 passes BigCrush; keys are derived by chaining the same
finaliser over ``seed, stream, round, client``. The whole thing is vectorised numpy
``uint64`` arithmetic (wrapping modulo 2^64 by design).
"""

from __future__ import annotations

import math
from enum import IntEnum

import numpy as np
from qlsd_flwr.jit import njit

_G = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = (np.uint64(v) for v in (30, 27, 31, 11))
_TWO53 = 1.0 / 9007199254740992.0  # 2^-53
_TWO_PI = 2.0 * np.pi


class Stream(IntEnum):
    """Purposes of random draws; each gets an independent stream."""

    PARTICIPATION = 1  # X^(3,i): is client i active at round k
    MINIBATCH = 2  # X^(1,i): the minibatch S_i
    DITHER = 3  # X^(2,i): the QSGD dither ξ
    NOISE = 4  # Z_{k+1}: the Langevin noise (client index 0 by convention)
    INIT = 5  # θ_0 when drawn at random
    DATA = 6  # synthetic data generation
    LOCAL = 7  # local Langevin steps on a client (DG-LMC's z_i), client i, round k
    ADAPT = 8  # the warm-up chain of metric-from = adapt (its round r, client 0)
    REFRESH = 9  # VR-FALD*'s coin: does round k refresh the reference θ_r (client 0)
    DOWNLINK = 10  # the QSGD dither of the compressed broadcast C(θ_k − w_{k−1}) (client 0; core.downlink)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


_MASK = (1 << 64) - 1
_GI, _M1I, _M2I = int(_G), int(_M1), int(_M2)


def _mix_int(z: int) -> int:
    """``_mix`` on a Python int, modulo 2^64 (bit for bit the same)."""
    z = ((z ^ (z >> 30)) * _M1I) & _MASK
    z = ((z ^ (z >> 27)) * _M2I) & _MASK
    return z ^ (z >> 31)


def key(seed, stream, round_, client) -> np.ndarray:
    """The 64-bit key of stream ``(seed, stream, round, client)``; arguments broadcast."""
    if type(seed) is int and type(round_) is int and type(client) is int \
            and 0 <= min(seed, round_, client) and max(seed, round_, client) <= _MASK:
        # one stream (every client message draws two): Python ints, no numpy scalar overhead
        k = _mix_int((seed + _GI * int(stream)) & _MASK)
        k = _mix_int((k + _GI * (round_ + 1)) & _MASK)
        return np.uint64(_mix_int((k + _GI * (client + 1)) & _MASK))
    with np.errstate(over="ignore"):
        k = _mix(np.asarray(seed, dtype=np.uint64) + _G * np.uint64(int(stream)))
        k = _mix(k + _G * (np.asarray(round_, dtype=np.uint64) + np.uint64(1)))
        k = _mix(k + _G * (np.asarray(client, dtype=np.uint64) + np.uint64(1)))
    return k


@njit(cache=True)
def mix_nb(z):
    """``_mix`` compiled (numba, uint64 arithmetic): the same bits."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(cache=True)
def unif_nb(k, j):
    """The ``j``-th uniform (``j ≥ 1``) of the stream with key ``k``, as :func:`uniform`."""
    return np.float64(np.int64(mix_nb(k + _G * np.uint64(j)) >> np.uint64(11))) * _TWO53


@njit(cache=True)
def _uniform_row(k, offset, out):
    for j in range(out.shape[0]):
        out[j] = unif_nb(k, offset + j + 1)


def uniform(seed, stream, round_, client, n: int, offset: int = 0) -> np.ndarray:
    """``n`` uniforms in ``[0, 1)`` (53-bit), shape ``broadcast(round, client).shape + (n,)``.

    ``offset`` skips the first ``offset`` positions of the stream (so two calls with offsets
    0 and n give disjoint, consecutive parts of one stream). One stream (Python-int keys, as
    a client message draws) runs the compiled copy of the arithmetic; tests check the bits.
    """
    k = key(seed, stream, round_, client)
    if np.ndim(k) == 0 and type(offset) is int and offset >= 0:
        out = np.empty(n, dtype=np.float64)
        _uniform_row(k, offset, out)
        return out
    k = k[..., None]
    j = np.arange(offset + 1, offset + n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = _mix(k + _G * j)
    return (x >> _S11).astype(np.float64) * _TWO53


def normal(seed, stream, round_, client, n: int) -> np.ndarray:
    """``n`` standard normals by Box–Muller on positions ``[0, 2n)`` of the stream."""
    u = uniform(seed, stream, round_, client, 2 * n)
    r = np.sqrt(-2.0 * np.log1p(-u[..., :n]))  # 1-u ∈ (0, 1]: never log(0)
    return r * np.cos(_TWO_PI * u[..., n:])


def subset(seed, stream, round_, client, n_total: int, n: int) -> np.ndarray:
    """A uniform ``n``-subset of ``[0, n_total)`` without replacement, sorted (int64).

    Each index gets a uniform key; the subset is the ``n`` smallest keys, which is uniform
    over all ``n``-subsets. Vectorised over leading dimensions of ``round``/``client``.
    """
    if n >= n_total:
        shape = np.broadcast(np.asarray(round_), np.asarray(client)).shape
        return np.broadcast_to(np.arange(n_total, dtype=np.int64), shape + (n_total,))
    keys = uniform(seed, stream, round_, client, n_total)
    idx = np.argpartition(keys, n - 1, axis=-1)[..., :n]
    return np.sort(idx, axis=-1).astype(np.int64)


# ------------------------------------------------------------------------ compiled twins
# The vectorised engine's kernel draws the same numbers as the functions above, inside numba:
# these are their compiled twins, tested bit for bit against them (tests/test_rng.py).
_ONE = np.uint64(1)
_SH11 = np.uint64(11)
_MAGIC = np.uint64(0x4330000000000000)  # the bits of 2^52


@njit(cache=True)
def key_seed_nb(seed, stream):
    """``mix(seed + G·stream)``: the first link of :func:`key`."""
    return mix_nb(seed + _G * stream)


@njit(cache=True)
def key_rc_nb(kseed, round_, client):
    """:func:`key` from its first link, for ``(round, client)``."""
    k = mix_nb(kseed + _G * (np.uint64(round_) + _ONE))
    return mix_nb(k + _G * (np.uint64(client) + _ONE))


@njit(cache=True)
def normal_row_nb(k, out):
    """:func:`normal`'s Box–Muller on the stream with key ``k``, into ``out`` (n = ``len(out)``),
    with libm's ``log1p`` and ``cos``: these may differ from numpy's in the last bit on some
    CPUs, so the vectorised engine checks them against :func:`normal` before it uses them."""
    n = out.shape[0]
    for j in range(n):
        u1 = unif_nb(k, j + 1)
        u2 = unif_nb(k, n + j + 1)
        out[j] = math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(_TWO_PI * u2)


@njit(cache=True)
def normal_rows_nb(seeds, stream, round_, client, out):
    """:func:`normal_row_nb` for each seed's stream ``(seed, stream, round, client)``."""
    for c in range(seeds.shape[0]):
        normal_row_nb(key_rc_nb(key_seed_nb(seeds[c], stream), round_, client), out[c])


@njit(cache=True)
def dither_nb(kdither, d, u, ulo):
    """The QSGD dither ``ξ_j = X_j·2^-53`` (``X_j = mix(κ + j·G) >> 11``) of ``rng.uniform``.
    Converted exactly without a 64-bit int→float instruction (AVX2 has none):
    ``X = 2·X_h + X_l`` with ``X_h < 2^52`` read as the double ``bits(2^52) | X_h`` minus 2^52."""
    ub = u.view(np.uint64)
    z = kdither
    for q in range(d):
        z = z + _G
        x = mix_nb(z) >> _SH11
        ub[q] = (x >> _ONE) | _MAGIC
        ulo[q] = np.int64(x & _ONE)
    for q in range(d):
        u[q] = ((u[q] - 4503599627370496.0) * 2.0 + (1.0 if ulo[q] != 0 else 0.0)) * _TWO53


@njit(cache=True)
def subset_nb(kkey, N, n, keys, cand_i, cand_k, amb, sel):
    """The uniform ``n``-subset of ``[0, N)`` drawn by :func:`subset`, from the stream key ``kkey``.

    ``subset`` keeps the indices of the ``n`` smallest of ``N`` uniform keys. Uniforms
    are ``(x >> 11)·2^-53``, so comparing the integers ``x >> 11`` gives the same order.
    Keys up to ``hi`` (a few standard deviations above the ``n``-th order statistic) are
    gathered branch-free; those below ``lo`` (as far below) are surely kept; the ``n``-th
    smallest key ``kth`` is found by ranking only the keys in ``[lo, hi]``. The chosen
    indices go to ``sel[:n]`` in ascending order. Returns 1 when keys tie at the boundary (two
    of the 53-bit keys equal at the ``n``-th place, chance about ``N·2^-53``, where numpy's
    ``argpartition`` may break the tie differently), else 0.
    """
    z = kkey
    for j in range(N):  # position j+1 of the stream: mix(κ + (j+1)·G)
        z = z + _G
        keys[j] = np.int64(mix_nb(z) >> _SH11)
    margin = 1.5 * math.sqrt(n) + 1.5
    m = 0
    for tier in range(3):
        frac = (n + margin * (1 + 2 * tier)) / N
        if tier == 2 or frac >= 1.0:
            hi = np.int64(9007199254740992)
        else:
            hi = np.int64(frac * 9007199254740992.0)
        m = 0
        for j in range(N):
            cand_i[m] = j
            cand_k[m] = keys[j]
            m += np.int64(keys[j] <= hi)
        if m >= n:
            break
    lof = (n - margin) / N
    lo = np.int64(lof * 9007199254740992.0) if lof > 0.0 else np.int64(0)
    nlow = 0
    ma = 0
    for q in range(m):
        x = cand_k[q]
        amb[ma] = x
        ma += np.int64(x >= lo)
        nlow += np.int64(x < lo)
    if nlow > n:  # rare: rank every candidate
        lo = np.int64(0)
        nlow = 0
        for q in range(m):
            amb[q] = cand_k[q]
        ma = m
    need = n - nlow
    kth = lo - 1  # need == 0: exactly the keys below lo
    if need > 0:
        for a in range(ma):
            xa = amb[a]
            rank = 0
            for b_ in range(ma):
                rank += np.int64(amb[b_] < xa)
            kth = xa if rank == need - 1 else kth
    cnt = 0
    for q in range(m):
        sel[cnt] = cand_i[q]
        cnt += np.int64(cand_k[q] <= kth)
    return 1 if cnt != n else 0
