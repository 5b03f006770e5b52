"""The vectorised engine: many independent chains at once, no Flower in the loop.

``engine = vectorised`` runs the *same* algorithm as the Flower strategy and the framework-free
loop (:func:`qlsd_flwr.engine.run_local`): the same participation rule, minibatches, oracles,
QSGD quantisation, memory rules and server step, drawing the same numbers from the same
counter-based streams (:mod:`qlsd_flwr.rng`). It adds one thing: ``num-chains`` independent
chains run side by side.

Chains
------
Chain ``c`` (``0 ≤ c < num-chains``) uses seed ``seed + c`` and starts from the task's ``θ_0``.
Chain 0 is therefore, bit for bit, the single chain that the ``local``, ``inprocess`` and ``ray``
engines produce for the same config (``tests/test_vectorised.py`` checks it against
``run_local``). All chains share the data (``data-seed``), ``θ*`` and every setting.

Two backends
------------
* ``numba`` — the fast path for the toy Gaussian task (every client a
  :class:`~qlsd_flwr.tasks.gaussian.GaussianLocal`, one QSGD norm per vector). One compiled
  kernel runs a block of rounds for all chains, in parallel over chains (``prange``). It
  re-implements SplitMix64, the subset draw, the oracles, QSGD quantise/dequantise, the exact
  code lengths and the server step with the same floating-point operations in the same order
  as the numpy reference, so the chain is bitwise equal (summation orders: numpy's reductions
  are reproduced exactly — sequential over rows for ``axis=0`` sums, numpy's pairwise sum for
  the QSGD norm). The Langevin noise needs ``log1p`` and ``cos``: the kernel uses libm's, and at
  first use checks on 2^17 draws that they equal numpy's bit for bit; if not (numpy built with
  another math library, e.g. SVML on AVX-512) the noise is drawn by :func:`qlsd_flwr.rng.normal`
  in numpy for each block instead.
* ``numpy`` — any :class:`~qlsd_flwr.tasks.base.Task` whose clients implement
  :class:`~qlsd_flwr.tasks.base.LocalPotential`. Randomness, quantisation, code lengths and
  the server step are vectorised over chains and clients with the very functions the other
  engines call (``rng``, ``participation``, ``QSGD.quantise_batch``...); the gradient oracle
  calls :func:`qlsd_flwr.oracles.oracle` once per (chain, active client).

``backend = "auto"`` picks ``numba`` when it applies and numba is installed.

Outputs
-------
With ``write=True`` the run folder is the one every engine writes (:class:`~qlsd_flwr.outputs.Recorder`
with ``num_chains`` chains: ``samples.nc`` with dims ``(chain, draw, theta_dim_0)``,
``metrics.csv``, ``config.json``, ``summary.json``). ``metrics.csv`` has one row per round whose
counts (active clients, bits, bytes) are **totals over the chains**; ``summary.json`` adds
``per_chain_round`` (the same divided by ``num_chains``). ``bits_exact`` is the length of the code
``QSGD.encode`` would produce (:meth:`~qlsd_flwr.compression.QSGD.code_length_bits_batch`) and
``bytes_payload`` its payload size ``5 + ⌈bits/8⌉``; messages are not actually encoded (the
round trip ``decode(encode(q)) == q`` is tested in ``tests/test_compression.py``).

Whether or not it writes, a run streams per-chain statistics of the kept draws (after burn-in,
on the thinning grid) in :class:`ChainStats`: sums of ``θ``, ``θ²``, ``f(θ) = ‖θ‖`` and ``f²``,
and per-chain bit counts, so long runs need no sample storage.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import components as C
from . import participation, rng
from .compression import HEADER_BYTES, QSGD, Identity, _omega_len_int
from .config import RunConfig
from .engine import resolve_theta_star
from .oracles import ClientState, full_local_grad, oracle
from .outputs import Recorder, make_run_dir
from .progress import progress_bar
from .tasks.base import Task

try:  # summary_extra: the facts every engine adds to its summary (moved between modules)
    from .server import summary_extra
except ImportError:  # pragma: no cover
    from .engine import summary_extra

try:  # numba is a dependency, but keep the generic path usable without it
    import numba as _nb

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    _nb = None
    HAVE_NUMBA = False

__all__ = ["ChainStats", "VectorisedResult", "run_vectorised", "chain_seeds", "HAVE_NUMBA",
           "backend_for", "noise_in_kernel_ok"]

_ORACLES = {"full": 0, "minibatch": 1, "star": 2, "svrg": 3}
_ENCODINGS = {"auto": 0, "elias": 1, "packed": 2}


def chain_seeds(cfg: RunConfig) -> np.ndarray:
    """Seeds of the chains: chain ``c`` uses ``seed + c``."""
    return np.arange(cfg.num_chains, dtype=np.int64) + int(cfg.seed)


# ---------------------------------------------------------------------------- results
@dataclass
class ChainStats:
    """Per-chain running statistics of the kept draws, and per-chain communication totals.

    ``f(θ) = ‖θ‖₂`` is the test function of the paper's toy experiment.
    """

    num_chains: int
    dim: int
    n_kept: int = 0
    sum_theta: np.ndarray = None  # (C, d)
    sum_theta2: np.ndarray = None  # (C, d)
    sum_f: np.ndarray = None  # (C,)
    sum_f2: np.ndarray = None  # (C,)
    rounds: int = 0
    n_active: np.ndarray = None  # (C,) client messages over the run
    skipped: np.ndarray = None  # (C,)
    bits_exact: np.ndarray = None  # (C,) exact code lengths, summed over messages
    bits_bound: np.ndarray = None  # (C,) analytic bound, summed over messages
    bytes_payload: np.ndarray = None  # (C,)
    subset_ties: np.ndarray = None  # (C,) boundary ties in a minibatch draw (numba backend)

    def __post_init__(self):
        c, d = self.num_chains, self.dim
        for name, shape, dt in (("sum_theta", (c, d), float), ("sum_theta2", (c, d), float),
                                ("sum_f", (c,), float), ("sum_f2", (c,), float),
                                ("n_active", (c,), np.int64), ("skipped", (c,), np.int64),
                                ("bits_exact", (c,), np.int64), ("bits_bound", (c,), float),
                                ("bytes_payload", (c,), np.int64), ("subset_ties", (c,), np.int64)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(shape, dtype=dt))

    def mean_f(self) -> np.ndarray:
        """Per-chain estimate of ``E[‖θ‖]`` (mean over kept draws)."""
        return self.sum_f / max(self.n_kept, 1)

    def mean_theta(self) -> np.ndarray:
        return self.sum_theta / max(self.n_kept, 1)

    def var_theta(self) -> np.ndarray:
        m = self.mean_theta()
        return np.maximum(self.sum_theta2 / max(self.n_kept, 1) - m * m, 0.0)

    def bits_exact_per_round(self) -> np.ndarray:
        """Per-chain mean exact bits uploaded per iteration (all clients)."""
        return self.bits_exact / max(self.rounds, 1)

    def bits_bound_per_round(self) -> np.ndarray:
        return self.bits_bound / max(self.rounds, 1)

    def to_dict(self) -> dict:
        return {"n_kept": self.n_kept, "rounds": self.rounds, "mean_f": self.mean_f().tolist(),
                "bits_exact_per_round": self.bits_exact_per_round().tolist(),
                "bits_bound_per_round": self.bits_bound_per_round().tolist(),
                "n_active": self.n_active.tolist(), "skipped": self.skipped.tolist(),
                "subset_ties": self.subset_ties.tolist()}


@dataclass
class VectorisedResult:
    summary: dict
    run_dir: Path | None
    stats: ChainStats
    theta: np.ndarray  # (C, d) the chains' last state
    trace: np.ndarray | None = None  # (C, K, d) θ_1..θ_K when keep_trace
    backend: str = "numpy"
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------- dispatch
def _is_gaussian(task: Task) -> bool:
    from .tasks.gaussian import GaussianLocal

    return all(type(c) is GaussianLocal for c in task.clients)


def backend_for(cfg: RunConfig, task: Task, backend: str = "auto") -> str:
    """``"numba"`` (Gaussian fast path) or ``"numpy"`` (any task); raises if ``numba`` is
    requested but does not apply."""
    ok = HAVE_NUMBA and _is_gaussian(task) and C.blocks_for(cfg, task) is None
    if backend == "auto":
        return "numba" if ok else "numpy"
    if backend == "numba" and not ok:
        raise ValueError("backend 'numba' needs numba installed, the Gaussian task and one QSGD "
                         "norm per vector (block-norm = vector)")
    if backend not in ("numba", "numpy"):
        raise ValueError(f"backend: unknown value {backend!r}; allowed: auto, numba, numpy")
    return backend


def run_vectorised(cfg: RunConfig, task: Task | None = None, write: bool = True,
                   keep_trace: bool = False, progress: bool | None = None, wire: bool = True,
                   backend: str = "auto", block_rounds: int | None = None,
                   threads: int | None = None) -> VectorisedResult:
    """Run ``cfg.num_chains`` chains of ``cfg`` side by side (chain ``c``: seed ``seed + c``).

    Args:
        cfg: the run configuration (any ``engine`` value; this function is the engine).
        task: the task, built from ``cfg`` when ``None``.
        write: write the run folder (:mod:`qlsd_flwr.outputs`).
        keep_trace: return every state ``θ_1..θ_K`` of every chain, ``(C, K, d)``.
        progress: show a progress bar (rounds/s and chain-iterations/s); default ``cfg``'s.
        wire: accepted for signature compatibility with ``run_local``; code lengths are always
            exact and nothing is actually encoded.
        backend: ``"auto"``, ``"numba"`` or ``"numpy"``.
        block_rounds: rounds per compiled call (numba) — default adapts to about 0.2 s a block.
        threads: numba threads (default: all cores).
    """
    task = task if task is not None else C.load_task(cfg)
    which = backend_for(cfg, task, backend)
    d = task.dim
    blocks = C.blocks_for(cfg, task)
    specs = [C.client_spec(cfg, i, task.clients[i].n_data, d, task.prior, blocks) for i in range(cfg.b)]
    theta0 = C.theta0_of(task)
    theta_star, ts_info = resolve_theta_star(
        cfg, task, theta0,
        lambda th: C.combine_grads(cfg, task.prior, [full_local_grad(s, task.clients[s.index], th) for s in specs], th))
    spec = C.server_spec(cfg, task, theta_star, blocks)
    nchain = cfg.num_chains
    stats = ChainStats(nchain, d)

    rec = run_dir = None
    if write:
        run_dir = make_run_dir(cfg.get("output-dir"), cfg.get("run-name"), cfg.variant)
        conf = cfg.to_dict()
        conf["engine_detail"] = {"engine": "vectorised", "backend": which,
                                 "chain_seeds": "seed + c for chain c"}
        rec = Recorder(run_dir, conf, d, nchain, cfg.burn_in, cfg.thin)
    trace = np.empty((nchain, cfg.num_rounds, d)) if keep_trace else None
    show = cfg.get("progress") if progress is None else progress
    bar = progress_bar(cfg.num_rounds, show, f"{cfg.variant} vectorised x{nchain}")
    t0 = time.perf_counter()
    if which == "numba":
        runner = _NumbaGaussian(cfg, task, specs, spec, theta0, theta_star, stats, threads)
    else:
        runner = _NumpyGeneric(cfg, task, specs, spec, theta0, theta_star, stats)
    k = 0
    R = block_rounds or runner.initial_block()
    while k < cfg.num_rounds:
        R = min(R, cfg.num_rounds - k)
        tb = time.perf_counter()
        need_states = rec is not None or keep_trace
        out = runner.run_block(k, R, need_states)
        dt = time.perf_counter() - tb
        if keep_trace:
            trace[:, k:k + R] = out["states"]
        if rec is not None:
            _record_block(rec, k, R, out, dt)
        k += R
        bar.update(R)
        if show:
            bar.set_postfix({"chain-it/s": f"{R * nchain / max(dt, 1e-9):,.0f}"}, refresh=False)
        if block_rounds is None:
            R = runner.next_block(R, dt)
    bar.close()
    wall = time.perf_counter() - t0
    stats.rounds = cfg.num_rounds
    info = {"engine": "vectorised", "backend": which, "num_chains": nchain,
            "chain_seeds": chain_seeds(cfg).tolist(), "chain_seed_rule": "seed + c",
            "engine_seconds": wall, "chain_iterations_per_second": cfg.num_rounds * nchain / max(wall, 1e-12),
            "stats": stats.to_dict(), **runner.info(), **ts_info}
    extra = summary_extra(cfg, task, info)
    if rec is not None:
        summary = rec.close(extra)
        summary["per_chain_round"] = {kk: v / nchain for kk, v in summary["per_round"].items()}
        import json

        from .outputs import _jsonable
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable))
    else:
        summary = extra
    return VectorisedResult(summary=summary, run_dir=run_dir, stats=stats, theta=runner.theta.copy(),
                            trace=trace, backend=which, extra=runner.info())


def _record_block(rec: Recorder, k0: int, R: int, out: dict, dt: float) -> None:
    act, skp = out["n_active"].sum(axis=0), out["skipped"].sum(axis=0)
    be, bb, by = out["bits_exact"].sum(axis=0), out["bits_bound"].sum(axis=0), out["bytes"].sum(axis=0)
    states = out["states"]
    for r in range(R):
        j = k0 + r + 1
        rec.record_round({"round": j, "n_active": int(act[r]), "n_replied": int(act[r]) ,
                          "n_rejected": 0, "skipped": int(skp[r]), "bits_bound": float(bb[r]),
                          "bits_exact": int(be[r]), "bytes_payload": int(by[r]), "bytes_message": 0,
                          "seconds": dt / R})
        if rec.keeps(j):
            rec.record_sample(j, states[:, r])


def _keeps(j: np.ndarray, burn_in: int, thin: int) -> np.ndarray:
    return (j > burn_in) & ((j - burn_in - 1) % thin == 0)


# ---------------------------------------------------------------------- numpy backend
class _NumpyGeneric:
    """Any task: vectorised over chains and clients, oracle calls per (chain, active client)."""

    def __init__(self, cfg, task, specs, spec, theta0, theta_star, stats):
        self.cfg, self.task, self.specs, self.spec = cfg, task, specs, spec
        self.stats = stats
        self.seeds = chain_seeds(cfg)
        nc, d, b = cfg.num_chains, task.dim, cfg.b
        self.theta = np.tile(theta0, (nc, 1))
        self.d, self.b = d, b
        self.zeta = None
        # per (chain, client) client state: anchor cache (ζ or θ*) and memory η_i
        self.states = [[ClientState() for _ in range(b)] for _ in range(nc)]
        if cfg.oracle == "star":
            for row in self.states:
                for st in row:
                    st.anchor = np.array(theta_star, dtype=np.float64, copy=True)
        self.eta_i = np.zeros((nc, b, d)) if spec.memory else None
        self.eta = np.zeros((nc, d)) if spec.memory else None
        self.bound = np.array([s.compressor.bound_bits(d) for s in specs])
        self.gsq = np.sqrt(2.0 * spec.gamma)
        self.anchor_grad = None

    def initial_block(self) -> int:
        return 16

    def next_block(self, R, dt) -> int:
        return int(min(4096, max(1, R * 0.5 / max(dt, 1e-6))))

    def info(self) -> dict:
        return {}

    def run_block(self, k0: int, R: int, need_states: bool) -> dict:
        nc = self.cfg.num_chains
        out = {"n_active": np.zeros((nc, R), np.int64), "skipped": np.zeros((nc, R), np.int64),
               "bits_exact": np.zeros((nc, R), np.int64), "bits_bound": np.zeros((nc, R)),
               "bytes": np.zeros((nc, R), np.int64)}
        states = np.empty((nc, R, self.d)) if need_states else None
        for r in range(R):
            self._round(k0 + r, r, out)
            if need_states:
                states[:, r] = self.theta
        out["states"] = states
        return out

    def _round(self, k: int, r: int, out: dict) -> None:
        cfg, spec, task, d, b = self.cfg, self.spec, self.task, self.d, self.b
        seeds = self.seeds
        nc = len(seeds)
        if cfg.oracle == "svrg" and k % spec.l == 0:  # ζ_k = θ_k and ∇U_i(ζ) for every client
            self.zeta = self.theta.copy()
            for c in range(nc):
                for i in range(b):
                    st = self.states[c][i]
                    st.anchor = self.zeta[c].copy()
                    st.anchor_grad = full_local_grad(self.specs[i], task.clients[i], st.anchor)
        active = participation.active_mask(seeds, k, cfg.p)  # (C, b)
        w = participation.weights(active, spec.p, spec.rule)
        skipped = participation.skips_round(active, spec.rule)  # (C,)
        g = np.zeros((nc, d))
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
                h[c] = oracle(si, pot, self.states[c][i], self.theta[c], None if idx is None else idx[c])
            if si.memory:
                h = h - self.eta_i[:, i]
            comp = si.compressor
            if isinstance(comp, QSGD):
                u = rng.uniform(seeds, rng.Stream.DITHER, k, i, d)
                hq = np.where(act[:, None], h, 0.0)  # inactive rows: quantise zeros, never used
                norms, levels = comp.quantise_batch(hq, u)
                gh = comp.dequantise_batch(norms, levels)
                bits = comp.code_length_bits_batch(levels)
                nbytes = HEADER_BYTES + (bits + 7) // 8
            else:
                gh = comp.quantise_batch(np.where(act[:, None], h, 0.0))
                bits = comp.code_length_bits_batch(gh)
                nbytes = bits // 8
            g = np.where(act[:, None], g + w[:, i, None] * gh, g)
            if si.memory:
                upd = self.eta_i[:, i] + spec.alpha[i] * gh
                self.eta_i[:, i] = np.where(act[:, None], upd, self.eta_i[:, i])
            out["n_active"][act, r] += 1
            out["bits_exact"][act, r] += bits[act]
            out["bits_bound"][act, r] += self.bound[i]
            out["bytes"][act, r] += nbytes[act]
        if spec.memory:
            g = g + self.eta
            self.eta = self.eta_i.sum(axis=1)
        if spec.prior_on_server and not spec.prior.is_flat:
            t = spec.prior.grad(self.theta)
            if spec.oracle == "star":
                t = t - spec.prior.grad(spec.theta_star)
            g = g + t
        z = rng.normal(seeds, rng.Stream.NOISE, k, 0, d)
        new = self.theta - spec.gamma * g + self.gsq * z
        self.theta = np.where(skipped[:, None], self.theta, new)
        out["skipped"][:, r] = skipped
        # skipped rounds leave the memory untouched (no replies)
        j = k + 1
        if _keeps(np.asarray(j), self.cfg.burn_in, self.cfg.thin):
            th = self.theta
            f = np.sqrt(np.sum(th * th, axis=1))
            st = self.stats
            st.n_kept += 1
            st.sum_theta += th
            st.sum_theta2 += th * th
            st.sum_f += f
            st.sum_f2 += f * f
        st = self.stats
        st.n_active += out["n_active"][:, r]
        st.skipped += out["skipped"][:, r]
        st.bits_exact += out["bits_exact"][:, r]
        st.bits_bound += out["bits_bound"][:, r]
        st.bytes_payload += out["bytes"][:, r]


# ---------------------------------------------------------------------- numba backend
_NOISE_CHECK: dict = {}


def noise_in_kernel_ok() -> bool:
    """Whether the kernel's Box–Muller (libm ``log1p``/``cos``) equals ``rng.normal`` bit for bit
    on 2^17 draws on this machine (checked once per process)."""
    if "ok" not in _NOISE_CHECK:
        seeds = np.arange(4, dtype=np.uint64)
        n = 1 << 15
        ref = rng.normal(seeds, rng.Stream.NOISE, 3, 0, n)  # (4, n)
        got = np.empty_like(ref)
        _nb_normal_rows(seeds, np.uint64(int(rng.Stream.NOISE)), 3, 0, got)
        _NOISE_CHECK["ok"] = bool(np.array_equal(ref, got))
    return _NOISE_CHECK["ok"]


class _NumbaGaussian:
    """Toy Gaussian fast path: all chains, a block of rounds per compiled call."""

    def __init__(self, cfg, task, specs, spec, theta0, theta_star, stats, threads):
        self.cfg, self.spec, self.stats = cfg, spec, stats
        nc, d, b = cfg.num_chains, task.dim, cfg.b
        self.d, self.b = d, b
        if threads:
            _nb.set_num_threads(int(threads))
        self.seeds = chain_seeds(cfg).astype(np.uint64)
        self.theta = np.ascontiguousarray(np.tile(theta0, (nc, 1)))
        self.zeta = self.theta.copy()
        self.agrad = np.zeros((nc, b, d)) if cfg.oracle == "svrg" else np.zeros((nc, 1, 1))
        mem = spec.memory
        self.eta_i = np.zeros((nc, b, d)) if mem else np.zeros((nc, 1, 1))
        self.eta = np.zeros((nc, d))
        ys = [c.y for c in task.clients]
        self.y = np.ascontiguousarray(np.concatenate(ys))
        self.yoff = np.concatenate([[0], np.cumsum([y.shape[0] for y in ys])]).astype(np.int64)
        self.ysum = np.ascontiguousarray(np.stack([c.y_sum for c in task.clients]))
        self.Ns = np.array([c.n_data for c in task.clients], dtype=np.int64)
        self.ns = np.array([s.batch_size for s in specs], dtype=np.int64)
        comps = [s.compressor for s in specs]
        self.compressed = isinstance(comps[0], QSGD)
        if not all(isinstance(c, QSGD) == self.compressed for c in comps):
            raise ValueError("numba backend: all clients must use the same kind of compressor")
        if not self.compressed and any(c.dtype != "float64" for c in comps):
            raise ValueError("numba backend: identity compressor must be float64")
        self.s = np.array([c.s if self.compressed else 1 for c in comps], dtype=np.int64)
        self.enc = _ENCODINGS[comps[0].encoding] if self.compressed else 2
        self.packed = np.array([c._packed_bits(d) if self.compressed else 64 * d for c in comps], dtype=np.int64)
        self.bound = np.array([c.bound_bits(d) for c in comps], dtype=np.float64)
        maxlev = int(self.s.max()) if self.compressed else 1
        self.omega_tab = np.array([0] + [_omega_len_int(m) for m in range(1, 65)], dtype=np.int64)  # L(0) := 0
        self.p = np.asarray(spec.p, dtype=np.float64)
        self.alpha = np.asarray(spec.alpha, dtype=np.float64)
        prior = task.prior
        self.prior_flat = bool(prior.is_flat)
        self.prior_var = float(prior.var)
        self.prior_mean = float(prior.mean)
        self.prior_w = float(specs[0].prior_weight)
        self.theta_star = np.zeros(d) if theta_star is None else np.asarray(theta_star, dtype=np.float64)
        self.noise_kernel = noise_in_kernel_ok()
        self.ties = np.zeros(nc, dtype=np.int64)
        self.err = np.zeros(nc, dtype=np.int64)
        st = stats
        self.iargs = np.array([_ORACLES[cfg.oracle], 1 if spec.rule == "active-fraction" else 0,
                               spec.l, cfg.burn_in, cfg.thin, int(self.compressed), int(mem),
                               int(self.prior_flat), int(spec.prior_on_server), self.enc,
                               int(self.noise_kernel), maxlev], dtype=np.int64)
        self.fargs = np.array([spec.gamma, np.sqrt(2.0 * spec.gamma), self.prior_var, self.prior_mean,
                               self.prior_w], dtype=np.float64)
        self._kept = np.zeros(nc, dtype=np.int64)
        self._st = st

    def initial_block(self) -> int:
        return 64

    def next_block(self, R, dt) -> int:
        return int(min(1 << 16, max(16, R * 0.25 / max(dt, 1e-6))))

    def info(self) -> dict:
        return {"noise": "kernel" if self.noise_kernel else "numpy",
                "numba_threads": int(_nb.get_num_threads())}

    def run_block(self, k0: int, R: int, need_states: bool) -> dict:
        nc, d = self.cfg.num_chains, self.d
        if self.noise_kernel:
            noise = np.zeros((nc, 0, d))
        else:
            noise = rng.normal(self.seeds.astype(np.int64)[:, None], rng.Stream.NOISE,
                               np.arange(k0, k0 + R)[None, :], 0, d)
        states = np.empty((nc, R, d)) if need_states else np.empty((nc, 0, d))
        m_act = np.zeros((nc, R), np.int64)
        m_skip = np.zeros((nc, R), np.int64)
        m_bits = np.zeros((nc, R), np.int64)
        m_bound = np.zeros((nc, R))
        m_bytes = np.zeros((nc, R), np.int64)
        st = self.stats
        _gauss_block(k0, R, self.seeds, self.theta, self.zeta, self.agrad, self.eta_i, self.eta,
                     self.iargs, self.fargs, self.p, self.alpha, self.s, self.Ns, self.ns, self.y,
                     self.yoff, self.ysum, self.theta_star, self.packed, self.bound, self.omega_tab,
                     noise, states, m_act, m_skip, m_bits, m_bound, m_bytes,
                     st.sum_theta, st.sum_theta2, st.sum_f, st.sum_f2, self._kept, self.ties, self.err)
        if self.err.any():
            c = int(np.flatnonzero(self.err)[0])
            code = int(self.err[c])
            msg = {1: "QSGD: cannot quantise a non-finite vector",
                   2: "QSGD: a block norm exceeds the float32 range (about 3.4e38)",
                   3: "Identity: cannot send a non-finite vector"}.get(code, f"error {code}")
            raise ValueError(f"{msg} (chain {c}, seed {int(self.seeds[c])})")
        st.n_kept = int(self._kept[0])
        st.n_active += m_act.sum(axis=1)
        st.skipped += m_skip.sum(axis=1)
        st.bits_exact += m_bits.sum(axis=1)
        st.bits_bound += m_bound.sum(axis=1)
        st.bytes_payload += m_bytes.sum(axis=1)
        st.subset_ties[:] = self.ties
        return {"n_active": m_act, "skipped": m_skip, "bits_exact": m_bits, "bits_bound": m_bound,
                "bytes": m_bytes, "states": states}


if HAVE_NUMBA:
    from numba import njit, prange
    from numba.cpython.unsafe.numbers import leading_zeros

    _G = rng._G
    _M1 = rng._M1
    _M2 = rng._M2
    _TWO53 = rng._TWO53
    _TWO_PI = rng._TWO_PI
    _ONE = np.uint64(1)
    _SH11 = np.uint64(11)

    @njit(inline="always", cache=True)
    def _mix(z):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))

    @njit(inline="always", cache=True)
    def _key_seed(seed, stream):
        """``mix(seed + G·stream)``: the first link of :func:`qlsd_flwr.rng.key`."""
        return _mix(seed + _G * stream)

    @njit(inline="always", cache=True)
    def _key_rc(kseed, round_, client):
        k = _mix(kseed + _G * (np.uint64(round_) + _ONE))
        return _mix(k + _G * (np.uint64(client) + _ONE))

    @njit(inline="always", cache=True)
    def _unif(k, j):
        """The ``j``-th uniform (``j ≥ 1``) of the stream with key ``k``."""
        return np.float64(_mix(k + _G * np.uint64(j)) >> _SH11) * _TWO53

    @njit(cache=True)
    def _nb_normal_rows(seeds, stream, round_, client, out):
        """``rng.normal(seed, stream, round, client, n)`` for each seed, in the kernel's arithmetic."""
        n = out.shape[1]
        for c in range(seeds.shape[0]):
            k = _key_rc(_key_seed(seeds[c], stream), round_, client)
            for j in range(n):
                u1 = _unif(k, j + 1)
                u2 = _unif(k, n + j + 1)
                out[c, j] = math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(_TWO_PI * u2)

    @njit(inline="always", cache=True)
    def _pairwise_leaf(a, lo, n):
        """numpy's pairwise sum of ``a[lo:lo+n]**2`` for ``n ≤ 128`` (8 accumulators)."""
        if n < 8:
            res = 0.0
            for i in range(n):
                x = a[lo + i]
                res += x * x
            return res
        r0 = a[lo] * a[lo]
        r1 = a[lo + 1] * a[lo + 1]
        r2 = a[lo + 2] * a[lo + 2]
        r3 = a[lo + 3] * a[lo + 3]
        r4 = a[lo + 4] * a[lo + 4]
        r5 = a[lo + 5] * a[lo + 5]
        r6 = a[lo + 6] * a[lo + 6]
        r7 = a[lo + 7] * a[lo + 7]
        i = 8
        m = n - (n % 8)
        while i < m:
            r0 += a[lo + i] * a[lo + i]
            r1 += a[lo + i + 1] * a[lo + i + 1]
            r2 += a[lo + i + 2] * a[lo + i + 2]
            r3 += a[lo + i + 3] * a[lo + i + 3]
            r4 += a[lo + i + 4] * a[lo + i + 4]
            r5 += a[lo + i + 5] * a[lo + i + 5]
            r6 += a[lo + i + 6] * a[lo + i + 6]
            r7 += a[lo + i + 7] * a[lo + i + 7]
            i += 8
        res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        while i < n:
            res += a[lo + i] * a[lo + i]
            i += 1
        return res

    @njit(cache=True)
    def _pairwise_sq(a, lo, n):
        """numpy's pairwise sum of ``a[lo:lo+n]**2`` (``np.add.reduce`` on a contiguous row):
        leaves of at most 128 terms, split at ``n2 = n/2 − (n/2 mod 8)``. Its recursion is
        unrolled onto an explicit stack (numba's cache mishandles recursive functions)."""
        if n <= 128:
            return _pairwise_leaf(a, lo, n)
        s_lo = np.empty(64, np.int64)
        s_n = np.empty(64, np.int64)
        s_stage = np.empty(64, np.int64)
        s_left = np.empty(64, np.float64)
        s_lo[0] = lo
        s_n[0] = n
        s_stage[0] = 0
        sp = 1
        val = 0.0
        while sp > 0:
            t = sp - 1
            nn = s_n[t]
            if nn <= 128 or s_stage[t] == 2:
                if nn <= 128:
                    val = _pairwise_leaf(a, s_lo[t], nn)
                else:
                    val = s_left[t] + val  # left + right
                sp -= 1
                if sp > 0:  # hand the value to the parent
                    p = sp - 1
                    if s_stage[p] == 1:
                        s_left[p] = val
                        s_stage[p] = 2
                        n2 = s_n[p] // 2
                        n2 -= n2 % 8
                        s_lo[sp] = s_lo[p] + n2
                        s_n[sp] = s_n[p] - n2
                        s_stage[sp] = 0
                        sp += 1
                    # stage 2: the parent combines on its next visit (val holds the right sum)
                continue
            # stage 0: descend into the left half
            n2 = nn // 2
            n2 -= n2 % 8
            s_stage[t] = 1
            s_lo[sp] = s_lo[t]
            s_n[sp] = n2
            s_stage[sp] = 0
            sp += 1
        return val

    @njit(inline="always", cache=True)
    def _omega_len(x, tab):
        """Elias omega code length of ``x ≥ 1``: ``L(x) = bitlen(x) + L(bitlen(x) − 1)`` with
        ``L(0) := 0``, ``L(1) = 1`` (``tab[m] = L(m)`` for ``m ≤ 64``)."""
        bl = 64 - leading_zeros(np.uint64(x))
        return bl + tab[bl - 1]

    @njit(cache=True)
    def _select(kkey, N, n, keys, cand_i, cand_k, work, sel):
        """The uniform ``n``-subset of ``[0, N)`` drawn by :func:`qlsd_flwr.rng.subset`.

        ``rng.subset`` keeps the indices of the ``n`` smallest of ``N`` uniform keys. Uniforms
        are ``(x >> 11)·2^-53``, so comparing the integers ``x >> 11`` gives the same order.
        Candidates below a threshold a few standard deviations above the ``n``-th order
        statistic are gathered (branch-free), the ``n``-th smallest among them found by
        quickselect, and the chosen indices written to ``sel[:n]`` in ascending order.
        Returns 1 when keys tie at the boundary (numpy's argpartition might then keep another
        index: counted and reported, probability about ``N·2^-53`` per draw), else 0.
        """
        for j in range(N):
            keys[j] = _mix(kkey + _G * np.uint64(j + 1)) >> _SH11
        margin = 2.0 * math.sqrt(n) + 2.0
        m = 0
        for tier in range(3):
            frac = (n + margin * (1 + 2 * tier)) / N
            if tier == 2 or frac >= 1.0:
                lim = np.uint64(18446744073709551615)
            else:
                lim = np.uint64(frac * 9007199254740992.0)
            m = 0
            for j in range(N):
                cand_i[m] = j
                cand_k[m] = keys[j]
                m += np.int64(keys[j] <= lim)
            if m >= n:
                break
        for q in range(m):
            work[q] = cand_k[q]
        lo = 0
        hi = m - 1
        kk = n - 1
        while lo < hi:  # Hoare quickselect (Wirth): work[kk] ends as the kk-th smallest
            pivot = work[kk]
            i = lo
            j = hi
            while i <= j:
                while work[i] < pivot:
                    i += 1
                while pivot < work[j]:
                    j -= 1
                if i <= j:
                    t = work[i]
                    work[i] = work[j]
                    work[j] = t
                    i += 1
                    j -= 1
            if j < kk:
                lo = i
            if kk < i:
                hi = j
        kth = work[kk]
        cnt = 0
        for q in range(m):
            sel[cnt] = cand_i[q]
            cnt += np.int64(cand_k[q] <= kth)
        return 1 if cnt != n else 0

    @njit(cache=True)
    def _client_h(i, oracle_code, th, zeta, agrad, y, yoff, ysum, Ns, ns, kmini, h, acc,
                  keys, cand_i, cand_k, work, sel, prior_flat, prior_w, prior_mean, prior_var,
                  theta_star):
        """``H_i(θ)`` of :func:`qlsd_flwr.oracles.oracle` for Gaussian client ``i``, with the same
        float operations in the same order (the minibatch sum ``y[idx].sum(axis=0)`` is sequential
        over rows in ascending index order, from zero). Returns 1 on a subset boundary tie."""
        d = th.shape[0]
        N = Ns[i]
        if oracle_code == 0:  # full: (N θ − Σy) + w ∇U_0(θ)
            fN = np.float64(N)
            for q in range(d):
                pg = 0.0 if prior_flat else (th[q] - prior_mean) / prior_var
                h[q] = (fN * th[q] - ysum[i, q]) + prior_w * pg
            return 0
        n = ns[i]
        tie = 0
        for q in range(d):
            acc[q] = 0.0
        off = yoff[i]
        if n >= N:
            for j in range(N):
                for q in range(d):
                    acc[q] = acc[q] + y[off + j, q]
        else:
            tie = _select(kmini, N, n, keys, cand_i, cand_k, work, sel)
            for jj in range(n):
                row = off + sel[jj]
                for q in range(d):
                    acc[q] = acc[q] + y[row, q]
        scale = np.float64(N) / np.float64(n)
        fn = np.float64(n)
        if oracle_code == 1:  # minibatch (QLSD#)
            for q in range(d):
                pg = 0.0 if prior_flat else (th[q] - prior_mean) / prior_var
                h[q] = scale * (fn * th[q] - acc[q]) + prior_w * pg
        elif oracle_code == 2:  # control variate at θ* (QLSD*)
            for q in range(d):
                a = theta_star[q]
                dp = 0.0 - 0.0 if prior_flat else (th[q] - prior_mean) / prior_var - (a - prior_mean) / prior_var
                h[q] = scale * ((fn * th[q] - acc[q]) - (fn * a - acc[q])) + prior_w * dp
        else:  # SVRG at ζ (QLSD++)
            for q in range(d):
                a = zeta[q]
                dp = 0.0 - 0.0 if prior_flat else (th[q] - prior_mean) / prior_var - (a - prior_mean) / prior_var
                h[q] = scale * ((fn * th[q] - acc[q]) - (fn * a - acc[q])) + prior_w * dp
                h[q] = h[q] + agrad[i, q]
        return tie

    @njit(cache=True)
    def _quantise(h, s, kdither, gh, u, lev, tab, want_bits, enc, packed):
        """QSGD quantise then dequantise ``h`` into ``gh``; returns ``(exact code bits, error)``.

        The float ops of ``QSGD.quantise_batch`` / ``dequantise_batch``: float64 norm by numpy's
        pairwise sum, float32 norm on the wire, ``r = min(|v|·s/‖v‖, s)``,
        ``ℓ = ⌊r⌋ + 1{ξ < r − ⌊r⌋}`` (held as an exact float), ``ĝ = float64(N32)·ℓ / s``.
        Error 1: non-finite input; 2: norm beyond float32.
        """
        d = h.shape[0]
        norm64 = math.sqrt(0.0 + _pairwise_sq(h, 0, d))
        if not math.isfinite(norm64):
            for q in range(d):
                if not math.isfinite(h[q]):
                    return 0, 1
        norm32 = np.float32(norm64)
        if not math.isfinite(norm32):
            return 0, 2
        sf = np.float64(s)
        if norm32 > 0 and norm64 > 0:
            n32 = np.float64(norm32)
            for q in range(d):
                u[q] = np.float64(_mix(kdither + _G * np.uint64(q + 1)) >> _SH11) * _TWO53
            for q in range(d):
                v = h[q]
                a = abs(v) * sf / norm64
                r = a if a < sf else sf
                lo = math.floor(r)
                lv = lo + (1.0 if u[q] < r - lo else 0.0)
                lv = (0.0 - lv) if v < 0 else lv  # 0.0 - 0.0 = +0.0: no negative zero, as int levels
                lev[q] = lv
                gh[q] = n32 * lv / sf
        else:  # zero vector, or a norm that underflows float32: sent as zero
            for q in range(d):
                lev[q] = 0.0
                gh[q] = 0.0
        if not want_bits or enc == 2:
            return packed, 0
        nz = 0
        body = 0
        prev = -1
        for q in range(d):
            a = abs(lev[q])
            isnz = np.int64(a != 0.0)
            mag = np.int64(a) + (1 - isnz)  # 1 where the level is 0 (length ignored)
            body += isnz * (_omega_len(q - prev, tab) + 1 + _omega_len(mag, tab))
            prev = q if isnz == 1 else prev
            nz += isnz
        elias = body + 32 + _omega_len(nz + 1, tab)
        if enc == 1:
            return elias, 0
        return min(elias, packed), 0

    @njit(parallel=True, cache=True)
    def _gauss_block(k0, R, seeds, theta, zeta, agrad, eta_i, eta, iargs, fargs, p, alpha, s, Ns, ns,
                     y, yoff, ysum, theta_star, packed, bound, tab, noise, states,
                     m_act, m_skip, m_bits, m_bound, m_bytes, s_th, s_th2, s_f, s_f2, kept, ties, err):
        """Rounds ``k0 .. k0+R-1`` of every chain, in parallel over chains.

        Each chain works on private copies of its state (no false sharing between threads) and
        writes them back at the end of the block.
        """
        oracle_code = iargs[0]
        active_fraction = iargs[1] == 1
        l_anchor = iargs[2]
        burn_in = iargs[3]
        thin = iargs[4]
        compressed = iargs[5] == 1
        memory = iargs[6] == 1
        prior_flat = iargs[7] == 1
        prior_server = iargs[8] == 1
        enc = iargs[9]
        noise_kernel = iargs[10] == 1
        gamma = fargs[0]
        sqrt2g = fargs[1]
        prior_var = fargs[2]
        prior_mean = fargs[3]
        prior_w = fargs[4]
        nc = theta.shape[0]
        d = theta.shape[1]
        b = Ns.shape[0]
        nmax = 1
        for i in range(b):
            nmax = max(nmax, Ns[i])
        record = states.shape[1] > 0
        star_prior = np.zeros(d)
        if not prior_flat:
            for q in range(d):
                star_prior[q] = (theta_star[q] - prior_mean) / prior_var
        wts = np.empty(b)
        for i in range(b):
            wts[i] = 1.0 / p[i]
        for c in prange(nc):
            h = np.empty(d)
            acc = np.empty(d)
            gh = np.empty(d)
            g = np.empty(d)
            u = np.empty(d)
            lev = np.empty(d)
            active = np.zeros(b, dtype=np.bool_)
            keys = np.empty(nmax, dtype=np.uint64)
            cand_i = np.empty(nmax, dtype=np.int64)
            cand_k = np.empty(nmax, dtype=np.uint64)
            work = np.empty(nmax, dtype=np.uint64)
            sel = np.empty(nmax, dtype=np.int64)
            th = theta[c].copy()
            zt = zeta[c].copy()
            ag = agrad[c].copy()
            et_i = eta_i[c].copy()
            et = eta[c].copy()
            sth = s_th[c].copy()
            sth2 = s_th2[c].copy()
            sf_ = s_f[c]
            sf2_ = s_f2[c]
            kept_c = kept[c]
            ties_c = ties[c]
            err_c = 0
            seed = seeds[c]
            ks_part = _key_seed(seed, np.uint64(1))
            ks_mini = _key_seed(seed, np.uint64(2))
            ks_dith = _key_seed(seed, np.uint64(3))
            ks_noise = _key_seed(seed, np.uint64(4))
            for r in range(R):
                k = k0 + r
                if oracle_code == 3 and k % l_anchor == 0:  # ζ_k = θ_k; ∇U_i(ζ) for every client
                    for q in range(d):
                        zt[q] = th[q]
                    for i in range(b):
                        fN = np.float64(Ns[i])
                        for q in range(d):
                            pg = 0.0 if prior_flat else (zt[q] - prior_mean) / prior_var
                            ag[i, q] = (fN * zt[q] - ysum[i, q]) + prior_w * pg
                n_act = 0
                for i in range(b):
                    if p[i] >= 1.0:
                        active[i] = True  # u < 1 always: the draw cannot change the outcome
                    else:
                        active[i] = _unif(_key_rc(ks_part, k, i), 1) < p[i]
                    n_act += 1 if active[i] else 0
                m_act[c, r] = n_act
                if active_fraction and n_act == 0:  # the rule is undefined: skip the round
                    m_skip[c, r] = 1
                else:
                    for q in range(d):
                        g[q] = 0.0
                    bits_r = 0
                    bound_r = 0.0
                    bytes_r = 0
                    for i in range(b):
                        if not active[i]:
                            continue
                        ties_c += _client_h(i, oracle_code, th, zt, ag, y, yoff, ysum, Ns, ns,
                                            _key_rc(ks_mini, k, i), h, acc, keys, cand_i, cand_k,
                                            work, sel, prior_flat, prior_w, prior_mean, prior_var,
                                            theta_star)
                        if memory:
                            for q in range(d):
                                h[q] = h[q] - et_i[i, q]
                        if compressed:
                            bits, e = _quantise(h, s[i], _key_rc(ks_dith, k, i), gh, u, lev, tab,
                                                True, enc, packed[i])
                            if e != 0:
                                err_c = e
                                break
                            bytes_r += 5 + (bits + 7) // 8
                        else:
                            for q in range(d):
                                if not math.isfinite(h[q]):
                                    err_c = 3
                                gh[q] = h[q]
                            if err_c != 0:
                                break
                            bits = packed[i]
                            bytes_r += bits // 8
                        bits_r += bits
                        bound_r += bound[i]
                        w = (np.float64(b) / np.float64(n_act)) if active_fraction else wts[i]
                        for q in range(d):
                            g[q] = g[q] + w * gh[q]
                        if memory and alpha[i] != 0.0:
                            ai = alpha[i]
                            for q in range(d):
                                et_i[i, q] = et_i[i, q] + ai * gh[q]
                    if err_c != 0:
                        break
                    m_bits[c, r] = bits_r
                    m_bound[c, r] = bound_r
                    m_bytes[c, r] = bytes_r
                    if memory:  # g += η_k, then η_{k+1} = Σ_i η_i (rows in order, from zero)
                        for q in range(d):
                            g[q] = g[q] + et[q]
                            et[q] = 0.0
                        for i in range(b):
                            for q in range(d):
                                et[q] = et[q] + et_i[i, q]
                    if prior_server and not prior_flat:
                        for q in range(d):
                            t = (th[q] - prior_mean) / prior_var
                            if oracle_code == 2:
                                t = t - star_prior[q]
                            g[q] = g[q] + t
                    if noise_kernel:
                        kn = _key_rc(ks_noise, k, 0)
                        for q in range(d):
                            u1 = _unif(kn, q + 1)
                            u2 = _unif(kn, d + q + 1)
                            z = math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(_TWO_PI * u2)
                            th[q] = th[q] - gamma * g[q] + sqrt2g * z
                    else:
                        for q in range(d):
                            th[q] = th[q] - gamma * g[q] + sqrt2g * noise[c, r, q]
                if record:
                    for q in range(d):
                        states[c, r, q] = th[q]
                j = k + 1
                if j > burn_in and (j - burn_in - 1) % thin == 0:
                    ss = 0.0
                    for q in range(d):
                        x = th[q]
                        ss += x * x
                        sth[q] += x
                        sth2[q] += x * x
                    f = math.sqrt(ss)
                    sf_ += f
                    sf2_ += f * f
                    kept_c += 1
            theta[c] = th
            zeta[c] = zt
            agrad[c] = ag
            eta_i[c] = et_i
            eta[c] = et
            s_th[c] = sth
            s_th2[c] = sth2
            s_f[c] = sf_
            s_f2[c] = sf2_
            kept[c] = kept_c
            ties[c] = ties_c
            err[c] = err_c
else:  # pragma: no cover
    def noise_in_kernel_ok() -> bool:  # noqa: F811
        return False
