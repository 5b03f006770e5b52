"""Whether a run's chains mixed: the report every path ends with (log, ``summary.json``,
``samples.nc``, ``overview.png``).

Over θ's coordinates: ArviZ's rank-normalised split R-hat and bulk/tail ESS (Vehtari et al.
2021), the worst coordinates named; over the kept window: whether ``‖θ‖`` still trends (a
Geweke-style comparison of its first and last thirds, with each third's ESS as its sample size;
the held-out log-likelihood too, once a classification run is evaluated).
The verdict is ``MIXED`` when the worst R-hat is at most :data:`RHAT_TARGET` and nothing trends,
``NOT MIXED`` otherwise. With one chain only the split R-hat within it is available, and with
chains that all started at one point R-hat reads optimistic: the report says which it was.

Models with symmetries (a neural network's hidden units can be permuted) keep a high R-hat over
raw weights even when the predictive has converged: for classification tasks the held-out
predictive's R-hat (:func:`qlsd_flwr.evaluation.evaluate.convergence`) is added next to it, and
``criterion`` says which quantity the verdict reads (``predictive`` for torch models, ``theta``
otherwise; a user picks with the key ``convergence-criterion``).
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("qlsd_flwr")

RHAT_TARGET = 1.05  # the bar (Vehtari et al. 2021 recommend < 1.01 for final results)
TREND_Z = 4.0  # |z| of the first-vs-last-third difference of ‖θ‖ above which the window trends
_CHUNK = 4096  # coordinates per call (memory: chains × draws × chunk floats, a few copies)


def _rhat_ess(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per coordinate of ``x`` ``(chain, draw, k)``: ArviZ's R-hat, bulk ESS, tail ESS, computed
    for all coordinates at once (:mod:`qlsd_flwr.outputs.diagnostics`)."""
    from qlsd_flwr.outputs.diagnostics import rhat_ess

    if x.shape[0] == 1:  # one chain: its two halves as two chains (split R-hat within the chain)
        h = x.shape[1] // 2
        x = np.stack([x[0, :h], x[0, h:2 * h]])
    return rhat_ess(x)


