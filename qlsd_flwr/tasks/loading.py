"""Loading a run's data: every client's (server side, local engines) or one client's own (a
SuperNode), from the task registry or a partition file. Reads files; the protocol never calls it."""

from __future__ import annotations

import numpy as np

from qlsd_flwr.config import ConfigError, RunConfig, check_memory
from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.plugins import is_plugin
from qlsd_flwr.protocol.build import blocks_for
from qlsd_flwr.tasks.threads import apply_threads


def load_task(cfg: RunConfig) -> Task:
    """The run's task with all clients' data (server side, tests, local engines); torch's threads
    are then set for this process (:mod:`qlsd_flwr.tasks.threads`)."""
    task = _load_task(cfg)
    apply_threads(cfg.raw, client=False)
    return task


def _load_task(cfg: RunConfig) -> Task:
    name = cfg.task
    pooled = cfg.sampler.pooled
    if name == "gaussian":
        from qlsd_flwr.tasks.gaussian import build_gaussian_task

        # d is known before the data are made: the chains' memory is refused first (the same check
        # as the preparation's, seconds of data generation earlier at dim = 1e5)
        check_memory(cfg, cfg.dim)
        return build_gaussian_task(b=cfg.num_clients, d=cfg.dim,
                                   data_seed=cfg.data_seed, prior_var=cfg.prior_var,
                                   pooled=pooled)
    if name in ("logistic", "mnist"):
        from qlsd_flwr.tasks import registry

        return registry.build(cfg, pooled=pooled)
    if name == "external":
        raise ConfigError("task = external: the clients bring their own potentials "
                          "(qlsd_flwr.flower.make_client_app(potential_fn)), so only a Flower run with "
                          "that ClientApp can sample it; name a task plug-in (task = 'module:callable') "
                          "to run it on every engine")
    if is_plugin(name):
        return plugin_task(cfg, pooled)
    raise ConfigError(f"task: unknown value {name!r}")


LABEL_LOOKALIKES = ("names", "labels", "param_names", "parameter_names", "coords", "coordinates")


def check_labels(task: Task, where: str) -> None:
    """``task.meta["param_labels"]`` (θ's coordinate names in ``samples.nc``) is ``d`` distinct
    strings; a look-alike key (``names``, ``labels``, …) without it is refused by name, since it
    would otherwise leave the coordinates numbered without a word."""
    labels = task.meta.get("param_labels")
    if labels is None:
        if near := [k for k in LABEL_LOOKALIKES if k in task.meta]:
            raise ConfigError(f"task: {where} sets meta[{near[0]!r}]; θ's coordinate names are read from "
                              f"meta['param_labels'] (d = {task.dim} distinct strings)")
        return
    labels = [str(v) for v in labels]
    if len(labels) != task.dim or len(set(labels)) != len(labels):
        raise ConfigError(f"task: {where} meta['param_labels'] has {len(labels)} names ({len(set(labels))} "
                          f"distinct), expected d = {task.dim} distinct strings")
    task.meta["param_labels"] = labels


def plugin_task(cfg: RunConfig, pooled: bool = False) -> Task:
    """A task plug-in's :class:`Task`: ``task = "my_pkg.my_task:make"`` with ``make(num_clients,
    data_seed) -> Task`` (see :mod:`qlsd_flwr.plugins`); with ``pooled`` (SGLD) its clients are
    pooled into one."""
    from qlsd_flwr.plugins import load_object

    task = load_object(cfg.task, "task")(cfg.num_clients, cfg.data_seed)
    if not isinstance(task, Task):
        raise ConfigError(f"task: {cfg.task!r} returned {type(task).__name__}, not a qlsd_flwr Task")
    if len(task.clients) != cfg.num_clients:
        raise ConfigError(f"task: {cfg.task!r} made {len(task.clients)} clients, num-clients = {cfg.num_clients}")
    check_labels(task, repr(cfg.task))
    if pooled:
        from qlsd_flwr.potentials import Pooled

        task = Task(name=task.name, dim=task.dim, clients=[Pooled(task.clients)], prior=task.prior,
                    theta_star=task.theta_star, posterior_mean=task.posterior_mean,
                    posterior_var=task.posterior_var, theta0=task.theta0, meta=task.meta)
    return task


def load_client(cfg: RunConfig, i: int, data_path: str | None = None):
    """Client ``i``'s own data only (what a SuperNode loads): ``(potential, prior, d, blocks)``.

    ``data_path`` (node config ``data-path``): an ``.npz`` with this node's partition only,
    see :func:`load_partition`."""
    name = cfg.task
    if data_path:
        return load_partition(cfg, data_path)
    if name == "gaussian" and not cfg.sampler.pooled:
        from qlsd_flwr.tasks.gaussian import GaussianLocal, client_data

        d = cfg.dim
        pot = GaussianLocal(client_data(i, d, cfg.data_seed))
        return pot, GaussianPrior(var=cfg.prior_var), d, None
    if name in ("logistic", "mnist"):
        from qlsd_flwr.tasks import registry

        return registry.load_client(cfg, i)
    task = load_task(cfg)
    return task.clients[i], task.prior, task.dim, blocks_for(cfg, task)


def load_partition(cfg: RunConfig, path: str):
    """One node's partition from an ``.npz`` file: ``y`` of shape ``(N_i, d)`` for the Gaussian
    task; ``X``, ``y`` and ``n_classes`` for logistic/mnist (softmax regression). Write one
    with :func:`qlsd_flwr.deploy.flwr_cli.write_partition`. Returns ``(potential, prior, d, blocks)``."""
    name = cfg.task
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if name == "gaussian":
        from qlsd_flwr.tasks.gaussian import GaussianLocal

        pot = GaussianLocal(arrays["y"])
        if pot.dim != cfg.dim:
            raise ConfigError(f"data-path {path}: points have d = {pot.dim}, the run config says "
                              f"dim = {cfg.get('dim')}")
        return pot, GaussianPrior(var=cfg.prior_var), pot.dim, None
    if name == "logistic" and "X" in arrays:
        from qlsd_flwr.tasks.logistic import LogisticLocal

        pot = LogisticLocal(arrays["X"], arrays["y"], int(arrays["n_classes"]))
        prior_var = float(arrays["prior_var"]) if "prior_var" in arrays else cfg.prior_var
        blocks = (pot.dim,) if cfg.block_norm == "tensor" else None
        return pot, GaussianPrior(var=prior_var), pot.dim, blocks
    raise ConfigError(f"data-path: task {name!r} cannot load a partition file (only gaussian and "
                      f"logistic); leave data-path unset")
