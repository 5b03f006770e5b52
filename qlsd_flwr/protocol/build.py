"""Builds the pieces of a run from its :class:`~qlsd_flwr.config.RunConfig`.

Every engine (Flower on Ray, in-process Flower, the framework-free loop, the vectorised
engine) calls these same functions, so they all run the same algorithm.
"""

from __future__ import annotations

import logging

import numpy as np

from qlsd_flwr.compression.identity import Identity
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.config import RunConfig
from qlsd_flwr.core.oracles import ClientSpec
from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.core.server_step import ServerSpec


def warn_if_unstable(cfg: RunConfig, task: Task) -> None:
    """Log :func:`stability_warning`'s message, if any (every engine calls this at start)."""
    if (why := stability_warning(cfg, task)) is not None:
        logging.getLogger("qlsd_flwr").warning(why)


def stability_warning(cfg: RunConfig, task: Task) -> str | None:
    """On a target whose posterior precision is known (the Gaussian task), the message to warn
    with when the step ``gamma`` is beyond the stability limit of Langevin with exact
    gradients, ``γ < 2/τ_max`` (``τ`` the precision: the iteration multiplies the error by
    ``1 − γτ``), i.e. when the chain will diverge; ``None`` otherwise."""
    if task.posterior_var is None:
        return None
    tau = float(1.0 / np.min(task.posterior_var))
    if cfg.gamma * tau < 2.0:
        return None
    return (f"gamma = {cfg.gamma:g} is beyond this target's stability limit 2/τ = {2.0 / tau:.3g} "
            f"(τ = {tau:.4g}, the posterior precision, grows with the clients' data): the chain will "
            f"diverge; choose gamma below {2.0 / tau:.3g} (e.g. {1.0 / tau:.3g}, γτ = 1)")


def blocks_for(cfg: RunConfig, task: Task) -> tuple[int, ...] | None:
    """QSGD norm blocks: one for the whole vector, or one per tensor (``block-norm = tensor``)."""
    if cfg.block_norm == "vector":
        return None
    blocks = task.meta.get("blocks")
    return tuple(int(x) for x in blocks) if blocks else None


def compressor_for(cfg: RunConfig, i: int, blocks=None):
    if not cfg.compressed:
        return Identity()
    return QSGD(s=int(cfg.s[i]), blocks=blocks, encoding=cfg.encoding)


def alphas(cfg: RunConfig, d: int, blocks=None) -> np.ndarray:
    """``α_i``: the configured value, or ``1/(ω_i + 1)``; ``0`` when the variant has no memory."""
    if not cfg.memory:
        return np.zeros(cfg.b)
    if cfg.alpha is not None:
        return np.full(cfg.b, float(cfg.alpha))
    return np.array([alpha_of(cfg, i, d, blocks) for i in range(cfg.b)])


def alpha_of(cfg: RunConfig, i: int, d: int, blocks=None) -> float:
    """Client ``i``'s ``α_i`` (one entry of :func:`alphas`)."""
    if not cfg.memory:
        return 0.0
    if cfg.alpha is not None:
        return float(cfg.alpha)
    return 1.0 / (compressor_for(cfg, i, blocks).omega(d) + 1.0)


def batch_size(cfg: RunConfig, n_data: int) -> int:
    """``n_i = max(1, ⌊N_i · batch-fraction⌋)`` (the paper's toy: ``⌊N_i/10⌋``)."""
    return minibatch_size(cfg.batch_fraction, n_data)


def minibatch_size(fraction: float, n_data: int) -> int:
    return max(1, int(np.floor(n_data * fraction)))


def client_settings(cfg: RunConfig, i: int, d: int, prior: GaussianPrior, blocks=None) -> dict:
    """What client ``i`` needs to compute its message, as plain scalars (the server sends them
    with every message, so that a client needs no run config of its own): the oracle, QSGD's
    ``s_i`` (0: no compression), the encoding and norm blocks, memory and ``α_i``, the
    batch fraction, its share ``w_i`` of the prior ``U_0`` and the prior's variance, the seed."""
    return {
        "oracle": cfg.oracle, "memory": bool(cfg.memory), "alpha": float(alpha_of(cfg, i, d, blocks)),
        "s": int(cfg.s[i]) if cfg.compressed else 0, "encoding": cfg.encoding,
        "blocks": ",".join(str(int(x)) for x in blocks) if blocks else "",
        "batch_fraction": float(cfg.batch_fraction), "prior_var": float(prior.var),
        "prior_mean": float(prior.mean), "prior_weight": (1.0 / cfg.b) if cfg.prior_on == "clients" else 0.0,
        "seed": int(cfg.seed),
    }


