"""Elias omega codes (the integer code of QSGD's sparse format): lengths, fields, the reader.

``ω(1) = 0``, ``ω(n) = ω(⌊log2 n⌋) ‖ binary(n) ‖ 0``: length ``L(1) = 1`` and
``L(n) = 1 + Σ_i (⌊log2 n_i⌋ + 1)`` over ``n_0 = n``, ``n_{i+1} = ⌊log2 n_i⌋`` while ``n_i > 1``;
equivalently ``L(n) = bitlen(n) + L(bitlen(n) − 1)`` with ``L(0) := 0``.

The numpy functions are the reference; :func:`omega_len_nb` is their compiled twin (the bit
writer, the reader and the vectorised engine call it), tested equal on every value class.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from qlsd_flwr.jit import njit
from numba.cpython.unsafe.numbers import leading_zeros

from qlsd_flwr.compression.format import OMEGA_GROUPS as _G
from qlsd_flwr.compression.format import DecodeError, DecodeFault


def _bitlen(x: np.ndarray) -> np.ndarray:
    """Number of binary digits of positive integers ``x < 2^53`` (exact via frexp)."""
    return np.frexp(x.astype(np.float64))[1].astype(np.int64)


_SMALL = 1 << 16  # omega codes of values below this come from tables (speed only)


def omega_length(x) -> np.ndarray:
    """Length in bits of the Elias omega code of each integer ``x ≥ 1`` (vectorised).

    ``L(1) = 1`` and ``L(n) = 1 + Σ_i (⌊log2 n_i⌋ + 1)`` over ``n_0 = n``, ``n_{i+1} = ⌊log2 n_i⌋``
    while ``n_i > 1``. Values below ``2^16`` are looked up in a table made by the same rule.
    """
    n = np.asarray(x, dtype=np.int64)
    if n.size and n.max() < _SMALL and n.min() >= 0:
        return _omega_len_table()[n]
    return _omega_length(n)


@lru_cache(maxsize=1)
def _omega_len_table() -> np.ndarray:
    return _omega_length(np.arange(_SMALL, dtype=np.int64))


def _omega_length(n: np.ndarray) -> np.ndarray:
    """The rule itself, vectorised: ``L`` by walking the groups (the tables are made with it)."""
    total = np.ones(n.shape, dtype=np.int64)
    for _ in range(_G):
        active = n > 1
        if not active.any():
            break
        bl = np.where(active, _bitlen(np.maximum(n, 1)), 0)
        total += bl
        n = np.where(active, bl - 1, 1)
    return total


def _omega_fields(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Elias omega codes of ``x ≥ 1`` as fields ``(values, lengths)``, shape ``(m, _G + 1)``.

    Fields are in emission order: the deepest group first, ``x``'s own binary last, then the
    terminating ``0``. Unused group slots have length 0.
    """
    n = x.astype(np.int64)
    if n.size and n.max() < _FIELDS_SMALL and n.min() >= 1:
        tv, tl = _omega_fields_table()
        return tv[n], tl[n]
    return _omega_fields_ref(n)


_FIELDS_SMALL = 1 << 12


@lru_cache(maxsize=1)
def _omega_fields_table() -> tuple[np.ndarray, np.ndarray]:
    """``_omega_fields`` of ``0..2^12 − 1`` (row 0 unused), made by the reference rule."""
    vals, lens = _omega_fields_ref(np.arange(_FIELDS_SMALL, dtype=np.int64))
    return vals, lens


