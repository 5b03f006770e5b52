"""The vectorised engine: many independent chains at once, no Flower in the loop.

``engine = vectorised`` runs the *same* algorithm as the Flower strategy and the framework-free
loop (:func:`qlsd_flwr.engine.run_local`): the same participation rule, minibatches, oracles,
QSGD quantisation, memory rules and server step, drawing the same numbers from the same
counter-based streams (:mod:`qlsd_flwr.rng`). It adds independent chains run side by side.

Chains
------
Chain ``c`` (``0 ≤ c < num-chains``) uses seed ``seed + c`` and starts from the task's ``θ_0``.
Chain 0 is therefore, bit for bit, the single chain that the ``local``, ``inprocess`` and ``ray``
engines produce for the same config (``tests/test_vectorised.py`` checks it against
``run_local``). All chains share the data (``data-seed``), ``θ*`` and every setting.

Configurations side by side
---------------------------
:func:`run_side_by_side` runs several configurations that differ only in ``variant``, ``s``,
``gamma``, ``l``, ``alpha``, ``compressor`` and ``encoding`` (same data, seeds, chains, rounds,
participation and batch fraction). Their chain ``c`` draws the same participation, minibatch,
dither and Langevin noise (common random numbers: the streams are keyed by seed, round and
client only), so the numba backend computes those once per (chain, round, client) for all
configurations. Each configuration's chains are still exactly those of a run on its own.

Two backends
------------
* ``numba`` — the fast path for the toy Gaussian task (every client a
  :class:`~qlsd_flwr.tasks.gaussian.GaussianLocal`, one QSGD norm per vector). One compiled
  kernel (``nogil``) runs a block of rounds for a group of chains; the chains are split into
  one contiguous group per core, run by a thread pool. It re-implements SplitMix64, the subset
  draw, the oracles, QSGD quantise/dequantise, the exact code lengths and the server step with
  the same floating-point operations in the same order as the numpy reference, so the chains
  are bitwise equal. Summation orders matter and are reproduced: ``y[idx].sum(axis=0)`` and
  ``η = Σ_i η_i`` are sequential over rows from zero; the QSGD norm uses numpy's pairwise sum
  (8 accumulators, blocks of 128). No fused multiply-add is emitted (numba does not contract
  without ``fastmath``). The Langevin noise needs ``log1p`` and ``cos``: the kernel calls libm,
  and at first use checks on 2^17 draws that these equal numpy's bit for bit; if not (a numpy
  built with another math library, e.g. SVML on AVX-512) the noise comes from
  :func:`qlsd_flwr.rng.normal` in numpy, one block at a time.
* ``numpy`` — any :class:`~qlsd_flwr.tasks.base.Task` whose clients implement
  :class:`~qlsd_flwr.tasks.base.LocalPotential`. Randomness, quantisation, code lengths and
  the server step are vectorised over chains and clients with the very functions the other
  engines call (``rng``, ``participation``, ``QSGD.quantise_batch``...); the gradient oracle
  calls :func:`qlsd_flwr.oracles.oracle` once per (chain, active client).

``backend = "auto"`` picks ``numba`` when it applies and numba is installed.

One event can make the numba chain differ from the reference: two of a client's ``N_i``
minibatch keys (53-bit uniforms) tying exactly at the ``n_i``-th place, where numpy's
``argpartition`` may break the tie differently. Its chance is about ``N_i·2^-53`` per draw
(about 1e-5 over the whole toy figure); such ties are counted (``subset_ties`` in the summary).

Outputs
-------
With ``write=True`` the run folder is the one every engine writes (:class:`~qlsd_flwr.outputs.Recorder`
with ``num_chains`` chains: ``samples.nc`` with dims ``(chain, draw, theta_dim_0)``,
``metrics.csv``, ``config.json``, ``summary.json``). ``metrics.csv`` has one row per round whose
counts (active clients, bits, bytes) are **totals over the chains**; ``summary.json`` adds
``per_chain_round`` (the same divided by ``num_chains``). ``bits_exact`` is the length of the code
``QSGD.encode`` would produce (:meth:`~qlsd_flwr.compression.QSGD.code_length_bits_batch`) and
``bytes_payload`` its payload size ``5 + ⌈bits/8⌉``; messages are not actually encoded (the
round trip ``decode(encode(q)) == q`` is tested with the compressor).

Checkpoints and divergence
--------------------------
With ``checkpoint-every = N`` (one configuration, writing) blocks end on multiples of ``N`` and
the engine saves ``checkpoint.npz`` there: every chain's state (θ, ζ, ``∇U_i(ζ)``, ``η_i``, ``η``),
the streamed statistics and the recorder's position. ``resume = <run folder>`` continues from it,
bitwise as if the run had never stopped (:mod:`qlsd_flwr.checkpoint`). A chain whose θ becomes
non-finite (or whose gradient overflows the codec) stops the run with
:class:`~qlsd_flwr.checkpoint.DivergenceError` (a ``ValueError``) naming the round and suggesting a
smaller ``gamma``; rounds before it are recorded and the run folder is closed cleanly.

Whether or not it writes, a run streams per-chain statistics of the kept draws (after burn-in,
on the thinning grid) in :class:`ChainStats`: sums of ``θ``, ``θ²``, ``f(θ) = ‖θ‖`` and ``f²``,
and per-chain bit counts, so long runs need no sample storage.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import checkpoint as ckpt
from . import components as C
from . import participation, rng
from .compression import HEADER_BYTES, QSGD
from .config import RunConfig
from .engine import resolve_theta_star
from .oracles import ClientState, full_local_grad, oracle
from .outputs import Recorder, _jsonable, make_run_dir
from .progress import progress_bar
from .tasks.base import Task

try:  # summary_extra: the facts every engine adds to its summary
    from .server import summary_extra
except ImportError:  # pragma: no cover
    from .engine import summary_extra

try:  # numba is a dependency, but keep the generic path usable without it
    import numba as _nb

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover
    _nb = None
    HAVE_NUMBA = False

__all__ = ["ChainStats", "VectorisedResult", "run_vectorised", "run_side_by_side", "chain_seeds",
           "HAVE_NUMBA", "backend_for", "noise_in_kernel_ok", "SIDE_BY_SIDE_KEYS"]

_ORACLES = {"full": 0, "minibatch": 1, "star": 2, "svrg": 3}
_ENCODINGS = {"auto": 0, "elias": 1, "packed": 2}
# run-config keys that may differ between configurations run side by side
SIDE_BY_SIDE_KEYS = ("variant", "s", "gamma", "l", "alpha", "compressor", "encoding", "run-name",
                     "output-dir", "progress", "verbose", "engine", "theta-star", "opt-rounds",
                     "opt-tol", "client-cpus", "reply-timeout")


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


def backend_for(cfgs, task: Task, backend: str = "auto") -> str:
    """``"numba"`` (Gaussian fast path) or ``"numpy"`` (any task); raises if ``numba`` is
    requested but does not apply."""
    cfgs = [cfgs] if isinstance(cfgs, RunConfig) else list(cfgs)
    ok = HAVE_NUMBA and _is_gaussian(task) and all(C.blocks_for(c, task) is None for c in cfgs)
    if backend == "auto":
        return "numba" if ok else "numpy"
    if backend not in ("numba", "numpy"):
        raise ValueError(f"backend: unknown value {backend!r}; allowed: auto, numba, numpy")
    if backend == "numba" and not ok:
        raise ValueError("backend 'numba' needs numba installed, the Gaussian task and one QSGD "
                         "norm per vector (block-norm = vector)")
    return backend


def _check_side_by_side(cfgs: list[RunConfig]) -> None:
    ref = cfgs[0]
    for c in cfgs[1:]:
        bad = [k for k in ref.raw if k not in SIDE_BY_SIDE_KEYS and str(ref.raw[k]) != str(c.raw[k])]
        if bad:
            raise ValueError(f"run_side_by_side: configurations differ in {', '.join(bad)}; only "
                             f"{', '.join(SIDE_BY_SIDE_KEYS)} may differ")
        if (c.variant == "sgld") != (ref.variant == "sgld"):
            raise ValueError("run_side_by_side: sgld pools the data on one client; run it apart")


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
        progress: show a progress bar (rounds/s, chain-iterations/s); default: ``cfg``'s.
        wire: accepted for signature compatibility with ``run_local``; code lengths are always
            exact and nothing is actually encoded.
        backend: ``"auto"``, ``"numba"`` or ``"numpy"``.
        block_rounds: rounds per compiled call; default adapts to about 0.25 s a block.
        threads: worker threads of the numba backend, one group of chains each (default: the
            cores this process may use).
    """
    return run_side_by_side([cfg], task=task, write=write, keep_trace=keep_trace, progress=progress,
                            backend=backend, block_rounds=block_rounds, threads=threads)[0]


