"""How one client's FSGLD surrogate precision widens the chain (issue 38): the variance law of FSGLD's
random-coefficient recursion in one coordinate, the model behind :func:`qlsd_flwr.robust.reports.cap_surrogates`
(FSGLD itself: :mod:`qlsd_flwr.core.fsgld`). Kept apart from it because the rule that uses it sits in
:mod:`qlsd_flwr.robust`, which :mod:`qlsd_flwr.core.fsgld` calls."""

from __future__ import annotations

import numpy as np


def widening(t, c, f, steps: int):
    r"""How much one client's surrogate widens a coordinate's stationary variance: ``Var / Var(exact surrogates)``
    on the local quadratic model (the toy Gaussian exactly; ``tests/test_fsgld_bounds.py`` checks it against
    ``laws_fsgld``). ``c = h A`` is the step times the coordinate's curvature ``A = P_0 + Σ_j H_j``; the client,
    drawn with probability ``f``, reports ``λ = H + t/h``. Its excess raises ``Λ`` by ``t/h``, so a round on
    another client multiplies the coordinate by ``r_o = 1 − c − t`` at each of its ``K = steps`` local steps, and
    a round on it by ``r = r_o + t/f`` (its ``(H − λ)/f`` term). With the rounds' clients independent of θ
    (and no offset: the surrogates are Taylor expansions at the mode) the variance is
    ``2h E[Σ_{m<K} r^{2m}] / (1 − E[r^{2K}])``; infinite where ``E[r^{2K}] ≥ 1``. With ``K = 1`` the ratio is
    ``(2c − c²) / (2c − c² − t² (1−f)/f)``. Arrays broadcast."""
    t, c, f = (np.asarray(x, dtype=np.float64) for x in (t, c, f))
    K = int(steps)

    def law(*rounds):  # E[Σ_{m<K} r^{2m}] / (1 − E[r^{2K}]) over the round's client: (probability, r) pairs
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # absurd reports: inf, not a warning
            num = sum(p * sum(x ** (2 * j) for j in range(K)) for p, x in rounds)
            den = 1.0 - sum(p * x ** (2 * K) for p, x in rounds)
            return np.where(den > 0, num / den, np.inf)

    ro = 1.0 - c - t
    with np.errstate(invalid="ignore", over="ignore"):
        return law((1.0 - f, ro), (f, ro + t / f)) / law((1.0, 1.0 - c))


def bisect_largest(ok, lo, hi, iters: int = 60):
    """The largest ``x`` in ``[lo, hi]`` with ``ok(x)``, elementwise by bisection (``ok`` true below some point and
    false above it): ``(lo, hi)`` around it after ``iters`` halvings. ``ok`` may be false on NaN and inf."""
    lo, hi = np.array(lo, dtype=np.float64), np.array(hi, dtype=np.float64)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        good = ok(mid)
        lo, hi = np.where(good, mid, lo), np.where(good, hi, mid)
    return lo, hi


def largest_excess(c, f, steps: int, widen: float, sign: float = 1.0, iters: int = 60):
    """The largest ``u ≥ 0`` with :func:`widening` at ``t = sign · u`` at most ``widen``, by bisection on ``[0, 2]``,
    elementwise over arrays ``c``, ``f`` (``0 < c ≤ 1``, where the widening grows with ``u`` on either side:
    ``tests/test_fsgld_bounds.py``). ``sign = −1``: how far below its curvature a client's precision may be."""
    c, f = np.broadcast_arrays(np.asarray(c, dtype=np.float64), np.asarray(f, dtype=np.float64))
    lo, _ = bisect_largest(lambda u: widening(sign * u, c, f, steps) <= widen, np.zeros(c.shape), np.full(c.shape, 2.0),
                           iters)
    # no limit where even u = 2 stays within (a lone client, f = 1: its own rounds are all the rounds)
    return np.where(widening(sign * 2.0, c, f, steps) <= widen, np.inf, lo)
