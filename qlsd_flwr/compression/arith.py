"""An adaptive arithmetic code of QSGD's levels: the compressed broadcast's code (``downlink = qsgd``; issue 37).

The broadcast's messages are dense: on the main job (``downlink-s = 128``, ``d = 7,850``) the levels of
``θ_k − w_{k−1}`` are mostly between 0 and 5. A Rice code (:mod:`.rice`) spends 2.88 bits a coordinate on them
where their order-0 entropy is 2.63, and no context (the metric's scale class, the previous level) lowers that
entropy (``benchmarks/bench_downlink_code.py``). An arithmetic code with an adaptive order-0 model reaches the
entropy to within the model's learning cost (about ``A/2 · log2 d`` bits a message for ``A`` symbols): the same
levels, so the same chain, in fewer bits.

**The model.** A level ``ℓ`` is coded as its magnitude ``|ℓ|``, then (where ``ℓ ≠ 0``) a sign bit of probability
½. Magnitudes ``0 … A − 2`` are symbols of their own and ``A − 1 = min(s, MAX_SYMBOL)`` is one more symbol;
where ``s > MAX_SYMBOL`` that last symbol is an escape, followed by ``e = |ℓ| − A + 2 ≥ 1`` as its bit length
``n + 1`` (``n`` a symbol of a second adaptive model of :data:`LENGTHS` symbols) and the ``n`` bits below its
leading one, uniform (as symbols of up to :data:`CHUNK` bits, most significant first). The magnitudes' frequencies start from a geometric shape whose parameter
``j`` (the bit length of the mean magnitude plus one, :data:`SHAPE_BITS` bits) the writer sends after the norms
(:func:`_prior`), the lengths' at 1; a coded symbol's frequency grows by :data:`INCREMENT`, and when the total passes
:data:`MAX_TOTAL` every frequency is halved (rounded up). Writer and reader update the same models, so no table is
sent; everything is integer arithmetic, so both sides (and any machine) agree bit for bit.

**The coder** is Witten, Neal & Cleary's (CACM 1987) 32-bit integer arithmetic coder: ``range · cum`` stays
below ``2^48`` since the total is at most ``2^16``. Its output is a bit stream, MSB first, after the blocks'
norms (float32 bits, 32 each) and ``j``, then zero padding to a byte; the layout follows :mod:`.format`'s 5-byte header
with tag :data:`~.format.TAG_ARITH`.

**Reading untrusted bytes.** Any bit string decodes to some sequence of ``d`` levels (the reader's interval
always holds its value), so a payload is accepted only if it is, byte for byte, the code the writer makes of what
it decoded, and its levels and norms pass QSGD's checks (:func:`~.codec._check`). The reader decides the first
without writing again: the prior's ``j`` must be the one the levels give, and the reader follows the
writer's interval, so it knows the writer's length (one bit a shift, two to end: :func:`_decode`'s ``shifts``) and its last bits (the settling bit and the pending ones, ``pending``); every
earlier bit is one the writer emitted when the interval lay in one half, which every value the reader could have
decoded these levels from shares. So the payload must have exactly that length, those last bits and zero padding
(trailing bytes, other padding and any other stream of these levels are refused; ``tests/test_arith.py`` holds
every accepted payload to the writer's bytes).
The reader's work is bounded: ``d`` symbols, each of at most 33 escape bits, and a
payload longer than :func:`max_bits` is refused before it is read.
"""

from __future__ import annotations

import struct

import numpy as np
from qlsd_flwr.jit import njit

from qlsd_flwr.compression.codec import _bit, _put, checked
from qlsd_flwr.compression.format import TAG_ARITH, DecodeError, DecodeFault