def run_side_by_side(cfgs, task: Task | None = None, write: bool = False, keep_trace: bool = False,
                     progress: bool | None = None, backend: str = "auto",
                     block_rounds: int | None = None, threads: int | None = None,
                     labels=None) -> list[VectorisedResult]:
    """Run several configurations (each with its ``num_chains`` chains) in one pass.

    The configurations may differ only in :data:`SIDE_BY_SIDE_KEYS` (variant, ``s``, ``γ``, ``l``,
    ``α``...). Their chain ``c`` shares seed ``seed + c`` and so every random draw; the numba
    backend computes the shared draws and minibatch sums once. Returns one
    :class:`VectorisedResult` per configuration, in order. ``labels`` name the progress bar.
    """
    cfgs = list(cfgs)
    if not cfgs:
        raise ValueError("run_side_by_side: no configuration given")
    _check_side_by_side(cfgs)
    ref = cfgs[0]
    task = task if task is not None else C.load_task(ref)
    which = backend_for(cfgs, task, backend)
    d, nchain, K = task.dim, ref.num_chains, ref.num_rounds
    parts = [_parts(cfg, task) for cfg in cfgs]
    stats = [ChainStats(nchain, d) for _ in cfgs]
    ck_on = write and any(ckpt.enabled(c) for c in cfgs)
    if ck_on and len(cfgs) > 1:
        raise ValueError("run_side_by_side: checkpoint-every and resume need a single configuration")
    resume = None
    if ck_on and ckpt.resume_dir(ref) is not None:
        resume = ckpt.load_for_resume(ref, "vectorised")
        if resume[1]["backend"] != which:
            raise ValueError(f"resume: the checkpoint was written by the {resume[1]['backend']} backend, "
                             f"this run uses {which}; pass backend={resume[1]['backend']!r}")
    recs, run_dirs = [], []
    for cfg in cfgs:
        rec = run_dir = None
        if write:
            conf = cfg.to_dict()
            conf["engine_detail"] = {"engine": "vectorised", "backend": which,
                                     "chain_seeds": "seed + c for chain c"}
            if resume is not None:
                run_dir = resume[0]
                rec = Recorder(run_dir, conf, d, nchain, cfg.burn_in, cfg.thin,
                               resume=ckpt.recorder_part(resume[1], resume[2]))
            else:
                run_dir = make_run_dir(cfg.get("output-dir"), cfg.get("run-name"), cfg.variant)
                rec = Recorder(run_dir, conf, d, nchain, cfg.burn_in, cfg.thin, raw_draws=ck_on)
        recs.append(rec)
        run_dirs.append(run_dir)
    traces = [np.empty((nchain, K, d)) for _ in cfgs] if keep_trace else None
    show = ref.get("progress") if progress is None else progress
    name = labels or (cfgs[0].variant if len(cfgs) == 1 else f"{len(cfgs)} configs")
    bar = progress_bar(K, show, f"{name} vectorised x{nchain}")
    if which == "numba":
        runner = _NumbaGaussian(cfgs, task, parts, stats, threads)
    else:
        runner = _Sequential([_NumpyGeneric(cfg, task, *pt, st) for cfg, pt, st in zip(cfgs, parts, stats)])
    t0 = time.perf_counter()
    k = 0
    last_ckpt = None
    if resume is not None:
        k = last_ckpt = int(resume[1]["k"])
        _restore(runner, stats[0], resume[2])
        bar.update(k)
    every = int(ref.get("checkpoint-every")) if ck_on else 0
    R = block_rounds or runner.initial_block()
    need_states = write or keep_trace
    try:
        while k < K:
            R = min(R, K - k)
            if every:
                R = min(R, every - k % every)  # blocks end on checkpoint rounds
            tb = time.perf_counter()
            outs = runner.run_block(k, R, need_states)
            dt = time.perf_counter() - tb
            for v, out in enumerate(outs):
                bad = _first_bad_round(out, runner.theta_of(v), R)
                if bad is not None:
                    _diverge(cfgs[v], recs, v, k, bad, out, traces, dt / len(cfgs), run_dirs[v], last_ckpt)
                if keep_trace:
                    traces[v][:, k:k + R] = out["states"]
                if recs[v] is not None:
                    _record_block(recs[v], k, R, out, dt / len(cfgs))
            k += R
            if every and k % every == 0:
                _save_checkpoint(ref, which, runner, stats[0], recs[0], run_dirs[0], k)
                last_ckpt = k
            bar.update(R)
            if show:
                bar.set_postfix({"chain-it/s": f"{R * nchain * len(cfgs) / max(dt, 1e-9):,.0f}"}, refresh=False)
            if block_rounds is None:
                R = runner.next_block(R, dt)
    finally:
        bar.close()
        runner.close()
    wall = time.perf_counter() - t0
    results = []
    for v, cfg in enumerate(cfgs):
        st = stats[v]
        st.rounds = K
        info = {"engine": "vectorised", "backend": which, "num_chains": nchain,
                "chain_seeds": chain_seeds(cfg).tolist(), "chain_seed_rule": "seed + c",
                "side_by_side": len(cfgs), "engine_seconds": wall,
                "chain_iterations_per_second": K * nchain * len(cfgs) / max(wall, 1e-12),
                "stats": st.to_dict(), **runner.info(), **parts[v][3]}
        if resume is not None:
            info["resumed_from_round"] = int(resume[1]["k"])
        extra = summary_extra(cfg, task, info)
        if recs[v] is not None:
            summary = recs[v].close(extra)
            summary["per_chain_round"] = {kk: val / nchain for kk, val in summary["per_round"].items()}
            (run_dirs[v] / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable))
        else:
            summary = extra
        results.append(VectorisedResult(summary=summary, run_dir=run_dirs[v], stats=st,
                                        theta=runner.theta_of(v).copy(),
                                        trace=traces[v] if keep_trace else None, backend=which,
                                        extra=runner.info()))
    return results