def trend(series: np.ndarray) -> dict:
    """Does a quantity ``(chain, draw)`` still move over the kept window? Per chain, the difference
    of the means of its first and last thirds over its standard error (each third's variance over
    its bulk ESS): ``z_max`` and whether it is above :data:`TREND_Z`."""
    c, n = series.shape
    if n < 16:
        return {"z_max": None, "trending": False, "why": "fewer than 16 draws"}
    k = n // 3
    zs = []
    for a in series:
        first, last = a[:k], a[-k:]
        _, e1, _ = _rhat_ess(np.stack([first[: k // 2], first[k // 2: 2 * (k // 2)]])[:, :, None])
        _, e3, _ = _rhat_ess(np.stack([last[: k // 2], last[k // 2: 2 * (k // 2)]])[:, :, None])
        e1, e3 = max(float(e1[0]) if np.isfinite(e1[0]) else 1.0, 1.0), max(float(e3[0]) if np.isfinite(e3[0]) else 1.0, 1.0)
        se = np.sqrt(first.var(ddof=1) / e1 + last.var(ddof=1) / e3)
        diff = float(last.mean() - first.mean())
        zs.append(abs(diff) / se if se > 0 else (0.0 if diff == 0 else np.inf))
    z = float(np.max(zs))
    return {"z_max": z, "trending": bool(z > TREND_Z)}


def theta_report(draws, labels=None, dispersed: bool = False) -> dict:
    """The convergence report over θ from ``draws`` ``(draw, chain, d)`` (the layout of
    ``draws.f8``; a memmap is read a chunk of coordinates at a time)."""
    n, c, d = draws.shape
    out: dict = {"chains": int(c), "draws": int(n), "starts": "dispersed" if dispersed else "one point",
                 "target": RHAT_TARGET}
    if n < 4:
        out.update({"verdict": "NOT CHECKED", "why": "fewer than 4 kept draws"})
        return out
    r = np.empty(d)
    eb = np.empty(d)
    et = np.empty(d)
    for a in range(0, d, _CHUNK):
        z = min(d, a + _CHUNK)
        x = np.transpose(np.asarray(draws[:, :, a:z], dtype=np.float64), (1, 0, 2))
        r[a:z], eb[a:z], et[a:z] = _rhat_ess(x)
    # a coordinate no draw moves (a constant) has no R-hat: it cannot disagree between chains
    fin = np.isfinite(r)
    worst = np.argsort(np.where(fin, -r, np.inf))[: min(5, d)]
    name = (lambda j: str(labels[j])) if labels is not None and len(labels) == d else (lambda j: f"theta[{j}]")
    norms = np.sqrt(np.einsum("ncd,ncd->cn", np.asarray(draws, dtype=np.float64), np.asarray(draws, dtype=np.float64))) \
        if n * c * d <= 50_000_000 else _norms_chunked(draws)
    tr = trend(norms)
    out.update({
        "rhat_max": float(np.max(r[fin])) if fin.any() else None,
        "rhat_p99": float(np.quantile(r[fin], 0.99)) if fin.any() else None,
        "ess_bulk_min": float(np.nanmin(eb)) if np.isfinite(eb).any() else None,
        "ess_tail_min": float(np.nanmin(et)) if np.isfinite(et).any() else None,
        "worst_coordinates": [int(j) for j in worst if fin[j]],
        "worst_names": [name(int(j)) for j in worst if fin[j]],
        "worst_rhat": [float(r[j]) for j in worst if fin[j]],
        "norm_trend_z": tr["z_max"], "stationary": not tr["trending"],
    })
    return out


def _norms_chunked(draws) -> np.ndarray:
    n, c, _ = draws.shape
    out = np.empty((c, n))
    for a in range(0, n, 256):
        z = min(n, a + 256)
        x = np.asarray(draws[a:z], dtype=np.float64)
        out[:, a:z] = np.sqrt(np.einsum("ncd,ncd->cn", x, x))
    return out


def verdict(report: dict, predictive: dict | None = None, criterion: str = "theta", raw: dict | None = None) -> dict:
    """``report`` with ``criterion``, ``verdict`` (``MIXED`` / ``NOT MIXED`` / ``NOT CHECKED``) and
    ``message`` (one paragraph for the log). ``predictive``: the held-out predictive's R-hat
    (:func:`qlsd_flwr.evaluation.evaluate.convergence`), read when ``criterion = predictive``."""
    rep = dict(report)
    if rep.get("verdict") == "NOT CHECKED":
        rep["message"] = f"convergence NOT CHECKED: {rep.get('why')}"
        return rep
    rep["criterion"] = criterion
    if predictive is not None:
        rep["predictive"] = {k: predictive.get(k) for k in ("rhat_pred_max", "rhat_pred_p99", "ess_bulk_pred_min",
                                                              "rhat_loglik", "ess_bulk_loglik")}
    if criterion == "predictive" and predictive is not None and predictive.get("rhat_pred_max") is not None:
        worst = max(float(predictive["rhat_pred_max"]), float(predictive.get("rhat_loglik") or 0.0))
        what = "the held-out predictive (worst test point and log-likelihood)"
    else:
        worst = rep.get("rhat_max")
        what = "θ's coordinates"
    ok = worst is not None and worst <= RHAT_TARGET and rep.get("stationary", True)
    rep["verdict"] = "MIXED" if ok else "NOT MIXED"
    parts = [f"convergence: {rep['verdict']} over {what}: worst R-hat {worst:.3g}"
             if worst is not None else f"convergence: {rep['verdict']}: no R-hat"]
    if rep.get("rhat_max") is not None:
        names = ", ".join(f"{n} {v:.3g}" for n, v in zip(rep["worst_names"][:3], rep["worst_rhat"][:3]))
        parts.append(f"θ: R-hat max {rep['rhat_max']:.3g} ({names}), bulk ESS min {rep['ess_bulk_min']:.3g}, "
                     f"tail ESS min {rep['ess_tail_min']:.3g}")
    pr = rep.get("predictive") or {}
    if pr.get("rhat_pred_max") is not None:
        parts.append(f"held-out predictive: worst test point R-hat {pr['rhat_pred_max']:.3g} (99th percentile "
                     f"{pr['rhat_pred_p99']:.3g}), log-likelihood R-hat {pr['rhat_loglik']:.3g}")
    parts.append(f"{rep['chains']} chain(s) × {rep['draws']} draws, started at "
                 f"{'dispersed points' if rep['starts'] == 'dispersed' else 'one point (R-hat reads optimistic: init = dispersed)'}")
    if rep["chains"] < 2:
        parts.append("one chain: split R-hat within it only (run num-chains ≥ 4)")
    if not rep.get("stationary", True):
        zs = [f"{what} |z| = {rep[key]:.3g}" for what, key in (("‖θ‖", "norm_trend_z"), ("held-out log-likelihood",
              "loglik_trend_z")) if rep.get(key) is not None and rep[key] > TREND_Z]
        parts.append(f"the kept window still trends (first vs last third: {', '.join(zs) or 'see z'} > {TREND_Z:g}): "
                     "not stationary; run longer or raise burn-in")
    if criterion == "predictive":
        parts.append("criterion: the predictive, since a network's weights have symmetries (permuted units) that "
                     "keep their R-hat high after the predictive has converged")
    if not ok:
        raw = raw or {}
        hints = ["more rounds"]
        if str(raw.get("metric", "identity")) == "identity":
            hints.append("a metric (metric = diagonal)")
        if str(raw.get("gamma", "")) != "auto":
            hints.append("gamma = auto")
        if str(raw.get("init", "")) != "dispersed":
            hints.append("init = dispersed to trust the check")
        parts.append(f"the target is R-hat ≤ {RHAT_TARGET}: try {', '.join(hints)}")
    rep["message"] = "; ".join(parts)
    return rep


def log_report(rep: dict) -> None:
    (log.info if rep.get("verdict") == "MIXED" else log.warning)(rep["message"])


def criterion_for(raw: dict) -> str:
    """Which quantity the verdict reads for a run's configuration: the key ``convergence-criterion``,
    or with ``auto`` ``predictive`` for torch networks (task ``mnist`` with a model other than
    ``logistic``: their weights have symmetries) and ``theta`` otherwise."""
    chosen = str(raw.get("convergence-criterion", "auto")).strip().lower()
    if chosen in ("theta", "predictive"):
        return chosen
    task = str(raw.get("task", "")).strip().lower()
    model = str(raw.get("model", "logistic")).strip().lower()
    return "predictive" if task == "mnist" and model not in ("logistic", "linear") else "theta"