#: the largest magnitude with a symbol of its own (plus one: the escape, where ``s`` exceeds it)
MAX_SYMBOL = 63
#: how much a coded symbol's frequency grows, and the total above which every frequency is halved: the total
#: stays at most ``2^16``, so the model adapts to a message's statistics within a few hundred coordinates
INCREMENT = 24
MAX_TOTAL = 1 << 16
#: the magnitudes' model starts from a geometric shape (:func:`_prior`) of weight ``PRIOR_WEIGHT`` at 0, its
#: parameter ``j`` sent in ``SHAPE_BITS`` bits: a symbol's first use then costs a few bits instead of up to 16,
#: which is most of the learning cost on a message of a few hundred coordinates
PRIOR_WEIGHT = 256
SHAPE_BITS = 3
#: the escape's bit lengths ``n + 1``, ``n = 0 … 32``: a magnitude up to ``s ≤ 2^32`` has at most 33 bits
LENGTHS = 33
#: the ``n`` bits below an escape's leading one go as uniform symbols of up to this many bits (most significant
#: first): the same length as one bit at a time, in a sixteenth of the coder's steps for a 16-bit fixed-point row's
#: levels (:mod:`.fixed`); a symbol's total stays at most ``2^16``, as the models'
CHUNK = 16

_HALF, _QUARTER = 1 << 31, 1 << 30
_TOP = (1 << 32) - 1

(_OK, _ABOVE_S, _NOT_CANONICAL) = (int(DecodeFault.OK), int(DecodeFault.ABOVE_S), int(DecodeFault.NOT_CANONICAL))


def alphabet(s: int) -> int:
    """``A``: the number of magnitude symbols for ``s`` levels (``0 … A − 1``; the last an escape if ``s`` is above
    :data:`MAX_SYMBOL`)."""
    return int(min(int(s), MAX_SYMBOL)) + 1


# The coder's state lives in local integers (returned as tuples by functions Numba inlines), not in an array: each
# symbol then costs register arithmetic, about twice as fast as the array form of 2026-12-05 for the same bits
# (``benchmarks/RESULTS.md``, "The arithmetic coder's speed").
@njit(cache=True, inline="always")
def _code(buf, low, high, pending, p, lo, hi, total):
    """Narrow ``[low, high]`` to the cumulative frequencies ``[lo, hi)`` of ``total`` and write the settled bits at
    ``p``, each followed by the ``pending`` opposite bits; returns ``(low, high, pending, p)``."""
    rng = high - low + 1
    high = low + (rng * hi) // total - 1
    low = low + (rng * lo) // total
    while True:
        if high < _HALF:
            p += 1
            for _ in range(pending):  # a 0, then the pending 1s
                buf[p >> 3] |= np.uint8(0x80 >> (p & 7))
                p += 1
            pending = 0
        elif low >= _HALF:
            buf[p >> 3] |= np.uint8(0x80 >> (p & 7))  # a 1, then the pending 0s
            p += 1 + pending
            pending = 0
            low -= _HALF
            high -= _HALF
        elif low >= _QUARTER and high < _HALF + _QUARTER:
            pending += 1
            low -= _QUARTER
            high -= _QUARTER
        else:
            break
        low = 2 * low
        high = 2 * high + 1
    return low, high, pending, p


@njit(cache=True)
def _shape(levels):
    """The prior's parameter ``j``: the bit length of the mean magnitude (integer division) plus one, within
    ``[1, 2^SHAPE_BITS − 1]``."""
    t = 0
    for i in range(levels.shape[0]):
        t += abs(levels[i])
    m = t // max(levels.shape[0], 1) + 1
    j = 0
    while m:
        m >>= 1
        j += 1
    return min(max(j, 1), (1 << SHAPE_BITS) - 1)


@njit(cache=True)
def _prior(nsym, j):
    """The magnitudes' starting frequencies: ``PRIOR_WEIGHT`` at 0, each next ``f − ⌊f / 2^j⌋`` (a geometric
    shape of mean about ``2^j``, in integers), at least 1."""
    freq = np.ones(nsym, dtype=np.int64)
    f = PRIOR_WEIGHT
    total = 0
    for x in range(nsym):
        freq[x] = max(f, 1)
        total += freq[x]
        f = f - (f >> j)
    return freq, total


