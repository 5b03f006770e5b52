"""Federated PSIS-LOO: the leave-one-out question about the training data, the data staying on
the clients (key ``loo``).

After sampling, the server sends every client the kept draws ``θ_s`` (``s < S``: all chains, all
kept draws, as ``samples.nc`` holds them) and ArviZ's relative efficiency ``r_eff`` (the mean
over θ's coordinates of the ``mean`` ESS, divided by ``S``: what ``az.loo`` computes from the
posterior group). Each client evaluates ``ℓ_sj = log p(y_j | θ_s)`` for its own points
(the potential's ``pointwise_log_lik``) and

* ``loo = psis`` (the default) Pareto-smooths each point's importance ratios ``1/p(y_j | θ_s)``
  itself, with ArviZ's ``psislw`` as ``az.loo`` does, and sends three numbers a point:
  ``elpd_loo,j = log Σ_s w̃_sj p(y_j | θ_s)``, ``lppd_j = log (1/S) Σ_s p(y_j | θ_s)`` and the
  Pareto shape ``k̂_j``. Uplink ``3 × 64 N_i`` bits; what leaves the client is those three
  numbers per point (no draw-by-draw likelihood).
* ``loo = pointwise`` sends the ``S × N_i`` matrix ``ℓ``; the server pools it into
  ``samples.nc``'s ``log_likelihood`` group (dims ``chain, draw, train_point``), where
  ``az.loo`` / ``az.compare`` / ``az.waic`` take it as it is. Uplink ``64 S N_i`` bits; each
  point's likelihood at every draw leaves the client (a record of the point's fit across the
  posterior: opt in only where that is acceptable).
* ``loo = off``: nothing.

PSIS smooths every point's weights on their own, so the client's computation is the pooled
one point by point: ``elpd_loo = Σ_j elpd_loo,j``, ``se = √(N var_j elpd_loo,j)``,
``p_loo = Σ_j lppd_j − elpd_loo`` (``az.loo``'s formulas), at the draws as they travel (float32,
:data:`DRAWS_DTYPE`). The downlink is ``32 S d`` bits per client. Each reply is validated (length from the client's handshake ``N_i``, finite values)
before anything is written; a refused or missing client leaves the LOO out, with the reason,
rather than a LOO over part of the data. A client can still lie about its own points' values:
the LOO is a model-comparison figure, never an input to the chain.

:func:`load` gives an ``arviz.ELPDData`` from a run folder or ``samples.nc`` under either mode
(``qlsd_flwr.loo``), which ``az.compare`` takes as it is.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from qlsd_flwr.outputs.bits import bits_object
from qlsd_flwr.robust.loo import LooError, check_reply  # noqa: F401 (LooError: the public name)

MODES = ("psis", "pointwise", "off")
GROUP = "loo"  # the psis mode's group in samples.nc (ArviZ reads no group of that name)
HELDOUT = "heldout_log_likelihood"  # the held-out test points' log p(y_j | θ_s): never az.loo's input
#: above this share of points with k̂ > good_k the PSIS estimate is called unreliable (summary
#: ``loo.reliable``); Vehtari et al. (2017) call each such point's estimate unreliable
UNRELIABLE_SHARE = 0.1
#: the most the draws may weigh in one message to a client (Flower's gRPC limit is 512 MiB)
DOWNLINK_MAX_BYTES = 256 * 2**20
#: the draws travel as float32 (issue 37: float64 doubled the LOO's downlink, every kept draw to every client, and
#: buys nothing here: θ rounded at 6e-8 of itself moves a point's log-likelihood by 6e-8 × |θ · ∇ log p|, far below
#: PSIS's own Monte Carlo error); every path (Flower's messages, the legacy API, the direct engines) computes the
#: LOO at the draws as sent, so the result is the same on each
DRAWS_DTYPE = np.float32
log = logging.getLogger(__name__)


def pointwise(pot, draws: np.ndarray) -> np.ndarray:
    """``ℓ_sj = log p(y_j | θ_s)``, ``(S, N_i)``, from the potential's ``pointwise_log_lik``."""
    f = getattr(pot, "pointwise_log_lik", None)
    if f is None:
        raise LooError(f"{type(pot).__name__} has no pointwise_log_lik(theta) -> (n_data,): the LOO needs each "
                       "example's log-likelihood (TorchPotential, LogDensityPotential and the built-in tasks have "
                       "it; NumpyPotential takes pointwise_log_lik=)")
    n = int(pot.n_data)
    out = np.empty((len(draws), n))
    for s, th in enumerate(draws):
        v = np.asarray(f(np.asarray(th, dtype=np.float64)), dtype=np.float64)
        if v.shape != (n,):
            raise LooError(f"pointwise_log_lik returned shape {v.shape}, expected ({n},)")
        out[s] = v
    return out


