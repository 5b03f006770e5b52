"""The QSGD wire format, laid out and read in Python: the reference for the compiled writer and
reader of :mod:`qlsd_flwr.compression.codec` (tested equal byte for byte and error for error).

``payload = header ‖ code ‖ zero padding to a whole byte``; the header is ``HEADER_BYTES = 5``
bytes (40 bits, *not* counted by ``code_length_bits``):

* byte 0: encoding tag, ``0x01`` packed, ``0x02`` Elias;
* bytes 1-4: ``d`` as little-endian uint32 (so a wrong ``d`` is always detected).

The code is one segment per block, in block order, bits written MSB first:
``segment_b = norm_b (32 bits, binary32 big-endian) ‖ body_b``.

* ``"packed"`` (dense regime): ``body_b`` = for each coordinate, 1 sign bit (1 = negative,
  0 for level 0) then ``|ℓ_j|`` in ``⌈log2(s+1)⌉`` bits. Length: ``32·n_blocks + d(1 + ⌈log2(s+1)⌉)``.
* ``"elias"`` (QSGD's sparse code, Theorem 3.2): ``body_b = ω(K_b + 1)`` (``K_b`` the number of
  nonzero levels of the block: a count, not an end marker), then for each nonzero coordinate in
  increasing position: ``ω(gap)`` (gap to the previous nonzero, positions 1-based within the
  block, so the first gap is the position itself), 1 sign bit, ``ω(|ℓ_j|)``
  (:mod:`qlsd_flwr.compression.elias`).
* ``"auto"``: the shorter of the two codes (packed on a tie).

Decoding accepts either tag, checks every field (lengths, ``d``, finite non-negative norms,
``|ℓ| ≤ s``, no ``−0`` level, zero norm ⇒ zero levels, count/positions inside the block,
zero padding, no trailing bytes) and raises ``DecodeError`` otherwise. Accepted payloads are
canonical: re-encoding with the same tag gives the same bytes. Work is ``O(d + len(payload))``
on any input: payloads longer than the longest possible code are rejected up front and every
Elias omega read is capped by the largest value the field may take.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.compression.elias import (
    _TW,
    _interleave,
    _omega_fields,
    _omega_table,
    _read_omega,
)
from qlsd_flwr.compression.format import DecodeError, DecodeFault

_BITCHARS = bytes.maketrans(b"\x00\x01", b"01")


def packed_fields(q, level_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The packed code as fields ``(values, lengths)``, one row per field, in order."""
    levels, nb = q.levels, len(q.blocks)
    starts = np.cumsum((0,) + q.blocks[:-1])
    ent_v = ((levels < 0).astype(np.int64) << level_bits) | np.abs(levels)
    ent_l = np.full(q.d, 1 + level_bits, dtype=np.int64)
    return _interleave(starts, q.norms.view(np.uint32).astype(np.int64)[:, None],
                       np.full((nb, 1), 32, dtype=np.int64), ent_v[:, None], ent_l[:, None])


def elias_fields(q) -> tuple[np.ndarray, np.ndarray]:
    """The Elias code as fields ``(values, lengths)`` (rows of ``_G + 1`` omega slots)."""
    blocks, levels, nb = q.blocks, q.levels, len(q.blocks)
    starts = np.cumsum((0,) + blocks[:-1])
    pos = np.flatnonzero(levels)
    prev = np.empty_like(pos)
    if pos.size:
        prev[0] = -1
        prev[1:] = pos[:-1]
    if nb > 1:
        blk = np.searchsorted(np.cumsum(blocks), pos, side="right")
        prev = np.maximum(prev, starts[blk] - 1)
    gv, gl = _omega_fields(pos - prev)
    mag = levels[pos]
    lv, ll = _omega_fields(np.abs(mag))
    ent_v = np.concatenate([gv, (mag < 0).astype(np.int64)[:, None], lv], axis=1)
    ent_l = np.concatenate([gl, np.ones((pos.size, 1), dtype=np.int64), ll], axis=1)
    first = np.searchsorted(pos, starts)  # index of each block's first nonzero
    cv, cl = _omega_fields(np.diff(np.append(first, pos.size)) + 1)
    width = ent_v.shape[1]
    hdr_v = np.zeros((nb, width), dtype=np.int64)
    hdr_l = np.zeros((nb, width), dtype=np.int64)
    hdr_v[:, 0] = q.norms.view(np.uint32)
    hdr_l[:, 0] = 32
    hdr_v[:, 1:1 + cv.shape[1]] = cv
    hdr_l[:, 1:1 + cl.shape[1]] = cl
    return _interleave(first, hdr_v, hdr_l, ent_v, ent_l)


