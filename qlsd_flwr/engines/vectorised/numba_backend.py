"""The numba backend: the toy Gaussian task's chains (bit for bit the reference) or the logistic
task's (within float rounding, on request) run by the compiled kernel (:mod:`.kernel`), ``V``
configurations × ``C`` chains, a block of rounds per call, the chains split into one contiguous
group per thread."""

from __future__ import annotations

import os

import numpy as np

from qlsd_flwr.compression.format import COMPILED_ENCODINGS, Encoding, QuantiseError
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.core import rng
from qlsd_flwr.core.oracles import Oracle
from qlsd_flwr.core.participation import Aggregation
from qlsd_flwr.engines.vectorised.kernel import chains_block
from qlsd_flwr.engines.vectorised.kernel_arrays import GAUSSIAN, LOGISTIC, BlockOutputs, ChainArrays, KernelParams
from qlsd_flwr.engines.vectorised.results import chain_seeds
from qlsd_flwr.protocol import build
from qlsd_flwr.tasks.logistic import LogisticLocal

_NOISE_CHECK: dict = {}


def noise_in_kernel_ok() -> bool:
    """Whether the kernel's Box–Muller (libm ``log1p``/``cos``) equals :func:`rng.normal` bit for
    bit on 2^17 draws on this machine (checked once per process). Where it does not (numba's and
    numpy's libm differ by 1 ulp on some CPUs), the noise comes from numpy, one block at a time."""
    if "ok" not in _NOISE_CHECK:
        seeds = np.arange(4, dtype=np.uint64)
        ref = rng.normal(seeds, rng.Stream.NOISE, 3, 0, 1 << 15)  # (4, 2^15)
        got = np.empty_like(ref)
        rng.normal_rows_nb(seeds, np.uint64(int(rng.Stream.NOISE)), 3, 0, got)
        _NOISE_CHECK["ok"] = bool(np.array_equal(ref, got))
    return _NOISE_CHECK["ok"]