def _omega_fields_ref(n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    vals = np.zeros((n.size, _G + 1), dtype=np.int64)
    lens = np.zeros((n.size, _G + 1), dtype=np.int64)
    for i in range(_G):
        active = n > 1
        bl = np.where(active, _bitlen(np.maximum(n, 1)), 0)
        vals[:, _G - 1 - i] = np.where(active, n, 0)
        lens[:, _G - 1 - i] = bl
        n = np.where(active, bl - 1, 1)
    lens[:, _G] = 1  # the terminating 0 bit
    return vals, lens


def _write_fields(vals: np.ndarray, lens: np.ndarray) -> tuple[bytes, int]:
    """Concatenate integer fields (MSB first) into bytes, zero padded; returns (bytes, bits)."""
    vals = vals.ravel()
    lens = lens.ravel()
    keep = lens > 0
    vals, lens = vals[keep], lens[keep]
    ends = np.cumsum(lens)
    total = int(ends[-1]) if ends.size else 0
    shift = np.repeat(ends - 1, lens) - np.arange(total, dtype=np.int64)
    bits = ((np.repeat(vals, lens) >> shift) & 1).astype(np.uint8)
    return np.packbits(bits).tobytes(), total


def _interleave(first: np.ndarray, hdr_v: np.ndarray, hdr_l: np.ndarray, ent_v: np.ndarray,
                ent_l: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fields of a code: block ``b``'s header row goes before entry ``first[b]``."""
    nb = hdr_v.shape[0]
    rows = ent_v.shape[0] + nb
    hdr_pos = np.asarray(first, dtype=np.int64) + np.arange(nb)
    if nb == 1 and hdr_pos[0] == 0:  # one block (the paper's QSGD): header, then the entries
        return np.concatenate([hdr_v, ent_v]), np.concatenate([hdr_l, ent_l])
    vals = np.zeros((rows, hdr_v.shape[1]), dtype=np.int64)
    lens = np.zeros((rows, hdr_v.shape[1]), dtype=np.int64)
    is_hdr = np.zeros(rows, dtype=bool)
    is_hdr[hdr_pos] = True
    vals[hdr_pos], lens[hdr_pos] = hdr_v, hdr_l
    vals[~is_hdr], lens[~is_hdr] = ent_v, ent_l
    return vals, lens


def _read_omega(bs: str, p: int, maxval: int) -> tuple[int, int]:
    """Decode one Elias omega integer from bit string ``bs`` at ``p``; require ``1 ≤ x ≤ maxval``.

    Every group read is at most ``bitlen(maxval) + 1`` bits, so the work is bounded whatever
    the input.
    """
    t = len(bs)
    n = 1
    while True:
        if p >= t:
            raise DecodeError(DecodeFault.TRUNC_OMEGA.message)
        if bs[p] == "0":
            p += 1
            break
        q = p + n + 1
        if q > t:
            raise DecodeError(DecodeFault.TRUNC_OMEGA.message)
        n = int(bs[p:q], 2)
        p = q
        if n > maxval:
            raise DecodeError(f"Elias omega value above its maximum {maxval}")
    if n > maxval:
        raise DecodeError(f"Elias omega value above its maximum {maxval}")
    return n, p


_TW = 18  # width of the table-driven Elias omega fast path (codes of values < 1024 fit)


@lru_cache(maxsize=1)
def _omega_table() -> tuple[list, list]:
    """For every ``_TW``-bit window: (value, length) of the omega code it starts with, or
    length 0 when that code does not end inside the window. Decoding speed only; the slow path
    ``_read_omega`` remains the reference and handles every error."""
    w = np.arange(1 << _TW, dtype=np.int64)
    n = np.ones_like(w)
    p = np.zeros_like(w)
    length = np.zeros_like(w)
    live = np.ones(w.shape, dtype=bool)
    for _ in range(_G + 1):
        bit = np.where(live & (p < _TW), (w >> np.maximum(_TW - 1 - p, 0)) & 1, -1)
        end = live & (bit == 0)
        length[end] = p[end] + 1
        live &= bit == 1
        q = p + n + 1
        live &= q <= _TW
        n = np.where(live, (w >> np.maximum(_TW - q, 0)) & ((np.int64(1) << np.minimum(n + 1, 62)) - 1), n)
        p = np.where(live, q, p)
    return n.tolist(), length.tolist()


# ----------------------------------------------------------------------- compiled twin
@njit(cache=True)
def _omega_small_nb(m):
    """``L(m)`` for ``0 ≤ m ≤ 63`` (``L(0) := 0``), branch-free."""
    return (np.int64(m >= 1) + 2 * np.int64(m >= 2) + 3 * np.int64(m >= 4) + np.int64(m >= 8)
            + 4 * np.int64(m >= 16) + np.int64(m >= 32))


@njit(cache=True)
def omega_len_nb(x):
    """``L(x)`` of one integer ``1 ≤ x < 2^64``: ``bitlen(x) + L(bitlen(x) − 1)``."""
    bl = 64 - leading_zeros(np.uint64(x))
    return bl + _omega_small_nb(bl - 1)


def omega_len_int(n: int) -> int:
    """``L(n)`` of one Python int ``1 ≤ n < 2^64``."""
    return int(omega_len_nb(np.uint64(n)))
