"""Compiled (numba) bit writer and reader for the QSGD wire format of :mod:`.wire`.

Every client message is encoded once and every reply decoded once, in Python, on the
federated path; at d = 50 that Python (fields laid out with numpy, an omega table walked
bit by bit) was the largest share of our per-message cost on Flower's engine. These kernels
write and read the very same codes, bit for bit, with the same checks and the same
``DecodeError`` messages; :mod:`.wire` keeps the numpy/Python implementation as the
reference, and ``tests/test_compression.py`` checks that the two agree on valid messages of
every layout and on hostile payloads.

Bits are written MSB first; see :mod:`.wire` for the layout.
"""

from __future__ import annotations

import numpy as np
from qlsd_flwr.jit import njit

from qlsd_flwr.compression.elias import _omega_small_nb, omega_len_nb
from qlsd_flwr.compression.format import DecodeError, DecodeFault

# the decoding kernels return a DecodeFault value (0 = valid); plain ints, frozen into the code
(_OK, _TRUNC_OMEGA, _ABOVE, _TRUNC_NORM, _TRUNC_SIGN, _TRAILING, _PADDING, _NEG_ZERO,
 _NONFINITE, _NEG_NORM, _ABOVE_S, _ZERO_NORM) = (int(f) for f in DecodeFault if f <= DecodeFault.ZERO_NORM)


@njit(cache=True)
def _bitlen(x):
    c = 0
    while x:
        x >>= 1
        c += 1
    return c


@njit(cache=True)
def _put(buf, p, val, nbits):
    for j in range(nbits - 1, -1, -1):
        if (val >> j) & 1:
            buf[p >> 3] |= np.uint8(0x80 >> (p & 7))
        p += 1
    return p


@njit(cache=True)
def _put_omega(buf, p, n, stack):
    m = 0
    while n > 1:
        stack[m] = n
        m += 1
        n = _bitlen(n) - 1
    for g in range(m - 1, -1, -1):
        p = _put(buf, p, stack[g], _bitlen(stack[g]))
    return p + 1  # the terminating 0


@njit(cache=True)
def elias_bits(levels, blocks):
    """Exact length of the Elias code of ``levels`` (int64, or exact integers held as float64)
    cut into ``blocks``: what :func:`encode_body` writes, and what the vectorised engine counts."""
    bits = 0
    start = 0
    for b in range(blocks.shape[0]):
        n = blocks[b]
        k = 0
        prev = 0
        for j in range(n):
            lv = levels[start + j]
            if lv != 0:
                k += 1
                bits += omega_len_nb(j + 1 - prev) + 1 + omega_len_nb(abs(lv))
                prev = j + 1
        bits += 32 + omega_len_nb(k + 1)
        start += n
    return bits


@njit(cache=True)
def elias_bits_float(lev, nzpos):
    """:func:`elias_bits` of one block whose levels are exact integers held as float64 (the
    vectorised kernel's form), branch-free: ``bitlen(|ℓ|)`` is read off the float's exponent and
    the nonzero positions are gathered without a branch (``nzpos``: scratch of length ``d``).
    Measured: 3 of the kernel's 16 µs per chain-iteration with the generic loop, not with this."""
    d = lev.shape[0]
    lb = lev.view(np.uint64)
    body = 0
    for q in range(d):
        e = np.int64((lb[q] >> np.uint64(52)) & np.uint64(0x7FF))
        isnz = np.int64(e != 0)
        bl = (e - 1022) * isnz + (1 - isnz)
        body += isnz * (1 + bl + _omega_small_nb(bl - 1))
    nz = 0
    for q in range(d):
        nzpos[nz] = q
        nz += np.int64((lb[q] << np.uint64(1)) != 0)
    prev = -1
    for t in range(nz):
        gap = nzpos[t] - prev
        prev = nzpos[t]
        body += omega_len_nb(gap)
    return body + 32 + omega_len_nb(nz + 1)


