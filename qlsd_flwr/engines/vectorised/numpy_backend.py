"""The numpy backend: any task, its chains vectorised over chains and clients.

The random streams, quantisation, code lengths and the server step are those every engine uses:
:mod:`qlsd_flwr.core.rng` (through the compiled twins the numba kernel calls, tested bit for bit
against the numpy functions), the compiled QSGD twins (``quantise_block_nb``, ``elias_bits_float``:
what the one-vector ``QSGD.quantise`` of every other engine runs; the numpy reference for
compressors they do not cover) and :func:`qlsd_flwr.core.server_step.server_step`, over a leading
chain axis.

Two paths compute a round. Their chains, counts and statistics are bit for bit the same
(``tests/test_batched_oracles.py`` runs both; ``tests/test_vectorised.py`` compares the default
one with the reference loop):

* ``batched`` (the default, :attr:`NumpyGeneric.BATCHED`): the oracles of a group of clients
  active in every chain in one call of :func:`~qlsd_flwr.core.oracles.oracle_batch_clients`
  (groups of consecutive clients, at most ~2^15 numbers per chains × clients × d array), the
  others one call of :func:`~qlsd_flwr.core.oracles.oracle_batch` per client for its active
  chains: batched array operations when the potential has ``grad_sum_clients`` /
  ``grad_sum_batch``, as the logistic task does, bitwise equal to its ``grad_sum`` row by row;
  row by row otherwise. A round's draws (participation, every client's minibatch and dither)
  come from one compiled call, for the active (chain, client) pairs only; quantisation and exact
  code lengths from another.
* ``batched=False``: the former per-client path, kept as the reference: one
  :func:`~qlsd_flwr.core.oracles.oracle` call per (chain, active client); streams, quantisation
  and code lengths client after client through the numpy functions.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.compression.format import COMPILED_ENCODINGS, HEADER_BYTES, Encoding, QuantiseError
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.core import participation, rng
from qlsd_flwr.core import server_step as sampler
from qlsd_flwr.core.oracles import (
    ClientState,
    batched_clients,
    full_local_grad,
    full_local_grad_batch,
    oracle,
    oracle_batch,
    oracle_batch_clients,
)
from qlsd_flwr.engines.vectorised import numpy_draws
from qlsd_flwr.engines.vectorised.results import chain_seeds, keeps
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.downlink import ChainsBroadcast

class NumpyGeneric:
    """Any task: vectorised over chains and clients (see the module docstring for the two paths)."""

    #: default of the ``batched`` argument (tests and benchmarks may switch it)
    BATCHED = True

    def __init__(self, cfg, task, specs, spec, theta_star, ts_info, stats, batched: bool | None = None,
                 theta0: np.ndarray | None = None):
        self.cfg, self.task, self.specs, self.spec = cfg, task, specs, spec
        self.stats = stats
        self.seeds = chain_seeds(cfg)
        nc, d, b = cfg.num_chains, task.dim, cfg.b
        self.d, self.b = d, b
        # downlink = qsgd: each chain's w_k, where the clients evaluate (protocol.downlink.ChainsBroadcast)
        self.down = ChainsBroadcast(cfg, self.seeds, task)
        # θ_0 of every chain: the task's, or each chain's own (init = dispersed, protocol.precondition)
        self.st = sampler.init_state(spec, np.tile(build.theta0_of(task), (nc, 1)) if theta0 is None else theta0)
        self.bound = np.array([s.compressor.bound_bits(d) for s in specs])
        # the batched path computes the QLSD family's H_i only; another message runs chain by chain
        self.batched = (self.BATCHED if batched is None else bool(batched)) and cfg.kind.batched
        if not self.batched:
            # per (chain, client) client state: anchor cache (ζ or θ*) and memory η_i
            self.states = [[ClientState() for _ in range(b)] for _ in range(nc)]
            if cfg.kind.cv_theta_star:
                for row in self.states:
                    for st in row:
                        st.anchor = np.array(theta_star, dtype=np.float64, copy=True)
            return
        # the batched path keeps the clients' state as arrays over (chain, client)
        self.theta_star = None if theta_star is None else np.array(theta_star, dtype=np.float64, copy=True)
        self.anchor_grad = np.zeros((nc, b, d)) if cfg.kind.cv_zeta else None  # ∇U_i(ζ_c)
        # minibatches: clients drawing an n_i-subset of N_i > n_i points; the others take all
        self.seeds_u64 = np.asarray(self.seeds).astype(np.uint64)
        self.n_data = np.array([task.clients[i].n_data for i in range(b)], dtype=np.int64)
        self.n_batch = np.array([s.batch_size for s in specs], dtype=np.int64)
        self.sub = np.array([i for i in range(b) if specs[i].kind.minibatch
                             and self.n_batch[i] < self.n_data[i]], dtype=np.int64)
        self.all_rows = [None if not specs[i].kind.minibatch or i in self.sub else
                         np.broadcast_to(np.arange(self.n_data[i], dtype=np.int64), (nc, self.n_data[i]))
                         for i in range(b)]
        # clients whose oracles are computed together (grad_sum_clients): consecutive runs of at
        # most ~2^15 numbers per (chains × clients × d) array; larger groups spill the L2 cache
        # and ran slower than client by client (measured on the digits task, d = 650)
        cap = max(2, (1 << 15) // max(1, nc * d))
        self.ogroups = [np.arange(j, min(j + cap, b)) for j in range(0, b, cap) if min(j + cap, b) - j > 1]
        self.ogroups = [m for m in self.ogroups
                        if batched_clients([specs[i] for i in m], [task.clients[i] for i in m])]
        # compressors: QSGD with one norm per vector runs compiled; any other one by the numpy
        # reference, one call per group of clients with the same compressor
        comps = [s.compressor for s in specs]
        # (the compiled rows count the Elias and packed codes; the arithmetic code's rows go by the reference)
        fast = [i for i, c in enumerate(comps) if isinstance(c, QSGD) and c._blocks(d) == (d,)
                and c.encoding in COMPILED_ENCODINGS]
        self.fast = np.array(fast, dtype=np.int64)
        self.fast_s = np.array([comps[i].s for i in fast], dtype=np.int64)
        self.fast_packed = np.array([comps[i]._packed_bits(d) for i in fast], dtype=np.int64)
        self.fast_enc = np.array([int(Encoding.of(comps[i].encoding)) for i in fast], dtype=np.int64)
        self.groups: list[tuple[object, np.ndarray]] = []
        for i, c in enumerate(comps):
            if i in fast:
                continue
            for g, (c2, members) in enumerate(self.groups):
                if c2 == c:
                    self.groups[g] = (c2, np.append(members, i))
                    break
            else:
                self.groups.append((c, np.array([i], dtype=np.int64)))
        self.qsgd = np.array([isinstance(c, QSGD) for c in comps])
        self.p = np.asarray(cfg.p, dtype=np.float64)

    @property
    def theta(self) -> np.ndarray:
        return self.st.theta

    def initial_block(self) -> int:
        return 16

    def next_block(self, R, dt) -> int:
        return int(min(4096, max(1, R * 0.5 / max(dt, 1e-6))))

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def theta_of(self, v: int) -> np.ndarray:
        return self.st.theta

    def run_block(self, k0: int, R: int, need_states: bool) -> dict:
        nc = self.cfg.num_chains
        out = {"n_active": np.zeros((nc, R), np.int64), "skipped": np.zeros((nc, R), np.int64),
               "bits_exact": np.zeros((nc, R), np.int64), "bits_bound": np.zeros((nc, R)),
               "bytes": np.zeros((nc, R), np.int64)}
        states = np.full((nc, R, self.d), np.nan) if need_states else None
        out["error"] = None
        if self.down.on:  # each round's code length per chain and client (−1: w_k sent in full)
            out["down_code_bits"] = np.full((nc, self.cfg.b, R), -1, np.int64)
        for r in range(R):
            try:
                self._round(k0 + r, r, out)
            except ValueError as exc:  # a client's message cannot be formed (non-finite, overflow)
                out["error"] = str(exc)
                break
            if need_states:
                states[:, r] = self.st.theta
            if not np.all(np.isfinite(self.st.theta)):
                out["error"] = "θ is not finite"
                break
        out["states"] = states
        return out

    def checkpoint_arrays(self) -> dict:
        st = self.st
        a = {"theta": st.theta, "n_kept": np.asarray(self.stats.n_kept)}
        if st.zeta is not None:
            a["zeta"] = st.zeta
            if self.cfg.kind.cv_zeta:
                a["anchor_grad"] = (self.anchor_grad.copy() if self.batched else
                                    np.array([[cs.anchor_grad for cs in row] for row in self.states]))
        if st.eta_i is not None:
            a["eta_i"], a["eta"] = st.eta_i, st.eta
        if self.down.w is not None:  # a resumed chain codes the same w's (protocol.broadcast: downlink_w)
            a["downlink_w"] = self.down.w
        return a

    def restore(self, a: dict) -> None:
        st = self.st
        st.theta = a["theta"].copy()
        if "zeta" in a:
            st.zeta = a["zeta"].copy()
            if "anchor_grad" in a:
                if self.batched:
                    self.anchor_grad = np.array(a["anchor_grad"], dtype=np.float64, copy=True)
                else:
                    for c, row in enumerate(self.states):
                        for i, cs in enumerate(row):
                            cs.anchor = st.zeta[c].copy()
                            cs.anchor_grad = a["anchor_grad"][c, i].copy()
        if "eta_i" in a:
            st.eta_i, st.eta = a["eta_i"].copy(), a["eta"].copy()
        self.down.restore(a.get("downlink_w"), self.st.theta.shape)

    def _round(self, k: int, r: int, out: dict) -> None:
        self.st.k = k
        if self.down.on:
            self.down.send(self.st.theta, k, out["down_code_bits"][:, :, r])
            self.st.w = self.down.w  # downlink-correction: the step's lag term (core.server_step)
        refreshed = sampler.refresh_anchor(self.spec, self.st)  # ζ_k = θ_k every l rounds (QLSD++)
        if refreshed and self.down.on:
            self.st.zeta = self.down.w.copy()  # the anchor refreshed at round k is w_k, where the clients evaluate
        if self.batched:
            self._round_batched(k, r, out, refreshed)
        else:
            self._round_per_client(k, r, out, refreshed)

    @property
    def point(self) -> np.ndarray:
        """Where the clients evaluate this round: θ_k, or w_k under ``downlink = qsgd``."""
        return self.st.theta if self.down.w is None else self.down.w

    def _draw(self, k: int):
        """Round ``k``'s participation ``(C, b)``, every client's minibatches (``(C, n_i)`` int64
        indices, or ``None`` for the full oracle) and the dither ``(C, b, d)`` (zeros where not
        drawn), by :func:`~.numpy_draws.draw_round`. Equal to what :func:`participation.active_mask`,
        :func:`rng.subset` and :func:`rng.uniform` give (rows of inactive pairs aside)."""
        nc, b, d, sub = len(self.seeds), self.b, self.d, self.sub
        ns = self.n_batch[sub]
        active = np.empty((nc, b), dtype=np.bool_)
        sel = np.zeros((sub.size, nc, max(1, int(ns.max()) if sub.size else 1)), dtype=np.int64)
        ties = np.zeros((sub.size, nc), dtype=np.int64)
        U = np.zeros((nc, b, d))
        numpy_draws.draw_round(self.seeds_u64, k, self.p, sub, self.n_data[sub], ns, self.qsgd, active, sel, ties, U)
        idxs = list(self.all_rows)
        for t, i in enumerate(sub):
            if ties[t].any():  # a tie at the n_i-th key (chance ~N_i·2^-53): the reference draw
                idxs[i] = rng.subset(self.seeds, rng.Stream.MINIBATCH, k, int(i), int(self.n_data[i]), int(ns[t]))
            else:
                idxs[i] = sel[t, :, :ns[t]]
        return active, idxs, U

    def _round_batched(self, k: int, r: int, out: dict, refreshed: bool) -> None:
        cfg, task, d, b, st = self.cfg, self.task, self.d, self.b, self.st
        nc = len(self.seeds)
        if refreshed:  # ∇U_i(ζ) for every client at the new anchor
            for i in range(b):
                self.anchor_grad[:, i] = full_local_grad_batch(self.specs[i], task.clients[i], st.zeta)
        active, idxs, u = self._draw(k)  # (C, b), b × (C, n_i) or None, (C, b, d)
        on = active.any(axis=0)
        h = np.zeros((nc, b, d))
        ag = self.anchor_grad
        done = ~on
        anchor = st.zeta if cfg.kind.cv_zeta else self.theta_star
        for m in self.ogroups:  # a group of clients active in every chain: together
            if active[:, m].all():
                h[:, m] = oracle_batch_clients([self.specs[i] for i in m], [task.clients[i] for i in m],
                                               self.point, [idxs[i] for i in m], anchor,
                                               None if ag is None else ag[:, m])
                done[m] = True
        for i in np.flatnonzero(~done):
            si, pot, act = self.specs[i], task.clients[i], active[:, i]
            rows = slice(None) if act.all() else np.flatnonzero(act)
            idx = idxs[i]
            h[rows, i] = oracle_batch(si, pot, self.point[rows], None if idx is None else idx[rows],
                                      st.zeta[rows] if si.kind.cv_zeta else self.theta_star,
                                      None if ag is None else ag[rows, i])
        if self.spec.whitened:  # compression-basis = metric (block): each row's Sᵀ H_i (B H_i), as its client computes it
            h = self.spec.whitening.apply_root_t(h.reshape(-1, d)).reshape(h.shape)
        if cfg.memory:
            h = np.where(active[:, :, None], h - st.eta_i, 0.0)  # send C(H_i − η_i)
        g_hat = np.zeros((nc, b, d))
        bits = np.zeros((nc, b), dtype=np.int64)
        err = 0
        if self.fast.size:
            err = numpy_draws.qsgd_rows(h, u, active, self.fast, self.fast_s, self.fast_packed, self.fast_enc, g_hat, bits)
        if err:  # the per-client path raises the error it would have raised, for the same client
            self._quantise_per_client(h, u, active)
            raise ValueError(QuantiseError(err).message)
        for comp, members in self.groups:
            mm = members[on[members]]
            if not mm.size:
                continue
            hq = np.where(active[:, mm, None], h[:, mm], 0.0)  # inactive rows: zeros, never used
            try:
                if isinstance(comp, QSGD):
                    norms, levels = comp.quantise_batch(hq, u[:, mm])
                    g_hat[:, mm] = comp.dequantise_batch(norms, levels)
                    bits[:, mm] = comp.code_length_bits_batch(levels)
                else:
                    g_hat[:, mm] = comp.quantise_batch(hq)
                    bits[:, mm] = comp.code_length_bits_batch(g_hat[:, mm])
            except ValueError:
                self._quantise_per_client(h, u, active)
                raise
        nbytes = np.where(self.qsgd, HEADER_BYTES + (bits + 7) // 8, bits // 8)
        out["n_active"][:, r] = active.sum(axis=1)
        out["bits_exact"][:, r] = np.where(active, bits, 0).sum(axis=1)
        # the bound is a float: added in client order, as the per-client path does (cumsum is sequential)
        out["bits_bound"][:, r] = np.cumsum(np.where(active, self.bound, 0.0), axis=1)[:, -1]
        out["bytes"][:, r] = np.where(active, nbytes, 0).sum(axis=1)
        self._finish_round(k, r, out, g_hat, active)

    def _quantise_per_client(self, h, u, active) -> None:
        """Quantise client after client as the per-client path does (raises its first error)."""
        for i in range(self.b):
            act = active[:, i]
            if not act.any():
                continue
            comp, hq = self.specs[i].compressor, np.where(act[:, None], h[:, i], 0.0)
            if isinstance(comp, QSGD):
                comp.quantise_batch(hq, u[:, i])
            else:
                comp.quantise_batch(hq)

    def _finish_round(self, k, r, out, g_hat, active) -> None:
        cfg, spec, st = self.cfg, self.spec, self.st
        # every active client's reply is valid here: the replies are the active set
        out["skipped"][:, r] = sampler.server_step(spec, st, self.seeds, g_hat, active)
        self.stats.add_round(st.theta, bool(keeps(np.asarray(k + 1), cfg.burn_in, cfg.thin)), out, r)

    def _round_per_client(self, k: int, r: int, out: dict, refreshed: bool) -> None:
        cfg, task, d, b, st = self.cfg, self.task, self.d, self.b, self.st
        seeds = self.seeds
        nc = len(seeds)
        if refreshed:  # every (chain, client)'s cache of the new anchor and ∇U_i(ζ)
            for c in range(nc):
                for i in range(b):
                    cs = self.states[c][i]
                    cs.anchor = st.zeta[c].copy()
                    cs.anchor_grad = full_local_grad(self.specs[i], task.clients[i], cs.anchor)
        active = participation.active_mask(seeds, k, cfg.p)  # (C, b)
        g_hat = np.zeros((nc, b, d))
        for i in range(b):
            si, pot = self.specs[i], task.clients[i]
            act = active[:, i]
            if not act.any():
                continue
            idx = None
            if si.kind.minibatch:
                if si.batch_size >= pot.n_data:
                    idx = np.broadcast_to(np.arange(pot.n_data, dtype=np.int64), (nc, pot.n_data))
                else:
                    idx = rng.subset(seeds, rng.Stream.MINIBATCH, k, i, pot.n_data, si.batch_size)
            h = np.zeros((nc, d))
            for c in np.flatnonzero(act):
                if si.kind.batched:
                    h[c] = oracle(si, pot, self.states[c][i], self.point[c], None if idx is None else idx[c])
                else:  # a message the QLSD family's H_i does not compute: the sampler's own
                    h[c] = si.kind.message(si, pot, self.states[c][i], int(seeds[c]), k, self.point[c], None)
            if self.spec.whitened:
                h = self.spec.whitening.apply_root_t(h)
            if si.memory:
                h = h - st.eta_i[:, i]
            comp = si.compressor
            hq = np.where(act[:, None], h, 0.0)  # inactive rows: quantise zeros, never used
            if isinstance(comp, QSGD):
                u = rng.uniform(seeds, rng.Stream.DITHER, k, i, d)
                norms, levels = comp.quantise_batch(hq, u)
                g_hat[:, i] = comp.dequantise_batch(norms, levels)
                bits = comp.code_length_bits_batch(levels)
                nbytes = HEADER_BYTES + (bits + 7) // 8
            else:
                g_hat[:, i] = comp.quantise_batch(hq)
                bits = comp.code_length_bits_batch(g_hat[:, i])
                nbytes = bits // 8
            out["n_active"][act, r] += 1
            out["bits_exact"][act, r] += bits[act]
            out["bits_bound"][act, r] += self.bound[i]
            out["bytes"][act, r] += nbytes[act]
        self._finish_round(k, r, out, g_hat, active)


class Sequential:
    """Several numpy runners, one per configuration, run one after the other each block."""

    def __init__(self, runners):
        self.runners = runners

    def initial_block(self) -> int:
        return self.runners[0].initial_block()

    def next_block(self, R, dt) -> int:
        return self.runners[0].next_block(R, dt / len(self.runners))

    def run_block(self, k0, R, need_states):
        return [r.run_block(k0, R, need_states) for r in self.runners]

    def info(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def theta_of(self, v: int) -> np.ndarray:
        return self.runners[v].theta
