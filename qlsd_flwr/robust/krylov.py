"""The low-rank correction's Hessian-vector products held by the leave-one-out rule (issue 38).

``metric-rank = k`` (:mod:`qlsd_flwr.core.lowrank`) sends blocks of vectors ``W = R X`` and sums the clients'
products ``P_i = ∇²U_i W``; from them it builds a block Krylov space ``K = [x_0 … x_{n−1}]`` and maps the
preconditioned curvature's Ritz values there to 1. A client's products reach the metric through the curvature
projected on that space, ``T = Kᵀ B K``, whose entry ``(a, b)`` is ``w_a · (P_0 + Σ_i ∇²U_i) w_b``. This module
keeps each client's share ``T_i[a, b] = w_a · P_i[b]`` as its products arrive (a block's products against every
vector sent so far: the entries on and above the diagonal), and takes the entries below as their transposes, as
an honest client's symmetric ``∇²U_i`` gives them; the prior's share ``T_0`` the same way. ``T`` is then
``T_0 + Σ_i s_i T_i``: what a client sent below the diagonal (its part along the next block's directions) only
steers which directions are explored and which Ritz pairs converge, never the values the metric takes.

**The rule** is the curvature reports' (:func:`qlsd_flwr.robust.reports.cap_leave_one_out`, with its
:data:`~qlsd_flwr.robust.reports.FACTOR_SHARE`): client ``i``'s share may raise what the prior and the other
clients give in the space, ``R_i = T_0 + Σ_{k≠i} T_k⁺``, by at most ``1 + a_i`` in any direction, and lower it by
at most the same factor, ``a_i = FACTOR_SHARE · N_i/N_{−i}``:

    −a_i/(1 + a_i) R_i ⪯ s_i T_i ⪯ a_i R_i,

``s_i`` the largest scale in ``[0, 1]`` that keeps both (the extreme generalised eigenvalues of ``(T_i, R_i)``),
with ``T_k⁺`` each other client's share's positive semi-definite part (an honest convex client's
share is that already), so that a negative lie cannot shrink the others' references and get them held.
So along any direction of the space, one client moves the corrected metric by at most ``1 + a_i`` either way
(17.7× for one client of ten equal ones), and it cannot make the curvature indefinite, which would leave the
metric uncorrected. The Krylov space and the residuals that pick the converged Ritz pairs rest on the products as
they were summed, so when a client is scaled the correction is made once more with its products scaled from
the start, and left out of a third pass if it is over again (:data:`PASSES`; every pass's exchanges are counted). Honest clients
used at most 0.728 of the allowance over the 37 cases of ``python benchmarks/bench_honest_claims.py``
(``worst_lowrank``; digits over 20 clients, a client alone with ink in some pixels) and 0.163 on the main job's
split (``lowrank_loo_share`` in every run's summary): a margin of 1.37×. An honest client held by mistake costs one
more pass and some mixing, never bias (any SPD metric keeps the posterior). With fewer than ``POOL_MIN`` clients
nothing is judged.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.robust.reports import POOL_MIN, share_allowance

#: passes of the correction: the first as the products came; a second with a held client's products scaled from the
#: start by :data:`CARRY` times the scale the first found (its new Krylov space differs, and at the exact boundary it
#: would be over again: measured with the review's calibrated lie, whose second pass then left no Ritz pair converged,
#: the scale applied to ``T`` alone no longer matching the products); a third, only when a client is over the rule
#: in both, without that client's products (scale 0). Each pass's exchanges are counted
PASSES = 3
CARRY = 0.5
#: the prior's key among the shares
PRIOR = "prior"


class KrylovShares:
    """Each client's share of the correction's projected curvature, kept block by block (module docstring)."""

    def __init__(self):
        self._W: list[np.ndarray] = []  # the blocks sent, (b, d) each
        self._cols: dict = {}  # key -> [(block index, (n_so_far, b) = W_{≤m} P_mᵀ)], the blocks it answered
        self.scales: dict[int, float] = {}  # clients held in the last gram(), and their scale
        self.share_max = 0.0  # the largest share of its allowance any client used (honest maxima)
        self.unjudged: list[int] = []  # clients whose reference was not positive-definite (not judged)

    def add(self, W: np.ndarray, parts: dict, prior: np.ndarray) -> None:
        """Block ``W`` (``(b, d)``, as the clients received it) and its products: ``parts`` ``{i: (b, d)}`` (as held
        and summed), ``prior`` the prior's ``(b, d)``."""
        m = len(self._W)
        self._W.append(np.asarray(W, dtype=np.float64))
        W_all = np.concatenate(self._W)
        keys = [PRIOR] + sorted(parts)
        stacked = np.concatenate([prior] + [parts[i] for i in sorted(parts)])  # one product for every key
        cols = W_all @ stacked.T
        b = W.shape[0]
        for j, key in enumerate(keys):
            self._cols.setdefault(key, []).append((m, cols[:, j * b:(j + 1) * b]))

    def _matrix(self, key) -> np.ndarray:
        b = self._W[0].shape[0] if self._W else 0
        n = b * len(self._W)
        T = np.zeros((n, n))
        seen = np.zeros(n)
        for m, c in self._cols.get(key, []):
            T[:c.shape[0], m * b:(m + 1) * b] = c
            seen[m * b:(m + 1) * b] = 1.0
        T = T + T.T  # the entries below the diagonal blocks as the transposes of those above
        for m in range(len(self._W)):
            T[m * b:(m + 1) * b, m * b:(m + 1) * b] *= 0.5  # each diagonal block: its symmetric part
        # a block the client did not answer (refused, or no reply) is not in its share, its rows as well as its
        # columns: with only the columns gone, an honest share would be indefinite (review, 2026-12-03)
        return T * np.outer(seen, seen)

    def gram(self, n_data) -> np.ndarray:
        """``T = T_0 + Σ_i s_i T_i`` with every client held to the rule (``n_data``: the clients' ``N_i``, whose
        shares give each one's allowance, :func:`qlsd_flwr.robust.reports.share_allowance`); sets :attr:`scales`
        (the clients scaled), :attr:`share_max` and :attr:`unjudged`."""
        shares = {k: self._matrix(k) for k in self._cols}
        T0 = shares.pop(PRIOR, None)
        allow = share_allowance(n_data, sorted(shares))
        n = T0.shape[0] if T0 is not None else 0
        if T0 is None:
            T0 = np.zeros((0, 0))
        s = {i: 1.0 for i in shares}
        self.scales, self.share_max, self.unjudged = {}, 0.0, []
        if len(shares) >= POOL_MIN and n:
            # each client is judged against the prior and the others' semi-definite parts: a share that is negative
            # somewhere (a lie; an honest convex client's is not) cannot make another client's reference smaller and
            # so get honest clients held (review, 2026-12-03: a calibrated negative lie did that, and escaped the bound)
            psd = {i: _psd_part(T) for i, T in shares.items()}
            total = T0 + sum(psd.values())
            for i in sorted(shares):
                ext = _extremes(shares[i], total - psd[i])
                if ext is None:
                    self.unjudged.append(i)
                    continue
                low, high = ext
                a = float(allow.get(i, 0.0))
                down = a / (1.0 + a)
                used = max(high / a if a > 0 else np.inf, -low / down if down > 0 else np.inf, 0.0)
                self.share_max = max(self.share_max, used)
                if used > 1.0:
                    s[i] = min(1.0, a / high if high > a else 1.0, down / -low if -low > down else 1.0)
                    self.scales[i] = s[i]
        return T0 + sum((s[i] * shares[i] for i in sorted(shares)), np.zeros((n, n)))