@njit(cache=True, inline="always")
def _update(freq, total, x):
    freq[x] += INCREMENT
    total += INCREMENT
    if total > MAX_TOTAL:
        total = 0
        for i in range(freq.shape[0]):
            freq[i] = (freq[i] + 1) // 2
            total += freq[i]
    return total


@njit(cache=True)
def _encode(levels, norm_bits, blocks, nsym, escape, buf):
    """Write the code into ``buf`` (zeroed, long enough); returns its length in bits."""
    p = 0
    for b in range(blocks.shape[0]):
        p = _put(buf, p, norm_bits[b], 32)
    j = _shape(levels)
    p = _put(buf, p, j, SHAPE_BITS)
    low, high, pending = 0, _TOP, 0
    freq, total = _prior(nsym, j)
    flen = np.ones(LENGTHS, dtype=np.int64)
    tlen = LENGTHS
    for j in range(levels.shape[0]):
        a = abs(levels[j])
        x = a if (not escape or a < nsym - 1) else nsym - 1
        lo = 0
        if x == nsym - 1:  # the last symbol (an escape, mostly): below it lies everything else
            lo = total - freq[x]
        else:
            for i in range(x):
                lo += freq[i]
        low, high, pending, p = _code(buf, low, high, pending, p, lo, lo + freq[x], total)
        total = _update(freq, total, x)
        if escape and x == nsym - 1:  # e = a − (A − 2) ≥ 1: its bit length, then the bits below its leading one
            e = a - (nsym - 2)
            n = 0
            while (e >> (n + 1)) > 0:
                n += 1
            lo = 0
            for i in range(n):
                lo += flen[i]
            low, high, pending, p = _code(buf, low, high, pending, p, lo, lo + flen[n], tlen)
            tlen = _update(flen, tlen, n)
            while n > 0:  # the bits below the leading one, up to CHUNK at a time as one uniform symbol
                k = min(n, CHUNK)
                n -= k
                v = (e >> n) & ((1 << k) - 1)
                low, high, pending, p = _code(buf, low, high, pending, p, v, v + 1, 1 << k)
        if a != 0:
            sign = 1 if levels[j] < 0 else 0
            low, high, pending, p = _code(buf, low, high, pending, p, sign, sign + 1, 2)
    # two more bits settle the interval: b, then pending + 1 bits !b
    if low < _QUARTER:
        p += 1
        for _ in range(pending + 1):
            buf[p >> 3] |= np.uint8(0x80 >> (p & 7))
            p += 1
    else:
        buf[p >> 3] |= np.uint8(0x80 >> (p & 7))
        p += 2 + pending
    return p


@njit(cache=True)
def _read(body, p):
    """Bit ``p`` of ``body``, 0 past its end (the reader's value register runs up to 32 bits ahead of the code)."""
    return _bit(body, p) if p < 8 * body.shape[0] else 0


@njit(cache=True)
def _field(body, p, nbits):
    """The ``nbits``-bit number at bit ``p`` (MSB first; :func:`_read`'s bits)."""
    v = 0
    for i in range(p, p + nbits):
        v = (v << 1) | _read(body, i)
    return v


@njit(cache=True, inline="always")
def _narrow(body, low, high, value, p, pending, lo, hi, total):
    """The reader's side of :func:`_code`: ``value`` the code's next 32 bits from ``p`` on, ``pending`` the writer's;
    returns ``(low, high, value, p, pending)``."""
    rng = high - low + 1
    high = low + (rng * hi) // total - 1
    low = low + (rng * lo) // total
    while True:
        if high < _HALF:
            pending = 0
        elif low >= _HALF:
            pending = 0
            low -= _HALF
            high -= _HALF
            value -= _HALF
        elif low >= _QUARTER and high < _HALF + _QUARTER:
            pending += 1
            low -= _QUARTER
            high -= _QUARTER
            value -= _QUARTER
        else:
            break
        low = 2 * low
        high = 2 * high + 1
        value = 2 * value + _read(body, p)
        p += 1
    return low, high, value, p, pending


