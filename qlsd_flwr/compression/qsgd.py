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

The wire format (:mod:`~qlsd_flwr.compression.wire`, compiled twin
:mod:`~qlsd_flwr.compression.codec`), the Elias codes (:mod:`~qlsd_flwr.compression.elias`) and the
analytic length bounds (:mod:`~qlsd_flwr.compression.bounds`) live beside this module.

The numpy :meth:`QSGD.quantise_batch` is the reference; its compiled twin
(:func:`~qlsd_flwr.compression.qsgd_nb.quantise_block_nb`: one block, levels and ``ĝ`` at once)
sits beside this module, serves the one-vector :meth:`QSGD.quantise` and the vectorised engine's
kernel, and is tested bit for bit against the reference.
"""

from __future__ import annotations

import math
import operator
import struct
from dataclasses import dataclass

import numpy as np

from qlsd_flwr.compression import codec, dense, wire
from qlsd_flwr.compression.bounds import (
    _bound_bits,
    _max_elias_bits,
    elias_bound_bits,
    qsgd_theorem_bits,
)
from qlsd_flwr.compression.elias import _write_fields, omega_length
from qlsd_flwr.compression.format import (
    ENCODINGS,
    HEADER_BYTES,
    MAX_D,
    MAX_S,
    TAG_ELIAS,
    TAG_PACKED,
    DecodeError,
    Encoding,
    QuantiseError,
)
from qlsd_flwr.compression.qsgd_nb import quantise_row


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
        encoding: ``"elias"``, ``"packed"``, ``"auto"`` (the shorter actual code), or one of the compressed
            broadcast's dense codes (:mod:`~qlsd_flwr.compression.dense`): ``"arith"``, ``"rice"``, or ``"dense"``
            (the shorter of those two, the broadcast's).
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
            raise ValueError(QuantiseError.NON_FINITE.message)
        if U.size and not (np.all(U >= 0.0) and np.all(U < 1.0)):
            raise ValueError(QuantiseError.DITHER.message)
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
            raise ValueError(QuantiseError.NORM_OVERFLOW.message)
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
            norms, levels = quantise_row(np.ascontiguousarray(v), np.ascontiguousarray(u), self.s)
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
        if self.encoding in dense.TAGS:
            return dense.code_bits(self.encoding, levels, self._blocks(levels.shape[-1]), self.s)
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
        if self.encoding in dense.TAGS:
            return float(dense.max_bits(self.encoding, self.s, blocks))
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
        if self.encoding in dense.TAGS:
            return dense.encode(self.encoding, q)
        body, elias, _ = codec.encode_body(q.levels, q.norms.view(np.uint32).astype(np.int64),
                                           np.asarray(q.blocks, dtype=np.int64), self.level_bits,
                                           int(Encoding.of(self.encoding)))
        return struct.pack("<BI", TAG_ELIAS if elias else TAG_PACKED, q.d) + body.tobytes()

    def encode_reference(self, q: Quantised) -> bytes:
        """``encode`` laid out with numpy fields: the reference the compiled writer
        (:mod:`qlsd_flwr.compression.codec`) is tested against, byte for byte."""
        self._check_encodable(q)
        enc = "packed"
        if self.encoding != "packed":
            vals, lens = wire.elias_fields(q)
            if self.encoding == "elias" or int(lens.sum()) < self._packed_bits(q.d):
                enc = "elias"
        if enc == "packed":
            vals, lens = wire.packed_fields(q, self.level_bits)
        body, _ = _write_fields(vals, lens)
        tag = TAG_PACKED if enc == "packed" else TAG_ELIAS
        return struct.pack("<BI", tag, q.d) + body

    def _check_encodable(self, q: Quantised) -> None:
        if q.s != self.s or tuple(q.blocks) != self._blocks(q.d):
            raise ValueError("QSGD.encode: message was quantised with another s or blocks")
        if q.d > MAX_D:
            raise ValueError("QSGD.encode: d does not fit the uint32 header")

    def decode(self, payload: bytes, d: int) -> Quantised:
        """Inverse of ``encode`` for dimension ``d``; any malformed payload raises ``DecodeError``."""
        return self._decode(payload, d, compiled=True)

    def decode_reference(self, payload: bytes, d: int) -> Quantised:
        """``decode`` with the Elias code read in Python: the reference the compiled reader
        (:mod:`qlsd_flwr.compression.codec`) is tested against, result and error message alike."""
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
        if dense.reads(self.encoding, tag):  # a dense code, read only where it is expected
            norms, levels, bits = dense.decode(self.encoding, tag, body, d, blocks, self.s)
            return Quantised(norms=norms, levels=levels, s=self.s, blocks=blocks, code_bits=bits)
        if tag not in (TAG_PACKED, TAG_ELIAS) or self.encoding in dense.TAGS:  # a dense reader reads no uplink code
            raise DecodeError(f"unknown encoding tag {tag:#04x}")
        elias = tag == TAG_ELIAS
        self._check_length(body, d, blocks, elias)
        if compiled:
            got = codec.decode_body(body, d, np.asarray(blocks, dtype=np.int64), self.s, elias, self.level_bits)
            if isinstance(got, str):
                raise DecodeError(got)
            norms, levels, bits = got
        else:
            norms, levels, bits = (wire.read_elias(body, d, blocks, self.s) if elias
                                   else wire.read_packed(body, d, blocks, self.level_bits))
            wire.check_fields(norms, levels, blocks, self.s)
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

    def _max_elias_bits(self, blocks) -> int:
        return _max_elias_bits(self.s, tuple(blocks))