def _parts(cfg: RunConfig, task: Task):
    """Client specs, server spec, θ* and its facts for ``cfg`` (as the other engines build them)."""
    d = task.dim
    C.warn_if_unstable(cfg, task)
    blocks = C.blocks_for(cfg, task)
    specs = [C.client_spec(cfg, i, task.clients[i].n_data, d, task.prior, blocks) for i in range(cfg.b)]
    theta0 = C.theta0_of(task)
    theta_star, ts_info = resolve_theta_star(
        cfg, task, theta0,
        lambda th: C.combine_grads(cfg, task.prior, [full_local_grad(s, task.clients[s.index], th) for s in specs], th))
    spec = C.server_spec(cfg, task, theta_star, blocks)
    return specs, spec, theta_star, ts_info


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


def _first_bad_round(out: dict, theta: np.ndarray, R: int) -> int | None:
    """Index in the block of the first round whose state is not finite (or not computed because
    a client's message could not be formed), or ``None`` when the whole block is fine."""
    if out.get("error") is None and np.all(np.isfinite(theta)):
        return None
    states = out.get("states")
    if states is None:
        return 0  # not recorded: somewhere in this block
    ok = np.isfinite(states).all(axis=(0, 2))  # (R,)
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else R - 1


def _diverge(cfg, recs, v, k0, bad, out, traces, dt, run_dir, last_ckpt) -> None:
    """Record the block's rounds before ``bad``, close every recorder cleanly, raise."""
    if traces is not None and bad:
        traces[v][:, k0:k0 + bad] = out["states"][:, :bad]
    exact = out.get("states") is not None
    where = "" if exact else f" (within rounds {k0 + 1}..{k0 + len(out['skipped'][0])})"
    reason = out.get("error") or "θ is not finite"
    if recs[v] is not None and bad:
        _record_block(recs[v], k0, bad, out, dt)
    msg = ckpt.divergence_message(k0 + bad + 1, cfg.gamma, run_dir if recs[v] is not None else None,
                                  last_ckpt, where) + f" [{reason}]"
    for w, rec in enumerate(recs):
        if rec is not None:
            rec.close({"diverged_at_round": k0 + bad + 1, "error": msg} if w == v else {"stopped": msg})
            recs[w] = None
    raise ckpt.DivergenceError(msg)


def _stats_arrays(st: ChainStats) -> dict:
    return {f"st_{n}": getattr(st, n) for n in ("sum_theta", "sum_theta2", "sum_f", "sum_f2", "n_active",
                                               "skipped", "bits_exact", "bits_bound", "bytes_payload",
                                               "subset_ties")}


def _save_checkpoint(cfg, backend, runner, st: ChainStats, rec: Recorder, run_dir, k: int) -> None:
    r = runner if isinstance(runner, _NumbaGaussian) else runner.runners[0]
    rec_meta, rec_arrays = rec.checkpoint_state()
    arrays = {**{f"run_{n}": a for n, a in r.checkpoint_arrays().items()}, **_stats_arrays(st),
              **{f"rec_{n}": a for n, a in rec_arrays.items()}}
    meta = {"kind": "vectorised", "backend": backend, "k": k, "config": cfg.raw,
            "stats": {"n_kept": st.n_kept, "rounds": st.rounds}, "recorder": rec_meta}
    ckpt.save(ckpt.path_in(run_dir), arrays, meta)


def _restore(runner, st: ChainStats, arrays: dict) -> None:
    r = runner if isinstance(runner, _NumbaGaussian) else runner.runners[0]
    r.restore({n[4:]: a for n, a in arrays.items() if n.startswith("run_")})
    for n, a in arrays.items():
        if n.startswith("st_"):
            getattr(st, n[3:])[...] = a
    if isinstance(r, _NumbaGaussian):
        st.n_kept = int(r.kept[0])
    else:
        st.n_kept = int(arrays["run_n_kept"])


