"""The vectorised engine's driver: configurations and chains side by side, blocks of rounds on a
backend, outputs, checkpoints and divergence (see :mod:`qlsd_flwr.engines.vectorised`)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from qlsd_flwr.config import ConfigError, RunConfig, check_memory
from qlsd_flwr.errors import CheckpointError
from qlsd_flwr.protocol.downlink import SamplingDownlink
from qlsd_flwr.protocol import broadcast, metric_sent
from qlsd_flwr.tasks.threads import pin_blas
from qlsd_flwr.protocol import precondition
from qlsd_flwr.core.metric import Identity
from qlsd_flwr.core.metric_codec import older_block_form, to_array
from qlsd_flwr.core.potential import Task
from qlsd_flwr.outputs import loo
from qlsd_flwr.engines.vectorised.numba_backend import NumbaChains
from qlsd_flwr.engines.vectorised.backends import backend_for
from qlsd_flwr.engines.vectorised.runaway import first_bad_round, runaway_limits
from qlsd_flwr.engines.vectorised.numpy_backend import NumpyGeneric, Sequential
from qlsd_flwr.engines.vectorised.rivals import RivalChains
from qlsd_flwr.engines.vectorised.results import (
    ChainStats,
    VectorisedResult,
    chain_seeds,
)
from qlsd_flwr.outputs import checkpoint as ckpt
from qlsd_flwr.outputs import jsonio
from qlsd_flwr.outputs.warmup import warmup_store
from qlsd_flwr.outputs.progress import progress_bar
from qlsd_flwr.outputs.recorder import Recorder
from qlsd_flwr.outputs.stopsignal import deferred_signals
from qlsd_flwr.outputs.run_dir import make_run_dir
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.divergence import DivergenceError, divergence_message
from qlsd_flwr.protocol.facts import summary_extra
from qlsd_flwr.tasks import loading

# run-config keys that may differ between configurations run side by side
SIDE_BY_SIDE_KEYS = ("variant", "s", "gamma", "l", "alpha", "compressor", "encoding", "run-name",
                     "output-dir", "progress", "verbose", "engine", "theta-star", "opt-rounds",
                     "opt-tol", "client-cpus", "reply-timeout", "local-steps", "tau", "rho")


def _check_side_by_side(cfgs: list[RunConfig]) -> None:
    ref = cfgs[0]
    for c in cfgs[1:]:
        bad = [k for k in ref.raw if k not in SIDE_BY_SIDE_KEYS and str(ref.raw[k]) != str(c.raw[k])]
        if bad:
            raise ValueError(f"run_side_by_side: configurations differ in {', '.join(bad)}; only "
                             f"{', '.join(SIDE_BY_SIDE_KEYS)} may differ")
        if c.sampler.pooled != ref.sampler.pooled:
            raise ValueError("run_side_by_side: sgld pools the data on one client; run it apart")


def run_vectorised(cfg: RunConfig, task: Task | None = None, write: bool = True,
                   keep_trace: bool = False, progress: bool | None = None, wire: bool = True,
                   backend: str | None = None, block_rounds: int | None = None,
                   threads: int | None = None) -> VectorisedResult:
    """Run ``cfg.num_chains`` chains of ``cfg`` side by side (chain ``c``: seed ``seed + c``).

    Args:
        cfg: the run configuration (any ``engine`` value; this function is the engine).
        task: the task, built from ``cfg`` when ``None``.
        write: write the run folder (:mod:`qlsd_flwr.outputs.recorder`).
        keep_trace: return every state ``θ_1..θ_K`` of every chain, ``(C, K, d)``.
        progress: show a progress bar (rounds/s, chain-iterations/s); default: ``cfg``'s.
        wire: accepted for signature compatibility with ``run_local``; code lengths are always
            exact and nothing is actually encoded.
        backend: ``"auto"``, ``"numba"`` or ``"numpy"``; ``None`` (the default) reads the run
            config's ``vectorised-backend`` (itself ``"auto"`` by default).
        block_rounds: rounds per compiled call; default adapts to about 0.25 s a block.
        threads: worker threads of the numba backend, one group of chains each (default: the
            cores this process may use).
    """
    return run_side_by_side([cfg], task=task, write=write, keep_trace=keep_trace, progress=progress,
                            backend=backend, block_rounds=block_rounds, threads=threads)[0]


def run_side_by_side(cfgs, task: Task | None = None, write: bool = False, keep_trace: bool = False,
                     progress: bool | None = None, backend: str | None = None,
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
    task = task if task is not None else loading.load_task(ref)
    pin_blas()  # a task passed in was not loaded here (tasks/threads)
    which = backend_for(cfgs, task, str(ref.get("vectorised-backend")) if backend is None else backend)
    d, nchain, K = task.dim, ref.num_chains, ref.num_rounds
    parts = [_parts(cfg, task, write) for cfg in cfgs]
    cfgs = [dataclasses.replace(c, gamma=pt[1].gamma) if c.gamma_auto else c for c, pt in zip(cfgs, parts)]
    ref = cfgs[0]
    stats = [ChainStats(nchain, d) for _ in cfgs]
    ck_on = write and any(ckpt.enabled(c) for c in cfgs)
    if ck_on and len(cfgs) > 1:
        raise ValueError("run_side_by_side: checkpoint-every and resume need a single configuration")
    resume = None
    if ck_on and ckpt.resume_dir(ref) is not None:
        resume = ckpt.load_for_resume(ref, "vectorised")
        if resume[1]["backend"] != which:
            raise ValueError(f"resume: the checkpoint was written by the {resume[1]['backend']} backend, "
                             f"this run uses {which}; set vectorised-backend = {resume[1]['backend']!r} (or pass backend=)")
        # the preparation is a function of the seed and the data, so it was made again above: it must
        # give the checkpoint's step and metric bit for bit (a changed metric file, for instance, does not)
        spec0 = parts[0][1]
        saved_m = resume[2].get("metric")
        if "gamma" in resume[1] and float(resume[1]["gamma"]) != float(spec0.gamma):
            raise ConfigError(f"resume: gamma differs from the checkpoint's ({resume[1]['gamma']!r} against "
                              f"{spec0.gamma!r}); the run's data or metric file changed")
        if saved_m is not None and not np.array_equal(saved_m, to_array(spec0.metric)):
            if older_block_form(saved_m, spec0.metric, d):
                raise ConfigError("resume: the checkpoint holds metric-block's metric as a dense correction, the form "
                                  "written before 2026-12-06; this version keeps it in its Kronecker structure, so this "
                                  "engine cannot continue that chain bit for bit: resume it with engine = ray or "
                                  "inprocess (they restore the checkpoint's metric), or start the run again")
            raise ConfigError("resume: the metric differs from the checkpoint's; the run's data or metric file changed")
    recs, run_dirs = [], []
    k = 0
    try:  # a stop while the recorders are open (numba compiling, a restore) closes them too
        for cfg in cfgs:
            rec = run_dir = None
            if write:
                conf = cfg.to_dict()
                conf["engine_detail"] = {"engine": "vectorised", "backend": which,
                                         "chain_seeds": "seed + c for chain c"}
                if resume is not None:
                    run_dir = resume[0]
                    rec = Recorder(run_dir, conf, d, nchain, cfg.burn_in, cfg.thin,
                                   resume=ckpt.recorder_part(resume[1], resume[2]),
                                   labels=task.meta.get("param_labels"))
                else:
                    run_dir = make_run_dir(cfg.get("output-dir"), cfg.get("run-name"), cfg.variant)
                    rec = Recorder(run_dir, conf, d, nchain, cfg.burn_in, cfg.thin,
                                   labels=task.meta.get("param_labels"))
            recs.append(rec)
            run_dirs.append(run_dir)
        if keep_trace:  # the traces are the run's largest allocation: sized before they are made
            for c in cfgs:
                check_memory(c, d, keep_trace=True)
        traces = [np.empty((nchain, K, d)) for _ in cfgs] if keep_trace else None
        show = ref.progress if progress is None else progress
        name = labels or (cfgs[0].variant if len(cfgs) == 1 else f"{len(cfgs)} configs")
        bar = progress_bar(K, show, f"{name} vectorised x{nchain}")
        if which == "numba":
            runner = NumbaChains(cfgs, task, parts, stats, threads)
        elif which == "torch":
            from qlsd_flwr.engines.vectorised.torch_backend import TorchChains

            runner = Sequential([TorchChains(cfg, task, *pt[:4], st, theta0=pt[4])
                                 for cfg, pt, st in zip(cfgs, parts, stats)])
        else:
            runner = Sequential([RivalChains(cfg, task, pt[0], pt[5], st) if cfg.kind.local else
                                 NumpyGeneric(cfg, task, *pt[:4], st, theta0=pt[4])
                                 for cfg, pt, st in zip(cfgs, parts, stats)])
        t0 = time.perf_counter()
        k = 0
        last_ckpt = None
        if resume is not None:
            k = last_ckpt = int(resume[1]["k"])
            _restore(runner, stats[0], resume[2], resume[1], ckpt.path_in(resume[0]))
            bar.update(k)
        every = ref.checkpoint_every if ck_on else 0
        R = block_rounds or runner.initial_block()
        limits = [runaway_limits(cfg, task, pt, runner.theta_of(v)) for v, (cfg, pt) in enumerate(zip(cfgs, parts))]
        # the downlink of the QLSD family's rounds, counted as the protocol server sends it (the rivals'
        # rounds run through that server and count their own)
        downs = [SamplingDownlink(cfg, d, chain_seeds(cfg), k, metric_sent.bits_by_client(
            pt[1].whitening, pt[3].get("block_clients", ()), cfg.b) if pt[0][0].whitened else 0)
                 if rec is not None and not cfg.kind.local else None
                 for cfg, rec, pt in zip(cfgs, recs, parts)]
        # a backend that keeps only the kept draws on the host gives each round's ‖θ‖ instead (torch)
        sparse = isinstance(runner, Sequential) and all(getattr(r, "sparse_states", False) for r in runner.runners)
        need_states = keep_trace or (write and not sparse)
    except BaseException as exc:
        _close_stopped(recs, exc, k)
        raise
    try:
        while k < K:
            R = min(R, K - k)
            if every:
                R = min(R, every - k % every)  # blocks end on checkpoint rounds
            tb = time.perf_counter()
            outs = runner.run_block(k, R, need_states)
            dt = time.perf_counter() - tb
            for v, out in enumerate(outs):
                if downs[v] is not None:
                    out["bits_down"] = downs[v].rounds(k, R, out.get("down_code_bits"))
                bad = first_bad_round(out, runner.theta_of(v), R, limits[v])
                if bad is not None:
                    _diverge(cfgs[v], recs, v, k, bad, out, traces, dt / len(cfgs), run_dirs[v], last_ckpt,
                             build.stable_gamma(task, parts[v][3]))
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
    except BaseException as exc:  # Ctrl-C, SIGTERM, an error: every run folder keeps its draws so far
        _close_stopped(recs, exc, k)
        raise
    finally:
        bar.close()
        runner.close()
    wall = time.perf_counter() - t0
    results = []
    for v, cfg in enumerate(cfgs):
        st = stats[v]
        st.rounds = K
        own = runner.runners[v].info() if isinstance(runner, Sequential) else runner.info()  # the rivals' counts
        info = {"engine": "vectorised", "backend": which, "num_chains": nchain,
                "chain_seeds": chain_seeds(cfg).tolist(), "chain_seed_rule": "seed + c",
                "side_by_side": len(cfgs), "engine_seconds": wall,
                "chain_iterations_per_second": K * nchain * len(cfgs) / max(wall, 1e-12),
                "stats": st.to_dict(), **own, **parts[v][3]}
        if resume is not None:
            info["resumed_from_round"] = int(resume[1]["k"])
        extra = summary_extra(cfg, task, info)
        if recs[v] is not None:
            summary = recs[v].close(extra)
            summary["per_chain_round"] = {kk: val / nchain for kk, val in summary["per_round"].items()}
            jsonio.write(run_dirs[v] / "summary.json", summary)
            mode = cfgs[v].get("loo")  # the federated LOO, each client's part computed as its node would
            loo.attach(run_dirs[v], mode, task.n_data, loo.local_ask(task.clients, mode), summary,
                       ceiling=loo.log_lik_ceiling(cfgs[v]))
        else:
            summary = extra
        results.append(VectorisedResult(summary=summary, run_dir=run_dirs[v], stats=st,
                                        theta=runner.theta_of(v).copy(),
                                        trace=traces[v] if keep_trace else None, backend=which,
                                        extra=runner.info()))
    return results


def _parts(cfg: RunConfig, task: Task, write: bool = True):
    """Client specs, server spec, θ*, its facts, the chains' starts and the whole preparation for ``cfg``
    (as the other engines build them); a writing run keeps the ``metric-from = adapt`` warm-up's state
    (:func:`qlsd_flwr.outputs.warmup.warmup_store`)."""
    d = task.dim
    build.check_clients(task)
    build.warn_if_unstable(cfg, task)
    blocks = build.blocks_for(cfg, task)
    specs = [build.client_spec(cfg, i, task.clients[i].n_data, d, task.prior, blocks) for i in range(cfg.b)]
    prep = precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs),
                                warm=warmup_store(cfg) if write else None,
                                supports=broadcast.task_supports(task) if build.support_on(cfg) else None)
    spec = build.server_spec(precondition.apply(cfg, prep), task, prep.theta_star, blocks, prep.metric)
    return specs, spec, prep.theta_star, prep.info, prep.theta0, prep


def _close_stopped(recs: list, exc: BaseException, k: int) -> None:
    """Close every open recorder of a stopped run (its folder keeps the draws so far)."""
    for w, rec in enumerate(recs):
        if rec is not None:
            recs[w] = None
            # the same text as QLSDServer.stop's
            rec.close({"stopped": f"{type(exc).__name__}: {exc}".rstrip(": "), "stopped_at_round": k})


def _record_block(rec: Recorder, k0: int, R: int, out: dict, dt: float) -> None:
    act, skp = out["n_active"].sum(axis=0), out["skipped"].sum(axis=0)
    be, bb, by = out["bits_exact"].sum(axis=0), out["bits_bound"].sum(axis=0), out["bytes"].sum(axis=0)
    down = out["bits_down"].sum(axis=0) if "bits_down" in out else np.zeros(R, np.int64)
    states = out["states"] if out.get("states") is not None else out.get("kept")  # (C, R, d), or {r: (C, d)}
    with deferred_signals():  # the block's rows and draws together (a stop then finds them consistent)
        _record_rows(rec, k0, R, act, skp, be, bb, by, down, states, dt)


def _record_rows(rec, k0, R, act, skp, be, bb, by, down, states, dt) -> None:
    for r in range(R):
        j = k0 + r + 1
        rec.record_round({"round": j, "n_active": int(act[r]), "n_replied": int(act[r]) ,
                          "n_rejected": 0, "skipped": int(skp[r]), "bits_bound": float(bb[r]),
                          "bits_exact": int(be[r]), "bytes_payload": int(by[r]), "bytes_message": 0,
                          "seconds": dt / R, "bits_down": int(down[r]), "bytes_message_down": 0})
        if rec.keeps(j):
            rec.record_sample(j, states[:, r] if isinstance(states, np.ndarray) else states[r])


def _diverge(cfg, recs, v, k0, bad, out, traces, dt, run_dir, last_ckpt, stable=None) -> None:
    """Record the block's rounds before ``bad``, close every recorder cleanly, raise."""
    if traces is not None and bad:
        traces[v][:, k0:k0 + bad] = out["states"][:, :bad]
    exact = out.get("states") is not None or out.get("norms") is not None
    where = "" if exact else f" (within rounds {k0 + 1}..{k0 + len(out['skipped'][0])})"
    reason = out.get("error") or "θ is not finite"
    if recs[v] is not None and bad:
        _record_block(recs[v], k0, bad, out, dt)
    msg = divergence_message(k0 + bad + 1, cfg.gamma, run_dir if recs[v] is not None else None,
                             last_ckpt, where, stable=stable) + f" [{reason}]"
    for w, rec in enumerate(recs):
        if rec is not None:
            rec.close({"diverged_at_round": k0 + bad + 1, "error": msg} if w == v else {"stopped": msg})
            recs[w] = None
    raise DivergenceError(msg)


