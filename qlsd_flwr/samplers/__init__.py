"""The samplers: one object per ``variant`` (:class:`~qlsd_flwr.samplers.base.Sampler`), one module per
family, and the registry that maps the ``variant`` key to its object.

How to add a sampler (docs/ARCHITECTURE.md): declare its :class:`Sampler` (and, for a new kind of client
message, its :class:`Estimator`) in a module of this package and list the module in ``_FAMILIES``, or
call :func:`register` from anywhere (``tests/test_toy_sampler.py`` adds one from a test file alone); the
configuration, the key table, the engines, the protocol, Flower's apps and the checkpoints read the
declaration. A new estimator brings its client update (``message``) and its server update (``step``),
written beside it, and names the fields its messages carry beyond the protocol's and its checkpoint arrays
(``down``, ``up``, ``kept``: rows of :data:`qlsd_flwr.samplers.fields.FIELDS`).
"""

from __future__ import annotations

from qlsd_flwr.samplers import dglmc, fald, fsgld, qlsd
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings

__all__ = ["ALIASES", "ESTIMATORS", "SAMPLERS", "Estimator", "Sampler", "Settings", "find", "get", "register",
           "unregister"]

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


def register(sampler: Sampler) -> Sampler:
    """Add ``sampler`` to the registry, so that ``variant = sampler.name`` runs it on every engine in this
    process (a Flower run on Ray or a SuperLink needs it registered where its ServerApp and ClientApps
    import their code). ``ValueError`` if its name is taken, or its estimator's label names another
    estimator."""
    if find(sampler.name) is not None:
        raise ValueError(f"variant: {sampler.name!r} is already a sampler; allowed: a new name")
    if sampler.estimator.message is None or sampler.estimator.step is None:
        raise ValueError(f"oracle: {sampler.oracle!r} declares no client update (message) or no server update "
                         "(step); an Estimator needs both")
    known = ESTIMATORS.get(sampler.oracle)
    if known is not None and known != sampler.estimator:
        raise ValueError(f"oracle: {sampler.oracle!r} already names another estimator ({known})")
    SAMPLERS[sampler.name] = sampler
    ESTIMATORS.setdefault(sampler.oracle, sampler.estimator)
    return sampler


def unregister(name: str) -> None:
    """Remove a sampler :func:`register` added (its estimator stays while another sampler uses it)."""
    sampler = SAMPLERS.pop(name)
    if not any(s.oracle == sampler.oracle for s in SAMPLERS.values()):
        ESTIMATORS.pop(sampler.oracle, None)
