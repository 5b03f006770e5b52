"""The torch twin of :mod:`qlsd_flwr.core.rng`: the same counter-based streams on a torch device.

The vectorised engine's torch backend (:mod:`qlsd_flwr.engines.vectorised.torch_backend`) draws a
round's participation, minibatches, QSGD dither and Langevin noise where its chains live (a GPU),
from the streams every other engine draws from. SplitMix64 is 64-bit integer arithmetic modulo
2^64; torch has no unsigned 64-bit multiply on every device, so it runs in ``int64``: additions and
products wrap modulo 2^64 in two's complement (the same bits as ``uint64``), and the logical right
shift is the arithmetic one with the sign bits masked off. The uniforms are therefore the
reference's **bit for bit** (``tests/test_torch_backend.py`` checks it on the CPU; the device
script checks it on the GPU it runs on). The normals use the device's ``log1p`` and ``cos``, which
may differ from numpy's in the last bit: the same law, not the same bits.
"""

from __future__ import annotations

import math

import torch

from qlsd_flwr.core import rng as _rng

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