_ORACLES = ("full", "minibatch", "star", "svrg")
_ENCODINGS = ("auto", "elias", "packed")


def client_spec_from_settings(settings: dict, i: int, n_data: int, d: int) -> tuple[ClientSpec, int]:
    """``(spec, seed)`` of client ``i`` from :func:`client_settings` (as received: every value
    is checked, and a bad one raises ``ValueError`` naming it)."""
    try:
        oracle, encoding = str(settings["oracle"]), str(settings["encoding"])
        s, seed = int(settings["s"]), int(settings["seed"])
        alpha, bf = float(settings["alpha"]), float(settings["batch_fraction"])
        prior_var, w = float(settings["prior_var"]), float(settings["prior_weight"])
        prior_mean = float(settings.get("prior_mean", 0.0))
        memory = bool(settings["memory"])
        blocks_s = str(settings["blocks"])
        blocks = tuple(int(x) for x in blocks_s.split(",")) if blocks_s else None
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"client settings: missing or malformed value ({type(exc).__name__}: {exc})") from None
    checks = {"oracle": oracle in _ORACLES, "encoding": encoding in _ENCODINGS, "s": 0 <= s < 2 ** 31,
              "alpha": 0.0 <= alpha <= 1.0, "batch_fraction": 0.0 < bf <= 1.0, "prior_var": prior_var > 0,
              "prior_mean": np.isfinite(prior_mean),
              "prior_weight": 0.0 <= w <= 1.0, "seed": 0 <= seed < 2 ** 63,
              "blocks": blocks is None or (all(x > 0 for x in blocks) and sum(blocks) == d)}
    if bad := [k for k, ok in checks.items() if not ok]:
        raise ValueError(f"client settings: bad value for {', '.join(bad)}")
    compressor = QSGD(s=s, blocks=blocks, encoding=encoding) if s else Identity()
    return ClientSpec(index=i, oracle=oracle, batch_size=minibatch_size(bf, n_data), compressor=compressor,
                      memory=memory, alpha=alpha, prior=GaussianPrior(var=prior_var, mean=prior_mean),
                      prior_weight=w), seed


def client_spec(cfg: RunConfig, i: int, n_data: int, d: int, prior: GaussianPrior,
                blocks=None) -> ClientSpec:
    """Client ``i``'s :class:`ClientSpec`: the one the server's :func:`client_settings` give it."""
    return client_spec_from_settings(client_settings(cfg, i, d, prior, blocks), i, n_data, d)[0]


def server_spec(cfg: RunConfig, task: Task, theta_star: np.ndarray | None, blocks=None) -> ServerSpec:
    return ServerSpec(
        b=cfg.b, gamma=cfg.gamma, p=cfg.p, rule=cfg.aggregation, memory=cfg.memory,
        alpha=alphas(cfg, task.dim, blocks), l=cfg.l, oracle=cfg.oracle, prior=task.prior,
        prior_on_server=(cfg.prior_on == "server"), theta_star=theta_star,
    )


def theta0_of(task: Task) -> np.ndarray:
    return np.zeros(task.dim) if task.theta0 is None else np.asarray(task.theta0, dtype=np.float64)


def combine_grads(cfg: RunConfig, prior: GaussianPrior, grads, theta: np.ndarray) -> np.ndarray:
    """``∇U(θ)`` from the clients' full local gradients (in index order) and, when it stays on
    the server, the prior. Used by the θ* optimisation phase on every engine."""
    g = np.zeros_like(theta)
    for gi in grads:
        g = g + gi
    if cfg.prior_on == "server":
        g = g + prior.grad(theta)
    return g
