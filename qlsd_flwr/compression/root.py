"""How a client's positive semi-definite report travels (issue 37): as its square root in 12- or 16-bit rows.

K-FAC's input factor ``G_i = Σ_j x̃_j x̃_jᵀ`` and ``metric-block``'s ``B_i`` are the main job's largest reports (an
upper triangle of float32 numbers: 308,505 and 500,500 a client, 5.2e8 of the preparation's 9.9e8 uplink bits). A
triangle rounded to 16 bits does not do: its error in spectral norm is up to ``m/2L`` of its largest entry
(``m = 1,000``: 1.5 %), which leaves the matrix indefinite, and shifting it back to semi-definite adds that much
curvature in every direction, twenty clients' worth; the bottom of ``B``'s spectrum is what ``metric-block`` is for.

So a client sends a root ``R`` with ``Pᵀ S P = RᵀR`` instead: the pivoted Cholesky factor (LAPACK ``dpstrf``),
upper trapezoidal, ``r × m`` for a report of rank ``r``, with its pivots ``P``. Whatever ``R`` arrives, ``RᵀR`` is
positive semi-definite: **rounding cannot make the report indefinite, and nor can a client**, so the check is
structural. Each row of ``R`` goes as :mod:`qlsd_flwr.compression.fixed`'s 16-bit row of its entries from the
diagonal on (pivoting makes ``|R_fj| ≤ R_ff``, so the row's scale is its diagonal), and the error of ``RᵀR``
along a direction ``u`` is ``2 (Ru)ᵀ(Eu) + ‖Eu‖²``, ``|E_fj| ≤ R_ff / 2L``: relative to ``uᵀSu = ‖Ru‖²`` it is
about ``‖Eu‖ / ‖Ru‖``, a square root's precision where the triangle's was the matrix's (16 bits on ``R`` keep
what 32 keep on ``S``). Cost: ``72 + 32 (m + r) + 16 (r m − r(r−1)/2)`` bits (a 9-byte head), against
``32 m(m+1)/2`` for the float32 triangle: half for a full-rank report, less for a low-rank one (a client's ``G_i`` has rank at most its data
count plus one: 198–200 of 785 on the main job, a fifth).

**Coded** (since 2026-12-05 afternoon): the writer sends the same pivots, scales and levels with the scales and levels
in :mod:`.arith`'s adaptive arithmetic code, a row a block, where that is shorter (tag :data:`CODED`), as
:mod:`.fixed` does for its rows, and a reader refuses the longer of the two (one report, one code). On the main job
K-FAC's roots take 0.51 of their raw bits and ``metric-block``'s 0.64 (``benchmarks/bench_preparation.py``).

**12 bits** (since 2026-12-07; issue 37): the clients write their roots' levels 12 bits wide (:data:`BITS`; tags
:data:`TAG12`, :data:`CODED12`, two levels in three bytes raw), within ``R_ff/2L`` at ``L = 2047``: what 24 bits keep
of ``S``. On the main job K-FAC's and ``metric-block``'s reports then cost 3.6e7 fewer bits (1.22e8 → 8.6e7), and the
predictive's TV to the HMC reference stayed within its Monte Carlo spread (``benchmarks/RESULTS.md``, "The preparation at 12 bits"). A reader takes either width.

Both ends round the same way (:func:`rounded` is ``decode(encode(S))``), so every engine uses the numbers Flower
carries.
"""

from __future__ import annotations

import struct

import numpy as np
from scipy.linalg import lapack

from qlsd_flwr.compression import arith, fixed
from qlsd_flwr.compression.format import DecodeError

#: the first byte of a root message in 16-bit levels (``fixed``'s rows start with 12, 16 or 32)
TAG = 0x52
#: and in 12-bit levels, two in three bytes (:func:`qlsd_flwr.compression.fixed._pack12`)
TAG12 = 0x53
#: :func:`factor` stops when the pivots left are below this times ``m`` times the largest diagonal entry: float32's
#: rounding, ``2⁻²⁴`` (:func:`factor`)
RANK_TOL = 2.0 ** -24
#: the first byte of a coded root (module docstring)
CODED = TAG | fixed.CODED
CODED12 = TAG12 | fixed.CODED
#: the width the clients write their roots at (module docstring, "12 bits"); a reader takes 12 or 16
BITS = fixed.NARROW
_WIDTH = {TAG: fixed.BITS, CODED: fixed.BITS, TAG12: fixed.NARROW, CODED12: fixed.NARROW}
_HEAD = struct.Struct("<BII")  # tag, m, r
_INDEX = np.dtype("<u4")
_FLOAT = np.dtype("<f4")
_LEVEL = np.dtype("<i2")


