"""Pareto-smoothed importance sampling (Vehtari et al. 2024) for a client's LOO reply, with numpy alone.

A client answers the federated LOO with each of its points' ``elpd_loo``, ``lppd`` and Pareto ``k̂``
(:func:`qlsd_flwr.outputs.loo.psis_points`). ``arviz.psislw`` computes them, but importing ArviZ costs
a SuperNode's ``flwr-clientapp`` process about 2.5 s of CPU (xarray, pandas, matplotlib) for a
computation of milliseconds, on every LOO message. This is ArviZ 0.23's ``psislw`` for a numpy
array, step for step (ArviZ, Apache License 2.0: ``arviz/stats/stats.py``, ``psislw``, ``_psislw``,
``_gpdfit``, ``_gpinv``; ``arviz/stats/stats_utils.py``, ``logsumexp``), so its numbers are
ArviZ's, bit for bit (``tests/test_loo.py`` compares them). The server, which has ArviZ, still
builds ``az.loo``'s ``ELPDData`` from the pooled points.
"""

from __future__ import annotations

import numpy as np


def psislw(log_weights: np.ndarray, reff: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``arviz.psislw(log_weights, reff)`` (normalised) for a ``(..., S)`` array: the smoothed
    log weights (same shape) and each row's Pareto shape ``k̂`` (shape ``(...)``)."""
    lw = np.array(log_weights, dtype=np.float64)  # a copy: rows are smoothed in place
    n_samples = lw.shape[-1]
    cutoff_ind = -int(np.ceil(min(n_samples / 5.0, 3 * (n_samples / reff) ** 0.5))) - 1
    cutoffmin = np.log(np.finfo(float).tiny)
    k = np.empty(lw.shape[:-1])
    for idx in np.ndindex(k.shape):
        row, k[idx] = _psislw_row(lw[idx], cutoff_ind, cutoffmin)
        lw[idx] = row
    return lw, k


def _psislw_row(x: np.ndarray, cutoff_ind: int, cutoffmin: float) -> tuple[np.ndarray, float]:
    max_x = np.max(x)
    x -= max_x  # numerical accuracy
    x_sort_ind = np.argsort(x)
    # the log weights' body and right tail
    xcutoff = max(x[x_sort_ind[cutoff_ind]], cutoffmin)
    expxcutoff = np.exp(xcutoff)
    (tailinds,) = np.where(x > xcutoff)
    x_tail = x[tailinds]
    tail_len = len(x_tail)
    if tail_len <= 4:  # too few tail draws to fit a generalised Pareto
        k = np.inf
    else:
        x_tail_si = np.argsort(x_tail)
        x_tail = np.exp(x_tail) - expxcutoff
        k, sigma = _gpdfit(x_tail[x_tail_si])
        if np.isfinite(k):  # no smoothing where the fit failed
            sti = np.arange(0.5, tail_len) / tail_len
            smoothed_tail = np.log(_gpinv(sti, k, sigma) + expxcutoff)
            x[tailinds[x_tail_si]] = smoothed_tail
            x[x > 0] = 0  # no smoothed weight above the largest raw one
    x -= _logsumexp(x)
    return x, k


def _gpdfit(ary: np.ndarray) -> tuple[float, float]:
    """Zhang and Stephens' empirical-Bayes estimate of a generalised Pareto's shape and scale from
    sorted data, with ArviZ's weakly informative prior on the shape."""
    prior_bs = 3
    prior_k = 10
    n = len(ary)
    m_est = 30 + int(n**0.5)
    b_ary = 1 - np.sqrt(m_est / (np.arange(1, m_est + 1, dtype=float) - 0.5))
    b_ary /= prior_bs * ary[int(n / 4 + 0.5) - 1]
    b_ary += 1 / ary[-1]
    k_ary = np.log1p(-b_ary[:, None] * ary).mean(axis=1)
    len_scale = n * (np.log(-(b_ary / k_ary)) - k_ary - 1)
    weights = 1 / np.exp(len_scale - len_scale[:, None]).sum(axis=1)
    real_idxs = weights >= 10 * np.finfo(float).eps  # negligible weights dropped
    if not np.all(real_idxs):
        weights = weights[real_idxs]
        b_ary = b_ary[real_idxs]
    weights /= weights.sum()
    b_post = np.sum(b_ary * weights)
    k_post = np.log1p(-b_post * ary).mean()
    sigma = -k_post / b_post
    k_post = (n * k_post + prior_k * 0.5) / (n + prior_k)
    return k_post, sigma


def _gpinv(probs: np.ndarray, kappa: float, sigma: float) -> np.ndarray:
    """The generalised Pareto's quantile function."""
    x = np.full_like(probs, np.nan)
    if sigma <= 0:
        return x
    ok = (probs > 0) & (probs < 1)
    if np.all(ok):
        if np.abs(kappa) < np.finfo(float).eps:
            x = -np.log1p(-probs)
        else:
            x = np.expm1(-kappa * np.log1p(-probs)) / kappa
        x *= sigma
    else:
        if np.abs(kappa) < np.finfo(float).eps:
            x[ok] = -np.log1p(-probs[ok])
        else:
            x[ok] = np.expm1(-kappa * np.log1p(-probs[ok])) / kappa
        x *= sigma
        x[probs == 0] = 0
        x[probs == 1] = np.inf if kappa >= 0 else -sigma / kappa
    return x


def _logsumexp(ary: np.ndarray) -> float:
    """ArviZ's ``logsumexp`` over a 1-D array, with its order of operations."""
    ary_max = np.empty((1,), dtype=ary.dtype)
    ary.max(axis=None, keepdims=True, out=ary_max)
    ary = ary.copy()
    ary -= ary_max
    np.exp(ary, out=ary)
    out = np.empty((), dtype=ary.dtype)
    ary.sum(axis=None, keepdims=False, out=out)
    np.log(out, out=out)
    out += ary_max.squeeze()
    return ary.dtype.type(out)
