"""The torch backend: the QLSD family's chains of a torch network, every part of a round on its device.

``vectorised-backend = torch`` (and ``auto`` when the clients' potentials live on a CUDA device) runs
the numpy backend's algorithm (:class:`~.numpy_backend.NumpyGeneric`) with the chains, the clients'
data and every array of a round on the device the clients' :class:`~qlsd_flwr.tasks.torch_models.TorchPotential`
use, so a GPU computes a round without a copy to the host:

* the round's participation, minibatches, QSGD dither and Langevin noise come from the streams every
  engine draws from (:mod:`.torch_twins`, the uniforms bit for bit);
* the oracles ``H_i`` (:func:`qlsd_flwr.core.oracles.oracle`'s expressions) of the active
  ``(chain, client)`` pairs, their minibatch gradients in one ``torch.func.vmap`` call over the pairs
  (and, for a control variate, over the two points ``θ`` and the anchor);
* the memory, QSGD with one norm and its exact code lengths (:mod:`.torch_twins`);
* the server step of :func:`qlsd_flwr.core.server_step.langevin_step` (the paper's, or with a diagonal
  metric ``M`` and a temperature ``T``: ``θ − γ M g + √(2γT) M^{1/2} Z``), its sums over clients in one
  reduction.

Its chains are the reference's in law, not bit for bit: the gradients are the model's float32
sums in vmap's order and the sums over clients one reduction, so the last bits differ, and a
QSGD level can then flip where the dither falls within that rounding of its threshold.
``tests/test_torch_backend.py`` checks each part against the reference (streams and QSGD codes
exactly, an uncompressed chain to float rounding) and the chain's law on a Gaussian posterior.
On CUDA it asks cuDNN for its deterministic float32 algorithms (no TF32) while it runs, so a run is
a function of its seed there too (the device script compares two runs).

The draws the run keeps cross to the host; the other rounds leave only their counts and ``‖θ‖``
(:attr:`TorchChains.sparse_states`). What it does not cover is refused before anything runs
(:func:`.torch_scope.unsupported`): another sampler, a metric that is not diagonal, the compressed downlink, one norm
per tensor, Rice codes, per-client compressors, a prior other than a Gaussian, potentials that are
not one torch architecture.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from qlsd_flwr.compression.format import HEADER_BYTES, QuantiseError
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.core import participation, rng
from qlsd_flwr.engines.vectorised import torch_twins as twins
from qlsd_flwr.engines.vectorised.results import chain_seeds, keeps
from qlsd_flwr.engines.vectorised.torch_scope import unsupported
from qlsd_flwr.protocol import build

#: the largest number of examples a gradient call takes at once (the anchor's full pass is chunked)
CHUNK_EXAMPLES = 1 << 16


class _Group:
    """Clients with the same ``N_i`` and ``n_i``: their data stacked ``(G, N, ...)`` on the device."""

    def __init__(self, members, pots, spec, b, device):
        self.members = np.asarray(members, dtype=np.int64)
        self.N = pots[members[0]].n_data
        self.n = spec.batch_size if spec.kind.minibatch else self.N
        self.X = torch.stack([pots[i].X for i in members])
        self.y = torch.stack([pots[i].y for i in members])
        pos = np.full(b, -1, dtype=np.int64)
        pos[self.members] = np.arange(len(members))
        self.pos = torch.as_tensor(pos, device=device)  # client → its row in X
        self.is_member = torch.as_tensor(pos >= 0, device=device)


class TorchChains:
    """One configuration's ``num_chains`` chains on the clients' torch device (module docstring)."""

    #: the run's θ reaches the host only for kept draws; each round leaves its ``‖θ‖`` (``out["norms"]``)
    sparse_states = True

    def __init__(self, cfg, task, specs, spec, theta_star, ts_info, stats, theta0: np.ndarray | None = None):
        why = unsupported(cfg, task, specs, spec)
        if why:
            raise ValueError(why)
        from torch.func import functional_call, grad, vmap

        self.cfg, self.task, self.specs, self.spec, self.stats = cfg, task, specs, spec, stats
        pots = list(task.clients)
        self.dev = dev = pots[0].device
        self.seeds = chain_seeds(cfg)
        nc, d, b = cfg.num_chains, task.dim, cfg.b
        self.nc, self.d, self.b = nc, d, b
        f64 = torch.float64
        th0 = np.tile(build.theta0_of(task), (nc, 1)) if theta0 is None else theta0
        self.theta_t = torch.tensor(np.asarray(th0, dtype=np.float64), device=dev)
        self.kind = cfg.kind
        self.zeta = None
        self.anchor_grad = torch.zeros((nc, b, d), dtype=f64, device=dev) if self.kind.cv_zeta else None
        self.theta_star = None if theta_star is None or not self.kind.cv_theta_star else \
            torch.tensor(np.asarray(theta_star, dtype=np.float64), device=dev)
        self.memory = bool(spec.memory)
        self.eta_i = torch.zeros((nc, b, d), dtype=f64, device=dev) if self.memory else None
        self.eta = torch.zeros((nc, d), dtype=f64, device=dev) if self.memory else None
        self.alpha = torch.as_tensor(np.asarray(spec.alpha, dtype=np.float64), device=dev)
        self.p_np = np.asarray(cfg.p, dtype=np.float64)
        self.p = torch.as_tensor(self.p_np, device=dev)
        self.unbiased = participation._rule(spec.rule) is participation.Aggregation.UNBIASED
        self.keys = {s: twins.seed_keys(self.seeds, int(s), dev) for s in
                     (rng.Stream.PARTICIPATION, rng.Stream.MINIBATCH, rng.Stream.DITHER, rng.Stream.NOISE)}
        self.clients = torch.arange(b, dtype=torch.int64, device=dev)
        self.round_keys = None  # the round's stream keys, from its block's (run_block)
        self.zero_client = torch.zeros(1, dtype=torch.int64, device=dev)
        prior = spec.prior
        self.prior_flat = bool(prior.is_flat)
        self.prior_on_server = bool(spec.prior_on_server) and not self.prior_flat
        # the step: the paper's expression where it is plain (bit for bit the reference's form), else M's diagonal
        self.plain = bool(spec.plain)
        if not self.plain:
            m = np.ones(d) if spec.metric.kind == "identity" else spec.metric.m
            self.m = torch.as_tensor(np.asarray(m, dtype=np.float64), device=dev)
            self.root = torch.sqrt(self.m)
        self.w = torch.as_tensor(np.array([s.prior_weight for s in specs], dtype=np.float64), device=dev)
        # clients grouped by (N_i, n_i): one gather of their minibatches each
        by = {}
        for i, s in enumerate(specs):
            by.setdefault((pots[i].n_data, s.batch_size), []).append(i)
        self.groups = [_Group(m, pots, specs[m[0]], b, dev) for m in by.values()]
        comp = specs[0].compressor
        self.qsgd = isinstance(comp, QSGD)
        self.s = comp.s if self.qsgd else None
        self.code = twins.CodeLength(d, comp.s, comp.encoding, dev) if self.qsgd else None
        self.wire = None if self.qsgd else (torch.float64 if comp.dtype == "float64" else torch.float32)
        self.id_bits = None if self.qsgd else int(comp.code_length_bits(np.zeros(d)))
        self.bound = np.array([s.compressor.bound_bits(d) for s in specs])
        # the model as a function of the flat parameter vector (θ's layout: TorchPotential's)
        model = pots[0].model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        shapes = [p.shape for _, p in named]
        sizes = [int(p.numel()) for _, p in named]
        frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        buffers = dict(model.named_buffers())
        losses = pots[0].example_losses
        self.dtype = pots[0].dtype

        def loss_sum(flat, x, y):
            prm = {n: t.view(sh) for n, t, sh in zip(names, torch.split(flat, sizes), shapes)}
            prm.update(frozen)
            return losses(functional_call(model, (prm, buffers), (x,)), y).sum()

        self._grad = vmap(grad(loss_sum), in_dims=(0, 0, 0))  # (P, d), (P, n, ...), (P, n) → (P, d)

    # ------------------------------------------------------------------ the driver's interface
    @property
    def theta(self) -> np.ndarray:
        return self.theta_t.cpu().numpy()

    def theta_of(self, v: int) -> np.ndarray:
        return self.theta

    def initial_block(self) -> int:
        return 16

    def next_block(self, R, dt) -> int:
        return int(min(4096, max(1, R * 0.5 / max(dt, 1e-6))))

    def info(self) -> dict:
        name = torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu"
        return {"torch_device": str(self.dev), "torch_device_name": name, "torch_version": torch.__version__}

    def close(self) -> None:
        pass

    def checkpoint_arrays(self) -> dict:
        a = {"theta": self.theta, "n_kept": np.asarray(self.stats.n_kept)}
        if self.zeta is not None:
            a["zeta"] = self.zeta.cpu().numpy()
            if self.anchor_grad is not None:
                a["anchor_grad"] = self.anchor_grad.cpu().numpy()
        if self.memory:
            a["eta_i"], a["eta"] = self.eta_i.cpu().numpy(), self.eta.cpu().numpy()
        return a

    def restore(self, a: dict) -> None:
        def t(x):
            return torch.tensor(np.asarray(x, dtype=np.float64), device=self.dev)

        self.theta_t = t(a["theta"])
        if "zeta" in a:
            self.zeta = t(a["zeta"])
            if "anchor_grad" in a and self.anchor_grad is not None:
                self.anchor_grad = t(a["anchor_grad"])
        if "eta_i" in a and self.memory:
            self.eta_i, self.eta = t(a["eta_i"]), t(a["eta"])

    # ------------------------------------------------------------------ a block of rounds
    def _device_flags(self):
        """On CUDA, cuDNN's deterministic algorithms (a run is a function of its seed: no atomics in the
        convolutions' sums) in float32 (no TF32, whose 10-bit mantissa would round the gradients ~1e-3),
        for this backend's blocks only; the user's settings stand outside them."""
        if self.dev.type != "cuda":
            return contextlib.nullcontext()
        return torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False)

    def run_block(self, k0: int, R: int, need_states: bool) -> dict:
        with self._device_flags():
            return self._run_block(k0, R, need_states)

    def _run_block(self, k0: int, R: int, need_states: bool) -> dict:
        nc, b = self.nc, self.b
        dev = self.dev
        active = torch.zeros((R, nc, b), dtype=torch.bool, device=dev)
        bits = torch.zeros((R, nc), dtype=torch.int64, device=dev)
        nbytes = torch.zeros((R, nc), dtype=torch.int64, device=dev)
        skipped = torch.zeros((R, nc), dtype=torch.bool, device=dev)
        bad = torch.zeros((R, nc), dtype=torch.bool, device=dev)  # a message that could not be formed
        norms = torch.zeros((R, nc), dtype=torch.float64, device=dev)
        kept, states = {}, ([] if need_states else None)
        cfg = self.cfg
        # the block's stream keys at once (rounds k0 .. k0 + R − 1; the noise's client is 0)
        block_keys = {s: twins.keys_block(kk, k0, R, self.zero_client if s == rng.Stream.NOISE else self.clients)
                      for s, kk in self.keys.items()}
        for r in range(R):
            k = k0 + r
            self.round_keys = {s: kk[r] for s, kk in block_keys.items()}
            self._round(k, active[r], bits[r], nbytes[r], skipped[r], bad[r])
            norms[r] = torch.where(bad[r], torch.nan, torch.linalg.vector_norm(self.theta_t, dim=-1))
            if keeps(np.asarray(k + 1), cfg.burn_in, cfg.thin):
                kept[r] = self.theta_t.clone()
            if need_states:
                states.append(self.theta_t.clone())
        # one copy to the host a block
        act, bits, nbytes = active.cpu().numpy(), bits.cpu().numpy(), nbytes.cpu().numpy()
        skipped, bad, norms = skipped.cpu().numpy(), bad.cpu().numpy(), norms.cpu().numpy()
        kept = {r: th.cpu().numpy() for r, th in kept.items()}
        stop = R
        finite = np.isfinite(norms).all(axis=1)
        if not finite.all():
            stop = int(np.argmin(finite))  # the first round that left the finite numbers (or sent a bad message)
        out = {"n_active": act.sum(axis=2).T.astype(np.int64), "skipped": skipped.T.astype(np.int64),
               "bits_exact": bits.T.copy(), "bytes": nbytes.T.copy(),
               # the bound is a float, added in client order as the reference does
               "bits_bound": np.cumsum(np.where(act, self.bound, 0.0), axis=2)[:, :, -1].T.copy(),
               "norms": norms.T.copy(), "kept": kept, "error": None,
               "states": None if states is None else torch.stack(states, dim=1).cpu().numpy()}
        if stop < R:
            out["error"] = QuantiseError.NON_FINITE.message if bad[stop].any() else "θ is not finite"
        for r in range(min(stop + 1, R)):
            self.stats.add_round(kept.get(r), r in kept, out, r)
        return out

    # ------------------------------------------------------------------ one round
    def _prior(self, t: torch.Tensor) -> torch.Tensor:
        """``∇U_0`` (:meth:`GaussianPrior.grad`'s expression, which takes a tensor; the flat prior's zeros on the device)."""
        return torch.zeros_like(t) if self.prior_flat else self.spec.prior.grad(t)

    def _grad_sums(self, points: torch.Tensor, grp: _Group, pos: torch.Tensor, idx) -> torch.Tensor:
        """``Σ_{j∈S} ∇U_ij`` at ``points`` ``(P, d)`` for the clients at rows ``pos`` ``(P,)`` of ``grp``,
        on the minibatches ``idx`` ``(P, n)`` (``None``: all their data, in chunks), float64 ``(P, d)``."""
        flat = points.to(self.dtype)
        if idx is not None:
            rows = pos[:, None]
            return self._grad(flat, grp.X[rows, idx], grp.y[rows, idx]).to(torch.float64)
        total = torch.zeros(points.shape, dtype=torch.float64, device=self.dev)
        step = max(1, CHUNK_EXAMPLES // max(1, points.shape[0]))
        for a in range(0, grp.N, step):
            total += self._grad(flat, grp.X[pos, a:a + step], grp.y[pos, a:a + step]).to(torch.float64)
        return total

    def _refresh(self) -> None:
        """ζ = θ, and every (chain, client)'s ``∇U_i(ζ)`` (a full pass over its data)."""
        self.zeta = self.theta_t.clone()
        nc = self.nc
        for grp in self.groups:
            G = len(grp.members)
            per = max(1, CHUNK_EXAMPLES // max(1, grp.N))  # pairs per call
            cc = torch.arange(nc, device=self.dev).repeat_interleave(G)
            ii = torch.as_tensor(np.tile(grp.members, nc), device=self.dev)
            for a in range(0, cc.numel(), per):
                c, i = cc[a:a + per], ii[a:a + per]
                g = self._grad_sums(self.zeta[c], grp, grp.pos[i], None) + self.w[i, None] * self._prior(self.zeta[c])
                self.anchor_grad[c, i] = g

    def _oracles(self, k: int, c_idx: torch.Tensor, i_idx: torch.Tensor) -> torch.Tensor:
        """``H_i(θ_k)`` of the active pairs ``(c_idx, i_idx)``, ``(P, d)`` (:func:`qlsd_flwr.core.oracles.oracle`)."""
        kind = self.kind
        h = None if len(self.groups) == 1 else torch.empty((c_idx.numel(), self.d), dtype=torch.float64, device=self.dev)
        mkeys = self.round_keys[rng.Stream.MINIBATCH] if kind.minibatch else None
        for grp in self.groups:
            sel = torch.nonzero(grp.is_member[i_idx]).flatten() if len(self.groups) > 1 else None
            c, i = (c_idx, i_idx) if sel is None else (c_idx[sel], i_idx[sel])
            if not c.numel():
                continue
            pos = grp.pos[i]
            theta = self.theta_t[c]
            w = self.w[i, None]
            if not kind.minibatch:
                hg = self._grad_sums(theta, grp, pos, None) + w * self._prior(theta)
            else:
                idx = twins.subset(mkeys[c, i], grp.N, grp.n)
                scale = grp.N / grp.n
                if not kind.control_variate:
                    hg = scale * self._grad_sums(theta, grp, pos, idx) + w * self._prior(theta)
                else:
                    anchor = self.zeta[c] if kind.cv_zeta else self.theta_star.expand_as(theta)
                    g = self._grad_sums(torch.cat([theta, anchor]), grp, torch.cat([pos, pos]), torch.cat([idx, idx]))
                    P = c.numel()
                    hg = scale * (g[:P] - g[P:]) + w * (self._prior(theta) - self._prior(anchor))
                    if kind.cv_zeta:
                        hg = hg + self.anchor_grad[c, i]
            if sel is None:
                h = hg
            else:
                h[sel] = hg
        return h

    def _round(self, k, active, bits, nbytes, skipped, bad) -> None:
        nc, b, d = self.nc, self.b, self.d
        dev = self.dev
        if self.kind.cv_zeta and k % self.spec.l == 0:
            self._refresh()
        u = twins.uniform(self.round_keys[rng.Stream.PARTICIPATION], 1)[..., 0]
        active.copy_(u < self.p)
        c_idx, i_idx = torch.nonzero(active, as_tuple=True)  # chain-major, clients ascending
        g_hat = torch.zeros((nc, b, d), dtype=torch.float64, device=dev)
        if c_idx.numel():
            h = self._oracles(k, c_idx, i_idx)
            if self.memory:
                h = h - self.eta_i[c_idx, i_idx]
            if self.qsgd:
                dkeys = self.round_keys[rng.Stream.DITHER][c_idx, i_idx]
                norm32, levels, ok = twins.quantise(h, twins.uniform(dkeys, d), self.s)
                gh = twins.dequantise(norm32, levels, self.s)
                nb = self.code(levels)
                by = HEADER_BYTES + (nb + 7) // 8
            else:
                gh = h.to(self.wire).to(torch.float64)
                ok = torch.isfinite(h).all(dim=-1) & torch.isfinite(gh).all(dim=-1)
                nb = torch.full_like(c_idx, self.id_bits)
                by = nb // 8
            g_hat[c_idx, i_idx] = gh
            bits.index_add_(0, c_idx, nb)  # integers: any order gives the same sum
            nbytes.index_add_(0, c_idx, by)
            nbad = torch.zeros(nc, dtype=torch.int64, device=dev).index_add_(0, c_idx, (~ok).to(torch.int64))
            bad.copy_(nbad > 0)
        # the server's step (core.server_step.langevin_step, the paper's expression)
        n_act = active.sum(dim=1, keepdim=True)
        if self.unbiased:
            wts = torch.where(active, 1.0 / self.p, 0.0)
        else:
            wts = torch.where(active, b / torch.clamp(n_act, min=1).to(torch.float64), 0.0)
            skipped.copy_(n_act[:, 0] == 0)
        g = torch.sum(wts[..., None] * g_hat, dim=1)
        if self.memory:
            self.eta_i += self.alpha[None, :, None] * g_hat  # zero rows for the inactive clients: unchanged
            g = g + self.eta
            self.eta = self.eta_i.sum(dim=1)
        if self.prior_on_server:
            g = g + self._prior(self.theta_t)
            if self.kind.cv_theta_star:
                g = g - self._prior(self.theta_star)
        z = twins.normal(self.round_keys[rng.Stream.NOISE][:, 0], d)
        gamma = float(self.spec.gamma)
        if self.plain:
            new = self.theta_t - gamma * g + math.sqrt(2.0 * gamma) * z
        else:
            new = self.theta_t - gamma * (self.m * g) + math.sqrt(2.0 * gamma * self.spec.temperature) * (self.root * z)
        self.theta_t = torch.where(skipped[:, None], self.theta_t, new)
