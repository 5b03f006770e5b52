"""Predictive evaluation of a run: posterior predictive on the task's test set.

:func:`evaluate_run` reads a run folder (``config.json`` + ``samples.nc``), rebuilds the task's
test set and predictor from the configuration (:mod:`qlsd_flwr.tasks.registry`), averages
``softmax(model_θ(x))`` over (at most ``max_samples``, evenly thinned) kept samples, and writes
``evaluation.json`` and ``reliability.png`` into the folder.

Metrics (definitions in :mod:`qlsd_flwr.evaluation.metrics`, after the supplement's "Bayesian neural
networks" section): accuracy, ECE, Brier score (summed over classes, no ``1/K``), nNLL, and
the AUROC of the predictive entropy for telling OOD inputs from test inputs.

* ECE bins: the supplement defines ECE with ``M`` equal-width bins but never states ``M``; we
  use ``M = 10`` (the common choice, e.g. Ovadia et al. 2019's reliability diagrams, which the
  supplement cites for these definitions).
* OOD set: the paper uses Fashion-MNIST for MNIST, which needs the network. Offline we use the
  test inputs with their features (pixels) permuted by one fixed, seeded permutation
  (:func:`ood_inputs`, ``kind = "permuted"``): the same intensity histogram per image, no digit
  structure (for tabular data: the same values in the wrong columns). Uniform noise in the
  data's range is reported as a second, easier OOD set (``ood_auroc_noise``).
* Accuracy here is the posterior-predictive accuracy (argmax of the averaged probabilities),
  not the supplement's "accuracy of the posterior mean θ"; both are reported
  (``accuracy_posterior_mean``) when the predictor allows it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from qlsd_flwr.config import CLASSIFICATION_TASKS  # noqa: F401 (one home: the configuration's)
from qlsd_flwr.outputs import jsonio
from qlsd_flwr.evaluation import metrics as M
from qlsd_flwr.outputs.loo import HELDOUT
from qlsd_flwr.outputs.convergence import RHAT_TARGET  # noqa: F401 (the main job's bar; one home)
from qlsd_flwr.outputs.convergence import predictive as cv_predictive

N_BINS = 10
OOD_SEED = 20220328


def ood_inputs(X: np.ndarray, kind: str = "permuted", seed: int = OOD_SEED) -> np.ndarray:
    """An offline out-of-distribution set made from the test inputs ``X`` (``(n, p)``).

    ``permuted``: every row's features reordered by one fixed random permutation;
    ``noise``: i.i.d. uniform values between the data's minimum and maximum.
    """
    X = np.asarray(X)
    rng = np.random.default_rng(seed)
    if kind == "permuted":
        return np.ascontiguousarray(X[:, rng.permutation(X.shape[1])])
    if kind == "noise":
        lo, hi = float(X.min()), float(X.max())
        return rng.uniform(lo, hi, X.shape).astype(X.dtype)
    raise ValueError(f"unknown OOD kind {kind!r}; allowed: permuted, noise")


def predictive_metrics(probs: np.ndarray, y: np.ndarray, probs_ood: dict | None = None,
                       n_bins: int = N_BINS) -> dict:
    """Accuracy, ECE, Brier, nNLL and, per OOD set, the entropy AUROC."""
    out = {"accuracy": M.accuracy(probs, y), "ece": M.ece(probs, y, n_bins),
           "brier": M.brier(probs, y), "nnll": M.nnll(probs, y), "n_test": int(len(y)),
           "ece_bins": n_bins}
    for name, po in (probs_ood or {}).items():
        key = "ood_auroc" if name == "permuted" else f"ood_auroc_{name}"
        out[key] = M.ood_auroc(probs, po)
    return out


def thin_samples(samples: np.ndarray, max_samples: int | None) -> np.ndarray:
    """``(chain, draw, d)`` or ``(S, d)`` → at most ``max_samples`` rows, evenly spaced per chain."""
    s = np.asarray(samples)
    if s.ndim == 2:
        s = s[None]
    n_chain, n_draw = s.shape[:2]
    if max_samples is not None and n_chain * n_draw > max_samples:
        per = max(1, max_samples // n_chain)
        idx = np.unique(np.linspace(0, n_draw - 1, per).round().astype(int))
        s = s[:, idx]
    return s.reshape(-1, s.shape[-1])


def evaluate_samples(samples: np.ndarray, predictor, X_test: np.ndarray, y_test: np.ndarray,
                     max_samples: int | None = 200, n_bins: int = N_BINS,
                     plot_path: str | os.PathLike | None = None, title: str | None = None) -> dict:
    """Posterior-predictive metrics of ``samples`` (any ``predictor.predict_proba``)."""
    th = thin_samples(samples, max_samples)
    probs = predictor.predict_proba(th, X_test)
    ood = {k: predictor.predict_proba(th, ood_inputs(X_test, k)) for k in ("permuted", "noise")}
    out = predictive_metrics(probs, y_test, ood, n_bins)
    out["n_samples"] = int(len(th))
    out["accuracy_posterior_mean"] = M.accuracy(
        predictor.predict_proba(th.mean(axis=0)[None], X_test), y_test)
    out["ood"] = ("test inputs with pixels/features permuted by a fixed seeded permutation "
                  "(offline stand-in for Fashion-MNIST); ood_auroc_noise: uniform noise")
    if plot_path is not None:
        M.reliability_diagram(probs, y_test, n_bins, path=plot_path,
                              title=(f"{title}\n" if title else "") + f"ECE = {out['ece']:.4f} ({n_bins} bins)")
        out["reliability_diagram"] = str(plot_path)
    return out


def evaluate_run(run_dir: str | os.PathLike, max_samples: int | None = 200, write: bool = True,
                 n_bins: int = N_BINS, title: str | None = None) -> dict:
    """Evaluate a run folder of a real-data task; writes ``evaluation.json`` and
    ``reliability.png`` there when ``write``. Returns the metrics."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.tasks import registry

    run_dir = Path(run_dir)
    cfg = resolve(json.loads((run_dir / "config.json").read_text())["config"])
    if cfg.task == "gaussian":
        raise ValueError("evaluate_run needs a classification task (logistic or mnist); the "
                         "Gaussian task's errors are in summary.json")
    X_te, y_te, _, _ = registry.test_set(cfg)
    return evaluate_held_out(run_dir, registry.predictor_of(cfg), X_te, y_te, cfg, max_samples, write, n_bins,
                             title or f"{cfg.variant} on {cfg.get('task')}")