def check_fields(norms: np.ndarray, levels: np.ndarray, blocks: tuple[int, ...], s: int) -> None:
    """The checks of a decoded message that the readers leave to the end."""
    if not np.all(np.isfinite(norms)):
        raise DecodeError(DecodeFault.NONFINITE.message)
    if np.any(np.signbit(norms)):
        raise DecodeError(DecodeFault.NEG_NORM.message)
    if np.any(np.abs(levels) > s):
        raise DecodeError(f"level above s = {s}")
    dead = np.repeat(norms == 0, blocks)
    if np.any(dead & (levels != 0)):
        raise DecodeError(DecodeFault.ZERO_NORM.message)


def read_packed(body: bytes, d: int, blocks, level_bits: int):
    """``(norms, levels, bits)`` of a packed body (Python reference)."""
    lb = level_bits
    w = 1 + lb
    nbits = 32 * len(blocks) + d * w
    bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8))
    if bits[nbits:].any():
        raise DecodeError(DecodeFault.PADDING.message)
    bsz = np.asarray(blocks, dtype=np.int64)
    off = np.concatenate([[0], np.cumsum(32 + bsz * w)[:-1]])
    nidx = off[:, None] + np.arange(32)
    nval = bits[nidx].astype(np.int64) @ (np.int64(1) << np.arange(31, -1, -1, dtype=np.int64))
    norms = nval.astype(np.uint32).view(np.float32)
    starts = np.concatenate([[0], np.cumsum(bsz)[:-1]])
    coff = np.repeat(off + 32 - starts * w, blocks) + np.arange(d, dtype=np.int64) * w
    f = bits[coff[:, None] + np.arange(w)].astype(np.int64) @ (np.int64(1) << np.arange(w - 1, -1, -1, dtype=np.int64))
    mag = f & ((1 << lb) - 1)
    neg = (f >> lb) == 1
    if np.any(neg & (mag == 0)):
        raise DecodeError(DecodeFault.NEG_ZERO.message)
    return norms, np.where(neg, -mag, mag), nbits


def read_elias(body: bytes, d: int, blocks, s: int):
    """``(norms, levels, bits)`` of an Elias body (Python reference)."""
    bs = np.unpackbits(np.frombuffer(body, dtype=np.uint8)).tobytes().translate(_BITCHARS).decode("ascii")
    t = len(bs)
    bsp = bs + "0" * _TW  # lets the fast path slice a full window near the end
    tab_v, tab_l = _omega_table()
    tw = _TW
    norm_bits = []
    levels = np.zeros(d, dtype=np.int64)
    p = 0
    start = 0
    for n in blocks:
        if p + 32 > t:
            raise DecodeError(DecodeFault.TRUNC_NORM.message)
        norm_bits.append(int(bs[p:p + 32], 2))
        p += 32
        count, p = _read_omega(bs, p, n + 1)
        k = count - 1
        pos = 0
        idx = []
        val = []
        for _ in range(k):
            # gap: table fast path when the code ends inside the window and the payload
            w = int(bsp[p:p + tw], 2)
            ln = tab_l[w]
            if ln and p + ln <= t and tab_v[w] <= n - pos:
                g = tab_v[w]
                p += ln
            else:
                g, p = _read_omega(bs, p, n - pos)
            pos += g
            if p >= t:
                raise DecodeError(DecodeFault.TRUNC_SIGN.message)
            neg = bs[p] == "1"
            p += 1
            w = int(bsp[p:p + tw], 2)
            ln = tab_l[w]
            if ln and p + ln <= t and tab_v[w] <= s:
                lev = tab_v[w]
                p += ln
            else:
                lev, p = _read_omega(bs, p, s)
            idx.append(start + pos - 1)
            val.append(-lev if neg else lev)
        if idx:
            levels[idx] = val
        start += n
    if (p + 7) // 8 != len(body):
        raise DecodeError(DecodeFault.TRAILING.message)
    if "1" in bs[p:]:
        raise DecodeError(DecodeFault.PADDING.message)
    return np.array(norm_bits, dtype=np.uint32).view(np.float32), levels, p
