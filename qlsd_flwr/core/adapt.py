"""``metric-from = adapt``: the metric ``M`` refined by a warm-up chain's own covariance, in
windows that double, before the first sampling round (Stan's windowed adaptation is the model).

The warm-up is the unadjusted Langevin chain on exact federated gradients,
``θ ← θ − γ M ∇U(θ) + √(2γT) M^{1/2} Z``, run by every chain of the run from its start
(``init``), with ``∇U`` one exchange with every client (the θ* phase's ``grad_fn``). Its rounds are
split as Stan splits its warm-up: a first buffer (15 %) that lets the chains leave their starts, slow
windows of doubling length in which the draws are kept, and a last buffer (10 %) run under the final
metric. At the end of each slow window:

- ``Σ̂``: the covariance of the window's draws, each chain centred on its own window mean, pooled over
  the chains (``n`` draws in all);
- ``M ← w Σ̂ + (1 − w) M`` with ``w = n / (n + 5)`` for ``diagonal`` (Stan's shrinkage) and
  ``w = n / (n + 5 + d)`` for ``dense`` (a window of fewer draws than ``d`` has a singular ``Σ̂``: the
  previous metric fills the directions it has not seen). A convex mix of a positive semi-definite and
  a positive-definite matrix is positive-definite, so ``M`` stays a metric;
- with ``gamma = auto``, ``γ ← c / λ_max(M^{1/2} ∇²U(θ*) M^{1/2})`` again (the Lanczos iteration of
  :func:`qlsd_flwr.core.spectral.lambda_max`).

Why a separate chain on exact gradients and not the sampling chain's burn-in: the compressed chain's
covariance carries the compression noise (inflated along every direction the messages' norms reach),
and ``M`` and ``γ`` must be the same on every engine, a function of the seed, settled before the run
folder is written (so that a checkpoint holds the frozen ``M``). The first metric is the curvature
metric (:func:`qlsd_flwr.core.curvature.metric_from_curvature`): the warm-up refines it. ``M`` is frozen
before the first sampling round, so the kept draws are those of ULA under a constant metric, and
the theory of ``docs/METRIC.md`` applies unchanged. The sampling chains continue from where the
warm-up chains end.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from qlsd_flwr.core import rng
from qlsd_flwr.core.metric import Dense, Diagonal, Metric, MetricError

#: the stream of the warm-up's noise (chain seed, ADAPT stream, warm-up round, client 0)
STREAM = rng.Stream.ADAPT
#: Stan's shares of the warm-up: the first buffer and the last, and the first slow window's length
FIRST_BUFFER, LAST_BUFFER, FIRST_WINDOW = 0.15, 0.10, 25


_LEFT = ("metric-from = adapt: the warm-up chain left the finite numbers by its round {r} (γ = {gamma:.4g}); use "
         "gamma = auto, or a smaller gamma")


class AdaptError(ValueError):
    """The warm-up chain left the finite numbers (names the window and the step)."""


def windows(rounds: int) -> list[tuple[int, int]]:
    """The slow windows ``[(start, end), ...]`` (round indices, end exclusive) of a warm-up of
    ``rounds`` rounds: doubling from :data:`FIRST_WINDOW` (scaled down for short warm-ups), the last
    stretched to end where the last buffer begins."""
    first = int(math.floor(FIRST_BUFFER * rounds))
    last_start = rounds - int(math.floor(LAST_BUFFER * rounds))
    span = last_start - first
    base = max(2, min(FIRST_WINDOW, span // 7))  # at least three doublings fit: 1 + 2 + 4 = 7 bases
    out, start, n = [], first, base
    while start < last_start:
        end = start + n
        if last_start - end < 2 * n:  # the next window would not fit: this one takes the rest
            end = last_start
        out.append((start, end))
        start, n = end, 2 * n
    return out


def pooled_cov(draws: np.ndarray, dense: bool) -> tuple[np.ndarray, int]:
    """The within-chain covariance of ``draws`` (``(n, C, d)``), pooled over the chains: the
    variances (``(d,)``) or the matrix (``(d, d)``), and the number of draws. Each chain is centred on
    its own mean, so chains that have not met do not inflate it."""
    n, C, _ = draws.shape
    x = draws - draws.mean(axis=0, keepdims=True)
    dof = max(C * (n - 1), 1)
    if dense:
        flat = x.reshape(n * C, -1)
        return (flat.T @ flat) / dof, n * C
    return np.einsum("ncd,ncd->d", x, x) / dof, n * C


def regularise(cov: np.ndarray, n: int, prev: Metric, d: int) -> Metric:
    """``w Σ̂ + (1 − w) M_prev`` (see the module docstring), as a :class:`Metric` of ``Σ̂``'s kind."""
    if cov.ndim == 1:
        w = n / (n + 5.0)
        was = prev.base
        base = was.m if isinstance(was, Diagonal) else (np.diag(was.m) if isinstance(was, Dense) else np.ones(d))
        return Diagonal(w * cov + (1.0 - w) * base)
    w = n / (n + 5.0 + d)
    was = prev.base
    base = was.m if isinstance(was, Dense) else (np.diag(was.m) if isinstance(was, Diagonal) else np.eye(d))
    return Dense(w * cov + (1.0 - w) * base)