def kernel_params(cfgs, task, parts, noise_in_kernel: bool) -> KernelParams:
    """The kernel's read-only inputs for configurations ``cfgs`` (their client and server specs
    in ``parts``), checking what the kernel supports."""
    ref = cfgs[0]
    V, d, b = len(cfgs), task.dim, ref.b
    logistic = all(type(c) is LogisticLocal for c in task.clients)
    # the Gaussian's points y_ij, or the logistic rows [x_ij, 1] (and their labels)
    ys = [c.Xa if logistic else c.y for c in task.clients]
    specs0, spec0 = parts[0][0], parts[0][1]
    ns = np.array([s.batch_size for s in specs0], dtype=np.int64)
    s = np.ones((V, b), dtype=np.int64)
    packed = np.zeros((V, b), dtype=np.int64)
    bound = np.zeros((V, b))
    alpha = np.zeros((V, b))
    theta_star = np.zeros((V, d))
    star_prior = np.zeros((V, d))
    enc = np.zeros(V, dtype=np.int64)
    compressed = np.zeros(V, dtype=np.bool_)
    prior = task.prior
    for v, (specs, spec, ts, *_) in enumerate(parts):
        comps = [sp.compressor for sp in specs]
        compressed[v] = isinstance(comps[0], QSGD)
        if not all(isinstance(c, QSGD) == compressed[v] for c in comps):
            raise ValueError("numba backend: all clients must use the same kind of compressor")
        if not compressed[v] and any(c.dtype != "float64" for c in comps):
            raise ValueError("numba backend: the identity compressor must be float64")
        if compressed[v] and any(c.s > 2**52 for c in comps):
            raise ValueError("numba backend: s must be at most 2^52")
        if compressed[v] and any(c.encoding != comps[0].encoding for c in comps):
            raise ValueError("numba backend: all clients must use the same encoding")
        if compressed[v] and comps[0].encoding not in COMPILED_ENCODINGS:  # the kernel counts those only
            raise ValueError(f"numba backend: encoding = {comps[0].encoding} runs on: auto, numpy")
        enc[v] = int(Encoding.of(comps[0].encoding)) if compressed[v] else int(Encoding.PACKED)
        for i, c in enumerate(comps):
            s[v, i] = c.s if compressed[v] else 1
            packed[v, i] = c._packed_bits(d) if compressed[v] else c.code_length_bits_batch(np.zeros(d))
            bound[v, i] = c.bound_bits(d)
        alpha[v] = np.asarray(spec.alpha, dtype=np.float64)
        if ts is not None:
            theta_star[v] = ts
            if not prior.is_flat:
                star_prior[v] = prior.grad(np.asarray(ts, dtype=np.float64))
        if not np.array_equal(ns, [sp.batch_size for sp in specs]):
            raise ValueError("run_side_by_side: minibatch sizes differ")
    oracle = np.array([int(Oracle.of(c.oracle)) for c in cfgs], dtype=np.int64)
    gamma = np.array([p[1].gamma for p in parts])
    return KernelParams(
        p=np.asarray(spec0.p, dtype=np.float64),
        Ns=np.array([c.n_data for c in task.clients], dtype=np.int64), ns=ns,
        y=np.ascontiguousarray(np.concatenate(ys)),
        yoff=np.concatenate([[0], np.cumsum([y.shape[0] for y in ys])]).astype(np.int64),
        ysum=(np.zeros((b, d)) if logistic else np.ascontiguousarray(np.stack([c.y_sum for c in task.clients]))),
        labels=(np.concatenate([c.y for c in task.clients]).astype(np.int64) if logistic else np.zeros(0, np.int64)),
        n_classes=int(task.clients[0].n_classes) if logistic else 1, task=LOGISTIC if logistic else GAUSSIAN,
        oracle=oracle, compressed=compressed,
        memory=np.array([p[1].memory for p in parts], dtype=np.bool_), encoding=enc,
        l=np.array([p[1].l for p in parts], dtype=np.int64),
        gamma=gamma, sqrt2gamma=np.array([np.sqrt(2.0 * g) for g in gamma]),
        s=s, packed=packed, bound=bound, alpha=alpha, theta_star=theta_star, star_prior=star_prior,
        active_fraction=Aggregation.of(spec0.rule) is Aggregation.ACTIVE_FRACTION, burn_in=int(ref.burn_in), thin=int(ref.thin),
        prior_flat=bool(prior.is_flat), prior_on_server=bool(spec0.prior_on_server),
        noise_in_kernel=bool(noise_in_kernel),
        need_minibatch=any(c.kind.minibatch for c in cfgs), need_dither=bool(compressed.any()),
        prior_var=float(prior.var), prior_mean=float(prior.mean),
        prior_weight=float(specs0[0].prior_weight))