def _keeps(j: np.ndarray, burn_in: int, thin: int) -> np.ndarray:
    return (j > burn_in) & ((j - burn_in - 1) % thin == 0)


# ---------------------------------------------------------------------- numpy backend
class _NumpyGeneric:
    """Any task: vectorised over chains and clients, oracle calls per (chain, active client)."""

    def __init__(self, cfg, task, specs, spec, theta_star, ts_info, stats):
        self.cfg, self.task, self.specs, self.spec = cfg, task, specs, spec
        theta0 = C.theta0_of(task)
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

    def close(self) -> None:
        pass

    def theta_of(self, v: int) -> np.ndarray:
        return self.theta

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
                states[:, r] = self.theta
            if not np.all(np.isfinite(self.theta)):
                out["error"] = "θ is not finite"
                break
        out["states"] = states
        return out

    def checkpoint_arrays(self) -> dict:
        a = {"theta": self.theta, "n_kept": np.asarray(self.stats.n_kept)}
        if self.zeta is not None:
            a["zeta"] = self.zeta
            if self.cfg.oracle == "svrg":
                a["anchor_grad"] = np.array([[st.anchor_grad for st in row] for row in self.states])
        if self.eta_i is not None:
            a["eta_i"], a["eta"] = self.eta_i, self.eta
        return a

    def restore(self, a: dict) -> None:
        self.theta = a["theta"].copy()
        if "zeta" in a:
            self.zeta = a["zeta"].copy()
            if "anchor_grad" in a:
                for c, row in enumerate(self.states):
                    for i, st in enumerate(row):
                        st.anchor = self.zeta[c].copy()
                        st.anchor_grad = a["anchor_grad"][c, i].copy()
        if "eta_i" in a:
            self.eta_i, self.eta = a["eta_i"].copy(), a["eta"].copy()

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


class _Sequential:
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


# ---------------------------------------------------------------------- numba backend
_NOISE_CHECK: dict = {}


def noise_in_kernel_ok() -> bool:
    """Whether the kernel's Box–Muller (libm ``log1p``/``cos``) equals :func:`rng.normal` bit for
    bit on 2^17 draws on this machine (checked once per process)."""
    if not HAVE_NUMBA:
        return False
    if "ok" not in _NOISE_CHECK:
        seeds = np.arange(4, dtype=np.uint64)
        ref = rng.normal(seeds, rng.Stream.NOISE, 3, 0, 1 << 15)  # (4, 2^15)
        got = np.empty_like(ref)
        _nb_normal_rows(seeds, np.uint64(int(rng.Stream.NOISE)), 3, 0, got)
        _NOISE_CHECK["ok"] = bool(np.array_equal(ref, got))
    return _NOISE_CHECK["ok"]


