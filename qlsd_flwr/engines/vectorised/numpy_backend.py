"""The numpy backend: any task, its chains vectorised over chains and clients.

Randomness, quantisation, code lengths and the server step are the very functions the other
engines call, over a leading chain axis (:mod:`qlsd_flwr.core.rng`,
:mod:`qlsd_flwr.core.participation`, ``QSGD.quantise_batch``,
:func:`qlsd_flwr.core.server_step.server_step`); the gradient oracle calls
:func:`qlsd_flwr.core.oracles.oracle` once per (chain, active client).
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.compression.format import HEADER_BYTES
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.core import participation, rng
from qlsd_flwr.core import server_step as sampler
from qlsd_flwr.core.oracles import ClientState, full_local_grad, oracle
from qlsd_flwr.engines.vectorised.results import chain_seeds, keeps
from qlsd_flwr.protocol import build


class NumpyGeneric:
    """Any task: vectorised over chains and clients, oracle calls per (chain, active client)."""

    def __init__(self, cfg, task, specs, spec, theta_star, ts_info, stats):
        self.cfg, self.task, self.specs, self.spec = cfg, task, specs, spec
        self.stats = stats
        self.seeds = chain_seeds(cfg)
        nc, d, b = cfg.num_chains, task.dim, cfg.b
        self.d, self.b = d, b
        self.st = sampler.init_state(spec, np.tile(build.theta0_of(task), (nc, 1)))
        # per (chain, client) client state: anchor cache (ζ or θ*) and memory η_i
        self.states = [[ClientState() for _ in range(b)] for _ in range(nc)]
        if cfg.oracle == "star":
            for row in self.states:
                for st in row:
                    st.anchor = np.array(theta_star, dtype=np.float64, copy=True)
        self.bound = np.array([s.compressor.bound_bits(d) for s in specs])

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
            if self.cfg.oracle == "svrg":
                a["anchor_grad"] = np.array([[cs.anchor_grad for cs in row] for row in self.states])
        if st.eta_i is not None:
            a["eta_i"], a["eta"] = st.eta_i, st.eta
        return a

    def restore(self, a: dict) -> None:
        st = self.st
        st.theta = a["theta"].copy()
        if "zeta" in a:
            st.zeta = a["zeta"].copy()
            if "anchor_grad" in a:
                for c, row in enumerate(self.states):
                    for i, cs in enumerate(row):
                        cs.anchor = st.zeta[c].copy()
                        cs.anchor_grad = a["anchor_grad"][c, i].copy()
        if "eta_i" in a:
            st.eta_i, st.eta = a["eta_i"].copy(), a["eta"].copy()

    def _round(self, k: int, r: int, out: dict) -> None:
        cfg, spec, task, d, b, st = self.cfg, self.spec, self.task, self.d, self.b, self.st
        seeds = self.seeds
        nc = len(seeds)
        st.k = k
        if sampler.refresh_anchor(spec, st):  # ζ_k = θ_k, and ∇U_i(ζ) for every client
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
            if si.oracle != "full":
                if si.batch_size >= pot.n_data:
                    idx = np.broadcast_to(np.arange(pot.n_data, dtype=np.int64), (nc, pot.n_data))
                else:
                    idx = rng.subset(seeds, rng.Stream.MINIBATCH, k, i, pot.n_data, si.batch_size)
            h = np.zeros((nc, d))
            for c in np.flatnonzero(act):
                h[c] = oracle(si, pot, self.states[c][i], st.theta[c], None if idx is None else idx[c])
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
        # every active client's reply is valid here: the replies are the active set
        out["skipped"][:, r] = sampler.server_step(spec, st, seeds, g_hat, active)
        s = self.stats
        if keeps(np.asarray(k + 1), cfg.burn_in, cfg.thin):
            th = st.theta
            f = np.sqrt(np.sum(th * th, axis=1))
            s.n_kept += 1
            s.sum_theta += th
            s.sum_theta2 += th * th
            s.sum_f += f
            s.sum_f2 += f * f
        s.n_active += out["n_active"][:, r]
        s.skipped += out["skipped"][:, r]
        s.bits_exact += out["bits_exact"][:, r]
        s.bits_bound += out["bits_bound"][:, r]
        s.bytes_payload += out["bytes"][:, r]


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
