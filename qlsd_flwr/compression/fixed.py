"""How the preparation's blocks of vectors and Hessian-vector products travel (issue 37): fixed-point rows, or
float32 where a row's entries span too many scales.

A message is one tag byte, :data:`NARROW` (12), :data:`BITS` (16) or 32, then its rows:

* **16** — each row ``v`` of ``d`` numbers as its scale ``σ = max_j |v_j|`` (float32, rounded up so that no
  level overflows) and ``d`` signed levels ``round(v_j L / σ)``, ``L = 2^15 − 1``, read back as
  ``level · σ / L`` (multiplied, then divided: the largest entry reads back as ``σ`` exactly, so a row sent
  again is the same row). Each coordinate is within ``σ / 2L`` of ``v_j``: for a dense row of ``d = 7,850``
  numbers whose largest is four times their root mean square, a relative error of about ``3e-5`` in norm, at
  ``16 d + 32`` bits a row instead of float32's ``32 d``.
* **12** — the same with ``L = 2^11 − 1``, two levels (each offset by ``2^11``) in three bytes, the last padded
  with a zero level: ``24 ⌈d/2⌉ + 32`` bits a row, each coordinate within ``σ / 2L``, 16 times 16 bits' error.
  The θ* descent's gradients take it where that error is within its stopping rule's allowance
  (:class:`qlsd_flwr.protocol.descent.DescentWidth`).
* **32** — each row as float32: a relative error of ``6e-8`` on every entry, however small. The power
  iteration's row uses it where the metric's scales span more than :data:`SPREAD_16` (its product sets the step,
  and a metric whose scales span ``1e10`` made 16-bit rows lose the stiff coordinates: λ_max 3× too small;
  :func:`qlsd_flwr.protocol.curvature_exchange.products_in`), and so do the correction's blocks (the entries of
  ``M^½ x`` then span more than ``√SPREAD_16 = 1,000``, and a coordinate 1,000 times below its row's largest is
  within 1.5 % in 16 bits).

**Coded** (since 2026-12-05 afternoon; issue 37) — at 12 and 16 bits the writer sends the same scales and levels in
:mod:`.arith`'s adaptive arithmetic code where that is shorter: tag ``CODED | bits`` (``0x8C``, ``0x90``), the row
count (uint32), then the code, a row a block and its scale the block's norm. The levels are the raw layout's, so the
rows read back are the same numbers, in fewer bits: a product or gradient row's levels spread over many scales (a
coordinate whose input pixel is always 0 has level 0; the rest lie between 1 and ``L``), and on the main job the
clients' products take 0.57 of their raw bits, the descent's 12-bit gradients 0.48, the server's blocks of vectors 0.90
(``benchmarks/bench_preparation.py``). One message, one code: the writer sends the shorter (the raw layout on a
tie), and a reader refuses the other (a raw message whose code would have been shorter, a code not shorter than its
raw layout), so every engine counts a message's bits as the writer's bytes (:func:`sent_bits`). A coded message's
rows are at most ``max_rows`` (or its body's bits over 32), checked before a level is read.

**On a support** (since 2026-12-07; issue 37) — tag bit :data:`ON` (``0x40``): only the coordinates ``cols`` of
each row (a client's own, whose products read nothing else), each row at its whole row's scale, so that every
coordinate reads back as it would in the whole row; the reader names its coordinates and gets 0 elsewhere. Its rows
need not reach level ``L``, so a reader holds them to the writer's message of these scales and levels (a row whose
levels are all 0 has scale 0).

A row that is not finite (or beyond float32's range) travels with a NaN scale (12, 16) or NaN values (32), which
every reader refuses: a client's failed product is refused and counted by the server on every engine alike.

Why 16 bits is enough for the correction, measured (offline, the main job's exact Hessian at the MAP, every
client's product rounded as it would travel, the K-FAC metric corrected by ``metric-rank = 150``;
``benchmarks/bench_lowrank_exchanges.py --bits``, RESULTS "Products as 16-bit rows"): the corrected metric's
condition number is 9.653 with float32 rows both ways, 9.654 with 16 bits and 9.65–9.70 with 12, but **63** with
8-bit products or blocks: the correction must resolve the bottom of the spectrum (``λ_min(B) = 0.035``, where the
product of a direction is 100× smaller than the row's largest part), and 8 bits bury it. **12 bits where the metric's
scales span at most** :data:`SPREAD_12` (since 2026-12-07; issue 37): on the main job (spread 5.9e4) its 12-bit blocks
and products, against 16-bit ones, left λ_max at 2.183 (2.182), the predictive's TV to the HMC reference 1.45× its
halves' (1.38× at 16; seeds 1 and 2 at 16: 1.46×, 1.43×, so within the Monte Carlo spread) and the verdict MIXED, for
6.6e7 fewer bits both ways (``benchmarks/RESULTS.md``, "The preparation at 12 bits"). Above it, 16 bits keep a
coordinate ``√spread`` below its row's largest within ``√spread/2L`` (1.5 % at ``SPREAD_16``).

Both ends round the same way (:func:`rounded` is ``decode(encode(x))`` without the bytes), so every engine, the
direct ones included, uses the very numbers Flower carries, and the server multiplies its own part (the
prior's curvature) by the block the clients received.
"""