@njit(cache=True, inline="always")
def _target(low, high, value, total):
    return ((value - low + 1) * total - 1) // (high - low + 1)


@njit(cache=True)
def _decode(body, blocks, s, nsym, escape, norm_bits, levels):
    """Fill ``norm_bits`` and ``levels`` from ``body``; returns ``(fault, bits)``: 0 and the writer's length in bits
    where ``body`` is the writer's code of them (module docstring), else the fault."""
    p = 0
    for b in range(blocks.shape[0]):
        norm_bits[b] = _field(body, p, 32)
        p += 32
    shape = _field(body, p, SHAPE_BITS)
    p += SHAPE_BITS
    if shape == 0:
        return _NOT_CANONICAL, 0
    start = p
    low, high, value, q, pending = 0, _TOP, _field(body, p, 32), p + 32, 0
    freq, total = _prior(nsym, shape)
    flen = np.ones(LENGTHS, dtype=np.int64)
    tlen = LENGTHS
    for j in range(levels.shape[0]):
        t = _target(low, high, value, total)
        x = 0
        lo = 0
        if t >= total - freq[nsym - 1]:  # the last symbol, without the scan (the scan ends there too)
            x, lo = nsym - 1, total - freq[nsym - 1]
        while x < nsym - 1 and lo + freq[x] <= t:
            lo += freq[x]
            x += 1
        low, high, value, q, pending = _narrow(body, low, high, value, q, pending, lo, lo + freq[x], total)
        total = _update(freq, total, x)
        a = x
        if escape and x == nsym - 1:
            t = _target(low, high, value, tlen)
            n = 0
            lo = 0
            while n < LENGTHS - 1 and lo + flen[n] <= t:
                lo += flen[n]
                n += 1
            low, high, value, q, pending = _narrow(body, low, high, value, q, pending, lo, lo + flen[n], tlen)
            tlen = _update(flen, tlen, n)
            e = 1
            while n > 0:
                k = min(n, CHUNK)
                n -= k
                v = min(_target(low, high, value, 1 << k), (1 << k) - 1)
                low, high, value, q, pending = _narrow(body, low, high, value, q, pending, v, v + 1, 1 << k)
                e = (e << k) | v
            a = e + nsym - 2
            if a > s:
                return _ABOVE_S, 0
        if a != 0:
            sign = 1 if _target(low, high, value, 2) >= 1 else 0
            low, high, value, q, pending = _narrow(body, low, high, value, q, pending, sign, sign + 1, 2)
            a = -a if sign else a
        levels[j] = a
    if shape != _shape(levels):  # the writer's prior is the one its levels give
        return _NOT_CANONICAL, 0
    # the writer's length and its last bits: one bit a shift, then the settling bit b and pending + 1 bits !b
    shifts = q - start - 32
    bits = start + shifts + 2
    if (bits + 7) // 8 != body.shape[0]:
        return _NOT_CANONICAL, 0
    b = 0 if low < _QUARTER else 1
    first = start + shifts - pending
    if _bit(body, first) != b:
        return _NOT_CANONICAL, 0
    for i in range(first + 1, bits):
        if _bit(body, i) == b:
            return _NOT_CANONICAL, 0
    for i in range(bits, 8 * body.shape[0]):
        if _bit(body, i):
            return _NOT_CANONICAL, 0
    return _OK, bits