def psis_points(ll: np.ndarray, reff: float) -> np.ndarray:
    """``(3, N_i)``: each point's ``elpd_loo,j``, ``lppd_j`` and Pareto ``k̂_j`` from its ``(S, N_i)``
    log-likelihoods, as ``az.loo`` computes them."""
    from scipy.special import logsumexp

    from qlsd_flwr.outputs.psis import psislw

    llt = np.ascontiguousarray(ll.T)  # (N_i, S): psislw smooths along the last axis, one point a row
    lw, k = psislw(-llt, reff)  # az.psislw's numbers, without importing ArviZ on a client
    lw = lw + llt
    return np.stack([logsumexp(lw, axis=1), logsumexp(llt, axis=1) - np.log(llt.shape[1]),
                     np.asarray(k, dtype=np.float64)])


def client_reply(pot, draws: np.ndarray, reff: float, mode: str) -> np.ndarray:
    """What client ``pot`` sends back for ``mode`` (flat float64): ``(3, N_i)`` or ``(S, N_i)``."""
    ll = pointwise(pot, draws)
    return (ll if mode == "pointwise" else psis_points(ll, reff)).ravel()


def _enough_draws(S: int) -> None:
    """PSIS needs at least 2 draws: the server's request and a client's reply both hold to it."""
    if S < 2:
        raise LooError(f"{S} kept draw(s): the LOO needs at least 2")


def reply_fields(pot, mode, draws, reff) -> dict:
    """A client's reply to the LOO request, on either Flower API: ``{"status": "ok", "payload": <float64
    bytes>}``, or ``{"status": "error", "error": ...}`` for a bad request or a potential that fails."""
    try:
        mode = str(mode)
        if mode not in ("psis", "pointwise"):
            raise LooError(f"mode {mode!r}; allowed: psis, pointwise")
        draws = np.asarray(draws, dtype=np.float64)
        if draws.ndim != 2 or draws.shape[1] != int(pot.dim):
            raise LooError(f"draws of shape {draws.shape}, expected (S, {pot.dim})")
        _enough_draws(draws.shape[0])  # a request of one draw made PSIS's tail index fail (IndexError)
        payload = client_reply(pot, draws, float(reff), mode)
    except (LooError, KeyError, TypeError, ValueError) as exc:
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"status": "ok", "payload": np.ascontiguousarray(payload, dtype="<f8").tobytes()}


def reff_of(posterior) -> float:
    """ArviZ's relative efficiency of a posterior group (``az.loo``'s ``reff``: the mean over every
    coordinate of the ESS of the mean, over chains × draws), all coordinates at once
    (:func:`qlsd_flwr.outputs.diagnostics.ess_mean`)."""
    from qlsd_flwr.outputs.diagnostics import ess_mean

    c, s = posterior.sizes["chain"], posterior.sizes["draw"]
    if c == 1:
        return 1.0
    x = np.concatenate([np.asarray(posterior[v].values, dtype=np.float64).reshape(c, s, -1)
                        for v in posterior.data_vars], axis=2)
    return float(ess_mean(x).mean() / (c * s))


def good_k(S: int) -> float:
    """ArviZ's threshold on k̂ for ``S`` draws."""
    return float(min(1 - 1 / np.log10(S), 0.7))


def elpd_from_points(points: np.ndarray, S: int):
    """An ``arviz.ELPDData`` (pointwise) from the ``(3, N)`` pooled per-point values, by
    ``az.loo``'s formulas."""
    import xarray as xr
    from arviz.stats.stats_utils import ELPDData

    loo_i, lppd_i, k = points
    N, gk = loo_i.size, good_k(S)
    elpd = float(loo_i.sum())
    coords = {"train_point": np.arange(N)}
    return ELPDData(
        data=[elpd, float((N * np.var(loo_i)) ** 0.5), float(lppd_i.sum() - elpd), S, N, bool(np.any(k > gk)),
              xr.DataArray(loo_i, dims=["train_point"], coords=coords, name="loo_i"),
              xr.DataArray(k, dims=["train_point"], coords=coords, name="pareto_shape"), "log", gk],
        index=["elpd_loo", "se", "p_loo", "n_samples", "n_data_points", "warning", "loo_i", "pareto_k",
               "scale", "good_k"])