from __future__ import annotations

import struct

import numpy as np

from qlsd_flwr.compression import arith
from qlsd_flwr.compression.format import DecodeError

#: bits a level of a fixed-point row: 16 (12 measured nearly the same on the main job, 8 not; module docstring)
BITS = 16
LEVELS = 2 ** (BITS - 1) - 1
#: the narrow width, two levels in three bytes: the θ* descent's gradients where its stopping rule allows, and the
#: preparation's blocks and products where the metric's scales span at most :data:`SPREAD_12`
#: (:class:`qlsd_flwr.protocol.descent.DescentWidth`)
NARROW = 12
#: a metric whose scales span more than this sends the correction's blocks as float32 rows (module docstring)
SPREAD_16 = 1e6
#: and 12-bit rows where they span at most this (measured, module docstring)
SPREAD_12 = 1e5
WIDTHS = (NARROW, BITS, 32)
#: a coded message's tag is its width's with this bit set (module docstring)
CODED = 0x80
#: and with this one for rows on a support (:func:`encode`'s ``cols``: a client's own coordinates), each row's scale
#: that of the whole row, so that every coordinate reads back as it would in the whole row
ON = 0x40
_CODED_HEAD = struct.Struct("<BI")  # tag, rows
_LEVEL = np.dtype("<i2")
_FLOAT = np.dtype("<f4")


def row_bits(d: int, bits: int = BITS) -> int:
    """The code length of one row of ``d`` numbers: a float32 scale and ``d`` levels (at :data:`NARROW`, two in three
    bytes, the last padded), or ``d`` float32 numbers."""
    return 8 * _row_bytes(int(d), bits)


