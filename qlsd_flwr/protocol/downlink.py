"""The sampling rounds' downlink for the engines that run the QLSD family without a protocol server
(the vectorised engine's numpy and numba backends): what :meth:`QLSDServer.fields_for
<qlsd_flwr.protocol.server.QLSDServer.fields_for>` would send, counted as its code length
(:class:`SamplingDownlink`), and, under ``downlink = qsgd``, the chains' ``w_k`` it codes
(:class:`ChainsBroadcast`).

Each round every active (chain, client) pair is sent θ_k (``64 d`` bits) and, when the client's copy of
the anchor is not the round's, the anchor (``64 d``): QLSD++ and LSD++ refresh ζ at the rounds ``k ≡ 0
(mod l)``, so a client gets it at its first active round since the last refresh; QLSD* and LSD* send θ*
at a client's first active round. On these engines every reply is accepted and no client restarts, so
the server's record of each client's anchor is the anchor of its last active round; the other fields
of :meth:`fields_for` (a resync's ``η_i``, the rivals' local numbers) never travel here, but for the metric
under ``compression-basis = metric`` (``block``: the basis; :mod:`qlsd_flwr.protocol.metric_sent`): its bytes with
each pair's first message, once a client's message however many of its chains need it.

Under ``downlink = qsgd`` (:mod:`qlsd_flwr.protocol.broadcast`) the round's code goes in θ's place to a
client that holds ``w_{k−1}`` (it was active at round ``k − 1``, or ``k = 0``: every client holds ``w_{−1} = 0``; any
client under ``downlink-feedback = none``), ``w_k`` in full (``64 d``) to the others, and at a refresh round the anchor is that ``w_k`` and not
sent.

A resumed run's count is the uninterrupted run's: this engine's clients keep their state over a stop (the
checkpoint holds it), so who holds the anchor, ``w_{k−1}`` and the metric is replayed from the participation
draws. (A protocol server instead resends them to each client after a resume, its clients having restarted.)
``tests/test_bits.py`` and ``tests/test_downlink.py`` check this count against the protocol server's.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import participation
from qlsd_flwr.core.downlink import own_positions, union_support
from qlsd_flwr.protocol import broadcast, build


class SamplingDownlink:
    """Round by round, each chain's downlink code length (bits) for ``cfg`` on ``d`` parameters, with the
    chains' ``seeds``; ``k0 > 0`` (a resumed run) replays the participation draws that decide which
    clients hold the current anchor, ``w_{k0−1}`` and the metric (the draws are a function of the seed and the
    round)."""

    def __init__(self, cfg, d: int, seeds, k0: int = 0, metric_bits=0):
        self.kind, self.l, self.d, self.p = cfg.kind, max(int(cfg.l), 1), int(d), cfg.p
        # the metric's (block: the basis's, whole or by reference: metric_sent.bits_by_client) bits, one number or
        # one a client, and theta_support's (downlink-support = data), with each pair's first message
        # (compression-basis; 0: not sent), once a client's message: the protocol's rule for both
        self.metric_bits = np.asarray(metric_bits, dtype=np.int64) + broadcast.support_bits(cfg, d)
        self.metric_held = np.zeros((np.asarray(seeds).size, cfg.b), dtype=bool)
        self.seeds = np.asarray(seeds)
        self.last = np.full((self.seeds.size, cfg.b), -1, dtype=np.int64)  # each pair's last active round
        # downlink = qsgd: the round of the w each pair holds (−1: none)
        self.coded = build.downlink_on(cfg)
        self.any_held = self.coded and str(cfg.get("downlink-feedback")) == "none"
        self.held = np.full((self.seeds.size, cfg.b), -1, dtype=np.int64)
        if self.coded and k0 > 0:  # those active at round k0 − 1 hold its w
            self.held[participation.active_mask(self.seeds, k0 - 1, self.p)] = k0 - 1
        start = 0 if self.kind.cv_theta_star else self.l * (k0 // self.l)  # what decides who holds the anchor
        if self.kind.control_variate:
            for k in range(start, k0):
                self.last[participation.active_mask(self.seeds, k, self.p)] = k
        for k in range(k0 if np.any(self.metric_bits) else 0):  # those active at any round before hold the metric
            self.metric_held |= participation.active_mask(self.seeds, k, self.p)

    def rounds(self, k0: int, R: int, code_bits: np.ndarray | None = None) -> np.ndarray:
        """``(C, R)``: the bits sent in rounds ``k0 + 1 .. k0 + R`` (θ_{k0}, ...), chain by chain; ``code_bits``
        (``downlink = qsgd``, ``(C, b, R)``): each round's code length per chain and client, −1 where ``w_k`` went in
        full to all (none since every chain's broadcast starts from ``w_{−1} = 0``: kept for a rule that sends it)."""
        out = np.zeros((self.seeds.size, R), dtype=np.int64)
        full = 64 * self.d
        for r in range(R):
            k = k0 + r
            active = participation.active_mask(self.seeds, k, self.p)  # (C, b)
            if self.coded:  # the code to a pair that holds w_{k−1}, w_k in full to the others
                code = code_bits[:, :, r]
                coded = active & (code >= 0) & (self.any_held | (self.held == k - 1))
                out[:, r] = np.where(coded, code, np.where(active, full, 0)).sum(axis=1)
                self.held[active] = k
            else:
                out[:, r] = full * active.sum(axis=1)
            if self.kind.cv_zeta and not (self.coded and k % self.l == 0):
                # ζ refreshed at round l⌊k/l⌋: a client not active since gets it (at the refresh round itself
                # under downlink = qsgd the anchor is the w_k the client builds, and is not sent)
                out[:, r] += full * (active & (self.last < self.l * (k // self.l))).sum(axis=1)
            elif self.kind.cv_theta_star:  # θ*: once, at the first active round
                out[:, r] += full * (active & (self.last < 0)).sum(axis=1)
            # the metric once a client's message, however many of its chains need it (wire.bundle_request): counted
            # in the first of them, as the protocol's chains count it (protocol.chains.ChainSet.fields_for)
            need = active & ~self.metric_held
            out[:, r] += (self.metric_bits * (need & (np.cumsum(need, axis=0) == 1))).sum(axis=1)
            self.metric_held |= active
            self.last[active] = k
        return out


class ChainsBroadcast:
    """``downlink = qsgd`` for chains stepped together without a protocol server: each chain's ``w_k``, coded
    from its θ_k with the chain's seed as its protocol server codes it (:func:`qlsd_flwr.protocol.broadcast.begin_round`),
    where its clients evaluate. ``on`` is ``False`` (and nothing happens) with ``downlink = off``."""

    def __init__(self, cfg, seeds, task=None):
        # downlink-support = data: the union of the clients' supports, these engines holding the clients (``task``),
        # and each client's own, which its code carries (protocol.broadcast.code_of)
        masks = broadcast.task_supports(task) if task is not None and build.support_on(cfg) else None
        support = None if masks is None else union_support(masks, task.dim)
        self.rule, self.seeds = broadcast.downlink_of(cfg, support), np.asarray(seeds)
        self.own = [own_positions(support, m) for m in masks] if masks is not None else [None] * cfg.b
        self.on = self.rule is not None
        self.w: np.ndarray | None = None  # (C, d); None until round 0

    def send(self, theta: np.ndarray, k: int, code_bits: np.ndarray) -> None:
        """Round ``k``'s ``w_k`` from each chain's θ_k (``(C, d)``) and ``w_{k−1}``; each chain's code length for each
        client into ``code_bits`` (``(C, b)``, left at −1 where ``w_k`` goes in full). A θ_k that cannot be coded
        (the chain ran away) raises the ``ValueError`` the round reports."""
        w = np.empty_like(theta)
        for c in range(w.shape[0]):
            try:
                w[c], q = self.rule.step(theta[c], None if self.w is None else self.w[c], int(self.seeds[c]), k)
            except ValueError as exc:  # θ_k − w_{k−1} not finite or beyond float32's range: the chain ran away
                raise ValueError(f"chain {c}: the broadcast cannot code θ_k ({exc})") from None
            if q is not None:
                whole = None
                for i, own in enumerate(self.own):
                    if own is None:
                        whole = whole if whole is not None else 8 * len(self.rule.code_for(q, None))
                    code_bits[c, i] = whole if own is None else 8 * len(self.rule.code_for(q, own))
        self.w = w

    def restore(self, w, shape: tuple) -> None:
        """The chains' ``w`` from a checkpoint's ``downlink_w``, held to what the configuration implies (checkpoints
        are written after round 0, which sets ``w``): :func:`qlsd_flwr.protocol.broadcast.checked_w`."""
        held = broadcast.checked_w(self.rule, w, shape, True)
        if held is not None:
            self.w = held