def summary_of(elpd, mode: str, bits_down: int, bits_up: int) -> dict:
    k = np.asarray(elpd["pareto_k"])
    return {"mode": mode, "elpd_loo": float(elpd["elpd_loo"]), "se": float(elpd["se"]),
            "p_loo": float(elpd["p_loo"]), "n_data_points": int(elpd["n_data_points"]),
            "n_samples": int(elpd["n_samples"]), "pareto_k_max": float(np.max(k)),
            "pareto_k_over_good": int(np.sum(k > elpd["good_k"])), "good_k": float(elpd["good_k"]),
            "bits_down": int(bits_down), "bits_up": int(bits_up)}


def request(samples_nc) -> tuple[np.ndarray, float, tuple[int, int, int]]:
    """What the server sends every client: the kept draws ``(S, d)`` chain by chain as :data:`DRAWS_DTYPE`,
    ArviZ's ``r_eff`` and the draws' ``(chains, draws, d)``; :class:`LooError` when there are too few draws
    or too many for one message."""
    idata = _read(samples_nc)
    th = np.asarray(idata.posterior["theta"].values, dtype=np.float64)
    c, n, d = th.shape
    S = c * n
    _enough_draws(S)
    size = np.dtype(DRAWS_DTYPE).itemsize * S * d
    if size > DOWNLINK_MAX_BYTES:
        raise LooError(f"the kept draws are {size / 2**20:.0f} MiB ({S} draws × d = {d}), more than one "
                       f"message may carry ({DOWNLINK_MAX_BYTES / 2**20:.0f} MiB); keep fewer draws (thin) or set "
                       "loo = off")
    with np.errstate(over="ignore"):  # a draw beyond float32's range travels as inf: its log-likelihoods are not finite, refused
        return th.reshape(S, d).astype(DRAWS_DTYPE), reff_of(idata.posterior), (c, n, d)


def excluded_clients(summary: dict | None) -> dict[int, str]:
    """The clients the norm guard excluded in any chain (``summary.json``'s ``excluded``: client → round,
    or chain → that), with the reason, for :func:`federated`: their data are not in every kept draw's
    posterior, and their own replies are the ones the guard refused to trust."""
    ex = (summary or {}).get("excluded") or {}
    per_chain = ex if all(isinstance(v, dict) for v in ex.values()) else {"0": ex}
    out: dict[int, list[str]] = {}
    for c, clients in per_chain.items():
        for i, k in clients.items():
            when = "before sampling" if int(k) == 0 else f"from round {k}"  # 0: left out by the preparation
            out.setdefault(int(i), []).append(when + (f" (chain {c})" if len(per_chain) > 1 else ""))
    return {i: "excluded " + ", ".join(r) for i, r in sorted(out.items())}


def log_lik_ceiling(cfg) -> float | None:
    """The largest log-likelihood one point can have under the run's model (``cfg``: its ``task`` and ``dim``):
    0 for the classification tasks, ``−(d/2) log 2π`` for the toy Gaussian (unit covariance), ``None`` (no
    ceiling known) for a user's potential."""
    from qlsd_flwr.config import CLASSIFICATION_TASKS

    if cfg.task in CLASSIFICATION_TASKS:
        return 0.0
    if cfg.task == "gaussian":
        return -0.5 * int(cfg.get("dim")) * float(np.log(2.0 * np.pi))
    return None


