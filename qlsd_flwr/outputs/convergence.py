"""Whether a run's chains mixed: the report every path ends with (log, ``summary.json``,
``samples.nc``, ``overview.png``).

Over θ's coordinates: ArviZ's rank-normalised split R-hat and bulk/tail ESS (Vehtari et al.
2021), the worst coordinates named; over the kept window: whether ``‖θ‖`` still trends (a
Geweke-style comparison of its first and last thirds, with each third's ESS as its sample size;
the held-out log-likelihood too, once a classification run is evaluated).
The verdict is ``MIXED`` when the worst R-hat is at most :data:`RHAT_TARGET`, the smallest bulk and tail
ESS are at least :data:`ESS_MIN`, every R-hat is defined and nothing trends; ``NOT MIXED`` otherwise, with
the reason. A coordinate whose R-hat is infinite or undefined (no spread within the chains) is a constant
only when it is one value in every draw of every chain; frozen at different values in different chains it
is the worst disagreement there is, and the verdict says so. With one chain only the split R-hat within it is available, and with
chains that all started at one point R-hat reads optimistic: the report says which it was.

Models with symmetries (a neural network's hidden units can be permuted) keep a high R-hat over
raw weights even when the predictive has converged: for classification tasks the held-out
predictive's R-hat (:func:`predictive`) is added next to it, and
``criterion`` says which quantity the verdict reads (``predictive`` for torch models, ``theta``
otherwise; a user picks with the key ``convergence-criterion``).
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("qlsd_flwr")

RHAT_TARGET = 1.05  # the bar (Vehtari et al. 2021 recommend < 1.01 for final results)
#: the smallest bulk and tail ESS (over all chains) before R-hat is trusted: Vehtari, Gelman, Simpson,
#: Carpenter & Bürkner (2021, §4.3) ask for rank-normalised bulk and tail ESS above 100 per chain for 4
#: chains (400) in final results, and above 100 overall before R-hat or the ESS themselves are reliable;
#: we take the latter as the floor of a verdict (below it R-hat cannot tell a slow chain from a mixed one:
#: 4 chains of an AR(0.999) process over 16 draws read R-hat < 1.05 in 4.5–10 % of trials)
ESS_MIN = 100.0
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
    constant = np.empty(d, dtype=bool)
    for a in range(0, d, _CHUNK):
        z = min(d, a + _CHUNK)
        x = np.transpose(np.asarray(draws[:, :, a:z], dtype=np.float64), (1, 0, 2))
        r[a:z], eb[a:z], et[a:z] = _rhat_ess(x)
        constant[a:z] = np.all(x == x[:1, :1, :], axis=(0, 1))
    # a coordinate that is one value in every draw of every chain (a constant) has no R-hat and cannot
    # disagree; any other non-finite R-hat (frozen at different values in different chains, a NaN) is
    # undefined, and the verdict reads it as not mixed
    fin = np.isfinite(r)
    undefined = np.isinf(r) & ~constant  # a NaN (too few draws to split) leaves the ESS undefined instead
    worst = np.argsort(np.where(fin, -r, np.inf))[: min(5, d)]
    name = (lambda j: str(labels[j])) if labels is not None and len(labels) == d else (lambda j: f"theta[{j}]")
    norms = np.sqrt(np.einsum("ncd,ncd->cn", np.asarray(draws, dtype=np.float64), np.asarray(draws, dtype=np.float64))) \
        if n * c * d <= 50_000_000 else _norms_chunked(draws)
    tr = trend(norms)
    out.update({
        "rhat_max": float(np.max(r[fin])) if fin.any() else None,
        "rhat_p99": float(np.quantile(r[fin], 0.99)) if fin.any() else None,
        "ess_bulk_min": float(np.nanmin(eb[fin])) if np.isfinite(eb[fin]).any() else None,
        "ess_tail_min": float(np.nanmin(et[fin])) if np.isfinite(et[fin]).any() else None,
        "worst_coordinates": [int(j) for j in worst if fin[j]],
        "worst_names": [name(int(j)) for j in worst if fin[j]],
        "worst_rhat": [float(r[j]) for j in worst if fin[j]],
        "rhat_undefined": int(undefined.sum()),
        "undefined_names": [name(int(j)) for j in np.flatnonzero(undefined)[:3]],
        "norm_trend_z": tr["z_max"], "stationary": not tr["trending"],
    })
    return out


def predictive(ll: np.ndarray) -> dict:
    """R-hat and bulk ESS (ArviZ's rank-normalised split versions, Vehtari et al. 2021) of what a
    user reads off the posterior, from the held-out log-likelihood ``ll`` ``(chain, draw, point)``:

    * the predictive probability of each test point's label, ``p(y_j | x_j, θ)`` per draw:
      the worst R-hat over the test points, the 99th percentile, and the smallest bulk ESS;
    * the held-out log-likelihood ``Σ_j log p(y_j | x_j, θ)`` per draw: its R-hat and bulk ESS.

    A point whose probability is one value in every draw of every chain has no R-hat and does not count;
    one whose probability is constant within each chain but differs between them (chains stuck apart)
    is counted in ``pred_undefined``, which the verdict reads as not mixed. With fewer than 2 chains or
    4 draws, R-hat cannot be computed: the values are ``None`` and ``why`` says so."""
    from qlsd_flwr.outputs.diagnostics import rhat_ess  # ArviZ's estimators, all points at once

    c, n, _ = ll.shape
    if c < 2 or n < 4:
        return {"chains": int(c), "draws": int(n), "rhat_pred_max": None, "rhat_pred_p99": None,
                "ess_bulk_pred_min": None, "rhat_loglik": None, "ess_bulk_loglik": None, "pred_undefined": 0,
                "why": "R-hat needs at least 2 chains and 4 draws"}
    prob = np.exp(ll)
    rp, ep, _ = rhat_ess(prob)
    r_ll, e_ll, _ = rhat_ess(ll.sum(axis=2)[:, :, None])
    finite = np.isfinite(rp)
    constant = np.all(prob == prob[:1, :1, :], axis=(0, 1))
    return {"chains": int(c), "draws": int(n),
            "rhat_pred_max": float(np.max(rp[finite])) if finite.any() else None,
            "rhat_pred_p99": float(np.quantile(rp[finite], 0.99)) if finite.any() else None,
            "ess_bulk_pred_min": float(np.min(ep[np.isfinite(ep)])) if np.isfinite(ep).any() else None,
            "rhat_loglik": float(r_ll[0]),
            "ess_bulk_loglik": float(e_ll[0]),
            "pred_undefined": int(np.sum(np.isinf(rp) & ~constant)),
            "target": RHAT_TARGET}


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
    (:func:`predictive`), read when ``criterion = predictive``."""
    rep = dict(report)
    if rep.get("verdict") == "NOT CHECKED":
        rep["message"] = f"convergence NOT CHECKED: {rep.get('why')}"
        return rep
    rep["criterion"] = criterion
    rep.pop("pending", None)
    if predictive is not None:
        rep["predictive"] = {k: predictive.get(k) for k in ("rhat_pred_max", "rhat_pred_p99", "ess_bulk_pred_min",
                                                              "rhat_loglik", "ess_bulk_loglik", "pred_undefined")}
    if criterion == "predictive" and (predictive is None or predictive.get("rhat_pred_max") is None):
        # never θ in its place, silently: a network's weights keep a high R-hat after its predictive has mixed
        rep.update({"verdict": "NOT CHECKED", "pending": "predictive",
                    "why": "convergence-criterion = predictive reads the held-out predictive, which this run has "
                           "not computed yet (the held-out evaluation of a classification task, or of "
                           "QLSDStrategy's heldout data, adds it after the run; set convergence-criterion = "
                           "theta to judge θ's coordinates instead)"})
        theta_part = (f"; θ for information: R-hat max {rep['rhat_max']:.3g}" if rep.get("rhat_max") is not None
                      else "")
        rep["message"] = f"convergence NOT CHECKED: {rep['why']}{theta_part}"
        return rep
    if criterion == "predictive":
        both = [_num(predictive["rhat_pred_max"]), _num(predictive.get("rhat_loglik"), 1.0)]
        worst = max(both) if all(np.isfinite(both)) else float("nan")
        ess = {"bulk ESS (worst test point)": predictive.get("ess_bulk_pred_min"),
               "bulk ESS (log-likelihood)": predictive.get("ess_bulk_loglik")}
        what = "the held-out predictive (worst test point and log-likelihood)"
        undefined = [] if np.isfinite(worst) else ["the predictive's R-hat"]
        if predictive.get("pred_undefined"):
            undefined.append(f"{predictive['pred_undefined']} test point(s)' predictive")
    else:
        worst = rep.get("rhat_max")
        ess = {"bulk ESS": rep.get("ess_bulk_min"), "tail ESS": rep.get("ess_tail_min")}
        what = "θ's coordinates"
        undefined = list(rep.get("undefined_names") or []) if rep.get("rhat_undefined") else []
    low = {k: v for k, v in ess.items() if v is None or not _num(v) >= ESS_MIN}
    ok = worst is not None and worst <= RHAT_TARGET and rep.get("stationary", True) and not undefined and not low
    rep["verdict"] = "MIXED" if ok else "NOT MIXED"
    rep["ess_min"] = ESS_MIN
    parts = [f"convergence: {rep['verdict']} over {what}: worst R-hat {worst:.3g}"
             if worst is not None else f"convergence: {rep['verdict']}: no R-hat"]
    if undefined:
        n_undef = rep.get("rhat_undefined") if criterion != "predictive" else len(undefined)
        parts.append(f"R-hat undefined on {n_undef} quantit{'y' if n_undef == 1 else 'ies'} ({', '.join(undefined)}): "
                     "no spread within the chains but not one value across them (chains stuck apart)")
    if low:
        parts.append("too few effective draws to trust R-hat: " + ", ".join(
            f"{k} {'undefined' if v is None else format(_num(v), '.3g')}" for k, v in low.items())
            + f" < {ESS_MIN:g}")
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
    elif _reads_theta_for_want_of_data(raw):
        parts.append("criterion: θ, for want of held-out data (strict for a network, whose weights have symmetries "
                     "that keep θ's R-hat high after its predictive has mixed): give QLSDStrategy "
                     "heldout=(predictor, X, y) to judge the predictive")
    if not ok:
        raw = raw or {}
        hints = ["more rounds"]
        if str(raw.get("metric", "identity")) == "identity":
            hints.append("a metric (metric = diagonal)")
        if str(raw.get("gamma", "")) != "auto":
            hints.append("gamma = auto")
        if str(raw.get("init", "")) != "dispersed":
            hints.append("init = dispersed to trust the check")
        parts.append(f"the target is R-hat ≤ {RHAT_TARGET} with bulk and tail ESS ≥ {ESS_MIN:g}: try {', '.join(hints)}")
    rep["message"] = "; ".join(parts)
    return rep


def _reads_theta_for_want_of_data(raw: dict | None) -> bool:
    """A user's own app (task ``external``) left the criterion to ``auto`` and gave no held-out data."""
    raw = raw or {}
    return (str(raw.get("task", "")) == "external"
            and str(raw.get("convergence-criterion", "auto")).strip().lower() == "auto")


def _num(x, default=float("nan")) -> float:
    """A report's number as a float (``None``, as strict JSON writes a non-finite one: ``default``)."""
    return default if x is None else float(x)


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