def max_bits(s: int, blocks) -> int:
    """A bound on the code's length (norms and body), for the reader's length guard and buffers. After the norms and
    ``j`` the code has one bit a shift plus two, and the writer's range stays above ``2^30`` after each shift, so
    the shifts are at most ``−log2`` of the final interval's width over ``2^32``, which is at least ``Π f/T`` up to a
    factor ``1 − 2^−14`` a symbol: ``Σ log2(T/f)`` plus a hair, with each symbol's ``f ≥ 1`` out of ``T ≤ 2^16``
    (at most 16 bits; the sign 1, and an escape's chunk of ``k`` uniform bits ``k``). Allowed here: 17 a magnitude, 1 a sign, 17 an escape's
    length and 32 its bits."""
    d = int(sum(int(n) for n in blocks))
    per = 17 + 1 + (17 + LENGTHS - 1 if int(s) > MAX_SYMBOL else 0)
    return 32 * len(blocks) + SHAPE_BITS + d * per + 2


def _write(levels, norm_bits, blocks, s):
    levels = np.ascontiguousarray(levels, dtype=np.int64)
    if levels.size and int(np.max(np.abs(levels))) > int(s):  # the model has no symbol for it
        raise ValueError(f"arithmetic code: a level above s = {s}")
    nsym = alphabet(s)
    buf = np.zeros((max_bits(s, blocks) + 7) // 8 + 1, dtype=np.uint8)
    bits = _encode(levels, norm_bits, np.asarray(blocks, dtype=np.int64), nsym, int(s) > MAX_SYMBOL, buf)
    return buf[: (bits + 7) // 8], int(bits)


def write(levels, norm_bits, blocks, s: int) -> tuple[bytes, int]:
    """``(code ‖ padding, the code's length in bits)`` of ``levels`` (``Σ blocks`` signed integers, ``|ℓ| ≤ s``) after
    the blocks' 32-bit ``norm_bits`` (float32 bit patterns), no header: what a format with its own header carries
    (:mod:`.fixed`'s coded rows, a row a block and its scale the norm); :func:`decode` reads it back."""
    buf, bits = _write(levels, np.asarray(norm_bits, dtype=np.int64), blocks, s)
    return buf.tobytes(), bits


def code_bits(levels: np.ndarray, blocks, s: int) -> np.ndarray:
    """The exact length (norms and body, no header) of the code of each row of ``levels`` (``(..., d)``)."""
    levels = np.asarray(levels, dtype=np.int64)
    rows = levels.reshape(-1, levels.shape[-1])
    zeros = np.zeros(len(blocks), dtype=np.int64)  # the norms' bits do not change the length
    out = np.array([_write(r, zeros, blocks, s)[1] for r in rows], dtype=np.int64)
    return out.reshape(levels.shape[:-1])


def written(q) -> tuple[bytes, int]:
    """``(header ‖ code ‖ padding, the code's length in bits)`` of a :class:`~.qsgd.Quantised` message."""
    buf, bits = _write(q.levels, q.norms.view(np.uint32).astype(np.int64), q.blocks, q.s)
    return struct.pack("<BI", TAG_ARITH, q.d) + buf.tobytes(), bits


def encode(q) -> bytes:
    """``header ‖ code ‖ padding`` of a :class:`~.qsgd.Quantised` message."""
    return written(q)[0]


def decode(body: bytes, d: int, blocks, s: int):
    """``(norms float32, levels int64, bits)`` of a code body, validated as QSGD's other codes are
    (:func:`~.codec._check`) and accepted only as the writer's own code of what it holds; ``DecodeError``
    naming the fault otherwise."""
    if len(body) > (max_bits(s, blocks) + 7) // 8:
        raise DecodeError("payload longer than any arithmetic code the server writes for this d and s")
    blk = np.asarray(blocks, dtype=np.int64)
    norm_bits = np.zeros(blk.shape[0], dtype=np.int64)
    levels = np.zeros(d, dtype=np.int64)
    raw = np.frombuffer(body, dtype=np.uint8)
    err, bits = _decode(raw, blk, int(s), alphabet(s), int(s) > MAX_SYMBOL, norm_bits, levels)
    norms, levels = checked(err, norm_bits, levels, blk, s)
    return norms, levels, bits