def federated(samples_nc, mode: str, n_data, ask: Callable[[np.ndarray, float], dict], ceiling: float | None = None,
              left_out: dict[int, str] | None = None) -> dict:
    """The federated LOO of a finished run: reads the kept draws from ``samples_nc``, calls
    ``ask(draws, reff)`` (every client's reply ``{i: payload}``; ``draws`` is ``(S, d)``, chain by
    chain), validates each reply against ``n_data[i]``, writes the result into ``samples_nc``
    (the ``loo`` group, or ``log_likelihood`` under ``pointwise``) and returns ``summary.json``'s
    ``loo`` entry (with ``error`` and ``refused`` when the LOO could not be completed). ``left_out``:
    clients (→ why) whose points the LOO leaves out (:func:`excluded_clients`), named in the entry."""
    import arviz as az

    if mode == "off":
        return {"mode": "off"}
    try:
        draws, reff, (c, n, d) = request(samples_nc)
    except LooError as exc:
        return {"mode": mode, "error": str(exc)}
    S = c * n
    replies = ask(draws, reff)
    b = len(n_data)
    left_out = {int(i): str(r) for i, r in (left_out or {}).items() if 0 <= int(i) < b}
    kept = [i for i in range(b) if i not in left_out]
    parts, refused = {}, {}
    for i in kept:
        if i not in replies:
            refused[str(i)] = "no reply"
            continue
        try:
            parts[i] = check_reply(replies[i], int(n_data[i]), S, mode, ceiling)
        except LooError as exc:
            refused[str(i)] = str(exc)
    bits_down = 8 * np.dtype(DRAWS_DTYPE).itemsize * S * d * b
    bits_up = sum(64 * a.size for a in parts.values())
    if refused:
        why = "; ".join(f"client {i}: {r}" for i, r in sorted(refused.items(), key=lambda t: int(t[0])))
        log.warning("loo: not computed, %d of %d clients gave no usable reply (%s)", len(refused), b, why)
        return {"mode": mode, "error": "clients without a usable reply: the LOO covers all training points or "
                "none", "refused": refused, "bits_down": bits_down, "bits_up": bits_up}
    if not kept:
        return {"mode": mode, "error": "every client was excluded: no points to leave out one at a time",
                "left_out": {str(i): r for i, r in left_out.items()}, "bits_down": bits_down, "bits_up": 0}
    # which client each train_point is, in the file too (a client left out shifts the others' points)
    where = {"clients": np.asarray(kept, dtype=np.int64),
             "offsets": np.cumsum([0] + [int(n_data[i]) for i in kept]).astype(np.int64)}
    if mode == "pointwise":
        ll = np.concatenate([parts[i] for i in kept], axis=1).reshape(c, n, -1)
        _write(samples_nc, "log_likelihood", {"y": ll}, ("chain", "draw", "train_point"), where)
        with warnings.catch_warnings():  # ArviZ's k̂ warning: the summary counts k̂ above good_k itself
            warnings.simplefilter("ignore", UserWarning)
            elpd = az.loo(_read(samples_nc), pointwise=True)
    else:
        pts = np.concatenate([parts[i] for i in kept], axis=1)
        _write(samples_nc, GROUP, {"loo_i": pts[0], "lppd_i": pts[1], "pareto_k": pts[2]}, ("train_point",),
               {"n_samples": S, "reff": reff, **where})
        elpd = elpd_from_points(pts, S)
    out = summary_of(elpd, mode, bits_down, bits_up)
    out["client_of_point"] = "train_point j belongs to clients[m] for offsets[m] <= j < offsets[m+1]"
    out["clients"] = kept
    out["offsets"] = where["offsets"].tolist()
    if left_out:
        out["left_out"] = {str(i): r for i, r in left_out.items()}
        out["points_left_out"] = int(sum(int(n_data[i]) for i in left_out))
        log.warning("loo: the points of client(s) %s left out (%s): the LOO covers the other clients' %d points",
                    ", ".join(map(str, left_out)), "; ".join(left_out.values()), out["offsets"][-1])
    return out


def load(path):
    """An ``arviz.ELPDData`` (pointwise, ``az.compare``'s input) for a run folder or its
    ``samples.nc``: ``az.loo`` on its ``log_likelihood`` group (``loo = pointwise``), or the
    clients' per-point values (``loo = psis``). :class:`LooError` if the run has neither."""
    import arviz as az

    p = Path(path)
    p = p / "samples.nc" if p.is_dir() else p
    if not p.is_file():
        raise LooError(f"{p}: no such file (a run folder or its samples.nc)")
    idata = _read(p)
    if "log_likelihood" in idata.groups():
        return az.loo(idata, pointwise=True)
    if GROUP in idata.groups():
        g = idata[GROUP]
        pts = np.stack([np.asarray(g[v].values, dtype=np.float64) for v in ("loo_i", "lppd_i", "pareto_k")])
        return elpd_from_points(pts, int(g.attrs["n_samples"]))
    raise LooError(f"{p}: no LOO in this file (the run had loo = off, its potential no pointwise_log_lik, or a "
                   "client without a usable reply: see summary.json 'loo'); rerun with loo = psis or pointwise")


