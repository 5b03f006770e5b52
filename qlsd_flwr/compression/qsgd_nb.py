"""The compiled (numba) twin of QSGD's quantise and dequantise, and of numpy's pairwise norm.

:meth:`qlsd_flwr.compression.qsgd.QSGD.quantise_batch` (numpy) is the reference; these run the
same floating-point operations in the same order, so they give the same bits (tested in
``tests/test_compression.py`` and ``tests/test_vectorised.py``). The one-vector ``QSGD.quantise``
of every client message and the vectorised engine's kernel call them.
"""

from __future__ import annotations

import math

import numpy as np
from qlsd_flwr.jit import njit

from qlsd_flwr.compression.format import QuantiseError

_NON_FINITE, _NORM_OVERFLOW = int(QuantiseError.NON_FINITE), int(QuantiseError.NORM_OVERFLOW)  # frozen into the code


@njit(cache=True)
def _sumsq_leaf_nb(a, lo, n):
    """numpy's pairwise sum of ``a[lo:lo+n]**2`` for ``n ≤ 128`` (8 accumulators)."""
    if n < 8:
        res = 0.0
        for i in range(n):
            x = a[lo + i]
            res += x * x
        return res
    r0 = a[lo] * a[lo]
    r1 = a[lo + 1] * a[lo + 1]
    r2 = a[lo + 2] * a[lo + 2]
    r3 = a[lo + 3] * a[lo + 3]
    r4 = a[lo + 4] * a[lo + 4]
    r5 = a[lo + 5] * a[lo + 5]
    r6 = a[lo + 6] * a[lo + 6]
    r7 = a[lo + 7] * a[lo + 7]
    i = 8
    m = n - (n % 8)
    while i < m:
        r0 += a[lo + i] * a[lo + i]
        r1 += a[lo + i + 1] * a[lo + i + 1]
        r2 += a[lo + i + 2] * a[lo + i + 2]
        r3 += a[lo + i + 3] * a[lo + i + 3]
        r4 += a[lo + i + 4] * a[lo + i + 4]
        r5 += a[lo + i + 5] * a[lo + i + 5]
        r6 += a[lo + i + 6] * a[lo + i + 6]
        r7 += a[lo + i + 7] * a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i] * a[lo + i]
        i += 1
    return res


@njit(cache=True)
def sumsq_nb(a, lo, n):
    """``np.sum(a[lo:lo+n]**2)`` bit for bit: numpy's pairwise sum on a contiguous row, leaves of
    at most 128 terms, split at ``n2 = n/2 − (n/2 mod 8)``. The recursion is unrolled onto an
    explicit stack (numba's on-disk cache mishandles recursive functions)."""
    if n <= 128:
        return _sumsq_leaf_nb(a, lo, n)
    s_lo = np.empty(64, np.int64)
    s_n = np.empty(64, np.int64)
    s_stage = np.empty(64, np.int64)
    s_left = np.empty(64, np.float64)
    s_lo[0] = lo
    s_n[0] = n
    s_stage[0] = 0
    sp = 1
    val = 0.0
    while sp > 0:
        t = sp - 1
        nn = s_n[t]
        if nn <= 128 or s_stage[t] == 2:
            if nn <= 128:
                val = _sumsq_leaf_nb(a, s_lo[t], nn)
            else:
                val = s_left[t] + val  # left + right
            sp -= 1
            if sp > 0 and s_stage[sp - 1] == 1:  # a left half is done: start the right half
                p = sp - 1
                s_left[p] = val
                s_stage[p] = 2
                n2 = s_n[p] // 2
                n2 -= n2 % 8
                s_lo[sp] = s_lo[p] + n2
                s_n[sp] = s_n[p] - n2
                s_stage[sp] = 0
                sp += 1
            continue
        n2 = nn // 2  # stage 0: descend into the left half
        n2 -= n2 % 8
        s_stage[t] = 1
        s_lo[sp] = s_lo[t]
        s_n[sp] = n2
        s_stage[sp] = 0
        sp += 1
    return val


@njit(cache=True, inline="always")
def _level(x, u, sf, norm64):
    """``ℓ = sign(x)(⌊r⌋ + 1{ξ < r − ⌊r⌋})``, ``r = min(|x|·s/‖v‖, s)``, as an exact float."""
    a = abs(x) * sf / norm64
    r = a if a < sf else sf
    fl = np.floor(r)
    lv = fl + (1.0 if u < r - fl else 0.0)
    return (0.0 - lv) if x < 0 else lv  # 0.0 - 0.0 = +0.0, as an int level 0


@njit(cache=True)
def quantise_block_nb(v, u, s, lev, gh, norm32_out):
    """One block of :meth:`QSGD.quantise_batch` then :meth:`QSGD.dequantise_batch`, compiled:
    the levels into ``lev`` (exact integers held as float64), ``ĝ`` into ``gh``, the float32 norm
    into ``norm32_out[0]``; returns a :class:`QuantiseError` value.

    The reference's float operations in its order: ``‖v‖`` in float64 by numpy's pairwise sum,
    ``r = min(|v|·s/‖v‖, s)``, ``ℓ = ⌊r⌋ + 1{ξ < r − ⌊r⌋}``, ``ĝ = float64(N32)·ℓ / s`` (for
    ``s = 2^p`` the product with ``2^-p``: the same correctly rounded number). The dither is not
    range-checked here (the callers draw it in ``[0, 1)``; :func:`quantise_row` checks a user's).
    """
    d = v.shape[0]
    norm64 = math.sqrt(0.0 + sumsq_nb(v, 0, d))
    if not math.isfinite(norm64):
        for q in range(d):
            if not math.isfinite(v[q]):
                return _NON_FINITE
    norm32 = np.float32(norm64)
    if not math.isfinite(norm32):
        return _NORM_OVERFLOW
    sf = np.float64(s)
    if norm32 > 0 and norm64 > 0:
        norm32_out[0] = norm32
        n32 = np.float64(norm32)
        # for s a power of 2, ``· (1/s)`` equals the reference's ``/ s`` bit for bit and is
        # faster; two loops keep that test out of the loop
        if (s & (s - 1)) == 0:
            inv_s = 1.0 / sf
            for q in range(d):
                lv = _level(v[q], u[q], sf, norm64)
                lev[q] = lv
                gh[q] = n32 * lv * inv_s
        else:
            for q in range(d):
                lv = _level(v[q], u[q], sf, norm64)
                lev[q] = lv
                gh[q] = n32 * lv / sf
    else:  # zero vector, or a norm that underflows float32: sent as zero
        norm32_out[0] = np.float32(0.0)
        for q in range(d):
            lev[q] = 0.0
            gh[q] = 0.0
    return 0


def quantise_row(v: np.ndarray, u: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`QSGD.quantise_batch` of one vector with one norm, compiled:
    ``(norms float32 (1,), levels int64)``, bit for bit; raises its ``ValueError``s."""
    if not (np.all(u >= 0.0) and np.all(u < 1.0)) and np.all(np.isfinite(v)):
        raise ValueError(QuantiseError.DITHER.message)
    lev = np.empty(v.shape[0])
    gh = np.empty(v.shape[0])
    norm32 = np.empty(1, dtype=np.float32)
    err = quantise_block_nb(v, u, s, lev, gh, norm32)
    if err:
        raise ValueError(QuantiseError(err).message)
    return norm32, lev.astype(np.int64)
