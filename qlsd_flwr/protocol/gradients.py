"""What a ``grad`` exchange of the preparation carries (the θ* descent, the power iteration's fallback, the
warm-up of ``metric-from = adapt``, the claims): θ down and the client's ``∇U_i(θ)`` back, at a width the request
names (``precision``). 64: float64 both ways. 32: float32 both ways. 16 (12): θ as float32 down and the gradient
back as one 16-bit (12-bit) fixed-point row (:mod:`qlsd_flwr.compression.fixed`: a float32 scale and a signed level a
number), a quarter (about 0.19) of float64's uplink; the θ* descent uses them where θ* is only the point where the
curvature is taken, at the width its stopping rule allows (:class:`qlsd_flwr.protocol.descent.DescentWidth`)."""

from __future__ import annotations

import numpy as np

from qlsd_flwr.compression import fixed
from qlsd_flwr.protocol.wire import arr_to_bytes, bytes_to_arr

#: a ``grad`` request's widths: float64, float32, or θ as float32 and the gradient as a 12- or 16-bit row (the θ*
#: descent)
PRECISIONS = (fixed.NARROW, fixed.BITS, 32, 64)
#: the widths whose gradient is one fixed-point row
ROWS = (fixed.NARROW, fixed.BITS)


def precision_of(fields: dict) -> int:
    """A ``grad`` request's ``precision`` (64 when absent), or ``ValueError`` naming the field and its values."""
    p = fields.get("precision", 64)
    if isinstance(p, bool) or p not in PRECISIONS:
        raise ValueError(f"grad: 'precision' must be one of {', '.join(map(str, PRECISIONS))}, not {p!r}")
    return int(p)


def gradient_to_bytes(g: np.ndarray, precision: int = 64) -> bytes:
    """A ``grad`` reply's payload: float64 bytes (:func:`arr_to_bytes`), float32 ones at ``precision = 32``, one
    fixed-point row (:mod:`qlsd_flwr.compression.fixed`) at 12 or 16."""
    if precision in ROWS:
        return fixed.encode(g, precision)
    return np.ascontiguousarray(g, dtype="<f4").tobytes() if precision == 32 else arr_to_bytes(g)


def gradient_of(payload, d: int, precision: int = 64) -> np.ndarray:
    """A θ* phase reply's ``∇U_i(θ)``: ``8d`` bytes of finite float64 (``4d`` of float32 at ``precision = 32``; one
    row of ``d`` at 12 or 16 bits, with a finite scale), else ``ValueError`` saying why (the caller counts it and asks
    again: :mod:`qlsd_flwr.flower.phases`)."""
    if precision in ROWS:  # its tag, whole rows of d, one of them, a finite scale (fixed.decode)
        if (got := fixed.width_of(payload)) != precision:
            raise ValueError(f"expected a {precision}-bit fixed-point row, got a {got}-bit one")
        g = fixed.decode(payload, d, max_rows=1)[0]
    elif precision == 32:
        n = len(payload) if isinstance(payload, (bytes, bytearray)) else "?"
        if n != 4 * d:
            raise ValueError(f"expected {4 * d} bytes of float32, got {type(payload).__name__} of length {n}")
        g = np.frombuffer(payload, dtype="<f4").astype(np.float64)
    else:
        g = bytes_to_arr(payload, d)
    if not np.all(np.isfinite(g)):
        raise ValueError("non-finite values")
    return g


def theta_width(precision: int) -> int:
    """The width θ goes down at in a ``grad`` request of ``precision``: float64 at 64, float32 otherwise."""
    return 64 if int(precision) == 64 else 32


def as_sent(x: np.ndarray, precision: int = 64) -> np.ndarray:
    """``x`` as a ``precision``-bit exchange carries it, back in float64 (the identity at 64; 12, 16: a fixed-point
    row, as :func:`gradient_to_bytes` sends it): every engine rounds where Flower's messages do, so all give one θ*."""
    if precision in (fixed.NARROW, fixed.BITS):
        return fixed.rounded(x, precision)[0]
    return x if precision == 64 else np.asarray(x, dtype=np.float32).astype(np.float64)
