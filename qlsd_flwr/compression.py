"""Compression operators ``C`` of QLSD: QSGD stochastic quantisation and the identity.

QSGD (Alistarh et al. 2017; QLSD paper eq. (3)). For ``v ∈ R^d``, ``s ≥ 1`` levels and
dither ``ξ_j ~ U[0, 1)``::

    r_j = s|v_j| / ‖v‖,   l_j = ⌊r_j⌋,
    C_j(v) = ‖v‖ sign(v_j) (l_j + 1{ξ_j < r_j − l_j}) / s,      C(0) = 0.

``P(ξ < r − l) = r − l`` exactly for ``ξ ∈ [0, 1)``, so ``E[C(v)] = v``; and
``E‖C(v) − v‖² ≤ ω‖v‖²`` with ``ω = min(d/s², √d/s)`` (QSGD Lemma 3.1). "p bits" in the paper
means ``s = 2^p``. With ``blocks`` (one norm per tensor, as in the authors' code) each block
of size ``n`` is quantised on its own and ``ω = max_blocks min(n/s², √n/s)``.

The caller owns randomness: ``quantise(v, u)`` takes the uniforms ``u = ξ``.

What goes on the wire, and the float32 norm
-------------------------------------------
The level ``ℓ_j = sign(v_j)(l_j + 1{…})`` is chosen with the float64 norm ``‖v‖``. The norm is
sent as IEEE-754 binary32, ``N = float32(‖v‖)`` (32 bits per block), and *both* sides use
``float64(N) · ℓ_j / s``, so client and server hold bit-identical ``ĝ``. The price is a
deterministic relative scale error ``δ = N/‖v‖ − 1``, ``|δ| ≤ 2^-24 ≈ 6e-8``:
``E[ĝ] = (1 + δ) v`` (and ``ω`` grows by the factor ``(1+δ)²``). Two edge cases of the float32
range: a block whose float32 norm underflows to 0 (``‖v‖ < 1.4e-45``) is sent as zero, and a
norm above float32's maximum (≈3.4e38) or a non-finite input raises ``ValueError``.

Wire format (``QSGD.encode``)
-----------------------------
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
  block, so the first gap is the position itself), 1 sign bit, ``ω(|ℓ_j|)``. Here ``ω(·)`` is
  the Elias omega (recursive) code: ``ω(1) = 0``, ``ω(2) = 100``, ``ω(4) = 101000``, ...
* ``"auto"``: the shorter of the two codes (packed on a tie).

Decoding accepts either tag, checks every field (lengths, ``d``, finite non-negative norms,
``|ℓ| ≤ s``, no ``−0`` level, zero norm ⇒ zero levels, count/positions inside the block,
zero padding, no trailing bytes) and raises ``DecodeError`` otherwise. Accepted payloads are
canonical: re-encoding with the same tag gives the same bytes. Work is ``O(d + len(payload))``
on any input: payloads longer than the longest possible code are rejected up front and every
Elias omega read is capped by the largest value the field may take.

Expected length bound (``QSGD.bound_bits``), base-2 logarithms
----------------------------------------------------------------
``bound_bits`` = per block ``min(QSGD Theorem 3.2, our Jensen bound)`` for the Elias code;
see ``QSGD.bound_bits``, ``elias_bound_bits`` (derivation, valid for this code, any ``v``, both
regimes) and ``qsgd_theorem_bits`` (QSGD Theorem 3.2 as printed).
"""

from __future__ import annotations

import math
import operator
import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import codec

__all__ = [
    "DecodeError",
    "Quantised",
    "QSGD",
    "Identity",
    "dequantise",
    "make_compressor",
    "omega_length",
    "elias_bound_bits",
    "qsgd_theorem_bits",
    "HEADER_BYTES",
    "TAG_PACKED",
    "TAG_ELIAS",
]