def warmup(grad_fn: Callable[[np.ndarray], np.ndarray], starts: np.ndarray, metric: Metric, gamma: float,
           rounds: int, seed: int, temperature: float = 1.0,
           restep: Callable[[Metric], float] | None = None, state: dict | None = None,
           save: Callable[[dict], None] | None = None, every: int = 0) -> tuple[Metric, float, np.ndarray, dict]:
    """Run the warm-up (module docstring) and return ``(M, γ, θ, info)``: the frozen metric, the step,
    the chains' states at its end (``(C, d)``) and facts for the summary.

    ``starts``: ``(C, d)``; chain ``c``'s noise is stream ``(seed + c, ADAPT, r, 0)``. ``restep(M)``:
    the step for a new metric (``gamma = auto``), or ``None`` to keep ``gamma``. ``grad_fn(θ)``:
    ``∇U(θ)`` (one exchange with every client; called once per chain and round, chains in order).

    ``save(state)``, with ``every > 0``: called after every ``every``-th warm-up round with the
    warm-up's whole state (:func:`snapshot`); ``state``: such a state to continue from. The noise is
    keyed by the round and the gradients are exact, so a warm-up continued from a state is bit for
    bit the uninterrupted one.
    """
    theta = np.array(starts, dtype=np.float64, copy=True)
    C, d = theta.shape
    dense = isinstance(metric.base, Dense)
    wins = windows(rounds)
    history: list[dict] = []
    kept: list[np.ndarray] = []
    w_idx, r0 = 0, 0
    if state is not None:
        r0, w_idx, gamma, metric = int(state["r"]), int(state["w_idx"]), float(state["gamma"]), state["metric"]
        theta, kept, history = np.array(state["theta"], dtype=np.float64), list(state["kept"]), list(state["history"])
    scale = math.sqrt(2.0 * gamma * temperature)
    for r in range(r0, rounds):
        for c in range(C):
            z = rng.normal(int(seed) + c, STREAM, r, 0, d)
            theta[c] = theta[c] - gamma * metric.apply(grad_fn(theta[c])) + scale * metric.apply_root(z)
        if not np.all(np.isfinite(theta)):
            raise AdaptError(_LEFT.format(r=r, gamma=gamma))
        if w_idx < len(wins) and wins[w_idx][0] <= r < wins[w_idx][1]:
            kept.append(theta.copy())
            if r + 1 == wins[w_idx][1]:
                cov, n = pooled_cov(np.stack(kept), dense)
                try:  # a chain far out but finite overflows the covariance: the same failure
                    metric = regularise(cov, n, metric, d)
                except MetricError:
                    raise AdaptError(_LEFT.format(r=r, gamma=gamma)) from None
                if restep is not None:
                    gamma = float(restep(metric))
                    scale = math.sqrt(2.0 * gamma * temperature)
                history.append({"window": [wins[w_idx][0], wins[w_idx][1]], "draws": n, "gamma": gamma,
                                "spread": metric.spread()})
                kept, w_idx = [], w_idx + 1
        if save is not None and every > 0 and (r + 1) % every == 0 and r + 1 < rounds:
            save(snapshot(r + 1, w_idx, gamma, metric, theta, kept, history))
    info = {"adapt_rounds": rounds, "adapt_exchanges": rounds * C, "adapt_windows": history}
    return metric, gamma, theta, info


def snapshot(r: int, w_idx: int, gamma: float, metric: Metric, theta: np.ndarray, kept: list, history: list) -> dict:
    """The warm-up's state before its round ``r``: what :func:`warmup` continues from."""
    C, d = theta.shape
    return {"r": r, "w_idx": w_idx, "gamma": gamma, "metric": metric, "theta": theta.copy(),
            "kept": np.stack(kept) if kept else np.zeros((0, C, d)), "history": list(history)}
