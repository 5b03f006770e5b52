"""The bound on a client's LOO reply (:mod:`qlsd_flwr.outputs.loo`): its shape from the client's
handshake ``N_i`` and the number of draws, finite values within :data:`VALUE_MAX`, and no log-likelihood
above the largest the model allows (:func:`qlsd_flwr.outputs.loo.log_lik_ceiling`): 0 for a discrete likelihood (the
classification tasks: a probability is at most 1, so a reply of +50 a point, elpd +4,947 on a classification
task before this rule, cannot be honest), and the density's peak for the toy Gaussian's ``N(y; θ, I)``,
``−(d/2) log 2π``. Every term a reply holds (``log p(y_j | θ_s)``, and the log predictives ``elpd_loo,j`` and
``lppd_j``, which are averages of such probabilities) is at most that ceiling. What a client can still change
is its own points' terms below it."""

from __future__ import annotations

import numpy as np

#: a log-likelihood beyond this is refused: sums over many points and draws stay finite
VALUE_MAX = 1e150
#: a log-likelihood (or the LOO's log predictive, an average of probabilities) above the model's ceiling by more
#: than this (relative to the ceiling's size, at least 1) is refused: float64's rounding of a log-sum-exp over
#: thousands of draws
LOG_P_MAX = 1e-9


class LooError(ValueError):
    """The LOO cannot be computed (a potential without ``pointwise_log_lik``, a bad reply, a file
    without it)."""


def check_reply(payload, n_i: int, S: int, mode: str, ceiling: float | None = None) -> np.ndarray:
    """The reply as an array of its mode's shape; :class:`LooError` naming what is wrong. ``ceiling``: the
    largest log-likelihood the model allows a point (:func:`qlsd_flwr.outputs.loo.log_lik_ceiling`); every log-likelihood and log
    predictive above it (by more than float64's rounding) is refused."""
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
    if ceiling is not None and np.any(vals > ceiling + LOG_P_MAX * max(1.0, abs(ceiling))):
        top = float(np.max(vals))
        raise LooError(f"a log-probability of {top:.3g} > 0: a discrete likelihood's probability is at most 1"
                       if ceiling == 0.0 else
                       f"a log-likelihood of {top:.6g} above the model's largest, {ceiling:.6g} (the density's peak)")
    if mode == "psis" and (np.any(np.isnan(a[2])) or np.any(a[2] == -np.inf)):
        raise LooError("a Pareto shape that is NaN or −inf")
    return a