class NumbaChains:
    """The compiled path (toy Gaussian; logistic on request): ``V`` configurations × ``C``
    chains, a block of rounds per call."""

    def __init__(self, cfgs, task, parts, stats, threads):
        ref = cfgs[0]
        self.stats = stats
        V, nc, d, b = len(cfgs), ref.num_chains, task.dim, ref.b
        self.V, self.nc, self.d, self.b = V, nc, d, b
        ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        nt = max(1, min(int(threads or ncpu), nc))
        edges = np.linspace(0, nc, nt + 1).round().astype(int)
        self.groups = [(int(a), int(z)) for a, z in zip(edges[:-1], edges[1:]) if z > a]
        self.pool = None
        if len(self.groups) > 1:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(max_workers=len(self.groups))
        self.noise_kernel = noise_in_kernel_ok()
        self.prm = kernel_params(cfgs, task, parts, self.noise_kernel)
        theta = np.empty((nc, V, d))
        for v, pt in enumerate(parts):  # init = dispersed: each configuration's own starts (θ* may differ)
            theta[:, v, :] = build.theta0_of(task) if pt[4] is None else pt[4]
        # ∇U_i(ζ) (QLSD++) and η_i (memory): a last axis of 1 when no configuration uses them
        wide_ag = d if any(c.kind.cv_zeta for c in cfgs) else 1
        wide_eta = d if self.prm.memory.any() else 1
        self.ch = ChainArrays(
            seeds=chain_seeds(ref).astype(np.uint64), theta=theta, zeta=theta.copy(),
            agrad=np.zeros((nc, V, b, wide_ag)), eta_i=np.zeros((nc, V, b, wide_eta)),
            eta=np.zeros((nc, V, d)), s_th=np.zeros((nc, V, d)), s_th2=np.zeros((nc, V, d)),
            s_f=np.zeros((nc, V)), s_f2=np.zeros((nc, V)), kept=np.zeros(nc, dtype=np.int64),
            ties=np.zeros(nc, dtype=np.int64), err=np.zeros((nc, V), dtype=np.int64))

    @property
    def kept(self) -> np.ndarray:
        return self.ch.kept

    def initial_block(self) -> int:
        return 64

    def next_block(self, R, dt) -> int:
        return int(min(1 << 16, max(16, R * 0.25 / max(dt, 1e-6))))

    def info(self) -> dict:
        return {"noise": "kernel" if self.noise_kernel else "numpy", "threads": len(self.groups)}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None

    def theta_of(self, v: int) -> np.ndarray:
        return self.ch.theta[:, v]

    def run_block(self, k0: int, R: int, need_states: bool) -> list[dict]:
        nc, V, d, ch = self.nc, self.V, self.d, self.ch
        if self.noise_kernel:
            noise = np.zeros((nc, 0, d))
        else:
            noise = rng.normal(ch.seeds.astype(np.int64)[:, None], rng.Stream.NOISE,
                               np.arange(k0, k0 + R)[None, :], 0, d)
        # NaN until written: a round the kernel stopped before shows as not finite
        out = BlockOutputs(
            noise=noise, states=np.full((nc, V, R, d), np.nan) if need_states else np.empty((nc, V, 0, d)),
            m_act=np.zeros((nc, R), np.int64), m_skip=np.zeros((nc, R), np.int64),
            m_bits=np.zeros((nc, V, R), np.int64), m_bound=np.zeros((nc, V, R)),
            m_bytes=np.zeros((nc, V, R), np.int64))

        def job(g):
            chains_block(k0, R, self.prm, ch.rows(*g), out.rows(*g))

        if self.pool is None:
            job(self.groups[0])
        else:
            list(self.pool.map(job, self.groups))
        errors = [None] * V
        if ch.err.any():  # the caller stops the run (DivergenceError) at the first bad round
            for c, v in zip(*(x.tolist() for x in np.nonzero(ch.err))):
                msg = QuantiseError(int(ch.err[c, v])).message
                errors[v] = errors[v] or f"{msg} (configuration {v}, chain {c}, seed {int(ch.seeds[c])})"
        outs = []
        for v in range(V):
            st = self.stats[v]
            st.n_kept = int(ch.kept[0])
            st.sum_theta[:] = ch.s_th[:, v]
            st.sum_theta2[:] = ch.s_th2[:, v]
            st.sum_f[:] = ch.s_f[:, v]
            st.sum_f2[:] = ch.s_f2[:, v]
            st.n_active += out.m_act.sum(axis=1)
            st.skipped += out.m_skip.sum(axis=1)
            st.bits_exact += out.m_bits[:, v].sum(axis=1)
            for r in range(out.m_bound.shape[2]):  # round by round: the float total must not depend on
                st.bits_bound += out.m_bound[:, v, r]  # where blocks end (they follow timing and resumes)
            st.bytes_payload += out.m_bytes[:, v].sum(axis=1)
            st.subset_ties[:] = ch.ties
            outs.append({"n_active": out.m_act, "skipped": out.m_skip, "bits_exact": out.m_bits[:, v],
                         "bits_bound": out.m_bound[:, v], "bytes": out.m_bytes[:, v],
                         "states": out.states[:, v] if need_states else None, "error": errors[v]})
        return outs

    _STATE = ("theta", "zeta", "agrad", "eta_i", "eta", "ties", "err", "kept", "s_th", "s_th2", "s_f", "s_f2")

    def checkpoint_arrays(self) -> dict:
        return {n: getattr(self.ch, n) for n in self._STATE}

    def restore(self, a: dict) -> None:
        for n in self._STATE:
            getattr(self.ch, n)[...] = a[n]  # in place: the worker jobs slice these arrays
