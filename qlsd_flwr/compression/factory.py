"""A compressor by name (the run config's ``compressor`` words): QSGD or the identity."""

from __future__ import annotations

from qlsd_flwr.compression.format import KINDS
from qlsd_flwr.compression.identity import Identity
from qlsd_flwr.compression.qsgd import QSGD


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
