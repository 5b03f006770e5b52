"""Bounded influence: what one client's well-formed reply can do to θ.

A reply can pass every format check and still carry any vector QSGD can code. :class:`NormGuard`
judges the decoded ``ĝ_i`` of each round before any state changes. Its scale is the reply's norm
*per datum*, ``v_i = ‖ĝ_i‖ / N_i`` (``N_i`` the client's data count, a claim clamped to
:data:`~qlsd_flwr.core.metric.REPORT_CAP` times the lower median of the claims): every variant's
reply is a sum over the client's data (``∇U_i``, ``∇U_i(θ) − ∇U_i(θ*)``, ``H_i − η_i``), so honest
clients of different sizes have comparable ``v_i``. Measured on Dirichlet(0.5) splits (logistic,
clients of 11 to 65 points; toy Gaussian, 11 to 198; every variant, p = 1 and 0.5): an honest
client's median ``v_i`` over 16 replies reached at most 9.5× the federation's, while single
replies of the memory variants spiked to 48× it (4,000 rounds).
So the rule separates what is *steady* from what is *transient*:

* **the reference** ``R``: the median of every valid reply's ``v`` over the last :data:`WINDOW`
  rounds, all clients pooled (one client is at most ``1/b`` of the pool and cannot move its median
  out of the honest range when at least 3 clients answer). It follows the chain as a whole (burn-in,
  a chain moving away together), so divergence is still seen as divergence.
* **per round:** a reply with ``v_i > FACTOR_ROUND · R`` is rejected (``norm_bound``); a client's
  first :data:`OWN_MIN` replies (no history yet: probation) are held to ``FACTOR_STEADY · R``;
* **steady:** a client whose median ``v`` over its last :data:`OWN` valid replies exceeds
  ``FACTOR_STEADY · R`` is *excluded* for the rest of the run (``excluded``, named in the log and
  in ``summary.json``): it is not asked again, and for the memory variants its ``η_i`` mirror
  leaves the sum. The chain then samples the posterior of the other clients' data, the best that
  can be done once a client's replies are known to be false.

The guarantee (``docs/DEPLOYMENT.md``): one client's accepted reply is at most
``FACTOR_ROUND · N_i · R`` in norm in any round, and a client whose typical reply exceeds
``FACTOR_STEADY · N_i · R`` is out after at most :data:`OWN` replies. Within those bounds a client
is indistinguishable from an honest one whose data are unusual, which is what a federated
posterior must allow. The key ``norm-bound``: ``auto`` (this rule), a number (a fixed limit on
``‖ĝ_i‖``, no exclusion) or ``off``. The ``vectorised`` engine simulates honest clients and applies
no guard. With fewer than 3 clients answering there is no robust reference and nothing is judged.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

#: a single reply's limit, in units of the federation's per-datum reference (honest replies of the
#: memory variants measured up to 48× in 4,000 rounds)
FACTOR_ROUND = 200.0
#: a client's typical reply (its median over :data:`OWN` replies) beyond this multiple of the
#: reference is steady, not a spike (honest clients measured up to 9.5×)
FACTOR_STEADY = 30.0
WINDOW = 32  # rounds pooled into the reference
OWN = 16  # a client's own replies its median is taken over
OWN_MIN = 8  # replies needed before a client can be excluded
POOL_MIN = 3  # distinct clients needed in the pool


class GuardStateError(ValueError):
    """A checkpoint's guard state that does not have the layout :meth:`NormGuard.state` writes."""