def factor(S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(R, piv)`` with ``S[piv][:, piv] ≈ RᵀR``: the pivoted Cholesky factor of the symmetric positive
    semi-definite ``S`` (``m × m``), ``R`` upper trapezoidal ``(r, m)``. It stops when every pivot left is below
    ``m`` :data:`RANK_TOL` times the largest diagonal entry ``σ`` (float32's triangle's bound in spectral norm,
    ``m 2⁻²⁴ σ``, taken a pivot at a time). What it leaves is semi-definite with each diagonal entry, hence each
    entry, below ``m 2⁻²⁴ σ``, and its spectral norm below ``(m − r)`` times that. Measured on the main job's
    clients at θ* (``python benchmarks/bench_preparation.py --reports``): the summed blocks with the prior within
    −6.1 % and +0.1 % of the exact ones in every direction (whitened), ``G`` within −1.2 % and +0.15 %; at the
    posterior mean a cut at ``2⁻²⁴ σ`` kept the blocks within ±0.15 % for 5e7 bits more (rank for float64's
    rounding noise), one at ``σ/2L`` within −1.2 % for 2.3e7 more. The metric is a preconditioner (γ is taken on
    the one the run keeps), and the main job's chains were measured with this cut. A matrix that is not finite
    gives ``ValueError``."""
    S = np.asarray(S, dtype=np.float64)
    m = S.shape[0]
    if not np.all(np.isfinite(S)):
        raise ValueError("a report to factor is not finite")
    if m == 0 or not np.any(np.diag(S) > 0):
        return np.zeros((0, m)), np.arange(m)
    tol = RANK_TOL * m * float(np.max(np.diag(S)))
    c, piv, rank, info = lapack.dpstrf(0.5 * S + 0.5 * S.T, tol=tol, lower=0)
    if info < 0:
        raise ValueError(f"dpstrf: argument {-info} is illegal")
    return np.triu(c[:rank]), piv.astype(np.int64) - 1


def _mask(r: int, m: int) -> np.ndarray:
    return np.arange(m)[None, :] >= np.arange(r)[:, None]


def encode(S, bits: int = BITS) -> bytes:
    """``S`` (``m × m``, symmetric positive semi-definite) as it travels: its tag (:data:`TAG12` or :data:`TAG`, or
    coded), ``m``, ``r``, the pivots (``m`` uint32), the rows' float32 scales and their ``bits``-wide levels (12 or
    16) from the diagonal on (module docstring). A report that is not finite, or a row beyond float32's range,
    travels with a NaN scale, which every reader refuses: a client's failed report is refused and counted by the
    server on every engine alike."""
    if bits not in (fixed.NARROW, fixed.BITS):
        raise ValueError(f"a root's levels are 12 or 16 bits wide, not {bits}")
    tag = TAG12 if bits == fixed.NARROW else TAG
    S = np.asarray(S, dtype=np.float64)
    if not np.all(np.isfinite(S)):
        m = S.shape[0]
        return _raw(tag, m, np.arange(m), np.array([np.nan], dtype=_FLOAT), np.zeros(m, dtype=np.int64))
    R, piv = factor(S)
    r, m = R.shape
    top = fixed._top(bits)
    s32 = fixed._scales(R) if r else np.zeros(0, dtype=_FLOAT)
    levels = fixed._levels(R, s32, top)[_mask(r, m)] if r else np.zeros(0, dtype=_LEVEL)
    raw = _raw(tag, m, piv, s32, levels)
    coded = _coded(levels, s32, piv, m, bits)
    return coded if len(coded) < len(raw) else raw


def _raw(tag: int, m: int, piv: np.ndarray, s32: np.ndarray, levels: np.ndarray) -> bytes:
    packed = levels.astype(_LEVEL).tobytes() if tag == TAG else fixed._pack12(levels[None, :]).tobytes()
    return (_HEAD.pack(tag, m, s32.size) + piv.astype(_INDEX).tobytes() + s32.astype(_FLOAT).tobytes() + packed)


def _blocks(r: int, m: int) -> list[int]:
    return [m - f for f in range(r)]  # row f from its diagonal on


def _coded(levels: np.ndarray, s32: np.ndarray, piv: np.ndarray, m: int, bits: int = fixed.BITS) -> bytes:
    r = s32.size
    body, _ = arith.write(levels, s32.astype(_FLOAT).view(np.uint32), _blocks(r, m), fixed._top(bits))
    return _HEAD.pack(CODED12 if bits == fixed.NARROW else CODED, m, r) + piv.astype(_INDEX).tobytes() + body


def message_bits(r: int, m: int, bits: int = BITS) -> int:
    """The raw layout's length of a rank-``r`` root of an ``m × m`` report at ``bits`` (12 or 16): the most it costs
    (its coded form, sent where shorter, depends on the levels)."""
    n = r * m - r * (r - 1) // 2
    return 8 * _HEAD.size + 32 * (m + r) + (24 * -(-n // 2) if bits == fixed.NARROW else 16 * n)


def decode(buf, m: int) -> np.ndarray:
    """The ``(m, m)`` float64 matrix ``P RᵀR Pᵀ`` of :func:`encode`'s bytes at either width (symmetric and positive
    semi-definite whatever they held), or ``ValueError`` saying why: not bytes, another tag or size, a length
    other than the rows', pivots that are not an ordering of ``0 … m−1``, or a scale that is negative or not
    finite."""
    if not isinstance(buf, (bytes, bytearray)) or len(buf) < _HEAD.size:
        raise ValueError("not a square-root report")
    tag, mm, r = _HEAD.unpack_from(buf)
    if tag not in _WIDTH or mm != int(m) or r > mm:
        raise ValueError(f"not a square-root report of a {m} × {m} matrix (tag {tag}, size {mm}, rank {r})")
    m, bits = int(m), _WIDTH[tag]
    top = fixed._top(bits)
    n = r * m - r * (r - 1) // 2
    raw = message_bits(r, m, bits) // 8
    if len(buf) != raw if tag in (TAG, TAG12) else not _HEAD.size + 4 * m <= len(buf) < raw:
        raise ValueError(f"expected {raw} bytes for rank {r}{'' if tag in (TAG, TAG12) else ' raw, and fewer coded'}, "
                         f"got {len(buf)}")
    at = _HEAD.size
    piv = np.frombuffer(buf, dtype=_INDEX, count=m, offset=at).astype(np.int64)
    if not np.array_equal(np.sort(piv), np.arange(m)):
        raise ValueError("its pivots are not an ordering of the rows")
    if tag in (CODED, CODED12):
        try:
            s32, levels, _ = arith.decode(bytes(buf[at + 4 * m:]), n, _blocks(r, m), top)
        except DecodeError as exc:
            raise ValueError(f"coded root: {exc}") from None
    else:
        s32 = np.frombuffer(buf, dtype=_FLOAT, count=r, offset=at + 4 * m)
        if not (np.all(np.isfinite(s32)) and not np.any(np.signbit(s32))):
            raise ValueError("a row's scale is negative or not finite")
        if tag == TAG:
            levels = np.frombuffer(buf, dtype=_LEVEL, count=n, offset=at + 4 * (m + r))
            if np.any(levels == np.iinfo(_LEVEL).min):
                raise ValueError("a 16-bit level is out of range (−32768)")
        else:
            packed = np.frombuffer(buf, dtype=np.uint8, offset=at + 4 * (m + r))
            levels = fixed._unpack12(packed[None, :], n)[0]
        if len(_coded(levels, s32, piv, m, bits)) < len(buf):
            raise ValueError("a raw root whose code is shorter: the writer sends the code (one report, one code)")
    L = np.zeros((r, m), dtype=np.int64)
    L[_mask(r, m)] = levels
    return _square(fixed._values(L, s32, top), piv)


def _square(R: np.ndarray, piv: np.ndarray) -> np.ndarray:
    m = piv.size
    Sp = R.T @ R  # finite: R's entries are at most float32's largest, 3.4e38, so each sum is below m 1.2e77
    S = np.empty((m, m))
    S[np.ix_(piv, piv)] = 0.5 * Sp + 0.5 * Sp.T
    return S


def rounded(S) -> np.ndarray:
    """``decode(encode(S))`` without the bytes: ``S`` as the server reads it."""
    return decode(encode(S), np.shape(S)[0])