@njit(cache=True)
def encode_body(levels, norm_bits, blocks, level_bits, mode):
    """The code of a quantised vector: ``(body uint8, elias?, bits)``. ``mode``: 0 packed,
    1 Elias, 2 the shorter (packed on a tie). ``norm_bits`` are the float32 norms' bit
    patterns (int64)."""
    d = levels.shape[0]
    nb = blocks.shape[0]
    packed_bits = 32 * nb + d * (1 + level_bits)
    elias = mode == 1
    bits = packed_bits
    if mode != 0:
        eb = elias_bits(levels, blocks)
        if mode == 1 or eb < packed_bits:
            elias = True
            bits = eb
    buf = np.zeros((bits + 7) // 8, dtype=np.uint8)
    stack = np.zeros(8, dtype=np.int64)
    p = 0
    start = 0
    for b in range(nb):
        n = blocks[b]
        p = _put(buf, p, norm_bits[b], 32)
        if elias:
            k = 0
            for j in range(n):
                if levels[start + j] != 0:
                    k += 1
            p = _put_omega(buf, p, k + 1, stack)
            prev = 0
            for j in range(n):
                lv = levels[start + j]
                if lv != 0:
                    p = _put_omega(buf, p, j + 1 - prev, stack)
                    p = _put(buf, p, 1 if lv < 0 else 0, 1)
                    p = _put_omega(buf, p, abs(lv), stack)
                    prev = j + 1
        else:
            for j in range(n):
                lv = levels[start + j]
                p = _put(buf, p, ((1 if lv < 0 else 0) << level_bits) | abs(lv), 1 + level_bits)
        start += n
    return buf, elias, p


@njit(cache=True)
def _bit(body, p):
    return (body[p >> 3] >> (7 - (p & 7))) & 1


@njit(cache=True)
def _read_omega(body, t, p, maxval):
    """One Elias omega integer at bit ``p``, required in ``[1, maxval]``: ``(n, p, error)``."""
    n = 1
    while True:
        if p >= t:
            return 0, p, _TRUNC_OMEGA
        if _bit(body, p) == 0:
            p += 1
            break
        q = p + n + 1
        if q > t:
            return 0, p, _TRUNC_OMEGA
        if n + 1 > 62:  # the group starts with a 1, so its value is ≥ 2^n > any maxval here
            return 0, q, _ABOVE
        v = 0
        for j in range(p, q):
            v = (v << 1) | _bit(body, j)
        n = v
        p = q
        if n > maxval:
            return 0, p, _ABOVE
    if n > maxval:
        return 0, p, _ABOVE
    return n, p, _OK


@njit(cache=True)
def _decode_elias(body, blocks, s, norm_bits, levels):
    """Fill ``norm_bits`` and ``levels``; returns ``(error, maxval of the failing read, bits)``."""
    t = 8 * body.shape[0]
    p = 0
    start = 0
    for b in range(blocks.shape[0]):
        n = blocks[b]
        if p + 32 > t:
            return _TRUNC_NORM, 0, p
        v = 0
        for j in range(p, p + 32):
            v = (v << 1) | _bit(body, j)
        norm_bits[b] = v
        p += 32
        count, p, e = _read_omega(body, t, p, n + 1)
        if e:
            return e, n + 1, p
        pos = 0
        for _ in range(count - 1):
            g, p, e = _read_omega(body, t, p, n - pos)
            if e:
                return e, n - pos, p
            pos += g
            if p >= t:
                return _TRUNC_SIGN, 0, p
            neg = _bit(body, p)
            p += 1
            lev, p, e = _read_omega(body, t, p, s)
            if e:
                return e, s, p
            levels[start + pos - 1] = -lev if neg else lev
        start += n
    if (p + 7) // 8 != body.shape[0]:
        return _TRAILING, 0, p
    for j in range(p, t):
        if _bit(body, j):
            return _PADDING, 0, p
    return _OK, 0, p


@njit(cache=True)
def _decode_packed(body, blocks, level_bits, norm_bits, levels):
    """The packed code (its length already checked); returns ``(error, 0, bits)``."""
    nbits = 32 * blocks.shape[0] + levels.shape[0] * (1 + level_bits)
    for j in range(nbits, 8 * body.shape[0]):
        if _bit(body, j):
            return _PADDING, 0, nbits
    mask = (np.int64(1) << level_bits) - 1
    p = 0
    start = 0
    neg_zero = False
    for b in range(blocks.shape[0]):
        v = 0
        for j in range(p, p + 32):
            v = (v << 1) | _bit(body, j)
        norm_bits[b] = v
        p += 32
        for j in range(blocks[b]):
            f = 0
            for _ in range(1 + level_bits):
                f = (f << 1) | _bit(body, p)
                p += 1
            mag = f & mask
            if f >> level_bits:
                neg_zero |= mag == 0
                levels[start + j] = -mag
            else:
                levels[start + j] = mag
        start += blocks[b]
    return (_NEG_ZERO if neg_zero else _OK), 0, nbits


@njit(cache=True)
def _check(norm_bits, levels, blocks, s):
    """``QSGD._check`` on bit patterns, in its order: finite norms, non-negative norms,
    ``|ℓ| ≤ s``, zero norm ⇒ zero levels."""
    for b in range(norm_bits.shape[0]):
        if (norm_bits[b] >> 23) & 0xFF == 0xFF:
            return _NONFINITE
    for b in range(norm_bits.shape[0]):
        if norm_bits[b] >> 31:
            return _NEG_NORM
    for j in range(levels.shape[0]):
        if abs(levels[j]) > s:
            return _ABOVE_S
    start = 0
    for b in range(norm_bits.shape[0]):
        if norm_bits[b] == 0:
            for j in range(start, start + blocks[b]):
                if levels[j] != 0:
                    return _ZERO_NORM
        start += blocks[b]
    return _OK


def checked(err: int, norm_bits: np.ndarray, levels: np.ndarray, blocks: np.ndarray, s: int):
    """A dense code's reading (:mod:`.rice`, :mod:`.arith`) finished: QSGD's checks (:func:`_check`) where the reader
    found no fault, ``DecodeError`` naming the fault otherwise; ``(norms float32, levels)``."""
    if not err:
        err = _check(norm_bits, levels, blocks, s)
    if err == _ABOVE_S:
        raise DecodeError(f"level above s = {s}")
    if err:
        raise DecodeError(DecodeFault(err).message)
    return norm_bits.astype(np.uint32).view(np.float32), levels


def decode_body(body: bytes, d: int, blocks: np.ndarray, s: int, elias: bool,
                level_bits: int) -> tuple[np.ndarray, np.ndarray, int] | str:
    """``(norms float32, levels int64, bits read)`` of a code body that passed its length
    checks, validated as ``QSGD._check`` does; or the error message ``QSGD`` raises."""
    norm_bits = np.zeros(blocks.shape[0], dtype=np.int64)
    levels = np.zeros(d, dtype=np.int64)
    raw = np.frombuffer(body, dtype=np.uint8)
    if elias:
        err, maxval, p = _decode_elias(raw, blocks, s, norm_bits, levels)
    else:
        err, maxval, p = _decode_packed(raw, blocks, level_bits, norm_bits, levels)
    if not err:
        err = _check(norm_bits, levels, blocks, s)
    if err == _ABOVE:
        return f"Elias omega value above its maximum {maxval}"
    if err == _ABOVE_S:
        return f"level above s = {s}"
    if err:
        return DecodeFault(err).message
    return norm_bits.astype(np.uint32).view(np.float32), levels, int(p)
