"""Reading a metric's tagged encoding (:meth:`~qlsd_flwr.core.metric.Metric.to_bytes`: the wire and the checkpoints):
every kind, :class:`~qlsd_flwr.core.kron_block.Blocked` included, validated number by number before a metric is
built."""

from __future__ import annotations

import math
import struct

import numpy as np

from qlsd_flwr.core.block_basis import BasisRef, BlockBasis
from qlsd_flwr.core.kron import Kron
from qlsd_flwr.core.kron_block import Blocked
from qlsd_flwr.core.lowrank import RITZ_FLOOR, T_MAX
from qlsd_flwr.core.metric import _MAGIC, Dense, Diagonal, Identity, Kronecker, Metric, MetricError

_KINDS = {1: ("m",), 2: ("M",), 3: ("qg", "qa", "den", "perm"), 4: ("u", "t"),
          5: ("qg", "qa", "den", "perm", "qh", "v", "t"),  # 5: core.kron_block.Blocked
          6: ("perm", "qh", "qa", "s", "a"),  # 6: core.block_basis.BlockBasis (the clients' basis, never a base)
          7: ("perm", "qa", "s", "a", "qsum")}  # 7: core.block_basis.BasisRef (that basis by reference; refs only)


def max_bytes(d: int) -> int:
    """The longest encoding of a metric of dimension ``d`` (a correction of rank ``d`` on a dense or block base)."""
    return 4 * len(_MAGIC) + 96 * 8 + 8 * (3 * d * d + 6 * d + 8)


def from_bytes(x, d: int, refs: bool = False) -> Metric | BasisRef:
    """The metric :meth:`Metric.to_bytes` encoded, for dimension ``d``; :class:`MetricError` saying what is
    wrong (the tag, a kind, a name, a shape, the length, a value) before anything is built. Empty bytes
    are the identity (a metric the server sends when ``metric-rank``'s correction found no direction). ``refs``: a
    client's ``metric``, which may be the clients' basis by reference (:class:`BasisRef`, resolved by the client)."""
    if not isinstance(x, (bytes, bytearray, memoryview)):
        raise MetricError(f"metric: expected bytes, got {type(x).__name__}")
    x = bytes(x)
    if not x:
        return Identity()
    if len(x) > max_bytes(d):
        raise MetricError(f"metric: {len(x)} bytes, more than any metric of d = {d} takes")
    metric, end = _read(x, 0, d, nested=False, refs=refs)
    if end != len(x):
        raise MetricError(f"metric: {len(x) - end} bytes after the metric's end")
    return metric


def _read(x: bytes, at: int, d: int, nested: bool, refs: bool = False) -> tuple[Metric | BasisRef, int]:
    def take(n: int) -> bytes:
        nonlocal at
        if at + n > len(x):
            raise MetricError("metric: the encoding ends early")
        at += n
        return x[at - n:at]

    if take(2) != _MAGIC:
        raise MetricError("metric: not a metric's encoding (no 'QM' tag)")
    code, count = struct.unpack("<BB", take(2))
    if code == 0 and count == 0:
        return Identity(), at
    names = _KINDS.get(code)
    if names is None or (nested and code in (4, 6, 7)) or (code == 7 and not refs):
        top = "0 to 7" if refs else "0 to 6"
        raise MetricError(f"metric: unknown kind code {code}; allowed: {top} (a correction's base: 0 to 3, 5)")
    if count != len(names):
        raise MetricError(f"metric: kind {code} carries {len(names)} arrays, not {count}")
    parts = {}
    for want in names:
        n, ndim = struct.unpack("<BB", take(2))
        name = take(n).decode("ascii", "replace")
        if name != want or not 1 <= ndim <= 2:
            raise MetricError(f"metric: array {name!r} of {ndim} dimensions where {want!r} was expected")
        shape = struct.unpack(f"<{ndim}I", take(4 * ndim))
        size = math.prod(shape)  # Python integers: a product of crafted dimensions cannot wrap around
        if size > 2 * d * d + 8:
            raise MetricError(f"metric: array {name!r} of shape {shape} is larger than d = {d} allows")
        a = np.frombuffer(take(8 * size), dtype="<f8").reshape(shape)
        if not np.all(np.isfinite(a)):
            raise MetricError(f"metric: array {name!r} holds a value that is not finite")
        parts[name] = a.copy()
    if code == 4:
        base, at = _read(x, at, d, nested=True)
        u, t = parts["u"], parts["t"]
        k = t.size
        # the rule of metric-block's values (Blocked.checked): the server clips t below at RITZ_FLOOR
        # (core.lowrank.correction), and a t beyond T_MAX with directions slightly off orthonormal would leave
        # I + U diag(1/t − 1) Uᵀ indefinite along them
        if t.ndim != 1 or u.shape != (d, k) or k < 1 or not (np.all(t >= RITZ_FLOOR) and np.all(t <= T_MAX)) \
                or not np.allclose(u.T @ u, np.eye(k), rtol=0.0, atol=min(1e-8, 0.1 / float(t.max()))):
            raise MetricError(f"metric: a low-rank correction needs values in [{RITZ_FLOOR:g}, {T_MAX:g}] and "
                              f"orthonormal directions of d = {d}")
        return base.corrected(u, t), at
    if code == 5:
        return Blocked.checked(parts, d), at
    if code == 6:
        return BlockBasis.checked(parts, d), at
    if code == 7:
        return BasisRef.checked(parts, d), at
    if code == 1:
        if parts["m"].shape != (d,):
            raise MetricError(f"metric: a diagonal metric of d = {d} needs {d} numbers, got {parts['m'].shape}")
        return Diagonal(parts["m"]), at
    if code == 2:
        if parts["M"].shape != (d, d):
            raise MetricError(f"metric: a dense metric of d = {d} needs {d} × {d} numbers, got {parts['M'].shape}")
        return Dense(parts["M"]), at
    try:
        return Kronecker(Kron.checked(parts["perm"], parts["qg"], parts["qa"], parts["den"], d)), at
    except ValueError as exc:
        raise MetricError(str(exc)) from None


def to_array(metric: Metric) -> np.ndarray:
    """The metric as a checkpoint holds it: its tagged encoding as a ``uint8`` array."""
    return np.frombuffer(metric.to_bytes(), dtype=np.uint8).copy()


def from_array(a, d: int) -> Metric:
    """The inverse of :func:`to_array` (a checkpoint's ``metric``); :class:`MetricError` saying what is wrong."""
    a = np.asarray(a)
    if a.dtype != np.uint8 or a.ndim != 1:
        raise MetricError(f"metric: expected the metric's encoding as bytes (uint8), got {a.dtype} of shape {a.shape}")
    return from_bytes(a.tobytes(), d)


def older_block_form(saved, metric: Metric, d: int) -> bool:
    """Whether a checkpoint's metric (``saved``, :func:`to_array`'s bytes) is ``metric-block``'s in its form before
    2026-12-06 (a dense correction of K-FAC) where this run's ``metric`` keeps it in its structure (:class:`Blocked`):
    the same metric to rounding, not the same bytes."""
    try:
        old = from_array(saved, d)
    except MetricError:
        return False
    return old.low is not None and isinstance(old.base, Kronecker) and isinstance(metric.base, Blocked)

