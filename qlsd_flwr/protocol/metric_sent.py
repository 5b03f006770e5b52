"""The metric ``M`` as it travels to the clients, when their messages need it: the rivals' local steps
(FALD, VR-FALD*, FSGLD, DG-LMC take their steps in ``M``) and the QLSD family with ``compression-basis =
metric`` (each client quantises ``Sᵀ H_i`` with ``M = S Sᵀ``). It goes with each client's first message and
again after a resync (a started or restored server has sent it to no client yet), as
:func:`qlsd_flwr.protocol.wire.metric_to_bytes` makes it: empty bytes for the identity that ``metric-rank``'s
correction leaves when it finds no direction (a client told to expect ``M`` would otherwise answer resync
forever).
"""

from __future__ import annotations

from qlsd_flwr.config import ConfigError
from qlsd_flwr.core.kron_block import Blocked
from qlsd_flwr.protocol.wire import metric_to_bytes


def wanted(server) -> bool:
    """Whether the clients' settings say that ``M`` travels to them."""
    return server.settings[0].get("metric", "identity") != "identity"


def setup(server, error=ConfigError) -> None:
    """Ready the metric's bytes on ``server`` (none when its clients do not take it); DG-LMC's may not carry a
    correction (``error`` naming the key)."""
    metric = server.spec.metric
    if server.cfg.kind.coupled and metric.has_correction:
        keys = [k for k, on in (("metric-block", isinstance(metric.base, Blocked)),
                                ("metric-rank", metric.low is not None)) if on]
        raise error(f"{' and '.join(keys)}: {server.cfg.variant}'s exact θ | z draw takes its metric in the metric's "
                    f"own eigenbasis, which a correction changes; allowed: {' and '.join(k + ' = 0' for k in keys)}")
    server._metric_sent = set()
    sent = server.spec.whitening  # compression-basis = block: the clients' basis stands for M (core.block_basis)
    server._metric_bytes = metric_to_bytes(sent) if wanted(server) or not metric.is_identity else None


def add(server, i: int, fields: dict) -> None:
    """``M`` into client ``i``'s fields with its first message and after a resync."""
    if getattr(server, "_metric_bytes", None) is not None and (i not in server._metric_sent or server.needs_resync[i]):
        fields["metric"] = server._metric_bytes
        server._metric_sent.add(i)
