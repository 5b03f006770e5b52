"""Builds the pieces of a run from its :class:`~qlsd_flwr.config.RunConfig`.

Every engine (Flower on Ray, in-process Flower, the framework-free loop, the vectorised
engine) calls these same functions, so they all run the same algorithm.
"""

from __future__ import annotations

import logging

import numpy as np

from .compression import Identity, QSGD
from .config import ConfigError, RunConfig
from .oracles import ClientSpec
from .sampler import ServerSpec
from .tasks.base import GaussianPrior, Task


def load_task(cfg: RunConfig) -> Task:
    """The run's task with all clients' data (server side, tests, local engines)."""
    name = str(cfg.get("task")).lower()
    pooled = cfg.variant == "sgld"
    if name == "gaussian":
        from .tasks.gaussian import build_gaussian_task

        return build_gaussian_task(b=int(cfg.get("num-clients")), d=int(cfg.get("dim")),
                                   data_seed=int(cfg.get("data-seed")), prior_var=cfg.prior_var,
                                   pooled=pooled)
    if name in ("logistic", "mnist"):
        from .tasks import registry

        return registry.build(cfg, pooled=pooled)
    raise ConfigError(f"task: unknown value {name!r}")


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
    return max(1, int(np.floor(n_data * cfg.batch_fraction)))


def prior_of(cfg: RunConfig, task: Task) -> GaussianPrior:
    return task.prior


def client_spec(cfg: RunConfig, i: int, n_data: int, d: int, prior: GaussianPrior,
                blocks=None) -> ClientSpec:
    return ClientSpec(
        index=i, oracle=cfg.oracle, batch_size=batch_size(cfg, n_data),
        compressor=compressor_for(cfg, i, blocks), memory=cfg.memory,
        alpha=alpha_of(cfg, i, d, blocks), prior=prior,
        prior_weight=(1.0 / cfg.b) if cfg.prior_on == "clients" else 0.0,
    )


def server_spec(cfg: RunConfig, task: Task, theta_star: np.ndarray | None, blocks=None) -> ServerSpec:
    return ServerSpec(
        b=cfg.b, gamma=cfg.gamma, p=cfg.p, rule=cfg.aggregation, memory=cfg.memory,
        alpha=alphas(cfg, task.dim, blocks), l=cfg.l, oracle=cfg.oracle, prior=task.prior,
        prior_on_server=(cfg.prior_on == "server"), theta_star=theta_star,
    )


def theta0_of(task: Task) -> np.ndarray:
    return np.zeros(task.dim) if task.theta0 is None else np.asarray(task.theta0, dtype=np.float64)


def needs_theta_star(cfg: RunConfig) -> bool:
    return cfg.oracle == "star"


def closed_form_theta_star(cfg: RunConfig, task: Task) -> np.ndarray:
    if task.theta_star is None:
        raise ConfigError(
            f"theta-star: task {task.name!r} has no closed-form θ*; set theta-star = optimise")
    return np.asarray(task.theta_star, dtype=np.float64)


def gd_step(theta: np.ndarray, grad: np.ndarray, lr: float) -> np.ndarray:
    """One step of the federated optimisation phase that finds ``θ* = argmin U``."""
    return theta - lr * grad


def opt_converged(grad: np.ndarray, grad0_norm: float, tol: float) -> bool:
    return float(np.linalg.norm(grad)) <= tol * (1.0 + grad0_norm)


def load_client(cfg: RunConfig, i: int, data_path: str | None = None):
    """Client ``i``'s own data only (what a SuperNode loads): ``(potential, prior, d, blocks)``.

    ``data_path`` (node config ``data-path``): an ``.npz`` with this node's partition only,
    see :func:`load_partition`."""
    name = str(cfg.get("task")).lower()
    if data_path:
        return load_partition(cfg, data_path)
    if name == "gaussian" and cfg.variant != "sgld":
        from .tasks.gaussian import GaussianLocal, client_data

        d = int(cfg.get("dim"))
        pot = GaussianLocal(client_data(i, d, int(cfg.get("data-seed"))))
        return pot, GaussianPrior(var=cfg.prior_var), d, None
    if name in ("logistic", "mnist"):
        from .tasks import registry

        return registry.load_client(cfg, i)
    task = load_task(cfg)
    return task.clients[i], task.prior, task.dim, blocks_for(cfg, task)


def load_partition(cfg: RunConfig, path: str):
    """One node's partition from an ``.npz`` file: ``y`` of shape ``(N_i, d)`` for the Gaussian
    task; ``X``, ``y`` and ``n_classes`` for logistic/mnist (softmax regression). Write one
    with :func:`qlsd_flwr.deploy.write_partition`. Returns ``(potential, prior, d, blocks)``."""
    name = str(cfg.get("task")).lower()
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if name == "gaussian":
        from .tasks.gaussian import GaussianLocal

        pot = GaussianLocal(arrays["y"])
        if pot.dim != int(cfg.get("dim")):
            raise ConfigError(f"data-path {path}: points have d = {pot.dim}, the run config says "
                              f"dim = {cfg.get('dim')}")
        return pot, GaussianPrior(var=cfg.prior_var), pot.dim, None
    if name == "logistic" and "X" in arrays:
        from .tasks.logistic import LogisticLocal

        pot = LogisticLocal(arrays["X"], arrays["y"], int(arrays["n_classes"]))
        prior_var = float(arrays["prior_var"]) if "prior_var" in arrays else cfg.prior_var
        blocks = (pot.dim,) if cfg.block_norm == "tensor" else None
        return pot, GaussianPrior(var=prior_var), pot.dim, blocks
    raise ConfigError(f"data-path: task {name!r} cannot load a partition file (only gaussian and "
                      f"logistic); leave data-path unset")


def combine_grads(cfg: RunConfig, prior: GaussianPrior, grads, theta: np.ndarray) -> np.ndarray:
    """``∇U(θ)`` from the clients' full local gradients (in index order) and, when it stays on
    the server, the prior. Used by the θ* optimisation phase on every engine."""
    g = np.zeros_like(theta)
    for gi in grads:
        g = g + gi
    if cfg.prior_on == "server":
        g = g + prior.grad(theta)
    return g