def _psd_part(T: np.ndarray) -> np.ndarray:
    """``T``'s positive semi-definite part (its negative eigenvalues set to zero)."""
    w, Q = np.linalg.eigh(0.5 * (T + T.T))
    return (Q * np.maximum(w, 0.0)) @ Q.T


def _extremes(share: np.ndarray, rest: np.ndarray) -> tuple[float, float] | None:
    """The smallest and largest generalised eigenvalue of ``(share, rest)``: ``min/max_u uᵀ share u / uᵀ rest u``;
    ``None`` when ``rest`` is not positive-definite (a model not convex at θ*: nothing to hold the share to, and
    the correction is then skipped anyway, ``lowrank_skipped``). A ridge of 1e-12 of ``rest``'s mean diagonal makes
    a direction only this client constrains (a flat prior) a huge excess: held, as the curvature reports are."""
    from scipy.linalg import LinAlgError, eigh

    if not np.any(share):
        return 0.0, 0.0
    scale = float(np.trace(rest)) / max(rest.shape[0], 1)
    if not scale > 0:
        return None
    try:
        w = eigh(0.5 * (share + share.T), rest + 1e-12 * scale * np.eye(rest.shape[0]), eigvals_only=True)
    except (LinAlgError, ValueError):
        return None
    return float(w[0]), float(w[-1])
