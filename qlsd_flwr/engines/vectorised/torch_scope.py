"""What the vectorised engine's torch backend (:mod:`.torch_backend`) covers, and when ``auto`` picks it;
apart from the backend so that the driver checks a run without building it."""

from __future__ import annotations

import numpy as np

from qlsd_flwr.compression.format import COMPILED_ENCODINGS
from qlsd_flwr.compression.identity import Identity as IdentityCompressor
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.core.potential import GaussianPrior
from qlsd_flwr.protocol import build


def unsupported(cfg, task, specs=None, spec=None) -> str | None:
    """Why the torch backend cannot run ``cfg`` on ``task`` (one line naming the key), or ``None``."""
    from qlsd_flwr.tasks.torch_models import TorchPotential

    pots = list(task.clients)
    if not all(isinstance(p, TorchPotential) for p in pots):
        return "vectorised-backend = torch needs torch potentials (a torch model's task); allowed here: auto, numpy"
    m0 = pots[0]
    if any(repr(p.model) != repr(m0.model) or p.blocks != m0.blocks or p.dtype != m0.dtype
           or p.device != m0.device or p._per_example is not m0._per_example for p in pots):
        return "vectorised-backend = torch needs every client on one model, dtype, device and loss; allowed here: auto, numpy"
    if not cfg.kind.batched or cfg.kind.local:
        return f"vectorised-backend = torch runs the QLSD family; variant {cfg.variant!r} runs on: auto, numpy"
    if build.downlink_on(cfg):
        return "vectorised-backend = torch sends θ in full; downlink = qsgd runs on: auto, numpy"
    if str(cfg.get("noise-correction")) != "off":
        return "vectorised-backend = torch takes ULA's noise; noise-correction = metric runs on: auto, numpy"
    if cfg.metric in ("dense", "kronecker") or int(cfg.get("metric-rank") or 0):  # a file: its kind, below
        return ("vectorised-backend = torch steps with metric = identity or diagonal and metric-rank = 0; "
                f"metric = {cfg.metric!r} runs on: auto, numpy")
    if not isinstance(task.prior, GaussianPrior) or np.ndim(task.prior.mean) or np.ndim(task.prior.var):
        return "vectorised-backend = torch needs a Gaussian prior with one mean and variance (prior-var)"
    if build.blocks_for(cfg, task) is not None:
        return "vectorised-backend = torch quantises with one norm per vector; block-norm: allowed: vector"
    if cfg.compressed and cfg.encoding not in COMPILED_ENCODINGS:  # before the specs: auto then picks numpy
        return f"vectorised-backend = torch codes QSGD as auto, elias or packed; encoding = {cfg.encoding!r} runs on: auto, numpy"
    if specs is not None:
        comps = [s.compressor for s in specs]
        if any(c != comps[0] for c in comps):
            return "vectorised-backend = torch needs one compressor for every client (s, encoding)"
        c = comps[0]
        if isinstance(c, QSGD) and c.encoding not in COMPILED_ENCODINGS:
            return f"vectorised-backend = torch codes QSGD as auto, elias or packed; encoding = {c.encoding!r}"
        if not isinstance(c, (QSGD, IdentityCompressor)):
            return f"vectorised-backend = torch has no twin of the compressor {type(c).__name__}; compressor: qsgd, identity"
    if spec is not None and (spec.offset is not None or spec.whitened or spec.metric.kind not in ("identity", "diagonal")):
        return ("vectorised-backend = torch runs the step with an identity or diagonal metric, no client left the "
                "federation, compression-basis = identity")
    return None


def applies(cfg, task) -> bool:
    """Whether ``vectorised-backend = auto`` picks this backend: torch potentials on a CUDA device
    that it covers (on the CPU the numpy backend's chains are the reference's bit for bit)."""
    from qlsd_flwr.tasks.torch_models import TorchPotential

    pots = list(task.clients)
    return (bool(pots) and all(isinstance(p, TorchPotential) for p in pots)
            and pots[0].device.type == "cuda" and unsupported(cfg, task) is None)
