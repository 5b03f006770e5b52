"""The samplers: one object per ``variant`` (:class:`~qlsd_flwr.samplers.base.Sampler`), one module per
family, and the registry that maps the ``variant`` key to its object.

How to add a sampler (docs/ARCHITECTURE.md): declare its :class:`Estimator` and :class:`Sampler` in a
module of this package and list the module in ``_FAMILIES``; the configuration, the key table, the
engines, the protocol and the checkpoints read the declaration.
"""

from __future__ import annotations

from qlsd_flwr.samplers import dglmc, fald, fsgld, qlsd
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings

__all__ = ["ALIASES", "ESTIMATORS", "SAMPLERS", "Estimator", "Sampler", "Settings", "estimator", "find", "get"]

_FAMILIES = (qlsd, fald, dglmc, fsgld)

#: ``variant`` → its :class:`Sampler`, in the order the documentation lists them
SAMPLERS: dict[str, Sampler] = {s.name: s for family in _FAMILIES for s in family.SAMPLERS}
#: the ``oracle`` label → its :class:`Estimator` (what the client settings carry)
ESTIMATORS: dict[str, Estimator] = {s.oracle: s.estimator for s in SAMPLERS.values()}
#: the paper's spellings of the variants
ALIASES = {"qlsd#": "qlsd-sharp", "qlsd*": "qlsd-star", "qlsd++": "qlsd-pp",
           "lsd*": "lsd-star", "lsd++": "lsd-pp", "vr-fald*": "vr-fald-star"}


def find(name) -> Sampler | None:
    """The sampler a ``variant`` value names (an alias too, any case), or ``None``."""
    v = str(name).strip().lower()
    return SAMPLERS.get(ALIASES.get(v, v))


def get(name) -> Sampler:
    """The sampler ``name`` names; ``KeyError`` naming the allowed values otherwise."""
    s = find(name)
    if s is None:
        raise KeyError(f"variant: unknown value {name!r}; allowed: {', '.join(SAMPLERS)}")
    return s


def estimator(oracle: str) -> Estimator:
    """The estimator an ``oracle`` label names (``KeyError`` for another)."""
    return ESTIMATORS[oracle]