def evaluate_held_out(run_dir: str | os.PathLike, predictor, X_test: np.ndarray, y_test: np.ndarray, cfg,
                      max_samples: int | None = 200, write: bool = True, n_bins: int = N_BINS,
                      title: str | None = None) -> dict:
    """The held-out evaluation of a run folder's draws with any ``predictor.predict_proba(thetas, X)``
    (the task's, or the one a user's ``QLSDStrategy(heldout=...)`` gives): the metrics; with
    ``write``, ``evaluation.json``, ``reliability.png``, samples.nc's held-out groups and the
    predictive's R-hat in the convergence report. ``cfg``: the run's configuration."""
    from qlsd_flwr.outputs.recorder import load_samples

    run_dir = Path(run_dir)
    samples = load_samples(run_dir)
    out = evaluate_samples(samples, predictor, X_test, y_test, max_samples, n_bins,
                           plot_path=run_dir / "reliability.png" if write else None, title=title)
    if write:
        ll = write_predictive_groups(run_dir / "samples.nc", samples, predictor, X_test, y_test, cfg.seed)
        out["convergence"] = cv_predictive(ll)
        (run_dir / "evaluation.json").write_text(jsonio.dumps(out, indent=2))
        add_predictive_to_report(run_dir, out["convergence"], cfg.raw, ll.sum(axis=2))
    return out


