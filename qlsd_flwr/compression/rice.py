"""Rice codes of QSGD's levels: the compressed broadcast's code (``downlink = qsgd``; issue 37).

QSGD's Elias code (:mod:`.codec`) is built for sparse messages: a nonzero level costs the Elias omega codes
of its gap and of its magnitude plus a sign, at least 4 bits. The broadcast's messages are dense: on the main
job (``downlink-s = 256``, ``d = 7,850``) 86 % of the levels of ``θ_k − w_{k−1}`` are nonzero, mostly between 1
and 5, and the Elias code spends 4.71 bits a coordinate where the levels' order-0 entropy is 3.59 (measured
over 149 broadcasts, ``benchmarks/bench_downlink_code.py``). A Rice code with one parameter a block fits that
shape: 3.76 bits a coordinate there, the same levels, so the same chain, in 20 % fewer bits.

Layout (bits MSB first, after :mod:`.format`'s 5-byte header with tag :data:`~.format.TAG_RICE`), block by
block: the block's norm (float32 bits, 32), the parameter ``k`` (:data:`K_BITS` bits, ``k ≤ bitlen(s)``), then
for each coordinate with level ``ℓ``: ``⌊|ℓ|/2^k⌋`` ones and a zero, the ``k`` low bits of ``|ℓ|``, and a sign
bit (1: negative) when ``ℓ ≠ 0``; zero padding to a byte. The writer picks each block's ``k`` as the one with
the shortest code (the smallest on a tie), so :func:`code_bits` is exact. The reader checks every field as it
goes: a truncated field, ``k`` above ``bitlen(s)``, a level above ``s``, trailing bytes or nonzero padding is a
``DecodeError`` with a message; its work is bounded by the payload's length, itself checked against
:func:`max_bits` first.
"""

from __future__ import annotations

import struct

import numpy as np
from qlsd_flwr.jit import njit

from qlsd_flwr.compression.codec import _bit, _put, checked
from qlsd_flwr.compression.format import TAG_RICE, DecodeError, DecodeFault

#: bits of a block's parameter ``k`` (up to 31, above ``bitlen(s)`` for any ``s ≤ 2^32``)
K_BITS = 5

(_OK, _TRUNC_NORM, _TRUNC_SIGN, _TRAILING, _PADDING, _ABOVE_S, _TRUNC_RICE, _ABOVE_K) = (
    int(DecodeFault.OK), int(DecodeFault.TRUNC_NORM), int(DecodeFault.TRUNC_SIGN), int(DecodeFault.TRAILING),
    int(DecodeFault.PADDING), int(DecodeFault.ABOVE_S), int(DecodeFault.TRUNC_RICE), int(DecodeFault.ABOVE_K))


def kmax(s: int) -> int:
    """The largest ``k`` a block may use: ``bitlen(s)`` (then every level's quotient is 0 or 1)."""
    return int(s).bit_length()


@njit(cache=True)
def _block_bits(levels, start, n, k):
    bits = 0
    for j in range(start, start + n):
        a = abs(levels[j])
        bits += (a >> k) + 1 + k + (1 if a != 0 else 0)
    return bits


@njit(cache=True)
def _choose(levels, blocks, top):
    """Each block's ``k`` (the shortest code, the smallest on a tie) and the code's length in bits."""
    ks = np.zeros(blocks.shape[0], dtype=np.int64)
    total = 0
    start = 0
    for b in range(blocks.shape[0]):
        n = blocks[b]
        best = _block_bits(levels, start, n, 0)
        for k in range(1, top + 1):
            bits = _block_bits(levels, start, n, k)
            if bits < best:
                best, ks[b] = bits, k
        total += 32 + K_BITS + best
        start += n
    return ks, total