HEADER_BYTES = 5  # 1 tag byte + uint32 d: 40 bits per message, not part of code_length_bits
TAG_PACKED = 0x01
TAG_ELIAS = 0x02
ENCODINGS = ("elias", "packed", "auto")
KINDS = ("qsgd", "identity")
MAX_S = 2**32  # levels fit the vectorised bit writer (int64 fields, float64-exact bit lengths)
MAX_D = 2**32 - 1  # d is a uint32 in the header
_G = 5  # Elias omega groups for any value < 2^63: n → ⌊log2 n⌋ → ... reaches 1 in ≤ 5 steps
_F32_MAX = float(np.finfo(np.float32).max)
_MODES = {"packed": 0, "elias": 1, "auto": 2}  # codec.encode_body's mode


class DecodeError(ValueError):
    """A payload that is not a valid code for this compressor and ``d``."""


# --------------------------------------------------------------------------- Elias omega
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
            raise DecodeError("truncated Elias omega code")
        if bs[p] == "0":
            p += 1
            break
        q = p + n + 1
        if q > t:
            raise DecodeError("truncated Elias omega code")
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


# ------------------------------------------------------------------- expected-length bound
def _omega_len_int(n: int) -> int:
    """Elias omega length of one Python int ``n ≥ 1`` (any size)."""
    total = 1
    while n > 1:
        bl = n.bit_length()
        total += bl
        n = bl - 1
    return total


