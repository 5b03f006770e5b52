"""The metric ``M`` as it travels to the clients, when their messages need it: the rivals' local steps
(FALD, VR-FALD*, FSGLD, DG-LMC take their steps in ``M``) and the QLSD family with ``compression-basis =
metric`` (each client quantises ``Sᵀ H_i`` with ``M = S Sᵀ``). It goes with each client's first message and
again after a resync (a started or restored server has sent it to no client yet), as
:func:`qlsd_flwr.protocol.wire.metric_to_bytes` makes it: empty bytes for the identity that ``metric-rank``'s
correction leaves when it finds no direction (a client told to expect ``M`` would otherwise answer resync
forever). ``compression-basis = block``'s basis goes by reference (:class:`~qlsd_flwr.core.block_basis.BasisRef`,
72 kB where the basis is 700 kB on the main job) to a client whose ``metric-block`` report the server took (it holds
the directions), and whole to any other, and to any client after it answered resync (its directions may be gone).
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.config import ConfigError
from qlsd_flwr.core.block_basis import BasisRef, BlockBasis
from qlsd_flwr.core.kron_block import Blocked
from qlsd_flwr.protocol.wire import metric_to_bytes


def wanted(server) -> bool:
    """Whether the clients' settings say that ``M`` travels to them."""
    return server.settings[0].get("metric", "identity") != "identity"


def setup(server, error=ConfigError, holders=()) -> None:
    """Ready the metric's bytes on ``server`` (none when its clients do not take it); DG-LMC's may not carry a
    correction (``error`` naming the key). ``holders``: the clients whose ``metric-block`` report was taken, sent
    the clients' basis by reference."""
    metric = server.spec.metric
    if server.cfg.kind.coupled and metric.has_correction:
        keys = [k for k, on in (("metric-block", isinstance(metric.base, Blocked)),
                                ("metric-rank", metric.low is not None)) if on]
        raise error(f"{' and '.join(keys)}: {server.cfg.variant}'s exact θ | z draw takes its metric in the metric's "
                    f"own eigenbasis, which a correction changes; allowed: {' and '.join(k + ' = 0' for k in keys)}")
    server._metric_sent = set()
    sent = server.spec.whitening  # compression-basis = block: the clients' basis stands for M (core.block_basis)
    server._metric_bytes = metric_to_bytes(sent) if wanted(server) or not metric.is_identity else None
    server._ref_bytes, server._ref_holders = ref_of(server._metric_bytes and sent, holders), set(map(int, holders))


def ref_of(sent, holders) -> bytes | None:
    """The clients' basis by reference (:class:`~qlsd_flwr.core.block_basis.BasisRef`), where ``sent`` is a block
    basis and some client holds its directions; else ``None``."""
    return BasisRef.of(sent).to_bytes() if isinstance(sent, BlockBasis) and len(holders) else None


def add(server, i: int, fields: dict) -> None:
    """``M`` into client ``i``'s fields with its first message and after a resync: the basis by reference to a
    client that holds its directions and has not answered resync since it was sent one."""
    if getattr(server, "_metric_bytes", None) is not None and (i not in server._metric_sent or server.needs_resync[i]):
        holders = getattr(server, "_ref_holders", set())
        if i in server._metric_sent:  # a resync: what it held may be gone
            holders.discard(i)
        ref = getattr(server, "_ref_bytes", None)
        fields["metric"] = ref if ref is not None and i in holders else server._metric_bytes
        server._metric_sent.add(i)


def bits_by_client(metric, holders, b: int) -> np.ndarray:
    """``(b,)``: the bits of the metric each client is sent with its first message (:func:`add`; the engines that
    count the protocol's downlink without a server: :class:`~qlsd_flwr.protocol.downlink.SamplingDownlink`)."""
    whole = 8 * len(metric_to_bytes(metric))
    out = np.full(b, whole, dtype=np.int64)
    ref = ref_of(metric, holders)
    if ref is not None:
        out[[int(i) for i in holders]] = 8 * len(ref)
    return out
