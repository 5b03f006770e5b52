"""Which backend the vectorised engine runs a configuration on (:func:`backend_for`)."""

from __future__ import annotations

import sys

from qlsd_flwr.compression.format import COMPILED_ENCODINGS
from qlsd_flwr.config import RunConfig
from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.protocol import build
from qlsd_flwr.tasks.gaussian import GaussianLocal
from qlsd_flwr.tasks.logistic import LogisticLocal


def _is_gaussian(task: Task) -> bool:
    return all(type(c) is GaussianLocal for c in task.clients)


def _is_logistic(task: Task) -> bool:
    return all(type(c) is LogisticLocal for c in task.clients)


def _torch_task(task: Task) -> bool:
    """Whether the clients are torch potentials (without importing torch: a task holding them has)."""
    mod = sys.modules.get("qlsd_flwr.tasks.torch_models")
    return mod is not None and bool(task.clients) and isinstance(task.clients[0], mod.TorchPotential)


def backend_for(cfgs, task: Task, backend: str = "auto") -> str:
    """``"numba"`` (the compiled kernel), ``"numpy"`` (any task) or ``"torch"`` (a torch network's
    QLSD chains on its device, :mod:`.torch_backend`); raises if ``numba`` or ``torch`` is requested
    but does not apply.

    ``auto`` picks ``torch`` when the clients' torch potentials live on a CUDA device and it covers
    the run (:func:`.torch_scope.applies`); on the CPU the numpy backend is the reference.

    ``auto`` picks ``numba`` for the toy Gaussian, where its chains are the reference's bit for
    bit. Not at ``d = 1``: there numpy sums a ``(b, 1)`` array over its first axis pairwise (the
    axis is contiguous), while the kernel adds rows one after another, as numpy does for
    ``d ≥ 2``; the last bits of ``η = Σ η_i`` and of minibatch sums would differ from the
    reference. On the logistic task ``numba`` runs only when asked for: its gradient is equal to
    the reference's within float rounding, not bit for bit (see :mod:`.kernel`)."""
    cfgs = [cfgs] if isinstance(cfgs, RunConfig) else list(cfgs)
    if backend == "torch":
        from qlsd_flwr.engines.vectorised import torch_scope

        why = next((w for w in (torch_scope.unsupported(c, task) for c in cfgs) if w), None)
        if why:
            raise ValueError(why)
        return "torch"
    if backend == "auto" and _torch_task(task):
        from qlsd_flwr.engines.vectorised import torch_scope

        if all(torch_scope.applies(c, task) for c in cfgs):
            return "torch"
    if any(c.compressed and c.encoding not in COMPILED_ENCODINGS for c in cfgs):  # the kernel counts those
        if backend == "numba":
            raise ValueError("vectorised-backend = numba counts QSGD's Elias and packed codes; "
                             "encoding = arith runs on: auto, numpy")
        return "numpy"
    if any(build.downlink_on(c) for c in cfgs):  # the compiled kernel steps from θ itself
        if backend == "numba":
            raise ValueError("vectorised-backend = numba sends θ in full; downlink = qsgd runs on: auto, numpy")
        return "numpy"
    if not all(c.kind.batched for c in cfgs):  # the rivals' local chains (engines.vectorised.rivals), or a message
        if backend == "numba":                  # the kernel does not compile: numpy runs the sampler's own
            raise ValueError(f"vectorised-backend = numba runs the QLSD family only; "
                             f"{', '.join(sorted({c.variant for c in cfgs if not c.kind.batched}))} runs on: auto, numpy")
        return "numpy"
    one_norm = all(build.blocks_for(c, task) is None for c in cfgs)
    # the kernel's step is the paper's, with a Gaussian prior
    plain = all(c.metric == "identity" and not int(c.get("metric-rank") or 0) and c.temperature == 1.0
                for c in cfgs) and isinstance(task.prior, GaussianPrior)
    ok = _is_gaussian(task) and task.dim >= 2 and one_norm and plain
    if backend == "numba" and not plain:
        raise ValueError("vectorised-backend = numba runs the paper's step only (metric = identity, metric-rank = 0, "
                         "temperature = 1, "
                         "a Gaussian prior); "
                         "allowed for this run: auto, numpy")
    if backend == "auto":
        return "numba" if ok else "numpy"
    if backend not in ("numba", "numpy"):
        raise ValueError(f"backend: unknown value {backend!r}; allowed: auto, numba, numpy, torch")
    if backend == "numba" and not (ok or (_is_logistic(task) and one_norm)):
        raise ValueError("vectorised-backend = numba needs the Gaussian task with dim >= 2 or the logistic task, "
                         "and one QSGD norm per vector (block-norm = vector); allowed for this run: auto, numpy")
    return backend
