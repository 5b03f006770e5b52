"""Stationary mean and variance of each variant on the toy Gaussian, derived in closed form.

Write ``e_k = θ_k − ȳ`` (flat prior, so ``θ* = ȳ``), ``N = Σ N_i`` and the round's gradient
``g = N e_k + ε_k`` with ``E[ε_k | F_k] = 0`` (every variant's aggregate is unbiased). Then

    e_{k+1} = (1 − γN) e_k − γ ε_k + √(2γ) Z_{k+1}

so ``E[e] = 0`` (the sample mean must hit ``ȳ``), the lag-m autocorrelation is exactly
``r^m`` with ``r = 1 − γN``, and per coordinate ``v = E‖e‖²/d`` solves

    v · (1 − r²) = 2γ + γ² E‖ε‖² / d.                                    (*)

With ``ε = 0`` this is ULA's ``v = 1/(N(1 − γN/2))`` (ALGORITHMS.md). The gradient noise of each
variant, with ``B_i ~ Bernoulli(p_i)`` and weight ``1/p_i`` (unbiased rule), QSGD noise ``c_i``
with ``0 ≤ E‖c_i‖² ≤ ω_i‖x_i‖²`` for message ``x_i``, and the minibatch noise ``m_i`` of
sampling ``n_i`` of ``N_i`` points without replacement, ``E‖m_i‖² = N_i² σ_i²/n_i · (1 − n_i/N_i)``:

* QLSD* / LSD*: ``H_i = N_i e`` exactly, so
  ``E‖ε‖² = Σ(1/p_i − 1) N_i² d v + Σ (1/p_i) E‖c_i‖²``.
* QLSD (full local gradients): as QLSD# with ``m_i = 0``.
* QLSD#: ``H_i = N_i(θ − ȳ_i) + m_i``, so ``E‖ε‖² = Σ(1/p_i − 1) N_i²(‖ȳ − ȳ_i‖² + d v)
  + Σ (1/p_i) E‖m_i‖² + Σ (1/p_i) E‖c_i‖²`` — the heterogeneity ``‖ȳ − ȳ_i‖²`` enters.
* QLSD++ / LSD++ (α = 1/(1+ω) → 1 as ω → 0): ``H_i = N_i(θ − ȳ_i)`` exactly, and the memory
  holds ``η_i = H_i(θ_{k'})`` from the client's last active round ``k' < k``, so the message is
  ``v_i = N_i(θ_k − θ_{k'})`` with ``E‖v_i‖² = 2 N_i² d v (1 − E r^{k−k'})`` and
  ``E r^{k−k'} = p_i r / (1 − (1 − p_i) r)`` (geometric gaps). ``E‖ε‖² = Σ(1/p_i − 1)E‖v_i‖²
  + Σ (1/p_i) E‖c_i‖²``. (Exact for ω = 0; the tests use ω ≤ 1e-8 here.)

Solving (*) with the compression term at its two extremes (0 and the ω bound) gives an interval
``[v_lo, v_hi]`` that must contain the chain's variance, up to Monte Carlo error.
"""

from __future__ import annotations

import numpy as np


def omega(s: int, d: int) -> float:
    return min(d / s**2, np.sqrt(d) / s)


def variance_band(task, variant: str, gamma: float, p: float, s: int | None, batch_fraction: float = 0.1):
    """``(v_lo, v_hi)`` per coordinate for ``variant`` (``s=None``: uncompressed)."""
    d = task.dim
    ys = [c.y for c in task.clients]
    n_i = np.array([y.shape[0] for y in ys], dtype=float)
    N = n_i.sum()
    ybar = np.concatenate(ys).mean(axis=0)
    r = 1.0 - gamma * N
    a = 1.0 - r * r
    w = 0.0 if s is None else omega(s, d)
    inv_p = 1.0 / p
    if variant in ("qlsd-star", "lsd-star"):
        P = np.sum((inv_p - 1) * n_i**2)
        Cq = np.sum(w * inv_p * n_i**2)
        return 2 * gamma / (a - gamma**2 * P), 2 * gamma / (a - gamma**2 * (P + Cq))
    if variant in ("qlsd-sharp", "qlsd"):
        nb = np.maximum(1, np.floor(n_i * batch_fraction)) if variant == "qlsd-sharp" else n_i
        het = np.array([np.sum((y.mean(axis=0) - ybar) ** 2) for y in ys])
        sig2 = np.array([np.sum((y - y.mean(axis=0)) ** 2) / (y.shape[0] - 1) for y in ys])
        M = n_i**2 * sig2 / nb * (1 - nb / n_i)  # 0 for the full gradient (n_i = N_i)
        A = np.sum((inv_p - 1) * n_i**2 * het)
        P = np.sum((inv_p - 1) * n_i**2)
        Msum = np.sum(inv_p * M)
        lo = (2 * gamma + gamma**2 * (A + Msum) / d) / (a - gamma**2 * P)
        Cq0 = np.sum(w * inv_p * (n_i**2 * het + M))
        Cq1 = np.sum(w * inv_p * n_i**2)
        hi = (2 * gamma + gamma**2 * (A + Msum + Cq0) / d) / (a - gamma**2 * (P + Cq1))
        return lo, hi
    if variant in ("qlsd-pp", "lsd-pp"):
        phi = 1.0 - p * r / (1.0 - (1.0 - p) * r)
        V = np.sum(2 * n_i**2 * phi)  # E‖v_i‖² = V_i d v
        lo = 2 * gamma / (a - gamma**2 * np.sum((inv_p - 1) * 2 * n_i**2 * phi))
        hi = 2 * gamma / (a - gamma**2 * (np.sum((inv_p - 1) * 2 * n_i**2 * phi) + w * inv_p * V))
        return lo, hi
    raise ValueError(variant)


def check_chain(trace: np.ndarray, task, gamma: float, band, z: float = 4.0, n_batches: int = 25) -> dict:
    """Mean and variance checks of a chain ``trace (K, d)`` (after burn-in) against theory.

    * mean: ``T = K(1−r)/((1+r) v̂) · mean_j ē_j²`` is ≈ χ²_d/d under ``E e = 0`` (AR(1) with lag
      correlation ``r``); we require it below the χ²_d quantile at 1 − 1e-4.
    * variance: ``v̂ = mean(e²)`` must lie in ``[v_lo − z·SE, v_hi + z·SE]``, SE from batch means.
    """
    from scipy import stats

    N = float(sum(c.n_data for c in task.clients))
    r = 1.0 - gamma * N
    e = trace - np.asarray(task.posterior_mean)
    K, d = e.shape
    v_hat = float(np.mean(e * e))
    batches = np.array([np.mean(b * b) for b in np.array_split(e, n_batches)])
    se = float(batches.std(ddof=1) / np.sqrt(n_batches))
    ebar = e.mean(axis=0)
    T = float(K * (1 - r) / ((1 + r) * v_hat) * np.mean(ebar**2))
    T_max = float(stats.chi2.ppf(1 - 1e-4, d) / d)
    lo, hi = band
    return {"v_hat": v_hat, "se": se, "v_lo": lo, "v_hi": hi, "T": T, "T_max": T_max,
            "mean_ok": T <= T_max, "var_ok": lo - z * se <= v_hat <= hi + z * se,
            "ratio_to_posterior": v_hat * N}
