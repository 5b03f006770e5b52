"""The facts every engine adds to a run's ``summary.json`` (the variant, the task, the step, and on a
target with a closed form its exact posterior and ULA's variance at this step)."""

from __future__ import annotations

import numpy as np

from qlsd_flwr.config import RunConfig
from qlsd_flwr.core.downlink import lag_beta
from qlsd_flwr.core.potential import Task
from qlsd_flwr.core.server_step import noise_factor
from qlsd_flwr.protocol.build import downlink_on


def summary_extra(cfg: RunConfig, task: Task, extra: dict) -> dict:
    """Facts every engine adds to its summary."""
    out = dict(extra)
    out.update({"variant": cfg.variant, "task": task.name, "b": cfg.b, "d": task.dim,
                "gamma": cfg.gamma, "num_rounds": cfg.num_rounds, "seed": cfg.seed,
                "temperature": cfg.temperature})
    out.update(task.meta.get("summary_extra", {}))  # e.g. dataset, partition counts, prior used
    if downlink_on(cfg):  # β of the step's lag term (core.downlink.lag_beta; 0: none)
        out["downlink_correction_beta"] = lag_beta(str(cfg.get("downlink-correction")), cfg.gamma,
                                                   out.get("metric", "identity") == "identity")
    noise = noise_factor(str(cfg.get("noise-correction")), cfg.gamma, out.get("metric", "identity") == "identity")
    if noise != 1.0:  # noise-correction = metric: the Langevin noise's scale (core.server_step.noise_factor)
        out["noise_factor"] = noise
    if task.posterior_mean is not None:
        out["posterior_mean_exact"] = np.asarray(task.posterior_mean).tolist()
        out["posterior_var_exact"] = np.asarray(task.posterior_var).tolist()
        # ULA with exact gradients on this Gaussian target has variance T/(τ(1 − γ m τ/2)), τ = 1/var,
        # m the diagonal metric's entry (1 without one): the discretisation bias every variant carries
        # at this γ, before any gradient noise. (A dense or Kronecker metric mixes the coordinates:
        # no per-coordinate formula is given then.)
        v = np.asarray(task.posterior_var)
        metric = out.get("metric", "identity")
        diag = 1.0 if metric == "identity" else (np.asarray(metric, dtype=np.float64)
                                              if isinstance(metric, list) and len(metric) == v.size
                                              and np.ndim(metric) == 1 else None)
        if diag is not None:  # ULA's exact variance at this γ: T v / (1 − γ M / (2 v)), coordinate-wise (times
            shrink = 1.0 - cfg.gamma * diag / (2.0 * v)  # noise-correction's 1 − γ/2 where it is on)
            if np.all(shrink > 0):
                out["ula_var_exact"] = (cfg.temperature * noise ** 2 * v / shrink).tolist()
    return out
