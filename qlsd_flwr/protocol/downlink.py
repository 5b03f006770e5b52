"""The sampling rounds' downlink for the engines that run the QLSD family without a protocol server
(the vectorised engine's numpy and numba backends): what :meth:`QLSDServer.fields_for
<qlsd_flwr.protocol.server.QLSDServer.fields_for>` would send, counted as its code length.

Each round every active (chain, client) pair is sent θ_k (``64 d`` bits) and, when the client's copy of
the anchor is not the round's, the anchor (``64 d``): QLSD++ and LSD++ refresh ζ at the rounds ``k ≡ 0
(mod l)``, so a client gets it at its first active round since the last refresh; QLSD* and LSD* send θ*
at a client's first active round. On these engines every reply is accepted and no client restarts, so
the server's record of each client's anchor is the anchor of its last active round; the other fields
of :meth:`fields_for` (a resync's ``η_i``, the rivals' local numbers) never travel here.
``tests/test_bits.py`` checks this count against the local engine's, which calls ``fields_for``.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import participation


class SamplingDownlink:
    """Round by round, each chain's downlink code length (bits) for ``cfg`` on ``d`` parameters, with the
    chains' ``seeds``; ``k0 > 0`` (a resumed run) replays the participation draws that decide which
    clients hold the current anchor (the draws are a function of the seed and the round)."""

    def __init__(self, cfg, d: int, seeds, k0: int = 0):
        self.kind, self.l, self.d, self.p = cfg.kind, max(int(cfg.l), 1), int(d), cfg.p
        self.seeds = np.asarray(seeds)
        self.last = np.full((self.seeds.size, cfg.b), -1, dtype=np.int64)  # each pair's last active round
        start = 0 if self.kind.cv_theta_star else self.l * (k0 // self.l)  # what decides who holds the anchor
        if self.kind.control_variate:
            for k in range(start, k0):
                self.last[participation.active_mask(self.seeds, k, self.p)] = k

    def rounds(self, k0: int, R: int) -> np.ndarray:
        """``(C, R)``: the bits sent in rounds ``k0 + 1 .. k0 + R`` (θ_{k0}, ...), chain by chain."""
        out = np.zeros((self.seeds.size, R), dtype=np.int64)
        for r in range(R):
            k = k0 + r
            active = participation.active_mask(self.seeds, k, self.p)  # (C, b)
            sent = active.sum(axis=1)
            if self.kind.cv_zeta:  # ζ refreshed at round l⌊k/l⌋: a client not active since gets it
                sent = sent + (active & (self.last < self.l * (k // self.l))).sum(axis=1)
            elif self.kind.cv_theta_star:  # θ*: once, at the first active round
                sent = sent + (active & (self.last < 0)).sum(axis=1)
            self.last[active] = k
            out[:, r] = 64 * self.d * sent
        return out