def _read(path):
    """The whole file in memory, the file closed again (ArviZ's default lazy load keeps it open,
    and the LOO then writes into it)."""
    import arviz as az

    with az.rc_context({"data.load": "eager"}):
        return az.from_netcdf(str(path))


def _write(path, name: str, data: dict, dims: tuple, attrs: dict | None = None) -> None:
    """Add (or overwrite in place) group ``name`` of ``samples.nc``."""
    import h5netcdf

    with h5netcdf.File(str(path), "a") as f:
        first = next(iter(data.values()))
        if name in f.groups:  # h5netcdf cannot delete a group: same shapes, overwritten
            g = f.groups[name]
            for k, v in data.items():
                if g[k].shape != v.shape:
                    raise LooError(f"{path}: group {name!r} has {k} of shape {g[k].shape}, now {v.shape}")
                g[k][...] = v
        else:
            g = f.create_group(name)
            g.dimensions = {dn: first.shape[i] for i, dn in enumerate(dims)}
            for i, dn in enumerate(dims):
                g.create_variable(dn, (dn,), data=np.arange(first.shape[i]))
            for k, v in data.items():
                g.create_variable(k, dims, data=v)
        for k, v in {**f["posterior"].attrs, **(attrs or {})}.items():
            g.attrs[k] = v


def attach(run_dir, mode: str, n_data, ask: Callable[[np.ndarray, float], dict], summary: dict | None = None,
           ceiling: float | None = None) -> dict:
    """:func:`federated` on a finished run folder, its result added to ``summary.json`` (and to
    ``summary``, the caller's copy) as ``loo``; logged in one line. Never raises for what a
    client or the potential did wrong: the reason is the entry's ``error``."""
    import json

    from qlsd_flwr.outputs import jsonio

    nc = Path(run_dir) / "samples.nc"
    if mode == "off" or not nc.is_file():
        return {}
    saved = Path(run_dir) / "summary.json"
    facts = summary if summary is not None and "excluded" in summary else (
        json.loads(saved.read_text()) if saved.is_file() else {})
    try:
        out = federated(nc, mode, n_data, ask, ceiling, left_out=excluded_clients(facts))
    except LooError as exc:
        out = {"mode": mode, "error": str(exc)}
    if "error" in out:
        log.warning("loo: not computed: %s", out["error"])
    else:
        from qlsd_flwr.outputs.progress import announce

        share = out["pareto_k_over_good"] / max(out["n_data_points"], 1)
        out["reliable"] = bool(share <= UNRELIABLE_SHARE)
        announce(f"  loo ({mode}, {out['n_data_points']} training points, federated): elpd_loo {out['elpd_loo']:.2f} "
                 f"(se {out['se']:.2f}), p_loo {out['p_loo']:.1f}, {out['pareto_k_over_good']} Pareto k̂ above "
                 f"{out['good_k']:.2f}" + ("" if out["reliable"] else
                 f": UNRELIABLE ({100 * share:.0f} % of the points move the posterior too far for importance "
                 "sampling; K-fold cross-validation answers better)")
                 + "; qlsd_flwr.loo(<run folder>) is az.compare's input", True)
    path = Path(run_dir) / "summary.json"
    if path.is_file():
        data = json.loads(path.read_text())
        data["loo"] = out
        data["bits"] = bits_object(data)  # the LOO's bits join the run's
        path.write_text(jsonio.dumps(data, indent=2))
    if summary is not None:
        summary["loo"] = out
        summary["bits"] = bits_object(summary)
    return out


def local_ask(clients, mode: str) -> Callable[[np.ndarray, float], dict]:
    """``ask`` for the engines that hold the clients' potentials in this process (local,
    vectorised): each client's :func:`client_reply`, as a Flower client computes it."""
    def ask(draws, reff):
        out = {}
        for i, pot in enumerate(clients):
            try:
                out[i] = client_reply(pot, draws, reff, mode)
            except LooError as exc:
                raise LooError(f"client {i}: {exc}") from None
        return out
    return ask