def _stats_arrays(st: ChainStats) -> dict:
    return {f"st_{n}": getattr(st, n) for n in ("sum_theta", "sum_theta2", "sum_f", "sum_f2", "n_active",
                                               "skipped", "bits_exact", "bits_bound", "bytes_payload",
                                               "subset_ties")}


def _save_checkpoint(cfg, backend, runner, st: ChainStats, rec: Recorder, run_dir, k: int) -> None:
    r = runner if isinstance(runner, NumbaChains) else runner.runners[0]
    rec_meta, rec_arrays = rec.checkpoint_state()
    arrays = {**{f"run_{n}": a for n, a in r.checkpoint_arrays().items()}, **_stats_arrays(st),
              **{f"rec_{n}": a for n, a in rec_arrays.items()}}
    arrays["metric"] = to_array(Identity() if isinstance(r, NumbaChains) else r.spec.metric)
    meta = {"kind": "vectorised", "backend": backend, "k": k, "config": cfg.raw, "gamma": _gamma_of(r),
            "stats": {"n_kept": st.n_kept, "rounds": st.rounds}, "recorder": rec_meta}
    if isinstance(r, RivalChains):  # the chains' servers' JSON state (guards, counters)
        meta["runner"] = r.checkpoint_meta()
    ckpt.save(ckpt.path_in(run_dir), arrays, meta)


