"""Bounded influence: what one client's well-formed reply can do to θ.

A reply can pass every format check and still carry any vector QSGD can code. :class:`NormGuard`
judges each round's valid replies before any state changes. What it measures is the client's
gradient estimate the reply makes, ``ĝ_i`` (or ``η_i + ĝ_i`` for the memory variants, whose replies
are differences with norms spanning orders of magnitude), *per datum*: ``v_i = ‖·‖ / N_i`` with
``N_i`` the client's data count (its claim, clamped to
:data:`~qlsd_flwr.robust.reports.N_CLAIM_CAP` times the lower median of the claims). Every variant's
estimate is a sum over the client's data, so honest clients of different sizes have comparable
``v_i``. The reference ``R`` is taken over the last :data:`WINDOW` rounds: each client's *largest*
``v`` in the window, then the median over the clients. One client is one entry of at least
:data:`POOL_MIN`, so it cannot move that median out of the range of the honest clients' maxima;
and ``R`` follows the chain as a whole (burn-in, a chain moving away together), so divergence is
still seen as divergence. Why the maxima and not the median of all values (the rule until
2026-12-02): a network's per-datum gradients are heavy-tailed (a point the draw fits has a
gradient near 0, one it misfits a gradient of order 1), so their median falls far below what an
honest client sends when its share of the misfit points is larger for a while. Against that
median, honest single replies reached 382 R and a client's median over 16 replies 103 R on the
quickstart's network, and an honest client was excluded at round 11,609 of 20,000; against the
median of the maxima the same replies are at most 9 R (one reply) and 1.6 R (a client's mean over
16) (``benchmarks/RESULTS.md``).

* **probation:** until a client has :data:`OWN_MIN` accepted replies, a reply with
  ``v_i > FACTOR_PROBATION · R`` is rejected (``norm_bound``); :data:`OWN_MIN` such rejections in a
  row exclude it. A client that is false from its first reply never has a reply accepted.
* **after probation:** a reply with ``v_i > FACTOR_ROUND · R`` is rejected; a client whose mean
  ``v`` over its last :data:`OWN` replies (refused ones included) exceeds ``FACTOR_STEADY · R`` is
  excluded (one that turns false later, or spends its allowance in bursts).
* **excluded** (``excluded`` in ``summary.json``, named in the log): not asked again; for the
  memory variants its ``η_i`` mirror leaves the sum. The chain then samples the posterior of the
  other clients' data, the best that can be done once a client's replies are known to be false.

Measured on honest runs (``python benchmarks/bench_byzantine.py --parts honest``, whose rows
record each test's ``peaks``; every variant, p = 1 and 0.5, 1 and 4 chains, iid and Dirichlet(0.5)
logistic splits, the toy Gaussian's 11 to 198 points, an MLP on breast_cancer with clients of 5 to
299 points; and the quickstart's network over 4,000 rounds): see ``benchmarks/RESULTS.md`` for the
largest ratios, each several times under its factor. The guarantee (``docs/DEPLOYMENT.md``): one client's accepted reply is at
most ``FACTOR_ROUND · N_i · R`` in any round, at most ``FACTOR_PROBATION · N_i · R`` until it has
earned :data:`OWN_MIN` acceptances, and a client whose typical reply exceeds
``FACTOR_STEADY · N_i · R`` is out after at most :data:`OWN` replies. Within those bounds a client
is indistinguishable from an honest one whose data are unusual, which a federated posterior must
allow. What no relative rule can bound is a client that adds the same lie to every gradient it
sends: the chain moves to the lied mode, where every honest client's gradient grows with the lie,
so ``R`` follows it; only an absolute scale can. The key ``norm-bound``: ``auto`` (this rule), a
number ``B`` (every estimate, and QLSD*'s claim ``c_i``, held to ``‖·‖ ≤ B``; refused replies are
counted, never excluded; a claim over ``B`` leaves the client out before sampling) or ``off``. The ``vectorised`` engine simulates honest clients and applies no guard.
With fewer than 3 clients answering there is no robust reference and nothing is judged.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

#: a client on probation (fewer than OWN_MIN accepted replies): its limit, in units of ``R``
#: (honest clients' first 8 replies measured up to 19 R: benchmarks/byzantine_honest.json)
FACTOR_PROBATION = 30.0
#: afterwards, one reply's limit (honest single replies measured up to 40 R)
FACTOR_ROUND = 100.0
#: afterwards, the limit on a client's mean over its last OWN replies (honest measured up to 7.1 R)
FACTOR_STEADY = 30.0
WINDOW = 32  # rounds pooled into the reference
OWN = 16  # a client's own replies its mean is taken over
OWN_MIN = 8  # accepted replies that end probation; rejections in a row that exclude
POOL_MIN = 3  # distinct clients needed in the pool
#: over :data:`WINDOW` rounds, refusals of more than this share of the replies of clients still in the
#: federation stop the run (:meth:`NormGuard.storm`): the chain would otherwise stand still and end with exit 0
#: (a VR-FALD* anchor ×1e6 under ``norm-bound = 2000`` had 2,995 of 3,000 honest replies refused, 49 sd off).
#: Honest runs under ``auto`` had 0 of 498,156 replies refused (``benchmarks/byzantine_honest.json``), so a
#: share of one half is far from anything honest; under a fixed ``B`` it also says that ``B`` is below what the
#: clients send.
STORM_SHARE = 0.5


def fixed_bound(mode) -> float | None:
    """The number ``B`` of ``norm-bound = B``; ``None`` for ``auto`` and ``off``."""
    word = str(mode).strip().lower()
    return None if word in ("auto", "off") else float(mode)


class GuardStateError(ValueError):
    """A checkpoint's guard state that does not have the layout :meth:`NormGuard.state` writes."""


