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

from enum import IntEnum

import numpy as np
from numba import njit

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