def _row_bytes(d: int, bits: int) -> int:
    if bits not in WIDTHS:
        raise ValueError(f"fixed-point rows: bits must be one of {WIDTHS}, got {bits}")
    return 4 * d if bits == 32 else 4 + 2 * d if bits == BITS else 4 + 3 * (-(-d // 2))


def message_bits(rows: int, d: int, bits: int = BITS) -> int:
    """A message of ``rows`` rows in the raw layout: its tag byte and the rows (the most a message of ``rows`` rows
    costs; :func:`sent_bits` is what one does)."""
    return 8 + int(rows) * row_bits(d, bits)


def sent_bits(X, bits: int = BITS, cols=None) -> int:
    """The bits of :func:`encode` ``(X, bits, cols)``: what the message carrying these rows costs, coded or raw. Rows
    that were read back (:func:`rounded`, :func:`decode`) give their own message's bytes again, so an engine that
    never writes them counts what Flower carries."""
    return 8 * len(encode(X, bits, cols))


def width_for(spread: float) -> int:
    """The width of the preparation's blocks of vectors and products (``metric-rank``'s and ``λ_max``'s) for a metric
    whose scales span ``spread``: 12 bits up to :data:`SPREAD_12`, 16 up to :data:`SPREAD_16`, float32 beyond (module
    docstring; :func:`qlsd_flwr.protocol.curvature_exchange.products_in`)."""
    spread = float(spread)
    return NARROW if spread <= SPREAD_12 else BITS if spread <= SPREAD_16 else 32


def _top(bits: int) -> int:
    """The largest level of a fixed-point row ``bits`` wide: ``L = 2^{bits−1} − 1``."""
    return 2 ** (int(bits) - 1) - 1


def max_error(bits: int) -> float:
    """An entry's largest rounding error at width ``bits``, relative to its row's largest ``σ``: ``1/2L`` in a
    fixed-point row, float32's ``2⁻²⁴`` (of the entry itself, so at most of ``σ``), 0 at 64 (float64 as it is)."""
    return 0.0 if bits == 64 else 2.0 ** -24 if bits == 32 else 1.0 / (2 * _top(bits))


def quotient_bound(spread: float, d: int, bits: int, clients: int = 1) -> float:
    """How far, relative to ``λ_max``, rounding ``u = M^½ v`` and the ``clients``' products ``∇²U_i u`` to rows of
    ``bits`` can move the quotient ``vᵀ M^½ Σ_i ∇²U_i u`` for a unit ``v``, where each ``∇²U_i`` is positive
    semi-definite (below the whole): each of the ``d`` entries of a row is within ``σ/2L`` of its largest ``σ``
    (float32: ``2⁻²⁴`` of itself), ``‖u‖ ≤ √m_max`` and each ``σ_{h_i} ≤ λ_max/√m_min``, so ``u``'s rounding and each
    product's move it by at most ``√(spread d)/2L``: ``(1 + clients) √(spread d)/2L`` in all (:func:`max_error`). A
    client whose curvature is not semi-definite (a network's) has no such bound."""
    return (1 + int(clients)) * float(np.sqrt(float(spread) * int(d))) * max_error(bits)


def _scales(X: np.ndarray) -> np.ndarray:
    s = np.max(np.abs(X), axis=1) if X.shape[1] else np.zeros(X.shape[0])
    bad = ~(np.isfinite(s) & (s <= np.finfo(np.float32).max))
    s32 = np.where(bad, 0.0, s).astype(_FLOAT)
    low = s32.astype(np.float64) < np.where(bad, 0.0, s)  # float32 rounded down: one step up, so |v_j| / σ ≤ 1
    s32[low] = np.nextafter(s32[low], np.float32(np.inf))
    s32[bad] = np.nan  # a row that cannot travel: every reader refuses it
    return s32


def _levels(X: np.ndarray, s32: np.ndarray, top: int = LEVELS) -> np.ndarray:
    s = s32.astype(np.float64)[:, None]
    safe = np.where(np.isfinite(s) & (s > 0), s, 1.0)
    with np.errstate(invalid="ignore"):
        q = np.where(np.isfinite(s), np.rint(np.nan_to_num(X) / safe * top), 0.0)
    return np.clip(q, -top, top).astype(_LEVEL)


def _values(levels: np.ndarray, s32: np.ndarray, top: int = LEVELS) -> np.ndarray:
    return levels.astype(np.float64) * s32.astype(np.float64)[:, None] / top


def _float32(X: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        out = X.astype(_FLOAT)
    out[~np.all(np.isfinite(out), axis=1)] = np.nan
    return out


def encode(X, bits: int = BITS, cols=None) -> bytes:
    """The rows of ``X`` (``(b, d)``, or one row) as they travel at width ``bits`` (12, 16 or 32); ``cols`` (sorted
    indices): only those coordinates, each row at its whole row's scale (:data:`ON`), so that they read back as the
    whole rows' do (a client's own support: the others' numbers never reach its products)."""
    X = np.atleast_2d(np.asarray(X, dtype=np.float64))
    on = 0 if cols is None else ON
    if bits == 32:
        v = _float32(X)
        return bytes([32 | on]) + (v if cols is None else np.ascontiguousarray(v[:, cols])).tobytes()
    if bits not in WIDTHS:
        raise ValueError(f"fixed-point rows: bits must be one of {WIDTHS}, got {bits}")
    s32 = _scales(X)
    q = _levels(X, s32, _top(bits))
    if cols is not None:
        q = np.ascontiguousarray(q[:, cols])
    s32[np.isfinite(s32) & ~np.any(q, axis=1)] = 0  # all its levels 0 (below float32's least scale): a zero row
    return _shorter(q, s32, bits | on)


def _shorter(q: np.ndarray, s32: np.ndarray, tag: int) -> bytes:
    raw, coded = _raw(q, s32, tag), _coded(q, s32, tag)
    return coded if len(coded) < len(raw) else raw


def _raw(q: np.ndarray, s32: np.ndarray, tag: int) -> bytes:
    packed = q.astype(_LEVEL).tobytes() if tag & ~ON == BITS else _pack12(q).tobytes()
    return bytes([tag]) + s32.tobytes() + packed


def _coded(q: np.ndarray, s32: np.ndarray, tag: int) -> bytes:
    body, _ = arith.write(q.ravel(), s32.view(np.uint32), [q.shape[1]] * q.shape[0], _top(tag & ~ON))
    return _CODED_HEAD.pack(CODED | tag, q.shape[0]) + body


_NARROW_TOP = _top(NARROW)  # 2,047: a level and its offset 2,048 fit in 12 bits, 0 is never written


def _pack12(q: np.ndarray) -> np.ndarray:
    """Signed levels ``(b, d)`` in ``[−2047, 2047]`` as ``(b, 3⌈d/2⌉)`` bytes: each pair ``(a, c)``, offset by 2,048,
    as ``a``'s low byte, ``a``'s high nibble with ``c``'s low one, ``c``'s high byte (an odd row padded with 0)."""
    b, d = q.shape
    u = np.full((b, 2 * (-(-d // 2))), 2 ** (NARROW - 1), dtype=np.uint16)
    u[:, :d] = q.astype(np.int32) + 2 ** (NARROW - 1)
    a, c = u[:, 0::2], u[:, 1::2]
    out = np.empty((b, a.shape[1], 3), dtype=np.uint8)
    out[..., 0] = a & 0xFF
    out[..., 1] = (a >> 8) | ((c & 0xF) << 4)
    out[..., 2] = c >> 4
    return out.reshape(b, -1)


def _unpack12(raw: np.ndarray, d: int) -> np.ndarray:
    """:func:`_pack12`'s levels back, ``(b, d)`` int64, or ``ValueError`` for a level outside ``[−2047, 2047]`` or
    padding that is not a zero level."""
    t = raw.reshape(raw.shape[0], -1, 3).astype(np.int64)
    u = np.empty((raw.shape[0], 2 * t.shape[1]), dtype=np.int64)
    u[:, 0::2] = t[..., 0] | ((t[..., 1] & 0xF) << 8)
    u[:, 1::2] = (t[..., 1] >> 4) | (t[..., 2] << 4)
    q = u - 2 ** (NARROW - 1)
    if np.any(q[:, :d] < -_NARROW_TOP) or np.any(q[:, d:] != 0):
        raise ValueError("a 12-bit level is out of range (−2048) or the padding is not zero")
    return q[:, :d]


def width_of(buf) -> int:
    """A message's width (its tag byte, less :data:`CODED` and :data:`ON`), or ``ValueError``."""
    if not isinstance(buf, (bytes, bytearray)) or len(buf) == 0 or buf[0] not in _TAGS:
        raise ValueError(f"not a block of rows: the first byte must be one of {WIDTHS}, or {CODED:#x} with 12 or 16, "
                         f"either with {ON:#x}")
    return int(buf[0]) & ~(CODED | ON)


_TAGS = (*WIDTHS, CODED | NARROW, CODED | BITS)
_TAGS = _TAGS + tuple(t | ON for t in _TAGS)


def decode(buf, d: int, max_rows: int | None = None, cols=None) -> np.ndarray:
    """The ``(b, d)`` float64 rows of :func:`encode`'s bytes, or ``ValueError`` saying why: not bytes, an unknown
    width, not whole rows of ``d``, more than ``max_rows`` rows, a scale or value that is not finite (or a
    negative scale), a code that does not read, or bytes that are not the writer's message of what they hold. Rows on
    a support (:data:`ON`) are read where the reader names its own, ``cols`` (sorted indices), and are 0 elsewhere."""
    width_of(buf)
    if not buf[0] & ON:
        return _decode(buf, int(d), max_rows)
    if cols is None:
        raise ValueError("rows on a support the reader did not name (it reads every coordinate)")
    cols = np.asarray(cols)
    part = _decode(buf, int(cols.size), max_rows)
    out = np.zeros((part.shape[0], int(d)))
    out[:, cols] = part
    return out


def _decode(buf, d: int, max_rows: int | None) -> np.ndarray:
    bits = width_of(buf)
    if buf[0] & CODED:
        return _decode_coded(bytes(buf), d, bits, max_rows)
    size = _row_bytes(d, bits)
    body = bytes(buf[1:])
    if len(body) == 0 or len(body) % size:
        raise ValueError(f"not whole rows of {d} ({size} bytes a row at {bits} bits)")
    b = len(body) // size
    if max_rows is not None and b > max_rows:
        raise ValueError(f"{b} rows, above the {max_rows} allowed")
    if bits == 32:
        X = np.frombuffer(body, dtype=_FLOAT).reshape(b, d).astype(np.float64)
        if not np.all(np.isfinite(X)):
            raise ValueError("a value is not finite")
        return X
    s32 = np.frombuffer(body, dtype=_FLOAT, count=b)
    if not (np.all(np.isfinite(s32)) and not np.any(np.signbit(s32))):
        raise ValueError("a row's scale is negative or not finite")
    if bits == NARROW:
        raw = np.frombuffer(body, dtype=np.uint8, offset=4 * b).reshape(b, size - 4)
        q = _unpack12(raw, d)
    else:
        q = np.frombuffer(body, dtype=_LEVEL, offset=4 * b).reshape(b, d)
    return _canonical(bytes(buf), q, s32, bits)


def _canonical(buf: bytes, q: np.ndarray, s32: np.ndarray, bits: int) -> np.ndarray:
    """The rows of ``q`` and ``s32`` read from ``buf``, where ``buf`` is the writer's own message of them; otherwise
    ``ValueError`` (one message, one code: every engine counts the writer's bytes). Where each row's largest level
    is ``L`` (or a zero row has scale 0) these are the writer's scale and levels (the largest entry reads back as
    the scale, and the rest as their levels), so only the layout is left to check: the shorter, raw on a tie. Any
    other rows (a float32-subnormal scale's, or a forger's) are written again and compared."""
    top = _top(bits)
    X = _values(q, s32, top)
    peak = np.max(np.abs(q), axis=1, initial=0)
    if buf[0] & ON:  # each row at its whole row's scale: the writer's message of these levels and scales
        if np.any(s32[peak == 0] != 0) or _shorter(q, s32, buf[0] & ~CODED) != buf:
            raise ValueError("rows that are not the writer's message of the numbers they hold (one message, one code)")
        return X
    if not np.all(((peak == top) & (s32 > 0)) | ((peak == 0) & (s32 == 0))):
        if encode(X, bits) != buf:
            raise ValueError("rows that are not the writer's message of the numbers they hold (one message, one code)")
        return X
    # a code was checked shorter than its raw rows before it was read (_decode_coded)
    if not buf[0] & CODED and len(_coded(q, s32, bits)) < len(buf):
        raise ValueError("raw rows whose code is shorter: the writer sends the code (one message, one code)")
    return X


def _decode_coded(buf: bytes, d: int, bits: int, max_rows: int | None) -> np.ndarray:
    """A coded message's rows (module docstring), or ``ValueError`` saying why."""
    if len(buf) < _CODED_HEAD.size:
        raise ValueError("a coded block of rows shorter than its header")
    b = _CODED_HEAD.unpack_from(buf)[1]
    body = buf[_CODED_HEAD.size:]
    most = 8 * len(body) // 32 if max_rows is None else int(max_rows)  # a row's scale alone is 32 bits
    if b == 0 or b > most:
        raise ValueError(f"{b} rows, {'none' if b == 0 else f'above the {most} allowed'}")
    if len(buf) >= 1 + b * _row_bytes(d, bits):
        raise ValueError("a code no shorter than its raw rows: the writer sends the raw rows (one message, one code)")
    try:
        s32, q, _ = arith.decode(body, b * d, [d] * b, _top(bits))
    except DecodeError as exc:
        raise ValueError(f"coded rows: {str(exc).replace('norm', 'row scale')}") from None  # QSGD's words, a row's
    return _canonical(buf, q.reshape(b, d), s32, bits)


def rounded(X, bits: int = BITS) -> np.ndarray:
    """``decode(encode(X, bits))`` without the bytes: the rows as the other end reads them, ``(b, d)`` float64 (a
    row that cannot travel: NaN). ``bits`` from 2 to 16 gives what a fixed-point code of that width would carry,
    for the benchmark that chose the width (``benchmarks/bench_lowrank_exchanges.py --bits``); 32: float32."""
    X = np.atleast_2d(np.asarray(X, dtype=np.float64))
    if bits == 32:
        return _float32(X).astype(np.float64)
    if not 2 <= int(bits) <= BITS:
        raise ValueError(f"fixed-point rows: bits must be in [2, {BITS}] or 32, got {bits}")
    s32, top = _scales(X), _top(bits)
    return _values(_levels(X, s32, top), s32, top)
