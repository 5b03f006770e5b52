"""Predictive and sample-quality metrics (numpy; arviz for R-hat/ESS; matplotlib for plots).

Predictive metrics take ``probs``: an ``(n, K)`` array of predictive probabilities
``p(y = k | x)`` (already averaged over posterior samples, e.g. by ``predict_proba``) and
integer labels ``y``. Definitions follow the supplement's "Bayesian neural networks" section:

* ``ECE = Σ_m |B_m|/n · |acc(B_m) − conf(B_m)|`` with top-1 confidence ``max_k p_k`` and
  ``M`` equal-width bins ``](m−1)/M, m/M]`` (right-closed, as written there);
* ``BS = (1/n) Σ_x Σ_c (p(c|x) − 1{y=c})²`` — summed over classes, *not* divided by ``K``
  (the supplement's normalisation), so it lies in ``[0, 2]``;
* ``nNLL = −(1/n) Σ log p(y|x)``;
* agreement: fraction of points where the top-1 predictions coincide;
* ``TV = (1/(2n)) Σ_x Σ_c |p_ref(c|x) − p(c|x)|``.

Top-1 prediction is ``argmax`` (ties go to the lowest class index, numpy's rule).

OOD detection: the supplement scores points by the predictive entropy (printed there as
``Σ p log p``, missing the minus sign; we use the usual ``−Σ p log p ≥ 0``) and classifies with
kernel density estimates of the in/out entropy densities. We report the threshold-free
AUROC of entropy as an OOD score (:func:`ood_auroc`), which does not need a bandwidth.

Sample quality: relative HPD error (§4, S5.2), errors in posterior mean/variance against a
reference (S5.2's memory ablation), R-hat and ESS (arviz).
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np


def _check(probs, y=None):
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"probs must be (n, K), got shape {p.shape}")
    if y is None:
        return p
    y = np.asarray(y, dtype=np.int64)
    if y.shape != (p.shape[0],):
        raise ValueError(f"y must have shape ({p.shape[0]},), got {y.shape}")
    return p, y


# ----------------------------------------------------------------------------- predictive
def accuracy(probs: np.ndarray, y: np.ndarray) -> float:
    """Fraction of points with ``argmax_k p_k = y``."""
    p, y = _check(probs, y)
    return float(np.mean(p.argmax(axis=1) == y))


def calibration_bins(probs: np.ndarray, y: np.ndarray, n_bins: int = 10) -> dict:
    """Per-bin counts, accuracy and mean confidence for ECE and reliability diagrams.

    Bin ``m`` (``1..M``) holds points with top-1 confidence in ``](m−1)/M, m/M]``;
    ``acc``/``conf`` are ``nan`` for empty bins.
    """
    p, y = _check(probs, y)
    if n_bins < 1:
        raise ValueError("n_bins must be >= 1")
    conf = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    # right-closed bins: bin m is the smallest m with conf <= m/M (edges m/M computed as the
    # nearest doubles, so a confidence of exactly 0.3 lands in ]0.2, 0.3]); conf = 0 -> bin 1
    edges = np.arange(n_bins + 1) / n_bins
    b = np.clip(np.searchsorted(edges, conf, side="left"), 1, n_bins) - 1
    counts = np.bincount(b, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = np.bincount(b, weights=correct, minlength=n_bins) / counts
        mconf = np.bincount(b, weights=conf, minlength=n_bins) / counts
    return {"edges": edges, "counts": counts, "acc": acc, "conf": mconf}


def ece(probs: np.ndarray, y: np.ndarray, n_bins: int = 10) -> float:
    """Expected calibration error with ``n_bins`` equal-width right-closed bins."""
    cb = calibration_bins(probs, y, n_bins)
    n = cb["counts"].sum()
    nz = cb["counts"] > 0
    return float(np.sum(cb["counts"][nz] / n * np.abs(cb["acc"][nz] - cb["conf"][nz])))


def brier(probs: np.ndarray, y: np.ndarray) -> float:
    """``(1/n) Σ_x Σ_c (p(c|x) − 1{y=c})²`` (supplement's normalisation: no ``1/K``)."""
    p, y = _check(probs, y)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(y)), y] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=1)))


def nnll(probs: np.ndarray, y: np.ndarray, eps: float = 1e-300) -> float:
    """Mean negative log predictive probability of the true label (``p`` floored at ``eps``)."""
    p, y = _check(probs, y)
    return float(-np.mean(np.log(np.maximum(p[np.arange(len(y)), y], eps))))


def agreement(probs: np.ndarray, probs_ref: np.ndarray) -> float:
    """Fraction of points whose top-1 predictions under ``probs`` and ``probs_ref`` coincide."""
    p, q = _check(probs), _check(probs_ref)
    if p.shape != q.shape:
        raise ValueError(f"shape mismatch {p.shape} vs {q.shape}")
    return float(np.mean(p.argmax(axis=1) == q.argmax(axis=1)))


def total_variation(probs: np.ndarray, probs_ref: np.ndarray) -> float:
    """Mean over points of ``½ Σ_c |p_c − q_c|``."""
    p, q = _check(probs), _check(probs_ref)
    if p.shape != q.shape:
        raise ValueError(f"shape mismatch {p.shape} vs {q.shape}")
    return float(np.mean(0.5 * np.abs(p - q).sum(axis=1)))


tv = total_variation


def predictive_entropy(probs: np.ndarray) -> np.ndarray:
    """``−Σ_c p_c log p_c`` per point (``0 log 0 = 0``), natural log."""
    p = _check(probs)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(p > 0, p * np.log(p), 0.0)
    return -t.sum(axis=1)


