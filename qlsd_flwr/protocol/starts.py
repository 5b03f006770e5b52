"""The chains' starting points for ``init = dispersed`` (step 4 of
:func:`qlsd_flwr.protocol.precondition.prepare`): over-dispersed around θ* by the metric's root or the
prior's scale, each tensor of a layered network capped at its own initialisation scale."""

from __future__ import annotations

import math

import numpy as np

from qlsd_flwr.config import RunConfig
from qlsd_flwr.core import rng
from qlsd_flwr.core.metric import Metric
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol.curvature_exchange import prior_curvature


def chain_starts(cfg: RunConfig, task: Task, theta0: np.ndarray, point: np.ndarray, metric: Metric,
                 chains: int) -> np.ndarray:
    """``chains`` starts around ``point`` (θ*), ``2√T`` times the metric's root apart (each tensor of a
    layered network capped at its initialisation scale), or with the identity metric the prior's sd
    where the prior has curvature, capped the same way (1 where it has none)."""
    scale: Metric | np.ndarray = metric
    layers = initialisation_scale(task, theta0)
    if metric.is_identity:
        pv = prior_curvature(task, point)
        scale = np.minimum(np.where(pv > 0, 1.0 / np.sqrt(np.where(pv > 0, pv, 1.0)), 1.0), layers)
    return dispersed_starts(point, scale, chains, cfg.seed, spread=2.0 * math.sqrt(cfg.temperature),
                            cap=None if metric.is_identity else layers)


def initialisation_scale(task: Task, theta0: np.ndarray) -> np.ndarray:
    """Per coordinate, the root mean square of its tensor in ``θ_0`` (tensors named by
    ``task.meta["param_labels"]``, ``<tensor>[i,j,…]``), ``inf`` where that is zero or θ is one
    tensor. A network's initialisation sets each layer's scale to what its activations tolerate
    (PyTorch's ``U(±1/√fan_in)``: a LeNet-5 weight about 0.05), far under a prior's sd (√5 here), so
    dispersing by the prior's sd alone throws the network out of its working range (measured: LeNet-5
    diverged at round 2); dispersing by at most twice the layer's own scale starts each chain from a
    network as plausible as a fresh initialisation. Only a layered network is capped (two or more
    tensors of two or more dimensions, as ``<tensor>[i,j]`` labels show): a GLM (one weight matrix and
    its bias, the main job's softmax regression), labels without indices or a zero start keep the prior's."""
    labels = task.meta.get("param_labels")
    out = np.full(task.dim, np.inf)
    if not labels or len(labels) != task.dim:
        return out
    names = np.array([str(x).split("[", 1)[0] for x in labels])
    starts = np.flatnonzero(np.r_[True, names[1:] != names[:-1]])
    matrices = sum(str(labels[a]).count(",") >= 1 for a in starts)  # "w[i,j]": two indices or more
    if matrices < 2:
        return out
    theta0 = np.asarray(theta0, dtype=np.float64)
    for a, b in zip(starts, np.r_[starts[1:], task.dim]):
        rms = float(np.sqrt(np.mean(theta0[a:b] ** 2)))
        if rms > 0 and np.isfinite(rms):
            out[a:b] = rms
    return out


def dispersed_starts(center: np.ndarray, scale: np.ndarray | Metric, chains: int, seed: int,
                     spread: float = 2.0, cap: np.ndarray | None = None) -> np.ndarray:
    """``C`` starting points ``θ_0^{(c)} = center + spread · S z_c`` with ``z_c`` standard normal
    from chain ``c``'s stream ``(seed + c, INIT, 0, 0)`` and ``S`` the metric's root (about the
    posterior's scale when ``M`` comes from the curvature) or a vector of scales. Over-dispersed
    starts (``spread = 2``: twice the scale) are what make R-hat able to show non-convergence.
    ``cap`` (:func:`initialisation_scale`, ``inf`` where nothing is capped): each tensor's step is
    scaled down to that root mean square where it is over it (with a metric: its scales in a
    network's poorly determined directions are the prior's)."""
    d = center.shape[0]
    out = np.empty((chains, d))
    edges = None if cap is None else np.flatnonzero(np.r_[True, cap[1:] != cap[:-1], True])
    for c in range(chains):
        z = rng.normal(int(seed) + c, rng.Stream.INIT, 0, 0, d)
        step = scale.apply_root(z) if isinstance(scale, Metric) else np.asarray(scale) * z
        for a, b in zip(edges[:-1], edges[1:]) if edges is not None else ():
            rms = float(np.sqrt(np.mean(step[a:b] ** 2)))
            if np.isfinite(cap[a]) and rms > cap[a]:
                step[a:b] *= cap[a] / rms
        out[c] = center + spread * step
    return out