def add_predictive_to_report(run_dir: Path, predictive: dict, raw: dict, loglik=None) -> None:
    """The run's convergence report (``summary.json``) with the held-out predictive's R-hat beside
    θ's, and whether the held-out log-likelihood ``loglik`` ``(chain, draw)`` still trends over the
    kept window; for networks (weights with symmetries) the verdict reads the predictive. Logged
    again."""
    from qlsd_flwr.outputs import convergence as cv

    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    theta = summary.get("convergence")
    if not isinstance(theta, dict) or (theta.get("verdict") == "NOT CHECKED" and not theta.get("pending")):
        return  # too few draws for any verdict; a verdict pending the predictive is given it now
    base = {k: v for k, v in theta.items() if k not in ("verdict", "message", "predictive", "pending", "why")}
    if loglik is not None:
        tr = cv.trend(np.asarray(loglik, dtype=np.float64))
        base["loglik_trend_z"] = tr["z_max"]
        base["stationary"] = bool(base.get("stationary", True)) and not tr["trending"]
    rep = cv.verdict(base, predictive, cv.criterion_for(raw), raw)
    summary["convergence"] = rep
    path.write_text(jsonio.dumps(summary, indent=2))
    try:  # samples.nc's attribute says the same verdict
        import h5netcdf

        with h5netcdf.File(run_dir / "samples.nc", "a") as f:
            for where in (f, f["posterior"]):
                where.attrs["convergence_verdict"] = str(rep["verdict"])
    except (OSError, KeyError):
        pass
    cv.log_report(rep)


def evaluate_classification(task: str, run_dir) -> dict | None:
    """:func:`evaluate_run` for a classification task's run folder (its ``evaluation.json`` and
    ArviZ's held-out groups); ``None`` for other tasks. What the CLI and the ServerApp call."""
    if run_dir is None or task not in CLASSIFICATION_TASKS:
        return None
    return evaluate_run(run_dir)


def write_predictive_groups(path: str | os.PathLike, samples: np.ndarray, predictor, X: np.ndarray,
                            y: np.ndarray, seed: int) -> np.ndarray:
    """Add the held-out groups to ``samples.nc``: ``heldout_log_likelihood`` (``y``: ``log p(y_j | θ)``
    per chain, draw and test point; named so that ``az.loo`` never takes the test points for the
    training data: the LOO is :mod:`qlsd_flwr.outputs.loo`'s), ArviZ's ``predictions``
    (``y``: one label drawn from each draw's predictive ``p(· | x_j, θ)``, seeded by the run's
    seed) and ``observed_data`` (``y``: the held-out labels), each over the dim ``test_point``.
    Every draw is evaluated (one predictive pass per draw). Returns the log-likelihood array."""
    import h5netcdf

    c, n, _ = samples.shape
    y = np.asarray(y, dtype=np.int64)
    ll = np.empty((c, n, len(y)))
    pred = np.empty((c, n, len(y)), dtype=np.int64)
    gen = np.random.default_rng([int(seed), 0x5052_4544])  # "PRED": its own stream
    for ci in range(c):
        for di in range(n):
            prob = predictor.predict_proba(samples[ci, di][None], X)
            ll[ci, di] = np.log(np.maximum(prob[np.arange(len(y)), y], np.finfo(float).tiny))
            cum = np.cumsum(prob, axis=1)
            u = gen.random(len(y))[:, None] * cum[:, -1:]
            pred[ci, di] = np.minimum((u > cum).sum(axis=1), prob.shape[1] - 1)
    with h5netcdf.File(path, "a") as f:
        for name, data, dims in ((HELDOUT, ll, ("chain", "draw", "test_point")),
                                 ("predictions", pred, ("chain", "draw", "test_point")),
                                 ("observed_data", y, ("test_point",))):
            if name in f.groups:  # evaluated before (h5netcdf cannot delete a group): overwrite in place
                old = f.groups[name]["y"]
                if old.shape != data.shape:
                    raise ValueError(f"{path}: group {name!r} has shape {old.shape}, the draws give "
                                     f"{data.shape}; evaluate a copy of the run folder without it")
                old[...] = data
                continue
            g = f.create_group(name)
            g.dimensions = {d: data.shape[i] for i, d in enumerate(dims)}
            for i, d in enumerate(dims):
                g.create_variable(d, (d,), data=np.arange(data.shape[i]))
            g.create_variable("y", dims, data=data)
            for k, v in f["posterior"].attrs.items():
                g.attrs[k] = v
    return ll