def auroc(scores_pos: np.ndarray, scores_neg: np.ndarray) -> float:
    """``P(S_pos > S_neg) + ½ P(S_pos = S_neg)`` via mid-ranks (Mann–Whitney U / (n₊n₋))."""
    from scipy.stats import rankdata

    sp = np.asarray(scores_pos, dtype=np.float64).ravel()
    sn = np.asarray(scores_neg, dtype=np.float64).ravel()
    if len(sp) == 0 or len(sn) == 0:
        raise ValueError("auroc needs at least one positive and one negative score")
    r = rankdata(np.concatenate([sp, sn]))  # average ranks for ties
    u = r[: len(sp)].sum() - len(sp) * (len(sp) + 1) / 2.0
    return float(u / (len(sp) * len(sn)))


def ood_auroc(probs_in: np.ndarray, probs_out: np.ndarray) -> float:
    """AUROC of predictive entropy for telling OOD (positive) from in-distribution points."""
    return auroc(predictive_entropy(probs_out), predictive_entropy(probs_in))


def selective_accuracy(probs: np.ndarray, y: np.ndarray, taus: Sequence[float]) -> np.ndarray:
    """Accuracy on ``{x : max_k p_k ≥ τ}`` for each ``τ`` (``nan`` if empty); supplement's
    accuracy-vs-credibility curve."""
    p, y = _check(probs, y)
    conf, ok = p.max(axis=1), p.argmax(axis=1) == y
    out = []
    for t in taus:
        m = conf >= t
        out.append(float(ok[m].mean()) if m.any() else float("nan"))
    return np.array(out)


def reliability_diagram(probs: np.ndarray, y: np.ndarray, n_bins: int = 10,
                        path: str | os.PathLike | None = None, title: str | None = None) -> dict:
    """Plot accuracy vs confidence per bin (bars) against the diagonal; write a PNG at ``path``.

    Uses matplotlib's Agg canvas directly (no pyplot, no global backend change). Returns the
    bin table of :func:`calibration_bins` plus ``ece``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cb = calibration_bins(probs, y, n_bins)
    e = ece(probs, y, n_bins)
    if path is not None:
        fig = Figure(figsize=(4.2, 4.2))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        width = 1.0 / n_bins
        centers = cb["edges"][:-1] + width / 2
        acc = np.nan_to_num(cb["acc"])
        ax.bar(centers, acc, width=width, edgecolor="black", color="tab:blue", label="accuracy")
        conf = np.where(cb["counts"] > 0, np.nan_to_num(cb["conf"]), acc)
        # the gap between accuracy and mean confidence, whichever is higher (over- or under-confident)
        ax.bar(centers, np.abs(conf - acc), bottom=np.minimum(acc, conf), width=width,
               edgecolor="tab:red", color="tab:red", alpha=0.3, label="gap to confidence")
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
        ax.set_title(title or f"ECE = {e:.4f} ({n_bins} bins)")
        ax.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(os.fspath(path), dpi=120)
    return {**{k: v.tolist() for k, v in cb.items()}, "ece": e}


# ----------------------------------------------------------------------------- sample quality
def hpd_threshold(U_values: np.ndarray, alpha: float = 0.01) -> float:
    """``η_α``: the ``(1 − α)`` empirical quantile of ``U(θ)`` over samples.

    The ``(1−α)`` HPD region is ``{θ : U(θ) ≤ η_α}``. Quantile by numpy's default (linear)
    interpolation.
    """
    u = np.asarray(U_values, dtype=np.float64).ravel()
    if not 0 < alpha < 1:
        raise ValueError("alpha must be in (0, 1)")
    return float(np.quantile(u, 1.0 - alpha))


def hpd_error(U_samples: np.ndarray, U_ref: np.ndarray, alpha: float = 0.01) -> float:
    """Relative HPD error ``|η_α − η_α^ref| / |η_α^ref|`` (paper §4, S5.2)."""
    eta, eta_ref = hpd_threshold(U_samples, alpha), hpd_threshold(U_ref, alpha)
    return float(abs(eta - eta_ref) / abs(eta_ref))


def _flat(samples) -> np.ndarray:
    s = np.asarray(samples, dtype=np.float64)
    return s.reshape(-1, s.shape[-1]) if s.ndim > 1 else s.reshape(-1, 1)


def mean_error(samples: np.ndarray, ref_mean: np.ndarray, relative: bool = False) -> float:
    """``‖mean(samples) − ref_mean‖₂`` (divided by ``‖ref_mean‖₂`` if ``relative``).

    ``samples``: ``(n, d)`` or ``(chain, draw, d)``; leading axes are pooled.
    """
    s = _flat(samples)
    ref = np.asarray(ref_mean, dtype=np.float64).ravel()
    err = float(np.linalg.norm(s.mean(axis=0) - ref))
    return err / float(np.linalg.norm(ref)) if relative else err


def var_error(samples: np.ndarray, ref_var: np.ndarray, relative: bool = False,
              ddof: int = 1) -> float:
    """``‖var(samples) − ref_var‖₂`` per-coordinate variances (unbiased, ``ddof=1``)."""
    s = _flat(samples)
    ref = np.asarray(ref_var, dtype=np.float64).ravel()
    err = float(np.linalg.norm(s.var(axis=0, ddof=ddof) - ref))
    return err / float(np.linalg.norm(ref)) if relative else err


def moment_errors(samples: np.ndarray, ref_samples: np.ndarray) -> dict:
    """Mean and variance errors (absolute and relative) against reference *samples*."""
    r = _flat(ref_samples)
    m, v = r.mean(axis=0), r.var(axis=0, ddof=1)
    return {"mean_error": mean_error(samples, m), "var_error": var_error(samples, v),
            "rel_mean_error": mean_error(samples, m, relative=True),
            "rel_var_error": var_error(samples, v, relative=True)}

