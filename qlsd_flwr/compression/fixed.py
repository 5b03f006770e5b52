"""Fixed-point rows: how the preparation's blocks of vectors and Hessian-vector products travel (issue 37).

A row ``v`` of ``d`` numbers is sent as its scale ``σ = max_j |v_j|`` (float32, rounded up so that no level
overflows) and ``d`` signed levels ``round(v_j L / σ)`` of :data:`BITS` bits, ``L = 2^(BITS−1) − 1``; it is read
back as ``level · (σ / L)``. Each coordinate is then within ``σ / 2L`` of ``v_j``: for a dense row of ``d =
7,850`` numbers whose largest is four times their root mean square, a relative error of about ``3e-5`` in norm,
against float32's ``6e-8`` and float64's ``1e-16``, at ``16 d + 32`` bits a row instead of ``32 d``.

Why this is enough, measured (offline, the main job's exact Hessian at the MAP, every client's product rounded as
it would travel, the K-FAC metric corrected by ``metric-rank = 150``; RESULTS, "Products as 16-bit rows"): the
corrected metric's condition number is 9.653 with float32 rows both ways, 9.654 with 16 bits and 9.66–9.70 with
12, but **63** with 8-bit products or blocks (``benchmarks/bench_lowrank_exchanges.py --bits``): the correction must resolve the bottom of the spectrum (``λ_min(B) = 0.035``, where
the product of a direction is 100× smaller than the row's largest part), and 8 bits bury it. 16 leaves a margin of
16× over 12 for rows with heavier tails than the main job's (a network's products).

Both ends round the same way (:func:`rounded` is ``decode(encode(x))`` without the bytes), so every engine, the
direct ones included, uses the very numbers Flower carries, and the server multiplies its own part (the
prior's curvature) by the block the clients received.
"""

from __future__ import annotations

import numpy as np

#: bits a level: 16 (12 measured nearly the same on the main job, 8 not; module docstring)
BITS = 16
LEVELS = 2 ** (BITS - 1) - 1
_LEVEL = np.dtype("<i2")
_SCALE = np.dtype("<f4")


def row_bits(d: int) -> int:
    """The code length of one row of ``d`` numbers: its float32 scale and ``d`` levels."""
    return 32 + BITS * int(d)


def _scales(X: np.ndarray) -> np.ndarray:
    s = np.max(np.abs(X), axis=1) if X.shape[1] else np.zeros(X.shape[0])
    if not np.all(np.isfinite(s)) or np.any(s > np.finfo(np.float32).max):
        raise ValueError("fixed-point rows: a value is not finite or exceeds the float32 range")
    s32 = s.astype(_SCALE)
    low = s32.astype(np.float64) < s  # float32 rounded down: one step up, so that |v_j| / σ ≤ 1
    s32[low] = np.nextafter(s32[low], np.float32(np.inf))
    return s32


def _levels(X: np.ndarray, s32: np.ndarray, top: int = LEVELS) -> np.ndarray:
    s = s32.astype(np.float64)[:, None]
    safe = np.where(s > 0, s, 1.0)
    return np.clip(np.rint(X / safe * top), -top, top).astype(_LEVEL)


def _values(levels: np.ndarray, s32: np.ndarray, top: int = LEVELS) -> np.ndarray:
    return levels.astype(np.float64) * (s32.astype(np.float64) / top)[:, None]


def encode(X) -> bytes:
    """The rows of ``X`` (``(b, d)``, or one row) as they travel: ``b`` float32 scales, then the ``b × d`` levels
    row by row (little-endian). ``ValueError`` when a value is not finite or exceeds float32's range."""
    X = np.atleast_2d(np.asarray(X, dtype=np.float64))
    s32 = _scales(X)
    return s32.tobytes() + _levels(X, s32).tobytes()


def decode(buf, d: int, max_rows: int | None = None) -> np.ndarray:
    """The ``(b, d)`` float64 rows of :func:`encode`'s bytes, or ``ValueError`` saying why: not bytes, not whole
    rows of ``d``, more than ``max_rows`` rows, or a scale that is negative or not finite."""
    if not isinstance(buf, (bytes, bytearray)) or len(buf) == 0 or len(buf) % (4 + 2 * int(d)):
        raise ValueError(f"not fixed-point bytes of whole rows of {d} ({4 + 2 * int(d)} bytes a row)")
    b = len(buf) // (4 + 2 * int(d))
    if max_rows is not None and b > max_rows:
        raise ValueError(f"{b} rows, above the {max_rows} allowed")
    s32 = np.frombuffer(bytes(buf), dtype=_SCALE, count=b)
    if not (np.all(np.isfinite(s32)) and np.all(s32 >= 0)):
        raise ValueError("a row's scale is negative or not finite")
    levels = np.frombuffer(bytes(buf), dtype=_LEVEL, offset=4 * b).reshape(b, int(d))
    return _values(levels, s32)


def rounded(X, bits: int = BITS) -> np.ndarray:
    """``decode(encode(X))`` without the bytes: the rows as the other end reads them, ``(b, d)`` float64.
    ``bits`` (2 to 16) other than :data:`BITS` gives what a narrower code would carry, for the benchmark that
    chose the width (``benchmarks/bench_lowrank_exchanges.py --bits``); nothing travels at it."""
    X = np.atleast_2d(np.asarray(X, dtype=np.float64))
    if not 2 <= int(bits) <= BITS:
        raise ValueError(f"fixed-point rows: bits must be in [2, {BITS}], got {bits}")
    s32, top = _scales(X), 2 ** (int(bits) - 1) - 1
    return _values(_levels(X, s32, top), s32, top)