def _gamma_of(r) -> float:
    return float(r.prm.gamma[0]) if isinstance(r, NumbaChains) else float(r.spec.gamma)


def _restore(runner, st: ChainStats, arrays: dict, meta: dict, path) -> None:
    r = runner if isinstance(runner, NumbaChains) else runner.runners[0]
    run = {n[4:]: a for n, a in arrays.items() if n.startswith("run_")}
    if not isinstance(r, RivalChains):  # the QLSD family's chains: each array as this run's own state is shaped
        shapes = {n: np.shape(a) for n, a in r.checkpoint_arrays().items()}
        th = shapes["theta"]  # ζ and ∇U_i(ζ) exist from the first refresh on: θ's shape, and one per client
        shapes = {"zeta": th, **({"anchor_grad": th[:1] + (r.b,) + th[1:]} if hasattr(r, "b") else {}), **shapes}
        for n, a in run.items():
            if n in shapes and np.shape(a) != shapes[n]:
                raise CheckpointError(f"checkpoint {path}: array 'run_{n}' has shape {np.shape(a)}, this run's is "
                                      f"{shapes[n]} (num-chains, num-clients and the model's dimension)")
    r.restore(run, meta.get("runner")) if isinstance(r, RivalChains) else r.restore(run)
    for n, a in arrays.items():
        if n.startswith("st_"):
            getattr(st, n[3:])[...] = a
    st.n_kept = int(r.kept[0]) if isinstance(r, NumbaChains) else int(arrays["run_n_kept"])
