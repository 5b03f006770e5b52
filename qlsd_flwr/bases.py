"""The coordinates the QLSD family's compressed messages are quantised in (``compression-basis``; docs/METRIC.md):
θ's own (the paper's), the metric's (``C(Sᵀ H_i − η_i)``, ``M = S Sᵀ``, the metric sent to every client), or K-FAC's
block basis (:mod:`qlsd_flwr.core.block_basis`, a few thousand numbers a client standing for a metric of megabytes)."""

from __future__ import annotations

from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core.block_basis import BlockBasis

#: ``compression-basis = auto`` quantises in the metric's coordinates where ``M`` is small enough for every
#: client to keep with each chain's state: a diagonal, or a dense ``M`` of ``d ≤ 512`` (2 MiB). K-FAC's factors
#: and a low-rank correction are too large for that (the main job's ``M`` was 24 MB a client and chain, and in
#: Flower's simulation its rounds ran 8× slower, 0.3 against 2.5 rounds/s, 2026-11-29): K-FAC with ``metric-block``
#: takes the block basis instead, and the others stay in θ's coordinates
WHITEN_AUTO_DENSE_MAX = 512


def compression_basis(cfg: RunConfig, d: int) -> str:
    """The coordinates the QLSD family's compressed messages are quantised in on this run: ``theta``, ``metric`` or
    ``block`` (``compression-basis``; ``auto``: ``block`` for K-FAC with ``metric-block``, ``metric`` by
    :data:`WHITEN_AUTO_DENSE_MAX`; docs/METRIC.md); ``ConfigError`` for ``block`` without a block to take it from."""
    basis, rank = cfg.get("compression-basis"), int(cfg.get("metric-rank") or 0)
    if basis == "theta" or not cfg.compressed or cfg.kind.local or (cfg.metric == "identity" and not rank):
        return "theta"
    blocked = cfg.metric == "kronecker" and int(cfg.get("metric-block") or 0) > 0
    if basis == "block" and not blocked:
        raise ConfigError("compression-basis: block takes K-FAC's root on metric-block's directions, and needs "
                          f"metric = kronecker with metric-block > 0 (metric = {cfg.metric}); allowed: auto, metric, theta")
    if basis != "auto":
        return basis
    if blocked:
        return "block"
    dense = cfg.metric == "dense" or cfg.metric.endswith(".npy")
    return "metric" if not rank and (cfg.metric == "diagonal" or (dense and d <= WHITEN_AUTO_DENSE_MAX)) else "theta"


def basis_of(cfg: RunConfig, d: int, metric) -> BlockBasis | None:
    """The server step's ``basis`` (:class:`~qlsd_flwr.core.server_step.ServerSpec`): the block basis of ``metric`` under
    ``block`` (held to what its clients will accept, :meth:`BlockBasis.checked`), ``None`` (``M``'s own root)
    otherwise; ``ConfigError`` naming the key where the metric has no block (a checkpoint's metric of the former
    dense form: sending that whole metric to every client is what the basis is for avoiding)."""
    if compression_basis(cfg, d) != "block":
        return None
    basis = BlockBasis.of(metric)
    if basis is None:
        raise ConfigError("compression-basis: block needs metric-block's metric, and this run's metric has no block "
                          "(a checkpoint of its former dense form?); allowed here: theta, metric")
    return BlockBasis.checked(basis.arrays(), d)


def whitening_of(cfg: RunConfig, d: int, metric):
    """What this run's clients quantise in (the server step's ``whitening``): the block basis, ``M`` itself, or
    ``None`` in θ's coordinates (an identity metric included)."""
    if not whitens(cfg, d) or metric.is_identity:
        return None
    basis = basis_of(cfg, d, metric)
    return metric if basis is None else basis


def whitens(cfg: RunConfig, d: int) -> bool:
    """Whether the QLSD family's compressed messages are quantised in the metric's coordinates, or a basis standing for
    them (:func:`compression_basis`): the server then sends the clients that basis once (``metric``: sent)."""
    return compression_basis(cfg, d) != "theta"
