"""The fields a sampler's messages carry, both ways, and the arrays its checkpoint keeps: one table, which
each :class:`~qlsd_flwr.samplers.base.Estimator` names from (``down``, ``up``, ``kept``).

Every sampler's messages carry the protocol's own fields (:data:`PROTOCOL_DOWN`, :data:`PROTOCOL_UP`:
the round, θ, the counters, the coded payload; :mod:`qlsd_flwr.protocol.wire`). A sampler's own fields
are the rows of :data:`FIELDS`, each with its form (how it is encoded and checked, one chain or several)
and when it travels. The protocol encodes and validates a field by its form, and refuses a field of this
table that the run's sampler does not declare: a client refuses such a message (``ValueError`` naming the
field), the server such a reply (rejected and counted as ``malformed``), a resume such a checkpoint
(``CheckpointError`` naming the array). ``tests/test_fields.py`` runs every sampler and checks that its
messages carry exactly what it declares.
"""

from __future__ import annotations

from dataclasses import dataclass

#: a vector of R^d: a float64 ``(d,)`` array (bytes on the legacy API); in a several-chain message an
#: ``(n, d)`` array whose rows are the chains ``<name>_chains`` names
VECTOR = "vector"
#: the round's four float64 numbers, 32 bytes a chain, the chains in the message's order
ROUND = "round"
#: 0 or 1; in a several-chain message the chains ``<name>_chains`` names
FLAG = "flag"
#: the run's bytes, the same for every chain, once a message: the metric ``M`` as
#: :meth:`qlsd_flwr.core.metric.Metric.to_bytes` tags it, or the broadcast's support
METRIC = "metric"
#: ``∇U_i`` at a point, ``8d`` bytes of float64; in a several-chain reply one for every chain, or one a chain
GRADIENT = "gradient"
#: a QSGD code (bytes); in a several-chain message a list of bytes, one for each chain ``<name>_chains`` names
CODE = "code"
FORMS = (VECTOR, ROUND, FLAG, METRIC, GRADIENT, CODE)


@dataclass(frozen=True)
class Field:
    """One field of a sampler's messages: its name on the wire, its form, its direction, when it travels."""

    name: str
    form: str
    direction: str  # "down" (server → client) or "up" (client → server)
    when: str


#: the fields every sampler's messages carry (the protocol's, :mod:`qlsd_flwr.protocol.wire`); ``metric``
#: goes whenever the clients' settings say ``metric = sent`` (the rivals' local steps with a metric, or
#: ``compression-basis = metric``), whatever the sampler, with the first message and after a resync
PROTOCOL_DOWN = ("phase", "round", "client", "theta", "anchor_version", "eta_count", "metric", "theta_code",
                 "anchor_is_theta", "theta_support")
PROTOCOL_UP = ("client", "status", "payload", "anchor_version")

#: the samplers' own fields, in the order a message carries them
FIELDS: dict[str, Field] = {f.name: f for f in (
    Field("theta_code", CODE, "down", "downlink = qsgd: the code of θ_k − w_{k−1} (ef21-p) or of θ_k (none), in "
          "θ's place, to a client that holds w_{k−1} (core.downlink)"),
    Field("anchor_is_theta", FLAG, "down", "downlink = qsgd: the anchor refreshed this round is w_k, which the "
          "client has just built; it is not sent"),
    Field("theta_support", METRIC, "down", "downlink-support = data: the coordinates the codes carry, d bits packed, "
          "with a client's first message and after a resync (core.downlink)"),
    Field("local", ROUND, "down", "every round: (h, w_i, S_A, p_i), or DG-LMC's (γ_i, ρ, 1, 1)"),
    Field("metric", METRIC, "down", "the first message and after a resync, when the settings say metric = sent"),
    Field("refresh", FLAG, "down", "VR-FALD*'s refresh rounds: the reply carries ref_grad too"),
    Field("anchor", VECTOR, "down", "a new anchor (ζ or θ*) or version, and after a resync"),
    Field("eta", VECTOR, "down", "after a resync: the server's mirror of η_i (DG-LMC's z_i)"),
    Field("anchor_total", VECTOR, "down", "with θ*: ∇U(θ*) of the clients kept"),
    Field("surrogate", VECTOR, "down", "with θ*: λ_i, this client's surrogate precision"),
    Field("surrogate_total", VECTOR, "down", "with θ*: Λ = Σ_j λ_j over the clients kept"),
    Field("anchor_grad", GRADIENT, "up", "the reply to a message carrying θ*: ∇U_i(θ*), repeated"),
    Field("ref_grad", GRADIENT, "up", "a refresh round's reply: ∇U_i(θ_k), for the next reference"),
)}

#: what a client keeps between rounds as vectors (``ClientState``; Flower: ``context.state``), beside
#: its counters and the metric
HELD = ("eta", "anchor", "anchor_grad", "anchor_total", "surrogate", "surrogate_total", "w", "w_support", "point")

#: a chain's checkpoint arrays that belong to one sampler's state (beside every chain's θ, ζ, η_i, the
#: counters, the metric and θ*'s claims), and what each must be
CHECKPOINT: dict[str, str] = {
    "surrogate": "the clients' surrogate precisions λ_i, (b, d) finite numbers ≥ 0 (FSGLD)",
    "reference_refresh": "the reference refresh counts (VR-FALD*, q > 0)",
}


def check_names(label: str, down: tuple, up: tuple, kept: tuple) -> None:
    """``ValueError`` naming a declared field or checkpoint array this module does not know, or one in the
    wrong direction (an :class:`~qlsd_flwr.samplers.base.Estimator` calls it when it is made)."""
    for names, direction in ((down, "down"), (up, "up")):
        for n in names:
            if n not in FIELDS or FIELDS[n].direction != direction:
                known = [f for f, x in FIELDS.items() if x.direction == direction]
                raise ValueError(f"oracle {label!r}: {n!r} is not a {direction} field; allowed: {', '.join(known)}")
    for n in kept:
        if n not in CHECKPOINT:
            raise ValueError(f"oracle {label!r}: {n!r} is not a checkpoint array; allowed: {', '.join(CHECKPOINT)}")


def undeclared(present, declared, direction: str) -> str | None:
    """The first field of :data:`FIELDS` in ``present`` (a message's keys) that travels ``direction`` but is
    not ``declared`` by the run's sampler, or ``None``."""
    for key in present:
        n = key[:-len("_chains")] if key.endswith("_chains") else key  # a several-chain message's row names
        f = FIELDS.get(n)
        if f is not None and f.direction == direction and n not in declared and n not in PROTOCOL_DOWN:
            return n
    return None
