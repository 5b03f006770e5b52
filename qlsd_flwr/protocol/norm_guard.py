"""A bound on the norm of a decoded reply: the defence against a Byzantine but well-formed reply.

A reply can pass every format check and still carry any vector QSGD can code: a norm up to
float32's 3.4e38, which one unbiased step (weight ``1/p_i``) turns into a θ that no honest round
brings back. :class:`NormGuard` rejects, before any state changes, a reply whose ``‖ĝ_i‖``
exceeds the round's limit (counted as ``norm_bound``). The key ``norm-bound``:

* ``auto`` (default): the limit is ``FACTOR`` (1000) times a robust reference — the median of
  this round's reply norms when there are at least 3 replies (an attacker is one of them and
  cannot move the median out of the honest range), else the median of the last ``HISTORY``
  accepted norms (at least 3 needed; before that, no limit). A chain that moves away as a
  whole (all replies grow together, e.g. a step that diverges) is not an outlier of its own
  round, so divergence is still seen as divergence.
* a number: a fixed limit on ``‖ĝ_i‖``;
* ``off``: no limit (the behaviour before this guard).

What it costs: an honest reply is rejected only if its norm is over 1000 times the round's
median, i.e. a client whose gradient dwarfs every other; then that round's step lacks it (a
bias in that round, counted, never silent). At the default settings on the toy Gaussian and
logistic tasks no honest reply was rejected (``benchmarks/bench_byzantine.py``). The ``vectorised``
engine simulates honest clients only and applies no guard. Limits: an attacker in the first
rounds of a run with fewer than 3 replies per round passes; replies just under the limit are
accepted (their effect is bounded by the limit, not removed).
"""

from __future__ import annotations

from collections import deque

import numpy as np

FACTOR = 1000.0
HISTORY = 256


class NormGuard:
    """The limit on ``‖ĝ_i‖`` for each round (see the module docstring)."""

    def __init__(self, mode="auto"):
        m = str(mode).strip().lower()
        self.mode = "off" if m == "off" else "auto" if m == "auto" else "fixed"
        self.fixed = float(mode) if self.mode == "fixed" else None
        self.history: deque[float] = deque(maxlen=HISTORY)

    def limit(self, round_norms) -> float:
        """The limit for this round's replies, given their norms (``inf``: none)."""
        if self.mode == "off":
            return float("inf")
        if self.mode == "fixed":
            return self.fixed
        norms = sorted(float(x) for x in round_norms)
        if len(norms) >= 3 and (m := float(np.median(norms))) > 0:
            return FACTOR * m
        # few replies, or a median of zero (QSGD may code an honest message as all zeros): the
        # recent accepted non-zero norms are the reference
        if len(self.history) >= 3:
            return FACTOR * float(np.median(np.asarray(self.history)))
        return float("inf")

    def record(self, accepted_norms) -> None:
        """Remember the accepted non-zero norms (in client order, so a resumed run sees the same
        history)."""
        self.history.extend(float(x) for x in accepted_norms if x > 0)

    def state(self) -> np.ndarray:
        return np.asarray(self.history, dtype=np.float64)

    def restore(self, history) -> None:
        self.history.clear()
        self.history.extend(float(x) for x in np.asarray(history, dtype=np.float64).ravel())