class NormGuard:
    """The bounded-influence rule (see the module docstring) for one chain of ``b`` clients."""

    def __init__(self, mode="auto", b: int = 1, n_data=None, measure: str = "estimate"):
        self.measure = measure  # what a norm is of (checkpoints of another measure restart the rule)
        word = str(mode).strip().lower()
        self.mode = word if word in ("off", "auto") else "fixed"
        self.fixed = fixed_bound(mode)
        self.b = int(b)
        self.set_counts(n_data)
        self.pool: deque[list[tuple[int, float]]] = deque(maxlen=WINDOW)
        self.own: dict[int, deque[float]] = {}
        self.accepted: dict[int, int] = {}  # client -> accepted replies (probation ends at OWN_MIN)
        self.streak: dict[int, int] = {}  # client -> probation rejections in a row
        self.excluded: dict[int, int] = {}  # client -> the round it was excluded at
        # the largest ratios to R of replies the rule accepted, by test (honest runs measure the
        # margins below their factors with them: benchmarks/bench_byzantine.py's honest part)
        self.peaks = {"probation": 0.0, "round": 0.0, "steady": 0.0}
        # per round of the last WINDOW: (the clients refused, the clients judged), for storm()
        self.recent: deque[tuple[list[int], list[int]]] = deque(maxlen=WINDOW)

    def set_counts(self, n_data) -> None:
        """The clients' ``N_i`` (claims; clamped as the curvature reports' scale is)."""
        from qlsd_flwr.robust.reports import clamped_counts

        self.n = clamped_counts(np.ones(self.b) if n_data is None else np.asarray(n_data), range(self.b))

    # ---- one round ----------------------------------------------------------------------------
    def reference(self, values: dict[int, float], given: float | None = None) -> float:
        """``R``: the median over clients of each one's largest non-zero per-datum norm in the window,
        this round's included (0: none); or ``given``, a reference the server computed itself."""
        if given is not None:
            return float(given) if 0 < given < math.inf else 0.0
        pooled = [(i, v) for rnd in self.pool for i, v in rnd] + list(values.items())
        top: dict[int, float] = {}  # each client's largest value in the window
        for i, v in pooled:
            if v > 0:
                top[i] = max(top.get(i, 0.0), v)
        if len({i for i, _ in pooled}) < POOL_MIN or not top:
            return 0.0
        return float(np.median(list(top.values())))

    def judge(self, norms: dict[int, float], k: int, given: float | None = None) -> tuple[dict[int, str], list[int]]:
        """This round's valid replies' norms → ``(rejected {i: reason}, newly excluded clients)``.
        Deterministic in the clients' order, whatever order the replies came in. ``given``: a
        per-datum reference the server computed itself, in place of the pool's median (FSGLD: one
        client answers a round, drawn by its data share, so the pool is not 1/b per client and a
        large client could be most of it)."""
        if self.mode == "off":
            return {}, []
        if self.mode == "fixed":
            out = {i: "norm_bound" for i, x in norms.items() if not x <= self.fixed}
            self._count(out, [i for i in norms if i not in self.excluded])
            return out, []
        values = {i: float(norms[i]) / self.n.get(i, 1) for i in sorted(norms) if i not in self.excluded}
        R = self.reference(values, given)
        rejected: dict[int, str] = {i: "excluded" for i in norms if i in self.excluded}  # a stray reply
        newly: list[int] = []
        for i, v in values.items():
            own = self.own.setdefault(i, deque(maxlen=OWN))
            if math.isfinite(v):
                own.append(v)
            if not math.isfinite(v) or R <= 0:
                if not math.isfinite(v):
                    rejected[i] = "norm_bound"
                continue
            # the mean, not the median: refused replies count too, so a client cannot spend its
            # allowance in bursts (7 rounds in 16 at 800× had every reply accepted under a median)
            steady = float(np.mean(own)) / R if len(own) >= OWN else 0.0
            if self.accepted.get(i, 0) < OWN_MIN:  # probation
                if v > FACTOR_PROBATION * R:
                    self.streak[i] = self.streak.get(i, 0) + 1
                    rejected[i] = "norm_bound"
                    if self.streak[i] >= OWN_MIN:
                        self.excluded[i], rejected[i] = int(k), "excluded"
                        newly.append(i)
                    continue
                self.peaks["probation"] = max(self.peaks["probation"], v / R)
            elif steady > FACTOR_STEADY:
                self.excluded[i], rejected[i] = int(k), "excluded"
                newly.append(i)
                continue
            elif v > FACTOR_ROUND * R:
                rejected[i] = "norm_bound"
                continue
            else:
                self.peaks["round"] = max(self.peaks["round"], v / R)
                self.peaks["steady"] = max(self.peaks["steady"], steady)
            self.streak[i] = 0
            self.accepted[i] = self.accepted.get(i, 0) + 1
        self.pool.append([(i, v) for i, v in values.items() if math.isfinite(v)])
        self._count({i: r for i, r in rejected.items() if r == "norm_bound"}, list(values))
        return rejected, newly

    def _count(self, refused: dict, judged: list) -> None:
        self.recent.append((sorted(refused), sorted(judged)))

    def storm(self) -> str | None:
        """Why the run must stop, when over the last :data:`WINDOW` rounds more than :data:`STORM_SHARE` of the
        replies of the clients still in the federation were refused (the chain then stands still); else
        ``None``. Names the clients least refused when they are a minority (an accepted client among refused
        ones is the likelier liar), and under a fixed ``B`` says it may be below what honest clients send."""
        if len(self.recent) < WINDOW:
            return None
        refused = sum(len(r) for r, _ in self.recent)
        judged = sum(len(j) for _, j in self.recent)
        if judged == 0 or refused <= STORM_SHARE * judged:
            return None
        seen = sorted({i for _, j in self.recent for i in j} - set(self.excluded))
        hit = {i for r, _ in self.recent for i in r}
        calm = [i for i in seen if i not in hit]
        why = (f"{refused} of the last {judged} replies ({WINDOW} rounds) were refused by the norm guard: the chain "
               "stands still, and its draws would not be the posterior")
        if calm and len(calm) < len(seen) / 2:
            why += (f"; client {', '.join(map(str, calm))} alone had every reply accepted: the likely cause is a "
                    "lie of theirs that moved the chain or its anchor")
        if self.mode == "fixed":
            why += f"; or norm-bound = {self.fixed:g} is below what honest clients send here: raise it or use auto"
        return why

    def limit_of(self, i: int, norms: dict[int, float], given: float | None = None) -> float:
        """Client ``i``'s limit on the norm this round (for messages), its probation counted as it
        stood before the round."""
        if self.mode == "fixed":
            return self.fixed
        R = self.reference({j: float(x) / self.n.get(j, 1) for j, x in norms.items()}, given)
        factor = FACTOR_ROUND if self.accepted.get(i, 0) >= OWN_MIN else FACTOR_PROBATION
        return factor * R * self.n.get(i, 1) if R > 0 else float("inf")

    # ---- checkpoints --------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON: the pool, each client's own values, counts and the exclusions (floats round-trip
        exactly)."""
        return {"measure": self.measure, "pool": [[[i, v] for i, v in rnd] for rnd in self.pool],
                "own": {str(i): list(o) for i, o in self.own.items()},
                "accepted": {str(i): n for i, n in self.accepted.items()},
                "streak": {str(i): n for i, n in self.streak.items()},
                "excluded": {str(i): k for i, k in self.excluded.items()},
                "recent": [[r, j] for r, j in self.recent]}

    def restore(self, s) -> None:
        """The state of :meth:`state`; ``GuardStateError`` naming the part that is not."""
        for part in (self.pool, self.own, self.accepted, self.streak, self.excluded, self.recent):
            part.clear()
        if s is None:  # a checkpoint from before this rule: start afresh
            return
        if not isinstance(s, dict):
            raise GuardStateError("'guard' is not a table")
        # norms of another quantity (a QLSD* checkpoint from before c_i + ĝ_i): the exclusions stand, the
        # reference and the probation start afresh
        same = s.get("measure", "estimate") == self.measure
        try:
            for rnd in list(s.get("pool", []))[-WINDOW:] if same else ():
                self.pool.append([(self._client(i), self._value(v)) for i, v in rnd])
            for r, j in list(s.get("recent", []))[-WINDOW:] if same else ():  # absent before the storm rule
                self.recent.append(([self._client(i) for i in r], [self._client(i) for i in j]))
            for i, o in dict(s.get("own", {}) if same else {}).items():
                self.own[self._client(i)] = deque((self._value(v) for v in list(o)[-OWN:]), maxlen=OWN)
            parts = (("accepted", self.accepted), ("streak", self.streak)) if same else ()
            for name, part in parts + (("excluded", self.excluded),):
                for i, n in dict(s.get(name, {})).items():
                    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**62:
                        raise GuardStateError(f"'guard.{name}' holds {n!r}, not an integer in [0, 2^62)")
                    part[self._client(i)] = n
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
