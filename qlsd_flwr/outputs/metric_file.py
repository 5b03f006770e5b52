"""A metric ``M`` from a ``.npy`` file (``metric = <path>``): the one file the preparation reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qlsd_flwr.core.metric import Dense, Diagonal, Metric, MetricError
from qlsd_flwr.core.curvature import DENSE_MAX_DIM


def metric_from_file(path: str, d: int) -> Metric:
    """A ``.npy`` holding ``d`` positive numbers or an SPD ``d × d`` matrix; ``MetricError`` naming
    the file otherwise."""
    p = Path(path).expanduser()
    shape = _header_shape(p, d)  # before anything is allocated: a header may claim any size
    try:
        a = np.load(p, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise MetricError(f"metric: cannot read {str(p)!r} as a .npy array ({type(exc).__name__}: {exc})") from None
    if not isinstance(a, np.ndarray) or a.shape != shape:
        raise MetricError(f"metric: {str(p)!r} does not hold the one array its header names")
    if a.shape == (d, d) and d > DENSE_MAX_DIM:
        raise MetricError(f"metric: {str(p)!r} is a dense {d} × {d} metric; dense metrics are allowed up to "
                          f"d = {DENSE_MAX_DIM}")
    try:
        return from_user_array(a, d)
    except MetricError as exc:
        raise MetricError(f"{exc} (in {str(p)!r})") from None


def _header_shape(p: Path, d: int) -> tuple:
    """The shape a ``.npy`` file's header declares, checked against ``(d,)`` or ``(d, d)`` and a numeric
    dtype before the array is read; ``MetricError`` naming the file and what it holds otherwise (an empty
    file, a ``.npz`` archive renamed, a header claiming another shape or any size)."""
    try:
        with open(p, "rb") as f:
            head = f.read(6)
            if head[:2] == b"PK":
                raise MetricError(f"metric: {str(p)!r} is a zip archive (a .npz?); save one array with np.save")
            if head != b"\x93NUMPY":
                raise MetricError(f"metric: {str(p)!r} is not a .npy file (it does not start with numpy's magic "
                                  "string); save the metric with np.save")
            f.seek(0)
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)  # what np.load itself reads first
    except MetricError:
        raise
    except (OSError, ValueError, EOFError) as exc:
        raise MetricError(f"metric: cannot read {str(p)!r} as a .npy array ({type(exc).__name__}: {exc})") from None
    if tuple(shape) not in ((d,), (d, d)):
        raise MetricError(f"metric: {str(p)!r} holds an array of shape {tuple(shape)}; expected {d} numbers or a "
                          f"{d} × {d} matrix")
    if dtype.kind not in "fiu":
        raise MetricError(f"metric: {str(p)!r} holds {dtype} values; expected numbers")
    return tuple(shape)


#: a user's metric file's entries in size at most this, and its diagonal at least its inverse
USER_MAX = 1e100


def from_user_array(a: np.ndarray, d: int) -> Metric:
    """A user's metric file's array (``metric = <path>.npy``): ``d`` positive numbers or an SPD ``d × d``
    matrix; :class:`MetricError` otherwise (an empty array too: the identity is ``metric = identity``)."""
    a = np.asarray(a)
    if a.dtype.kind not in "fiu":
        raise MetricError(f"metric: expected numbers, got an array of {a.dtype}")
    diag = a if a.shape == (d,) else np.diagonal(a) if a.shape == (d, d) else None
    if diag is not None and a.size and np.all(np.isfinite(a)) and (
            np.any(np.abs(a) > USER_MAX) or np.any((diag > 0) & (diag < 1 / USER_MAX))):
        # M multiplies every gradient and its root every noise draw: past these the products overflow or
        # vanish in float64 and the chain fails for a reason that is the file's, named here
        raise MetricError(f"metric: entries must lie within [{1 / USER_MAX:g}, {USER_MAX:g}] in size (a metric's "
                          f"scale is free: rescale it; gamma = auto follows); got {np.abs(a).max():.3g} at most, "
                          f"{diag[diag > 0].min() if np.any(diag > 0) else 0:.3g} at least on the diagonal")
    if a.shape == (d,):
        return Diagonal(a)
    if a.shape == (d, d):
        return Dense(a)
    raise MetricError(f"metric: expected {d} numbers or a {d} × {d} matrix, got shape {a.shape}")