class _NumbaGaussian:
    """Toy Gaussian fast path: ``V`` configurations × ``C`` chains, a block of rounds per call."""

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
        self.seeds = chain_seeds(ref).astype(np.uint64)
        theta0 = C.theta0_of(task)
        self.theta = np.array(np.broadcast_to(theta0, (nc, V, d)), dtype=np.float64)  # a writable copy
        self.zeta = self.theta.copy()
        oracles = [_ORACLES[c.oracle] for c in cfgs]
        # ∇U_i(ζ) (QLSD++) and η_i (memory); a last axis of 1 when no configuration uses them
        self.agrad = np.zeros((nc, V, b, d if 3 in oracles else 1))
        self.eta_i = np.zeros((nc, V, b, d if any(c.memory for c in cfgs) else 1))
        self.eta = np.zeros((nc, V, d))
        ys = [c.y for c in task.clients]
        self.y = np.ascontiguousarray(np.concatenate(ys))
        self.yoff = np.concatenate([[0], np.cumsum([y.shape[0] for y in ys])]).astype(np.int64)
        self.ysum = np.ascontiguousarray(np.stack([c.y_sum for c in task.clients]))
        self.Ns = np.array([c.n_data for c in task.clients], dtype=np.int64)
        specs0 = parts[0][0]
        self.ns = np.array([s.batch_size for s in specs0], dtype=np.int64)
        iv = np.zeros((V, 5), dtype=np.int64)
        fv = np.zeros((V, 2))
        self.s = np.ones((V, b), dtype=np.int64)
        self.packed = np.zeros((V, b), dtype=np.int64)
        self.bound = np.zeros((V, b))
        self.alpha = np.zeros((V, b))
        self.theta_star = np.zeros((V, d))
        self.star_prior = np.zeros((V, d))
        prior = task.prior
        for v, (cfg, (specs, spec, theta_star, _)) in enumerate(zip(cfgs, parts)):
            comps = [sp.compressor for sp in specs]
            compressed = isinstance(comps[0], QSGD)
            if not all(isinstance(c, QSGD) == compressed for c in comps):
                raise ValueError("numba backend: all clients must use the same kind of compressor")
            if not compressed and any(c.dtype != "float64" for c in comps):
                raise ValueError("numba backend: the identity compressor must be float64")
            if compressed and any(c.s > 2**52 for c in comps):
                raise ValueError("numba backend: s must be at most 2^52")
            enc = _ENCODINGS[comps[0].encoding] if compressed else 2
            if compressed and any(c.encoding != comps[0].encoding for c in comps):
                raise ValueError("numba backend: all clients must use the same encoding")
            iv[v] = [oracles[v], int(compressed), int(spec.memory), enc, spec.l]
            fv[v] = [spec.gamma, np.sqrt(2.0 * spec.gamma)]
            for i, c in enumerate(comps):
                self.s[v, i] = c.s if compressed else 1
                self.packed[v, i] = c._packed_bits(d) if compressed else c.code_length_bits_batch(np.zeros(d))
                self.bound[v, i] = c.bound_bits(d)
            self.alpha[v] = np.asarray(spec.alpha, dtype=np.float64)
            if theta_star is not None:
                self.theta_star[v] = theta_star
                if not prior.is_flat:
                    self.star_prior[v] = prior.grad(np.asarray(theta_star, dtype=np.float64))
            if not np.array_equal(self.ns, [s.batch_size for s in specs]):
                raise ValueError("run_side_by_side: minibatch sizes differ")
        self.iv, self.fv = iv, fv
        self.p = np.asarray(parts[0][1].p, dtype=np.float64)
        self.noise_kernel = noise_in_kernel_ok()
        spec0 = parts[0][1]
        self.ish = np.array([int(spec0.rule == "active-fraction"), ref.burn_in, ref.thin,
                             int(prior.is_flat), int(spec0.prior_on_server), int(self.noise_kernel),
                             int(any(o != 0 for o in oracles)), int(iv[:, 1].any())], dtype=np.int64)
        self.fsh = np.array([float(prior.var), float(prior.mean), float(specs0[0].prior_weight)])
        self.ties = np.zeros(nc, dtype=np.int64)
        self.err = np.zeros((nc, V), dtype=np.int64)
        self.kept = np.zeros(nc, dtype=np.int64)
        self.s_th = np.zeros((nc, V, d))
        self.s_th2 = np.zeros((nc, V, d))
        self.s_f = np.zeros((nc, V))
        self.s_f2 = np.zeros((nc, V))

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
        return self.theta[:, v]

    def run_block(self, k0: int, R: int, need_states: bool) -> list[dict]:
        nc, V, d = self.nc, self.V, self.d
        if self.noise_kernel:
            noise = np.zeros((nc, 0, d))
        else:
            noise = rng.normal(self.seeds.astype(np.int64)[:, None], rng.Stream.NOISE,
                               np.arange(k0, k0 + R)[None, :], 0, d)
        # NaN until written: a round the kernel stopped before shows as not finite
        states = np.full((nc, V, R, d), np.nan) if need_states else np.empty((nc, V, 0, d))
        m_act = np.zeros((nc, R), np.int64)
        m_skip = np.zeros((nc, R), np.int64)
        m_bits = np.zeros((nc, V, R), np.int64)
        m_bound = np.zeros((nc, V, R))
        m_bytes = np.zeros((nc, V, R), np.int64)

        def job(g):
            a, z = g
            _gauss_block(k0, R, self.seeds[a:z], self.theta[a:z], self.zeta[a:z], self.agrad[a:z],
                         self.eta_i[a:z], self.eta[a:z], self.ish, self.fsh, self.iv, self.fv,
                         self.s, self.packed, self.bound, self.alpha, self.theta_star,
                         self.star_prior, self.p, self.Ns, self.ns, self.y, self.yoff, self.ysum,
                         noise[a:z], states[a:z], m_act[a:z], m_skip[a:z],
                         m_bits[a:z], m_bound[a:z], m_bytes[a:z], self.s_th[a:z], self.s_th2[a:z],
                         self.s_f[a:z], self.s_f2[a:z], self.kept[a:z], self.ties[a:z], self.err[a:z])

        if self.pool is None:
            job(self.groups[0])
        else:
            list(self.pool.map(job, self.groups))
        errors = [None] * V
        if self.err.any():  # the caller stops the run (DivergenceError) at the first bad round
            for c, v in zip(*(x.tolist() for x in np.nonzero(self.err))):
                code = int(self.err[c, v])
                msg = {1: "QSGD: cannot quantise a non-finite vector",
                       2: "QSGD: a block norm exceeds the float32 range (about 3.4e38)",
                       3: "Identity: cannot send a non-finite vector"}.get(code, f"error {code}")
                errors[v] = errors[v] or f"{msg} (configuration {v}, chain {c}, seed {int(self.seeds[c])})"
        outs = []
        for v in range(V):
            st = self.stats[v]
            st.n_kept = int(self.kept[0])
            st.sum_theta[:] = self.s_th[:, v]
            st.sum_theta2[:] = self.s_th2[:, v]
            st.sum_f[:] = self.s_f[:, v]
            st.sum_f2[:] = self.s_f2[:, v]
            st.n_active += m_act.sum(axis=1)
            st.skipped += m_skip.sum(axis=1)
            st.bits_exact += m_bits[:, v].sum(axis=1)
            st.bits_bound += m_bound[:, v].sum(axis=1)
            st.bytes_payload += m_bytes[:, v].sum(axis=1)
            st.subset_ties[:] = self.ties
            outs.append({"n_active": m_act, "skipped": m_skip, "bits_exact": m_bits[:, v],
                         "bits_bound": m_bound[:, v], "bytes": m_bytes[:, v],
                         "states": states[:, v] if need_states else None, "error": errors[v]})
        return outs

    _STATE = ("theta", "zeta", "agrad", "eta_i", "eta", "ties", "err", "kept", "s_th", "s_th2", "s_f", "s_f2")

    def checkpoint_arrays(self) -> dict:
        return {n: getattr(self, n) for n in self._STATE}

    def restore(self, a: dict) -> None:
        for n in self._STATE:
            getattr(self, n)[...] = a[n]  # in place: the worker jobs slice these arrays