class NormGuard:
    """The bounded-influence rule (see the module docstring) for one chain of ``b`` clients."""

    def __init__(self, mode="auto", b: int = 1, n_data=None):
        m = str(mode).strip().lower()
        self.mode = "off" if m == "off" else "auto" if m == "auto" else "fixed"
        self.fixed = float(mode) if self.mode == "fixed" else None
        self.b = int(b)
        self.set_counts(n_data)
        self.pool: deque[list[tuple[int, float]]] = deque(maxlen=WINDOW)
        self.own: dict[int, deque[float]] = {}
        self.excluded: dict[int, int] = {}  # client -> the round it was excluded at

    def set_counts(self, n_data) -> None:
        """The clients' ``N_i`` (claims; clamped as the curvature reports' scale is)."""
        from qlsd_flwr.core.metric import clamped_counts

        clients = range(self.b)
        self.n = clamped_counts(np.ones(self.b) if n_data is None else np.asarray(n_data), clients)

    # ---- one round ----------------------------------------------------------------------------
    def reference(self, values: dict[int, float]) -> float:
        """``R``: the median of the pooled non-zero per-datum norms, this round's included (0: none)."""
        pooled = [(i, v) for rnd in self.pool for i, v in rnd] + list(values.items())
        nz = [v for _, v in pooled if v > 0]
        if len({i for i, _ in pooled}) < POOL_MIN or not nz:
            return 0.0
        return float(np.median(nz))

    def judge(self, norms: dict[int, float], k: int) -> tuple[dict[int, str], list[int]]:
        """This round's valid replies' norms → ``(rejected {i: reason}, newly excluded clients)``.
        Deterministic in the clients' order, whatever order the replies came in."""
        if self.mode == "off":
            return {}, []
        if self.mode == "fixed":
            return {i: "norm_bound" for i, x in norms.items() if not x <= self.fixed}, []
        values = {i: float(norms[i]) / self.n.get(i, 1) for i in sorted(norms)}
        R = self.reference(values)
        rejected: dict[int, str] = {}
        newly: list[int] = []
        for i, v in values.items():
            if i in self.excluded:  # the server asks it no more; a stray reply changes nothing
                rejected[i] = "excluded"
                continue
            if not math.isfinite(v):
                rejected[i] = "norm_bound"
                continue
            own = self.own.setdefault(i, deque(maxlen=OWN))
            # a client without a history yet is on probation: its replies are held to the steady
            # factor (an honest client's first 8 replies measured within 5.9× the reference)
            factor = FACTOR_ROUND if len(own) >= OWN_MIN else FACTOR_STEADY
            own.append(v)
            if R > 0 and len(own) >= OWN_MIN and float(np.median(own)) > FACTOR_STEADY * R:
                self.excluded[i] = int(k)
                newly.append(i)
                rejected[i] = "excluded"
            elif R > 0 and v > factor * R:
                rejected[i] = "norm_bound"
        self.pool.append([(i, v) for i, v in values.items() if math.isfinite(v) and i not in self.excluded])
        return rejected, newly

    def limit_of(self, i: int, norms: dict[int, float]) -> float:
        """Client ``i``'s limit on ``‖ĝ_i‖`` for a round whose replies had ``norms`` (for messages)."""
        if self.mode == "fixed":
            return self.fixed
        R = self.reference({j: float(x) / self.n.get(j, 1) for j, x in norms.items()})
        factor = FACTOR_ROUND if len(self.own.get(i, ())) > OWN_MIN else FACTOR_STEADY
        return factor * R * self.n.get(i, 1) if R > 0 else float("inf")

    # ---- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON: the pool, each client's own replies and the exclusions (floats round-trip exactly)."""
        return {"pool": [[[i, v] for i, v in rnd] for rnd in self.pool],
                "own": {str(i): list(o) for i, o in self.own.items()},
                "excluded": {str(i): k for i, k in self.excluded.items()}}

    def restore(self, s) -> None:
        """The state of :meth:`state`; ``GuardStateError`` naming the part that is not."""
        self.pool.clear()
        self.own.clear()
        self.excluded.clear()
        if s is None:  # a checkpoint from before this rule: start afresh
            return
        if not isinstance(s, dict):
            raise GuardStateError("'guard' is not a table")
        try:
            for rnd in list(s.get("pool", []))[-WINDOW:]:
                self.pool.append([(self._client(i), self._value(v)) for i, v in rnd])
            for i, o in dict(s.get("own", {})).items():
                self.own[self._client(i)] = deque((self._value(v) for v in list(o)[-OWN:]), maxlen=OWN)
            for i, k in dict(s.get("excluded", {})).items():
                if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < 2**62:
                    raise GuardStateError(f"'guard.excluded' round {k!r} is not an integer in [0, 2^62)")
                self.excluded[self._client(i)] = k
        except (TypeError, ValueError) as exc:
            if isinstance(exc, GuardStateError):
                raise
            raise GuardStateError(f"'guard' does not have the layout of a checkpoint: {exc}") from None

    def _client(self, i) -> int:
        try:
            j = int(i) if isinstance(i, (int, str)) and not isinstance(i, bool) else None
        except ValueError:
            j = None
        if j is None or not 0 <= j < self.b:
            raise GuardStateError(f"'guard' names client {i!r}, not one of 0..{self.b - 1}")
        return j

    @staticmethod
    def _value(v) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
            raise GuardStateError(f"'guard' holds {v!r}, not a finite norm >= 0")
        return float(v)