@njit(cache=True)
def _encode(levels, norm_bits, blocks, top):
    ks, bits = _choose(levels, blocks, top)
    buf = np.zeros((bits + 7) // 8, dtype=np.uint8)
    p = 0
    start = 0
    for b in range(blocks.shape[0]):
        k = ks[b]
        p = _put(buf, p, norm_bits[b], 32)
        p = _put(buf, p, k, K_BITS)
        for j in range(start, start + blocks[b]):
            a = abs(levels[j])
            for _ in range(a >> k):
                buf[p >> 3] |= np.uint8(0x80 >> (p & 7))
                p += 1
            p += 1  # the quotient's terminating 0
            p = _put(buf, p, a & ((np.int64(1) << k) - 1), k)
            if a != 0:
                p = _put(buf, p, 1 if levels[j] < 0 else 0, 1)
        start += blocks[b]
    return buf, p


@njit(cache=True)
def _decode(body, blocks, s, top, norm_bits, levels):
    """Fill ``norm_bits`` and ``levels``; returns ``(error, bits)``."""
    t = 8 * body.shape[0]
    p = 0
    start = 0
    for b in range(blocks.shape[0]):
        if p + 32 + K_BITS > t:
            return _TRUNC_NORM, p
        v = 0
        for j in range(p, p + 32):
            v = (v << 1) | _bit(body, j)
        norm_bits[b] = v
        p += 32
        k = 0
        for j in range(p, p + K_BITS):
            k = (k << 1) | _bit(body, j)
        p += K_BITS
        if k > top:
            return _ABOVE_K, p
        qmax = s >> k
        for j in range(start, start + blocks[b]):
            q = 0
            while True:
                if p >= t:
                    return _TRUNC_RICE, p
                one = _bit(body, p)
                p += 1
                if one == 0:
                    break
                q += 1
                if q > qmax:
                    return _ABOVE_S, p
            if p + k > t:
                return _TRUNC_RICE, p
            r = 0
            for i in range(p, p + k):
                r = (r << 1) | _bit(body, i)
            p += k
            a = (q << k) | r
            if a > s:
                return _ABOVE_S, p
            if a != 0:
                if p >= t:
                    return _TRUNC_SIGN, p
                levels[j] = -a if _bit(body, p) else a
                p += 1
        start += blocks[b]
    if (p + 7) // 8 != body.shape[0]:
        return _TRAILING, p
    for j in range(p, t):
        if _bit(body, j):
            return _PADDING, p
    return _OK, p


def code_bits(levels: np.ndarray, blocks, s: int) -> np.ndarray:
    """The exact length (norms and body, no header) of the Rice code of each row of ``levels`` (``(..., d)``)."""
    levels = np.asarray(levels, dtype=np.int64)
    blk = np.asarray(blocks, dtype=np.int64)
    rows = levels.reshape(-1, levels.shape[-1])
    out = np.array([_choose(np.ascontiguousarray(r), blk, kmax(s))[1] for r in rows], dtype=np.int64)
    return out.reshape(levels.shape[:-1])


def max_bits(s: int, blocks) -> int:
    """The longest code the writer makes for these blocks (a decoder guard, and a bound): at ``k = bitlen(s)``
    every quotient is 0, so a level costs at most ``bitlen(s) + 2`` bits, and the writer picks the shortest
    ``k``. A longer payload (another ``k``'s long unary runs) is refused before it is read."""
    return int(sum(32 + K_BITS + int(n) * (kmax(s) + 2) for n in blocks))


def encode(q) -> bytes:
    """``header ‖ code ‖ padding`` of a :class:`~.qsgd.Quantised` message."""
    buf, _ = _encode(np.ascontiguousarray(q.levels, dtype=np.int64), q.norms.view(np.uint32).astype(np.int64),
                     np.asarray(q.blocks, dtype=np.int64), kmax(q.s))
    return struct.pack("<BI", TAG_RICE, q.d) + buf.tobytes()


def decode(body: bytes, d: int, blocks, s: int):
    """``(norms float32, levels int64, bits)`` of a Rice code body, validated as QSGD's other codes are
    (:func:`~.codec._check`); ``DecodeError`` naming the fault otherwise."""
    if len(body) > (max_bits(s, blocks) + 7) // 8:
        raise DecodeError("payload longer than any Rice code the server writes for this d and s")
    blk = np.asarray(blocks, dtype=np.int64)
    norm_bits = np.zeros(blk.shape[0], dtype=np.int64)
    levels = np.zeros(d, dtype=np.int64)
    err, p = _decode(np.frombuffer(body, dtype=np.uint8), blk, int(s), kmax(s), norm_bits, levels)
    norms, levels = checked(err, norm_bits, levels, blk, s)
    return norms, levels, int(p)
