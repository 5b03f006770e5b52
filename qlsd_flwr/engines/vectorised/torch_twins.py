"""The torch twins of the references a round calls: the counter-based streams
(:mod:`qlsd_flwr.core.rng`) and QSGD with one norm per vector (:class:`qlsd_flwr.compression.qsgd.QSGD`),
on a torch device, for the vectorised engine's torch backend (:mod:`.torch_backend`). They sit here,
not beside their references, because the mathematics (``core``, ``compression``) imports no torch.

**Streams.** SplitMix64 is 64-bit integer arithmetic modulo 2^64; torch has no unsigned 64-bit multiply
on every device, so it runs in ``int64``: additions and products wrap modulo 2^64 in two's complement
(the same bits as ``uint64``), and the logical right shift is the arithmetic one with the sign bits
masked off. The uniforms are therefore the reference's **bit for bit** (``tests/test_torch_backend.py``
on the CPU; ``benchmarks/bench_torch_backend.py --device cuda`` on an H200). The normals use the
device's ``log1p`` and ``cos``, which may differ from numpy's in the last bit: the same law, not the
same bits.

**QSGD.** :func:`quantise` is :meth:`QSGD.quantise_batch`'s expression, operation for operation;
:func:`dequantise` is ``float64(N) · ℓ / s``; :class:`CodeLength` is :meth:`QSGD.code_length_bits_batch`
(the exact length of the Elias code, the packed one, or the shorter) from the levels in integer
arithmetic. For the same float64 input and dither the levels and code lengths are the reference's
exactly, except where the float64 norm's last bit (a sum in another order) moves a level's threshold
across the dither, a chance of about one in 2^50 per coordinate.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from qlsd_flwr.compression.elias import omega_length
from qlsd_flwr.compression.format import COMPILED_ENCODINGS
from qlsd_flwr.core import rng as _rng

# ---------------------------------------------------------------- the streams
_MASK = (1 << 64) - 1


def _signed(v: int) -> int:
    """The ``int64`` with the bits of the unsigned 64-bit ``v``."""
    v &= _MASK
    return v - (1 << 64) if v >> 63 else v


_G = _signed(int(_rng._G))
_M1 = _signed(int(_rng._M1))
_M2 = _signed(int(_rng._M2))
_TWO53 = 1.0 / 9007199254740992.0  # 2^-53


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """The logical right shift of ``z``'s 64 bits by ``s`` (``int64``'s ``>>`` copies the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (:func:`qlsd_flwr.core.rng._mix`) on ``int64`` bits."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def seed_keys(seeds, stream: int, device) -> torch.Tensor:
    """``mix(seed + G·stream)`` of each seed ``(C,)``: the first link of :func:`qlsd_flwr.core.rng.key`."""
    s = torch.as_tensor([_signed(int(x)) for x in seeds], dtype=torch.int64, device=device)
    return mix(s + _signed(_G * int(stream)))


def keys(kseed: torch.Tensor, round_: int, clients: torch.Tensor) -> torch.Tensor:
    """:func:`qlsd_flwr.core.rng.key` from its first link ``kseed`` ``(C,)``, for round ``round_`` and
    ``clients`` (``int64``, any shape ``S``): ``(C,) + S``."""
    k = mix(kseed + _signed(_G * (int(round_) + 1)))
    k = k.reshape(k.shape + (1,) * clients.dim())
    return mix(k + (clients + 1) * _G)


def keys_block(kseed: torch.Tensor, k0: int, R: int, clients: torch.Tensor) -> torch.Tensor:
    """:func:`keys` of the rounds ``k0 .. k0 + R − 1`` at once, ``(R, C) + S``: a block's keys in a few
    launches instead of a few a round (element ``r`` equals ``keys(kseed, k0 + r, clients)``)."""
    rounds = torch.arange(k0 + 1, k0 + R + 1, dtype=torch.int64, device=kseed.device)
    k = mix(kseed[None, :] + rounds[:, None] * _G)
    k = k.reshape(k.shape + (1,) * clients.dim())
    return mix(k + (clients + 1) * _G)


def uniform(k: torch.Tensor, n: int, offset: int = 0) -> torch.Tensor:
    """``n`` uniforms in ``[0, 1)`` of each stream key in ``k`` (``k.shape + (n,)``, float64), as
    :func:`qlsd_flwr.core.rng.uniform`: position ``offset + j + 1`` of the stream, bit for bit."""
    j = torch.arange(offset + 1, offset + n + 1, dtype=torch.int64, device=k.device)
    x = mix(k[..., None] + j * _G)
    return _shr(x, 11).to(torch.float64) * _TWO53


