"""What a sampler declares, in one place: :class:`Estimator` (what a client's message is: its flags, the
``oracle`` label that travels in the client settings, the client's update that computes the message and
the server's update that takes it) and :class:`Sampler` (a ``variant``: its estimator, whether its messages
are compressed and carry a memory, what it needs before sampling, the keys that do not apply to it and
the ones it refuses).

The rest of the package asks these objects, never the names: ``cfg.sampler.pooled``,
``spec.kind.cv_zeta``, ``spec.kind.message(...)``. The updates are functions of explicit state, built from
the mathematics in :mod:`qlsd_flwr.core`; this package sits above it and below the configuration, so
every layer above (the configuration, the protocol, the engines, Flower, the checkpoints) may read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from qlsd_flwr.samplers import fields


@dataclass(frozen=True)
class Estimator:
    """What client ``i``'s message is, as the core and the protocol ask about it (ALGORITHMS.md).

    The flags are independent facts; the properties combine them.
    """

    name: str  # the ``oracle`` label in the client settings and ``RunConfig.oracle``
    minibatch: bool = False  # draws a minibatch S_i each round (QLSD#, QLSD*, QLSD++, SGLD)
    cv_theta_star: bool = False  # H_i(θ) − H_i(θ*): a control variate at θ* (QLSD*, LSD*)
    cv_zeta: bool = False  # H_i(θ) − H_i(ζ) + ∇U_i(ζ), ζ refreshed every l rounds (QLSD++, LSD++)
    local: bool = False  # K local steps, the round's numbers sent in ``local`` (FALD, VR-FALD*, DG-LMC, FSGLD)
    at_theta_star: bool = False  # anchored at θ* with the federation's ∇U(θ*) sent beside it (VR-FALD*, FSGLD)
    coupled: bool = False  # z_i kept on both sides, θ | z drawn exactly by the server (DG-LMC)
    refreshable: bool = False  # its reference θ_r refreshed with probability q (VR-FALD*)
    surrogate: bool = False  # Taylor surrogates at θ*, one client a round by its data share (FSGLD)
    measure: str = "estimate"  # what the bounded-influence rule judges of a reply, as its messages name it
    #: the client's update: ``message(spec, pot, state, seed, round_, theta, local)`` → the vector it sends
    #: before compression (``core.oracles.client_round`` compresses it and keeps the memory)
    message: Callable | None = None
    #: the server's update: ``step(spec, st, seed, g_hat, replied)`` → each chain's skipped flag, advancing
    #: ``st`` (a :class:`qlsd_flwr.core.server_step.ServerState`) by one round
    step: Callable | None = None
    #: ``message`` is the QLSD family's ``H_i``, whose batched forms (``core.oracles.oracle_batch``, the numba
    #: kernel) the vectorised engine may use; otherwise it runs ``message`` chain by chain
    batched: bool = False
    #: its own fields (:data:`qlsd_flwr.samplers.fields.FIELDS`) beside the protocol's: those its messages
    #: carry server → client (``down``) and client → server (``up``), and its checkpoint arrays (``kept``);
    #: the protocol refuses any other field of the table (:mod:`qlsd_flwr.samplers.fields`)
    down: tuple = ()
    up: tuple = ()
    kept: tuple = ()

    def __post_init__(self):
        fields.check_names(self.name, self.down, self.up, self.kept)

    @property
    def control_variate(self) -> bool:
        """A difference at an anchor, whose mean vanishes at the mode (QLSD*, QLSD++, LSD*, LSD++)."""
        return self.cv_theta_star or self.cv_zeta

    @property
    def anchored(self) -> bool:
        """The client keeps an anchor (θ* or ζ) and its version."""
        return self.control_variate or self.at_theta_star

    @property
    def needs_theta_star(self) -> bool:
        """θ* is settled before sampling and every client's ``∇U_i(θ*)`` repeated in its replies to it."""
        return self.cv_theta_star or self.at_theta_star

    @property
    def weighs_by_p(self) -> bool:
        """A reply is weighed by ``1/p_i`` under ``aggregation = unbiased`` (not DG-LMC's draw nor FSGLD)."""
        return not (self.coupled or self.surrogate)


#: Refusals: ``check(sampler, settings)`` raises :class:`~qlsd_flwr.errors.ConfigError` naming the key.
Check = Callable[["Sampler", "Settings"], None]


@dataclass(frozen=True)
class Settings:
    """The parsed keys a sampler's refusals read (``config.resolve`` builds it)."""

    raw: dict
    p: object  # np.ndarray of p_i
    aggregation: str
    metric_rank: int


@dataclass(frozen=True)
class Sampler:
    """One ``variant``: everything the rest of the package asks about it.

    Symbols follow the paper and ALGORITHMS.md; ``reference`` cites the sampler.
    """

    name: str  # the ``variant`` key's value
    title: str  # as printed (QLSD++, VR-FALD*, ...)
    estimator: Estimator
    compressed: bool  # QSGD-coded messages under ``compressor = auto``
    memory: bool  # a memory η_i (QLSD++'s; DG-LMC's z_i) kept on both sides
    reference: str
    pooled: bool = False  # centralised: the task's data pooled into one client taking part every round (SGLD)
    not_applicable: frozenset = field(default_factory=frozenset)  # keys that cannot change its runs
    checks: tuple = ()  # its refusals (Check)

    @property
    def oracle(self) -> str:
        return self.estimator.name

    def refuse(self, settings: Settings) -> None:
        """Raise :class:`~qlsd_flwr.errors.ConfigError` for a key this sampler does not take."""
        for check in self.checks:
            check(self, settings)
