"""The bound on a client's LOO reply (:mod:`qlsd_flwr.outputs.loo`): its shape from the client's
handshake ``N_i`` and the number of draws, finite values within :data:`VALUE_MAX`, and, for a discrete
likelihood (the classification tasks), log-probabilities at most 0: a probability is at most 1, so a reply
of +50 a point (elpd +4,947 on a classification task before this rule) cannot be honest."""

from __future__ import annotations

import numpy as np

#: a log-likelihood beyond this is refused: sums over many points and draws stay finite
VALUE_MAX = 1e150
#: a discrete likelihood's log-probability (and the LOO's log predictive, an average of them) above this is
#: refused: 0 exactly, plus float64's rounding of a log-sum-exp over thousands of draws
LOG_P_MAX = 1e-9


class LooError(ValueError):
    """The LOO cannot be computed (a potential without ``pointwise_log_lik``, a bad reply, a file
    without it)."""


def check_reply(payload, n_i: int, S: int, mode: str, discrete: bool = False) -> np.ndarray:
    """The reply as an array of its mode's shape; :class:`LooError` naming what is wrong. ``discrete``: the
    likelihood is a probability (classification), so every log-likelihood and log predictive is ≤ 0."""
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
    if discrete and np.any(vals > LOG_P_MAX):
        raise LooError(f"a log-probability of {float(np.max(vals)):.3g} > 0: a discrete likelihood's probability "
                       "is at most 1")
    if mode == "psis" and (np.any(np.isnan(a[2])) or np.any(a[2] == -np.inf)):
        raise LooError("a Pareto shape that is NaN or −inf")
    return a