def normal(k: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`qlsd_flwr.core.rng.normal`'s Box–Muller on the streams ``k`` (the device's libm)."""
    u = uniform(k, 2 * n)
    return torch.sqrt(-2.0 * torch.log1p(-u[..., :n])) * torch.cos((2.0 * math.pi) * u[..., n:])


def subset(k: torch.Tensor, n_total: int, n: int) -> torch.Tensor:
    """:func:`qlsd_flwr.core.rng.subset`: the ``n`` smallest of ``n_total`` uniform keys, sorted
    (``k.shape + (n,)``, int64). The same set as the reference's unless two keys tie exactly at the
    ``n``-th place (chance about ``n_total·2^-53`` a draw)."""
    if n >= n_total:
        return torch.arange(n_total, device=k.device).expand(k.shape + (n_total,))
    u = uniform(k, n_total)
    idx = torch.topk(u, n, dim=-1, largest=False, sorted=False).indices
    return torch.sort(idx, dim=-1).values


# ---------------------------------------------------------------- QSGD
def quantise(V: torch.Tensor, U: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of ``V`` ``(..., d)`` (float64) quantised with the dither ``U`` (same shape).

    Returns ``(norm32 (..., 1) float32, levels (..., d) int64, finite (...,) bool)``; ``finite`` is
    false where the row (or its float32 norm) is not finite, where the reference raises ``ValueError``
    and this twin's levels are meaningless."""
    norm64 = torch.sqrt(torch.sum(V * V, dim=-1, keepdim=True))
    norm32 = norm64.to(torch.float32)
    finite = torch.isfinite(norm32)[..., 0]
    live = (norm32 > 0) & (norm64 > 0)  # float32 underflow: the row is sent as zero
    norm32 = torch.where(live, norm32, torch.zeros((), dtype=torch.float32, device=V.device))
    safe = torch.where(live, norm64, torch.ones((), dtype=torch.float64, device=V.device))
    sf = float(s)
    r = torch.clamp(torch.abs(V) * sf / safe, max=sf)
    r = torch.where(live, r, torch.zeros((), dtype=torch.float64, device=V.device))
    lo = torch.floor(r)
    levels = lo.to(torch.int64) + (U < r - lo).to(torch.int64)
    levels = torch.where(V < 0, -levels, levels)
    return norm32, levels, finite


def dequantise(norm32: torch.Tensor, levels: torch.Tensor, s: int) -> torch.Tensor:
    """``ĝ = float64(N) · ℓ / s`` (float64), as :meth:`QSGD.dequantise_batch`."""
    return norm32.to(torch.float64) * levels / s


class CodeLength:
    """:meth:`QSGD.code_length_bits_batch` for one QSGD (one norm, ``encoding`` auto, elias or packed)
    on vectors of length ``d``: the Elias omega lengths it needs are looked up in a table on the device."""

    def __init__(self, d: int, s: int, encoding: str, device):
        if encoding not in COMPILED_ENCODINGS:
            raise ValueError(f"encoding = {encoding!r} has no torch twin; allowed: auto, elias, packed")
        self.d, self.encoding = int(d), encoding
        self.packed = 32 + self.d * (1 + int(s).bit_length())
        n = np.arange(max(self.d, int(s)) + 2, dtype=np.int64)
        table = np.zeros_like(n)
        table[1:] = omega_length(n[1:])
        self.table = torch.as_tensor(table, device=device)
        self.idx = torch.arange(self.d, dtype=torch.int64, device=device)

    def __call__(self, levels: torch.Tensor) -> torch.Tensor:
        """The exact code length (norm and body, no header) of each row of ``levels`` ``(..., d)``."""
        if self.encoding == "packed":
            return torch.full(levels.shape[:-1], self.packed, dtype=torch.int64, device=levels.device)
        nz = levels != 0
        last = torch.cummax(torch.where(nz, self.idx, -1), dim=-1).values  # the last nonzero so far
        prev = torch.cat([torch.full_like(last[..., :1], -1), last[..., :-1]], dim=-1)
        gap = torch.where(nz, self.idx - prev, 1)
        lev = torch.where(nz, levels.abs(), 1)
        per = torch.where(nz, self.table[gap] + 1 + self.table[lev], 0)
        count = nz.sum(dim=-1)
        elias = per.sum(dim=-1) + 32 + self.table[count + 1]
        return elias if self.encoding == "elias" else torch.clamp(elias, max=self.packed)
