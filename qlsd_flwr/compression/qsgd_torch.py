"""The torch twin of QSGD with one norm per vector (:class:`qlsd_flwr.compression.qsgd.QSGD`).

:func:`quantise` is :meth:`QSGD.quantise_batch`'s expression, operation for operation, on torch
tensors; :func:`dequantise` is ``float64(N) · ℓ / s``; :func:`code_length_bits` is
:meth:`QSGD.code_length_bits_batch` (the exact length of the Elias code, the packed one, or the
shorter) computed from the levels with integer arithmetic. For the same float64 input and dither
the levels and code lengths are the reference's exactly, except where the float64 norm's last bit
(a sum in another order) moves a level's threshold across the dither, a chance of about one in
2^50 per coordinate (``tests/test_torch_backend.py`` compares them). Used by the vectorised
engine's torch backend (:mod:`qlsd_flwr.engines.vectorised.torch_backend`).
"""

from __future__ import annotations

import numpy as np
import torch

from qlsd_flwr.compression.elias import omega_length


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
        if encoding not in ("auto", "elias", "packed"):
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