if HAVE_NUMBA:
    from numba import njit
    from numba.cpython.unsafe.numbers import leading_zeros

    _G = rng._G
    _TWO53 = rng._TWO53
    _TWO_PI = rng._TWO_PI
    _ONE = np.uint64(1)
    _SH11 = np.uint64(11)
    _MAGIC = np.uint64(0x4330000000000000)  # the bits of 2^52

    _mix = rng.mix_nb

    @njit(cache=True)
    def _key_seed(seed, stream):
        """``mix(seed + G·stream)``: the first link of :func:`qlsd_flwr.rng.key`."""
        return _mix(seed + _G * stream)

    @njit(cache=True)
    def _key_rc(kseed, round_, client):
        """:func:`qlsd_flwr.rng.key` from its first link, for ``(round, client)``."""
        k = _mix(kseed + _G * (np.uint64(round_) + _ONE))
        return _mix(k + _G * (np.uint64(client) + _ONE))

    _unif = rng.unif_nb

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

    @njit(cache=True)
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
        leaves of at most 128 terms, split at ``n2 = n/2 − (n/2 mod 8)``. The recursion is
        unrolled onto an explicit stack (numba's on-disk cache mishandles recursive functions)."""
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
                if sp > 0 and s_stage[sp - 1] == 1:  # a left half is done: start the right half
                    p = sp - 1
                    s_left[p] = val
                    s_stage[p] = 2
                    n2 = s_n[p] // 2
                    n2 -= n2 % 8
                    s_lo[sp] = s_lo[p] + n2
                    s_n[sp] = s_n[p] - n2
                    s_stage[sp] = 0
                    sp += 1
                continue
            n2 = nn // 2  # stage 0: descend into the left half
            n2 -= n2 % 8
            s_stage[t] = 1
            s_lo[sp] = s_lo[t]
            s_n[sp] = n2
            s_stage[sp] = 0
            sp += 1
        return val

    @njit(cache=True)
    def _omega_small(m):
        """Elias omega length ``L(m)`` for ``0 ≤ m ≤ 63`` (``L(0) := 0``), branch-free."""
        return (np.int64(m >= 1) + 2 * np.int64(m >= 2) + 3 * np.int64(m >= 4) + np.int64(m >= 8)
                + 4 * np.int64(m >= 16) + np.int64(m >= 32))

    @njit(cache=True)
    def _omega_len(x):
        """Elias omega code length of ``x ≥ 1``: ``L(x) = bitlen(x) + L(bitlen(x) − 1)``."""
        bl = 64 - leading_zeros(np.uint64(x))
        return bl + _omega_small(bl - 1)

    @njit(cache=True)
    def _select(kkey, N, n, keys, cand_i, cand_k, amb, sel):
        """The uniform ``n``-subset of ``[0, N)`` drawn by :func:`qlsd_flwr.rng.subset`.

        ``rng.subset`` keeps the indices of the ``n`` smallest of ``N`` uniform keys. Uniforms
        are ``(x >> 11)·2^-53``, so comparing the integers ``x >> 11`` gives the same order.
        Keys up to ``hi`` (a few standard deviations above the ``n``-th order statistic) are
        gathered branch-free; those below ``lo`` (as far below) are surely kept; the ``n``-th
        smallest key ``kth`` is found by ranking only the keys in ``[lo, hi]``. The chosen
        indices go to ``sel[:n]`` in ascending order. Returns 1 when keys tie at the boundary
        (see the module docstring), else 0.
        """
        z = kkey
        for j in range(N):  # position j+1 of the stream: mix(κ + (j+1)·G)
            z = z + _G
            keys[j] = np.int64(_mix(z) >> _SH11)
        margin = 1.5 * math.sqrt(n) + 1.5
        m = 0
        for tier in range(3):
            frac = (n + margin * (1 + 2 * tier)) / N
            if tier == 2 or frac >= 1.0:
                hi = np.int64(9007199254740992)
            else:
                hi = np.int64(frac * 9007199254740992.0)
            m = 0
            for j in range(N):
                cand_i[m] = j
                cand_k[m] = keys[j]
                m += np.int64(keys[j] <= hi)
            if m >= n:
                break
        lof = (n - margin) / N
        lo = np.int64(lof * 9007199254740992.0) if lof > 0.0 else np.int64(0)
        nlow = 0
        ma = 0
        for q in range(m):
            x = cand_k[q]
            amb[ma] = x
            ma += np.int64(x >= lo)
            nlow += np.int64(x < lo)
        if nlow > n:  # rare: rank every candidate
            lo = np.int64(0)
            nlow = 0
            for q in range(m):
                amb[q] = cand_k[q]
            ma = m
        need = n - nlow
        kth = lo - 1  # need == 0: exactly the keys below lo
        if need > 0:
            for a in range(ma):
                xa = amb[a]
                rank = 0
                for b_ in range(ma):
                    rank += np.int64(amb[b_] < xa)
                kth = xa if rank == need - 1 else kth
        cnt = 0
        for q in range(m):
            sel[cnt] = cand_i[q]
            cnt += np.int64(cand_k[q] <= kth)
        return 1 if cnt != n else 0

    @njit(cache=True)
    def _minibatch_sum(i, kmini, y, yoff, Ns, ns, acc, keys, cand_i, cand_k, amb, sel):
        """``Σ_{j∈S_i} y_ij`` as ``y[idx].sum(axis=0)``: rows in ascending index order, from zero.
        Returns 1 on a subset boundary tie."""
        N = Ns[i]
        n = ns[i]
        d = acc.shape[0]
        off = yoff[i]
        acc[:] = 0.0
        if n >= N:
            for j in range(N):
                for q in range(d):
                    acc[q] = acc[q] + y[off + j, q]
            return 0
        tie = _select(kmini, N, n, keys, cand_i, cand_k, amb, sel)
        for jj in range(n):
            row = off + sel[jj]
            for q in range(d):
                acc[q] = acc[q] + y[row, q]
        return tie

    @njit(cache=True)
    def _oracle(i, code, th, anchor, ag, acc, Ns, ns, ysum, h, prior_flat, prior_w, prior_mean,
                prior_var):
        """``H_i(θ)`` of :func:`qlsd_flwr.oracles.oracle` for Gaussian client ``i``, with the same
        float operations in the same order; ``acc`` is the minibatch sum of ``y``."""
        d = th.shape[0]
        N = Ns[i]
        if code == 0:  # full: (N θ − Σy) + w ∇U_0(θ)
            fN = np.float64(N)
            if prior_flat:
                for q in range(d):
                    h[q] = (fN * th[q] - ysum[i, q]) + prior_w * 0.0
            else:
                for q in range(d):
                    h[q] = (fN * th[q] - ysum[i, q]) + prior_w * ((th[q] - prior_mean) / prior_var)
            return
        n = min(ns[i], N)
        scale = np.float64(N) / np.float64(n)
        fn = np.float64(n)
        if code == 1:  # minibatch (QLSD#): (N/n)(n θ − Σ_S y) + w ∇U_0(θ)
            if prior_flat:
                for q in range(d):
                    h[q] = scale * (fn * th[q] - acc[q]) + prior_w * 0.0
            else:
                for q in range(d):
                    h[q] = scale * (fn * th[q] - acc[q]) + prior_w * ((th[q] - prior_mean) / prior_var)
            return
        # control variate at the anchor a = θ* (QLSD*) or ζ (QLSD++)
        if prior_flat:
            for q in range(d):
                h[q] = scale * ((fn * th[q] - acc[q]) - (fn * anchor[q] - acc[q])) + prior_w * (0.0 - 0.0)
        else:
            for q in range(d):
                dp = (th[q] - prior_mean) / prior_var - (anchor[q] - prior_mean) / prior_var
                h[q] = scale * ((fn * th[q] - acc[q]) - (fn * anchor[q] - acc[q])) + prior_w * dp
        if code == 3:
            for q in range(d):
                h[q] = h[q] + ag[q]

    @njit(cache=True)
    def _dither(kdither, d, u, ulo):
        """The QSGD dither ``ξ_j = X_j·2^-53`` (``X_j = mix(κ + j·G) >> 11``) of ``rng.uniform``.
        Converted exactly without a 64-bit int→float instruction (AVX2 has none):
        ``X = 2·X_h + X_l`` with ``X_h < 2^52`` read as the double ``bits(2^52) | X_h`` minus 2^52."""
        ub = u.view(np.uint64)
        z = kdither
        for q in range(d):
            z = z + _G
            x = _mix(z) >> _SH11
            ub[q] = (x >> _ONE) | _MAGIC
            ulo[q] = np.int64(x & _ONE)
        for q in range(d):
            u[q] = ((u[q] - 4503599627370496.0) * 2.0 + (1.0 if ulo[q] != 0 else 0.0)) * _TWO53

    @njit(cache=True)
    def _quantise(h, s, u, gh, lev, nzpos, enc, packed):
        """QSGD quantise then dequantise ``h`` into ``gh`` with dither ``u``; returns
        ``(exact code bits, error)``.

        The float ops of ``QSGD.quantise_batch`` / ``dequantise_batch``: float64 norm by numpy's
        pairwise sum, float32 norm on the wire, ``r = min(|v|·s/‖v‖, s)``,
        ``ℓ = ⌊r⌋ + 1{ξ < r − ⌊r⌋}`` (held as an exact float), ``ĝ = float64(N32)·ℓ / s``
        (``/ s`` is the multiplication by ``2^-p`` when ``s = 2^p``: the same correctly rounded
        number). Error 1: non-finite input; 2: norm beyond float32. The code length is that of
        ``code_length_bits_batch``: ``min(Elias, packed)`` for ``encoding = auto``.
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
            # Two copies of the loop, so the branch stays out of it: for s a power of 2,
            # ``· (1/s)`` equals the reference's ``/ s`` bit for bit and is faster.
            if (s & (s - 1)) == 0:
                inv_s = 1.0 / sf
                for q in range(d):
                    v = h[q]
                    a = abs(v) * sf / norm64
                    r = a if a < sf else sf
                    fl = np.floor(r)
                    lv = fl + (1.0 if u[q] < r - fl else 0.0)
                    lv = (0.0 - lv) if v < 0 else lv  # 0.0 - 0.0 = +0.0, as an int level 0
                    lev[q] = lv
                    gh[q] = n32 * lv * inv_s
            else:
                for q in range(d):
                    v = h[q]
                    a = abs(v) * sf / norm64
                    r = a if a < sf else sf
                    fl = np.floor(r)
                    lv = fl + (1.0 if u[q] < r - fl else 0.0)
                    lv = (0.0 - lv) if v < 0 else lv
                    lev[q] = lv
                    gh[q] = n32 * lv / sf
        else:  # zero vector, or a norm that underflows float32: sent as zero
            for q in range(d):
                lev[q] = 0.0
                gh[q] = 0.0
        if enc == 2:
            return packed, 0
        # Elias: per nonzero level ω(gap) + 1 sign bit + ω(|ℓ|), then 32 + ω(K + 1);
        # bitlen(|ℓ|) is read off the exponent of the exact integer-valued float.
        lb = lev.view(np.uint64)
        body = 0
        for q in range(d):
            e = np.int64((lb[q] >> np.uint64(52)) & np.uint64(0x7FF))
            isnz = np.int64(e != 0)
            bl = (e - 1022) * isnz + (1 - isnz)
            body += isnz * (1 + bl + _omega_small(bl - 1))
        nz = 0
        for q in range(d):
            nzpos[nz] = q
            nz += np.int64((lb[q] << _ONE) != 0)
        prev = -1
        for t in range(nz):
            gap = nzpos[t] - prev
            prev = nzpos[t]
            body += _omega_len(gap)
        elias = body + 32 + _omega_len(nz + 1)
        if enc == 1:
            return elias, 0
        return min(elias, packed), 0

    @njit(nogil=True, cache=True)
    def _gauss_block(k0, R, seeds, theta, zeta, agrad, eta_i, eta, ish, fsh, iv, fv, s, packed,
                     bound, alpha, theta_star, star_prior, p, Ns, ns, y, yoff, ysum, noise,
                     states, m_act, m_skip, m_bits, m_bound, m_bytes, s_th, s_th2, s_f, s_f2, kept,
                     ties, err):
        """Rounds ``k0 .. k0+R-1`` of the chains passed (a contiguous group), for every
        configuration ``v``; releases the GIL.

        Per (chain, round, client) the participation, minibatch sum, dither and noise are
        drawn once and shared by the configurations. Each chain works on private copies of
        its state (no false sharing with threads running other chains) and writes them back
        at the end of the block.
        """
        active_fraction = ish[0] == 1
        burn_in = ish[1]
        thin = ish[2]
        prior_flat = ish[3] == 1
        prior_server = ish[4] == 1
        noise_kernel = ish[5] == 1
        need_mini = ish[6] == 1
        need_dither = ish[7] == 1
        prior_var = fsh[0]
        prior_mean = fsh[1]
        prior_w = fsh[2]
        nc = theta.shape[0]
        V = theta.shape[1]
        d = theta.shape[2]
        b = Ns.shape[0]
        nmax = 1
        for i in range(b):
            nmax = max(nmax, Ns[i])
        record = states.shape[2] > 0
        wts = np.empty(b)
        for i in range(b):
            wts[i] = 1.0 / p[i]
        for c in range(nc):
            h = np.empty(d)
            acc = np.zeros(d)
            gh = np.empty(d)
            g = np.empty((V, d))
            u = np.empty(d)
            z = np.empty(d)
            lev = np.empty(d)
            nzpos = np.empty(d, dtype=np.int64)
            active = np.zeros(b, dtype=np.bool_)
            keys = np.empty(nmax, dtype=np.int64)
            cand_i = np.empty(nmax, dtype=np.int64)
            cand_k = np.empty(nmax, dtype=np.int64)
            amb = np.empty(nmax, dtype=np.int64)
            sel = np.empty(nmax, dtype=np.int64)
            bits_r = np.zeros(V, dtype=np.int64)
            bytes_r = np.zeros(V, dtype=np.int64)
            bound_r = np.zeros(V)
            th = theta[c].copy()
            zt = zeta[c].copy()
            ag = agrad[c].copy()
            et_i = eta_i[c].copy()
            et = eta[c].copy()
            sth = s_th[c].copy()
            sth2 = s_th2[c].copy()
            sf_ = s_f[c].copy()
            sf2_ = s_f2[c].copy()
            kept_c = kept[c]
            ties_c = ties[c]
            bad = False
            seed = seeds[c]
            ks_part = _key_seed(seed, np.uint64(1))
            ks_mini = _key_seed(seed, np.uint64(2))
            ks_dith = _key_seed(seed, np.uint64(3))
            ks_noise = _key_seed(seed, np.uint64(4))
            for r in range(R):
                k = k0 + r
                for v in range(V):  # ζ_k = θ_k every l rounds, and ∇U_i(ζ) for every client
                    if iv[v, 0] == 3 and k % iv[v, 4] == 0:
                        for q in range(d):
                            zt[v, q] = th[v, q]
                        for i in range(b):
                            fN = np.float64(Ns[i])
                            for q in range(d):
                                pg = 0.0 if prior_flat else (zt[v, q] - prior_mean) / prior_var
                                ag[v, i, q] = (fN * zt[v, q] - ysum[i, q]) + prior_w * pg
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
                    g[:, :] = 0.0
                    bits_r[:] = 0
                    bytes_r[:] = 0
                    bound_r[:] = 0.0
                    for i in range(b):
                        if not active[i]:
                            continue
                        if need_mini:
                            ties_c += _minibatch_sum(i, _key_rc(ks_mini, k, i), y, yoff, Ns, ns, acc,
                                                     keys, cand_i, cand_k, amb, sel)
                        if need_dither:
                            _dither(_key_rc(ks_dith, k, i), d, u, nzpos)
                        w = (np.float64(b) / np.float64(n_act)) if active_fraction else wts[i]
                        for v in range(V):
                            code = iv[v, 0]
                            _oracle(i, code, th[v], theta_star[v] if code == 2 else zt[v], ag[v, i],
                                    acc, Ns, ns, ysum, h, prior_flat, prior_w, prior_mean, prior_var)
                            if iv[v, 2] == 1:  # memory: send C(H_i − η_i)
                                for q in range(d):
                                    h[q] = h[q] - et_i[v, i, q]
                            if iv[v, 1] == 1:
                                bits, e = _quantise(h, s[v, i], u, gh, lev, nzpos, iv[v, 3], packed[v, i])
                                if e != 0:
                                    err[c, v] = e
                                    bad = True
                                    break
                                bytes_r[v] += 5 + (bits + 7) // 8
                            else:
                                for q in range(d):
                                    if not math.isfinite(h[q]):
                                        err[c, v] = 3
                                        bad = True
                                    gh[q] = h[q]
                                if bad:
                                    break
                                bits = packed[v, i]
                                bytes_r[v] += bits // 8
                            bits_r[v] += bits
                            bound_r[v] += bound[v, i]
                            for q in range(d):
                                g[v, q] = g[v, q] + w * gh[q]
                            if iv[v, 2] == 1 and alpha[v, i] != 0.0:
                                ai = alpha[v, i]
                                for q in range(d):
                                    et_i[v, i, q] = et_i[v, i, q] + ai * gh[q]
                        if bad:
                            break
                    if bad:
                        break
                    for v in range(V):
                        m_bits[c, v, r] = bits_r[v]
                        m_bound[c, v, r] = bound_r[v]
                        m_bytes[c, v, r] = bytes_r[v]
                        if iv[v, 2] == 1:  # g += η_k, then η_{k+1} = Σ_i η_i (rows in order, from zero)
                            for q in range(d):
                                g[v, q] = g[v, q] + et[v, q]
                                et[v, q] = 0.0
                            for i in range(b):
                                for q in range(d):
                                    et[v, q] = et[v, q] + et_i[v, i, q]
                        if prior_server and not prior_flat:
                            for q in range(d):
                                t = (th[v, q] - prior_mean) / prior_var
                                if iv[v, 0] == 2:
                                    t = t - star_prior[v, q]
                                g[v, q] = g[v, q] + t
                    if noise_kernel:
                        kn = _key_rc(ks_noise, k, 0)
                        for q in range(d):
                            u1 = _unif(kn, q + 1)
                            u2 = _unif(kn, d + q + 1)
                            z[q] = math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(_TWO_PI * u2)
                    else:
                        for q in range(d):
                            z[q] = noise[c, r, q]
                    for v in range(V):
                        gam = fv[v, 0]
                        sq2 = fv[v, 1]
                        for q in range(d):
                            th[v, q] = th[v, q] - gam * g[v, q] + sq2 * z[q]
                if record:
                    for v in range(V):
                        for q in range(d):
                            states[c, v, r, q] = th[v, q]
                j = k + 1
                if j > burn_in and (j - burn_in - 1) % thin == 0:
                    for v in range(V):
                        for q in range(d):
                            x = th[v, q]
                            sth[v, q] += x
                            sth2[v, q] += x * x
                        f = math.sqrt(0.0 + _pairwise_sq(th[v], 0, d))  # as np.sqrt(np.sum(θ², -1))
                        sf_[v] += f
                        sf2_[v] += f * f
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
else:  # pragma: no cover

    def _nb_normal_rows(*args):
        raise RuntimeError("numba is not installed")
