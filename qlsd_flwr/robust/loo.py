"""The bound on a client's LOO reply (:mod:`qlsd_flwr.outputs.loo`): its shape from the client's
handshake ``N_i`` and the number of draws, finite values within :data:`VALUE_MAX`."""

from __future__ import annotations

import numpy as np

#: a log-likelihood beyond this is refused: sums over many points and draws stay finite
VALUE_MAX = 1e150


class LooError(ValueError):
    """The LOO cannot be computed (a potential without ``pointwise_log_lik``, a bad reply, a file
    without it)."""


def check_reply(payload, n_i: int, S: int, mode: str) -> np.ndarray:
    """The reply as an array of its mode's shape; :class:`LooError` naming what is wrong."""
    rows = S if mode == "pointwise" else 3
    if not isinstance(payload, (bytes, bytearray, np.ndarray)):
        raise LooError(f"payload of type {type(payload).__name__}, expected float64 bytes")
    if isinstance(payload, (bytes, bytearray)) and len(payload) % 8:
        raise LooError(f"{len(payload)} bytes, not whole float64 numbers, expected {rows} × N_i = {rows * n_i}")
    a = np.frombuffer(bytes(payload), dtype="<f8") if isinstance(payload, (bytes, bytearray)) else payload
    if a.size != rows * n_i:
        raise LooError(f"{a.size} numbers, expected {rows} × N_i = {rows * n_i}")
    a = np.asarray(a, dtype=np.float64).reshape(rows, n_i)
    vals = a if mode == "pointwise" else a[:2]
    if not np.all(np.isfinite(vals)) or np.any(np.abs(vals) > VALUE_MAX):
        raise LooError("values not finite or beyond 1e150")
    if mode == "psis" and (np.any(np.isnan(a[2])) or np.any(a[2] == -np.inf)):
        raise LooError("a Pareto shape that is NaN or −inf")
    return a