@lru_cache(maxsize=1)
def _omega_hull() -> tuple[np.ndarray, np.ndarray]:
    """Vertices of the least concave majorant ``f`` of ``L`` on ``[1, 2^63]``.

    ``L`` is non-decreasing and constant on ``[2^m, 2^(m+1))``, so the upper concave hull of the
    points ``(2^m, L(2^m))`` majorises it everywhere.
    """
    xs = [float(2**m) for m in range(64)]
    ys = [_omega_len_int(2**m) for m in range(64)]
    hull: list[tuple[float, float]] = []
    for pt in zip(xs, ys):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (pt[0] - x1) <= (pt[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(pt)
    hx, hy = (np.array(a, dtype=np.float64) for a in zip(*hull))
    return hx, hy


def _f(x):
    hx, hy = _omega_hull()
    return np.interp(x, hx, hy)


def elias_bound_bits(n: int, s: int) -> float:
    """Upper bound on the expected length of one block's Elias segment, any ``v ∈ R^n``.

    Derivation (valid in both the sparse and the dense regime, base-2 throughout). Let ``f`` be
    the least concave majorant of the Elias omega length ``L`` (piecewise linear,
    ``f(1) = L(1) = 1``), ``K`` the number of nonzero levels and ``S = Σ|ℓ_j|``. The segment has
    ``32 + L(K+1) + Σ_i [L(g_i) + 1 + L(|ℓ_i|)]`` bits; the gaps satisfy ``Σ g_i ≤ n``, so by
    Jensen and monotonicity of ``f`` it is at most ``32 + Φ(K, S)`` with::

        Φ(K, S) = f(K+1) + K + K f(n/K) + K f(S/K),

    jointly concave (perspectives of a concave ``f``) and increasing in ``S``. Hence
    ``E[bits] ≤ 32 + Φ(E K, E S)``. With ``r_j = s|v_j|/‖v‖``: ``E S = Σ r_j ≤ s√n`` and
    ``E K = Σ min(1, r_j) ≤ K̄ = min(n, s√n)``, so::

        E[bits] ≤ 32 + max_{0 ≤ K ≤ K̄} Φ(K, s√n).

    ``Φ(·, s√n)`` is concave and piecewise linear in ``K`` (breakpoints at ``n/x``, ``s√n/x``
    and ``x − 1`` for hull vertices ``x``), so the maximum is taken exactly over those points.
    In the dense regime (``K̄ = n``) this reads ``32 + f(n+1) + n(2 + f(s/√n))``: one bit per
    unit gap, one sign bit, and Jensen on the level code.
    """
    n = int(n)
    s = int(s)
    if n < 1 or s < 1:
        raise ValueError("elias_bound_bits needs n >= 1 and s >= 1")
    s_bar = s * math.sqrt(n)
    k_bar = min(float(n), s_bar)
    hx, _ = _omega_hull()
    cand = np.concatenate([[k_bar], n / hx, s_bar / hx, hx - 1.0])
    cand = cand[(cand > 0) & (cand <= k_bar)]
    phi = _f(cand + 1.0) + cand + cand * _f(n / cand) + cand * _f(s_bar / cand)
    best = max(1.0, float(phi.max()) if phi.size else 1.0)  # Φ(0) = f(1) = 1
    return 32.0 + best


@lru_cache(maxsize=256)
def _bound_bits(s: int, blocks: tuple[int, ...], encoding: str, packed_bits: int) -> float:
    """``QSGD.bound_bits`` (memoised: it is asked for every message)."""
    elias = float(sum(min(qsgd_theorem_bits(n, s), elias_bound_bits(n, s)) for n in blocks))
    packed = float(packed_bits)
    return {"elias": elias, "packed": packed, "auto": min(elias, packed)}[encoding]


@lru_cache(maxsize=256)
def _max_elias_bits(s: int, blocks: tuple[int, ...]) -> int:
    """The longest Elias code any message of these blocks can have (a decoder guard)."""
    ls = _omega_len_int(s)
    return sum(32 + _omega_len_int(n + 1) + n * (_omega_len_int(n) + 1 + ls) for n in blocks)


def qsgd_theorem_bits(n: int, s: int) -> float:
    """QSGD Theorem 3.2 (Alistarh et al. 2017) as printed, with base-2 logs and ``o(1)`` dropped::

        32 + (3 + (3/2) log2(2(s² + n) / (s(s + √n)))) · s(s + √n).

    This is the paper's sparse-regime figure (the QLSD authors' ``communication_eval`` used natural
    logs, which undercounts). QSGD states it with ``(3/2 + o(1))``; dropping the ``o(1)`` makes it
    an asymptotic statement, not a proven bound for finite ``n``. For *this* code (which also
    sends the count ``ω(K+1)``) it was checked numerically: the exact expected length (computed
    in closed form from the Bernoulli levels) stayed below it in a random search over 3000
    vectors (constant, sparse, spiky, heavy-tailed; ``n < 300``, ``s ≤ 8``), worst ratio 0.93;
    Monte Carlo for constant vectors up to ``n = 3·10^4`` gave at most 0.97.
    """
    n = float(n)
    m = s * (s + math.sqrt(n))
    return 32.0 + (3.0 + 1.5 * math.log2(2.0 * (s * s + n) / m)) * m


# ------------------------------------------------------------------------------- messages
@dataclass(frozen=True, eq=False)
class Quantised:
    """A QSGD message: what the client sends and the server decodes.

    Attributes:
        norms: float32 ``(n_blocks,)``, ``N_b = float32(‖v_b‖)``, sent as 32 bits each.
        levels: int64 ``(d,)``, ``ℓ_j = sign(v_j) · level_j`` with ``0 ≤ level_j ≤ s``.
        s: number of levels ``s``.
        blocks: block sizes (sum ``d``); ``(d,)`` for one norm for the whole vector.
        code_bits: set by ``QSGD.decode``: the length in bits of the code it read (norms and
            body, no header, no padding), i.e. what the sender's code really cost.
    """

    norms: np.ndarray
    levels: np.ndarray
    s: int
    blocks: tuple[int, ...]
    code_bits: int | None = None

    def __post_init__(self):
        if not (isinstance(self.norms, np.ndarray) and self.norms.dtype == np.float32
                and self.norms.ndim == 1):
            raise ValueError("Quantised.norms must be a 1-D float32 array")
        if not (isinstance(self.levels, np.ndarray) and self.levels.dtype == np.int64
                and self.levels.ndim == 1):
            raise ValueError("Quantised.levels must be a 1-D int64 array")
        if len(self.norms) != len(self.blocks) or sum(self.blocks) != len(self.levels):
            raise ValueError("Quantised: norms/levels do not match blocks")

    @property
    def d(self) -> int:
        return int(self.levels.shape[0])

    def __eq__(self, other):
        if not isinstance(other, Quantised):
            return NotImplemented
        return (self.s == other.s and tuple(self.blocks) == tuple(other.blocks)
                and np.array_equal(self.norms.view(np.uint32), other.norms.view(np.uint32))
                and np.array_equal(self.levels, other.levels))

    __hash__ = None


def _dequantise(norms: np.ndarray, levels: np.ndarray, s: int, blocks: tuple[int, ...]) -> np.ndarray:
    scale = np.repeat(norms.astype(np.float64), blocks, axis=-1)
    return scale * levels / s


def dequantise(q: Quantised) -> np.ndarray:
    """``ĝ_j = float64(N_b) · ℓ_j / s`` (float64). Client and server get bit-identical vectors."""
    return _dequantise(q.norms, q.levels, q.s, q.blocks)


# ----------------------------------------------------------------------------------- QSGD
@dataclass(frozen=True)
class QSGD:
    """QSGD stochastic quantisation ``C^(s)`` with exact wire codes (see the module docstring).

    Attributes:
        s: number of quantisation levels ``s ≥ 1`` (the paper's "p bits" is ``s = 2^p``).
        blocks: ``None`` for one norm for the whole vector (the paper), or per-tensor block
            sizes (the authors' code), each block quantised and coded with its own norm.
        encoding: ``"elias"``, ``"packed"`` or ``"auto"`` (the shorter actual code).
    """

    s: int
    blocks: tuple[int, ...] | None = None
    encoding: str = "auto"

    def __post_init__(self):
        try:
            s = operator.index(self.s)
        except TypeError:
            raise ValueError(f"QSGD: s must be an integer, got {self.s!r}") from None
        if isinstance(self.s, bool) or not 1 <= s <= MAX_S:
            raise ValueError(f"QSGD: s must be an integer in [1, 2^32], got {self.s!r}")
        object.__setattr__(self, "s", int(s))
        if self.blocks is not None:
            try:
                blocks = tuple(operator.index(b) for b in self.blocks)
            except TypeError:
                raise ValueError(f"QSGD: blocks must be integers, got {self.blocks!r}") from None
            if not blocks or any(b < 1 for b in blocks):
                raise ValueError(f"QSGD: blocks must be positive sizes, got {self.blocks!r}")
            object.__setattr__(self, "blocks", blocks)
        if self.encoding not in ENCODINGS:
            raise ValueError(f"QSGD: unknown encoding {self.encoding!r}; allowed: {', '.join(ENCODINGS)}")

    # ----------------------------------------------------------------- structure helpers
    def _blocks(self, d: int) -> tuple[int, ...]:
        d = int(d)
        if self.blocks is None:
            if d < 1:
                raise ValueError(f"QSGD: dimension must be >= 1, got {d}")
            return (d,)
        if sum(self.blocks) != d:
            raise ValueError(f"QSGD: blocks {self.blocks} sum to {sum(self.blocks)}, not d = {d}")
        return self.blocks

    @property
    def level_bits(self) -> int:
        """``⌈log2(s+1)⌉``: bits of one level in the packed code."""
        return self.s.bit_length()

    def omega(self, d: int) -> float:
        """Variance factor ``ω = max_blocks min(n/s², √n/s)`` (``min(d/s², √d/s)`` unblocked)."""
        s = float(self.s)
        return max(min(n / s**2, math.sqrt(n) / s) for n in self._blocks(d))

    # --------------------------------------------------------------------- quantisation
    def quantise_batch(self, V: np.ndarray, U: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Quantise each row of ``V`` (shape ``(..., d)``) with dither ``U = ξ`` (same shape).

        Returns ``(norms float32 (..., n_blocks), levels int64 (..., d))``; row by row bitwise
        equal to ``quantise`` (which calls this). ``‖v_b‖`` is computed in float64 and chooses the
        levels; the float32 norm is what is sent.
        """
        V = np.asarray(V, dtype=np.float64)
        U = np.asarray(U, dtype=np.float64)
        if V.ndim < 1 or V.shape != U.shape:
            raise ValueError(f"QSGD: v and u must have the same shape (..., d); got {V.shape} and {U.shape}")
        blocks = self._blocks(V.shape[-1])
        if not np.all(np.isfinite(V)):
            raise ValueError("QSGD: cannot quantise a non-finite vector")
        if U.size and not (np.all(U >= 0.0) and np.all(U < 1.0)):
            raise ValueError("QSGD: the dither u must lie in [0, 1)")
        sq = V * V
        if len(blocks) == 1:
            norm64 = np.sqrt(np.sum(sq, axis=-1, keepdims=True))
        else:
            ends = np.cumsum(blocks)
            norm64 = np.stack([np.sqrt(np.sum(sq[..., e - n:e], axis=-1)) for n, e in zip(blocks, ends)],
                              axis=-1)
        with np.errstate(over="ignore"):
            norm32 = norm64.astype(np.float32)
        if not np.all(np.isfinite(norm32)):
            raise ValueError("QSGD: a block norm exceeds the float32 range (about 3.4e38)")
        live = (norm32 > 0) & (norm64 > 0)  # float32 underflow: the block is sent as zero
        norm32 = np.where(live, norm32, np.float32(0.0))
        safe = np.where(live, norm64, 1.0)
        if len(blocks) > 1:  # one norm per block: spread each block's over its coordinates
            safe, live = np.repeat(safe, blocks, axis=-1), np.repeat(live, blocks, axis=-1)
        s = float(self.s)
        r = np.minimum(np.abs(V) * s / safe, s)
        r = np.where(live, r, 0.0)
        lo = np.floor(r)
        levels = lo.astype(np.int64) + (U < r - lo)
        levels = np.where(V < 0, -levels, levels)
        return norm32, levels

    def quantise(self, v: np.ndarray, u: np.ndarray) -> Quantised:
        """``C^(s)(v)`` with dither ``u = ξ ∈ [0,1)^d`` supplied by the caller."""
        v = np.asarray(v, dtype=np.float64)
        u = np.asarray(u, dtype=np.float64)
        if v.ndim != 1:
            raise ValueError(f"QSGD.quantise: v must be 1-D, got shape {v.shape}")
        blocks = self._blocks(v.shape[0])
        if len(blocks) == 1 and u.shape == v.shape:  # compiled, the same bits (tests check it)
            norms, levels = codec.quantise_row(np.ascontiguousarray(v), np.ascontiguousarray(u), self.s)
            return Quantised(norms=norms, levels=levels, s=self.s, blocks=blocks)
        norms, levels = self.quantise_batch(v[None, :], u[None, :] if u.ndim == 1 else u)
        return Quantised(norms=norms[0], levels=levels[0], s=self.s, blocks=blocks)

    def dequantise_batch(self, norms: np.ndarray, levels: np.ndarray) -> np.ndarray:
        """``float64(N_b) · ℓ_j / s`` over leading dimensions; same arithmetic as ``dequantise``."""
        levels = np.asarray(levels)
        return _dequantise(np.asarray(norms, dtype=np.float32), levels, self.s, self._blocks(levels.shape[-1]))

    def dequantise(self, q: Quantised) -> np.ndarray:
        return dequantise(q)

    # ------------------------------------------------------------------- code lengths
    def _packed_bits(self, d: int) -> int:
        blocks = self._blocks(d)
        return 32 * len(blocks) + d * (1 + self.level_bits)

    def _elias_bits_batch(self, levels: np.ndarray) -> np.ndarray:
        levels = np.asarray(levels, dtype=np.int64)
        d = levels.shape[-1]
        blocks = self._blocks(d)
        starts = np.cumsum((0,) + blocks[:-1])
        nz = levels != 0
        idx = np.arange(d, dtype=np.int64)
        last = np.maximum.accumulate(np.where(nz, idx, -1), axis=-1)
        prev = np.empty_like(last)
        prev[..., 0] = -1
        prev[..., 1:] = last[..., :-1]
        prev = np.maximum(prev, np.repeat(starts - 1, blocks))  # previous nonzero in the same block
        gap = np.where(nz, idx - prev, 1)
        per = np.where(nz, omega_length(gap) + 1 + omega_length(np.where(nz, np.abs(levels), 1)), 0)
        body = per.sum(axis=-1)
        counts = np.add.reduceat(nz, starts, axis=-1) if len(blocks) > 1 else nz.sum(axis=-1, keepdims=True)
        return body + (32 + omega_length(counts + 1)).sum(axis=-1)

    def code_length_bits_batch(self, levels: np.ndarray) -> np.ndarray:
        """Exact code length (norms + body, no header) of each row of ``levels`` (..., d)."""
        levels = np.asarray(levels, dtype=np.int64)
        packed = self._packed_bits(levels.shape[-1])
        if self.encoding == "packed":
            return np.full(levels.shape[:-1], packed, dtype=np.int64)
        elias = self._elias_bits_batch(levels)
        if self.encoding == "elias":
            return elias
        return np.minimum(elias, packed)

    def code_length_bits(self, q: Quantised) -> int:
        """Exact bits of the code ``encode(q)`` produced: norms and body, excluding the 40-bit
        header and the final zero padding (``len(payload) = 5 + ⌈bits/8⌉``)."""
        return int(self.code_length_bits_batch(q.levels))

    # -------------------------------------------------------------------------- bound
    def bound_bits(self, d: int) -> float:
        """Analytic bound on the expected code length (bits, base-2 logs; header excluded).

        * ``"elias"``: ``Σ_blocks min(qsgd_theorem_bits(n, s), elias_bound_bits(n, s))``: QSGD
          Theorem 3.2 (sparse regime; tighter there by ~10%, checked numerically, see
          ``qsgd_theorem_bits``) and the Jensen bound derived in ``elias_bound_bits`` (proven for
          every ``v``; the only finite one in the dense regime, where Theorem 3.2's ``s(s+√n)``
          term explodes). ``proven_bound_bits`` returns the proven part alone.
        * ``"packed"``: the code's fixed length ``32·n_blocks + d(1 + ⌈log2(s+1)⌉)``.
        * ``"auto"``: the minimum of the two (the auto code is never longer than either).
        """
        return _bound_bits(self.s, self._blocks(d), self.encoding, self._packed_bits(d))

    def proven_bound_bits(self, d: int) -> float:
        """As ``bound_bits`` with only the proven Jensen bound for the Elias code."""
        blocks = self._blocks(d)
        elias = float(sum(elias_bound_bits(n, self.s) for n in blocks))
        packed = float(self._packed_bits(d))
        return {"elias": elias, "packed": packed, "auto": min(elias, packed)}[self.encoding]

    def theorem_bits(self, d: int) -> float:
        """QSGD Theorem 3.2 as printed (base 2), summed over blocks: for comparison with the paper."""
        return float(sum(qsgd_theorem_bits(n, self.s) for n in self._blocks(d)))

    # ------------------------------------------------------------------------ encoding
    def encode(self, q: Quantised) -> bytes:
        """``header ‖ code ‖ padding`` (module docstring); the code has ``code_length_bits(q)`` bits.

        With ``encoding = "auto"`` the Elias fields are built first and their length decides
        (packed on a tie), so the Elias code is laid out once, not measured and then built."""
        self._check_encodable(q)
        body, elias, _ = codec.encode_body(q.levels, q.norms.view(np.uint32).astype(np.int64),
                                           np.asarray(q.blocks, dtype=np.int64), self.level_bits,
                                           _MODES[self.encoding])
        return struct.pack("<BI", TAG_ELIAS if elias else TAG_PACKED, q.d) + body.tobytes()

    def encode_reference(self, q: Quantised) -> bytes:
        """``encode`` laid out with numpy fields: the reference the compiled writer
        (:mod:`qlsd_flwr.codec`) is tested against, byte for byte."""
        self._check_encodable(q)
        enc = "packed"
        if self.encoding != "packed":
            vals, lens = self._elias_fields(q)
            if self.encoding == "elias" or int(lens.sum()) < self._packed_bits(q.d):
                enc = "elias"
        if enc == "packed":
            vals, lens = self._packed_fields(q)
        body, _ = _write_fields(vals, lens)
        tag = TAG_PACKED if enc == "packed" else TAG_ELIAS
        return struct.pack("<BI", tag, q.d) + body

    def _check_encodable(self, q: Quantised) -> None:
        if q.s != self.s or tuple(q.blocks) != self._blocks(q.d):
            raise ValueError("QSGD.encode: message was quantised with another s or blocks")
        if q.d > MAX_D:
            raise ValueError("QSGD.encode: d does not fit the uint32 header")

    def _packed_fields(self, q: Quantised) -> tuple[np.ndarray, np.ndarray]:
        """The packed code as fields ``(values, lengths)``, one row per field, in order."""
        levels, nb = q.levels, len(q.blocks)
        starts = np.cumsum((0,) + q.blocks[:-1])
        ent_v = ((levels < 0).astype(np.int64) << self.level_bits) | np.abs(levels)
        ent_l = np.full(q.d, 1 + self.level_bits, dtype=np.int64)
        return _interleave(starts, q.norms.view(np.uint32).astype(np.int64)[:, None],
                           np.full((nb, 1), 32, dtype=np.int64), ent_v[:, None], ent_l[:, None])

    def _elias_fields(self, q: Quantised) -> tuple[np.ndarray, np.ndarray]:
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

    def decode(self, payload: bytes, d: int) -> Quantised:
        """Inverse of ``encode`` for dimension ``d``; any malformed payload raises ``DecodeError``."""
        return self._decode(payload, d, compiled=True)

    def decode_reference(self, payload: bytes, d: int) -> Quantised:
        """``decode`` with the Elias code read in Python: the reference the compiled reader
        (:mod:`qlsd_flwr.codec`) is tested against, result and error message alike."""
        return self._decode(payload, d, compiled=False)

    def _decode(self, payload: bytes, d: int, compiled: bool) -> Quantised:
        try:
            d = operator.index(d)
            blocks = self._blocks(d)
        except (TypeError, ValueError) as e:
            raise DecodeError(f"bad dimension for this compressor: {e}") from None
        if d > MAX_D:
            raise DecodeError("d does not fit the uint32 header")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        payload = bytes(payload)
        if len(payload) < HEADER_BYTES:
            raise DecodeError("payload shorter than the header")
        tag, d_wire = struct.unpack_from("<BI", payload)
        if d_wire != d:
            raise DecodeError(f"payload is for d = {d_wire}, expected d = {d}")
        body = payload[HEADER_BYTES:]
        if tag not in (TAG_PACKED, TAG_ELIAS):
            raise DecodeError(f"unknown encoding tag {tag:#04x}")
        elias = tag == TAG_ELIAS
        self._check_length(body, d, blocks, elias)
        if compiled:
            got = codec.decode_body(body, d, np.asarray(blocks, dtype=np.int64), self.s, elias, self.level_bits)
            if isinstance(got, str):
                raise DecodeError(got)
            norms, levels, bits = got
        else:
            norms, levels, bits = (self._decode_elias if elias else self._decode_packed)(body, d, blocks)
            self._check(norms, levels, blocks)
        return Quantised(norms=norms, levels=levels, s=self.s, blocks=blocks, code_bits=bits)

    def _check_length(self, body: bytes, d: int, blocks, elias: bool) -> None:
        """Length checks made before any bit is read (they bound the decoder's work)."""
        if elias:
            if len(body) > (self._max_elias_bits(blocks) + 7) // 8:
                raise DecodeError("payload longer than any Elias code for this d and s")
            return
        nbits = 32 * len(blocks) + d * (1 + self.level_bits)
        if len(body) != (nbits + 7) // 8:
            raise DecodeError(f"packed code must be {(nbits + 7) // 8} bytes, got {len(body)}")

    def _check(self, norms: np.ndarray, levels: np.ndarray, blocks: tuple[int, ...]) -> None:
        if not np.all(np.isfinite(norms)):
            raise DecodeError("non-finite norm")
        if np.any(np.signbit(norms)):
            raise DecodeError("negative norm")
        if np.any(np.abs(levels) > self.s):
            raise DecodeError(f"level above s = {self.s}")
        dead = np.repeat(norms == 0, blocks)
        if np.any(dead & (levels != 0)):
            raise DecodeError("nonzero level in a block with zero norm")

    def _decode_packed(self, body: bytes, d: int, blocks):
        lb = self.level_bits
        w = 1 + lb
        nbits = 32 * len(blocks) + d * w
        bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8))
        if bits[nbits:].any():
            raise DecodeError("nonzero padding")
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
            raise DecodeError("negative zero level")
        return norms, np.where(neg, -mag, mag), nbits

    def _max_elias_bits(self, blocks) -> int:
        return _max_elias_bits(self.s, tuple(blocks))

    def _decode_elias(self, body: bytes, d: int, blocks):
        bs = np.unpackbits(np.frombuffer(body, dtype=np.uint8)).tobytes().translate(_BITCHARS).decode("ascii")
        t = len(bs)
        bsp = bs + "0" * _TW  # lets the fast path slice a full window near the end
        tab_v, tab_l = _omega_table()
        tw = _TW
        s = self.s
        norm_bits = []
        levels = np.zeros(d, dtype=np.int64)
        p = 0
        start = 0
        for n in blocks:
            if p + 32 > t:
                raise DecodeError("truncated norm")
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
                    raise DecodeError("truncated sign bit")
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
            raise DecodeError("trailing bytes after the Elias code")
        if "1" in bs[p:]:
            raise DecodeError("nonzero padding")
        return np.array(norm_bits, dtype=np.uint32).view(np.float32), levels, p


_BITCHARS = bytes.maketrans(b"\x00\x01", b"01")


# ------------------------------------------------------------------------------- identity
@dataclass(frozen=True)
class Identity:
    """The identity compressor ``C(v) = v`` (``ω = 0``): LSD*, LSD++ and SGLD.

    ``dtype = "float64"`` is exact; ``"float32"`` rounds each coordinate (a biased, not a
    stochastic, compression). The wire is the raw little-endian array, no header:
    ``64·d`` or ``32·d`` bits.
    """

    dtype: str = "float64"

    def __post_init__(self):
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"Identity: unknown dtype {self.dtype!r}; allowed: float64, float32")

    @property
    def _wire(self) -> np.dtype:
        return np.dtype("<f8" if self.dtype == "float64" else "<f4")

    def omega(self, d: int) -> float:
        return 0.0

    def quantise(self, v: np.ndarray, u=None) -> np.ndarray:
        """The vector cast through ``dtype`` (returned as float64); ``u`` is ignored."""
        v = np.asarray(v, dtype=np.float64)
        if not np.all(np.isfinite(v)):
            raise ValueError("Identity: cannot send a non-finite vector")
        with np.errstate(over="ignore"):
            x = v.astype(self._wire)
        if not np.all(np.isfinite(x)):
            raise ValueError("Identity: vector exceeds the float32 range")
        return x.astype(np.float64)

    def quantise_batch(self, V: np.ndarray, U=None) -> np.ndarray:
        return self.quantise(V)

    def dequantise(self, q: np.ndarray) -> np.ndarray:
        return np.array(q, dtype=np.float64)

    def dequantise_batch(self, q: np.ndarray) -> np.ndarray:
        return np.array(q, dtype=np.float64)

    def encode(self, q: np.ndarray) -> bytes:
        return np.ascontiguousarray(q, dtype=self._wire).tobytes()

    def decode(self, payload: bytes, d: int) -> np.ndarray:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        try:
            d = operator.index(d)
        except TypeError:
            raise DecodeError(f"bad dimension {d!r}") from None
        payload = bytes(payload)
        if d < 1 or len(payload) != self._wire.itemsize * d:
            raise DecodeError(f"identity payload must be {self._wire.itemsize * d} bytes, got {len(payload)}")
        x = np.frombuffer(payload, dtype=self._wire).astype(np.float64)
        if not np.all(np.isfinite(x)):
            raise DecodeError("non-finite value in identity payload")
        return x

    def code_length_bits(self, q) -> int:
        return 8 * self._wire.itemsize * int(np.shape(q)[-1])

    def code_length_bits_batch(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X)
        return np.full(X.shape[:-1], 8 * self._wire.itemsize * X.shape[-1], dtype=np.int64)

    def bound_bits(self, d: int) -> float:
        return float(8 * self._wire.itemsize * int(d))


def make_compressor(kind: str, s: int | None = None, blocks=None, encoding: str = "auto",
                    dtype: str = "float64"):
    """``"qsgd"`` → ``QSGD(s, blocks, encoding)``; ``"identity"`` → ``Identity(dtype)``."""
    key = kind.strip().lower() if isinstance(kind, str) else kind
    if key == "qsgd":
        if s is None:
            raise ValueError("make_compressor: kind 'qsgd' needs s (number of levels, >= 1)")
        return QSGD(s=s, blocks=None if blocks is None else tuple(blocks), encoding=encoding)
    if key == "identity":
        return Identity(dtype=dtype)
    raise ValueError(f"make_compressor: unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
