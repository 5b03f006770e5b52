"""The framework-free path: the same algorithm as the Flower strategy, in one process.

One Python loop over rounds and clients calling exactly the functions the Flower
``ClientApp`` and ``Strategy`` call (:func:`qlsd_flwr.oracles.client_round`,
:func:`qlsd_flwr.sampler.server_step`), with the message encoded and decoded as it would be
on the wire. For one seed it produces the same chain, bit for bit, as Flower does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import components as C
from . import participation, sampler
from .config import RunConfig
from .oracles import ClientState, client_round, full_local_grad, set_anchor
from .outputs import Recorder, make_run_dir
from .progress import progress_bar
from .tasks.base import Task


@dataclass
class RunResult:
    summary: dict
    run_dir: Path | None
    trace: np.ndarray | None = None  # θ_1..θ_K when keep_trace
    server: sampler.ServerState | None = None
    clients: list = field(default_factory=list)


def optimise_theta_star(cfg: RunConfig, task: Task, theta0: np.ndarray, grad_fn) -> tuple[np.ndarray, int]:
    """Federated gradient descent for ``θ* = argmin U``: ``θ ← θ − γ ∇U(θ)``.

    ``grad_fn(θ)`` returns ``∇U(θ)`` as summed from the clients' full local gradients (plus the
    prior); it is how each engine reaches its clients. Stops when
    ``‖∇U‖ ≤ opt-tol·(1 + ‖∇U(θ_0)‖)`` or after ``opt-rounds`` rounds.
    """
    theta = theta0.copy()
    g = grad_fn(theta)
    g0 = float(np.linalg.norm(g))
    rounds = 0
    for rounds in range(1, int(cfg.get("opt-rounds")) + 1):
        theta = C.gd_step(theta, g, cfg.gamma)
        g = grad_fn(theta)
        if C.opt_converged(g, g0, float(cfg.get("opt-tol"))):
            break
    return theta, rounds


def resolve_theta_star(cfg: RunConfig, task: Task, theta0: np.ndarray, grad_fn) -> tuple[np.ndarray | None, dict]:
    if not C.needs_theta_star(cfg):
        return None, {}
    if cfg.theta_star == "closed-form":
        return C.closed_form_theta_star(cfg, task), {"theta_star": "closed-form"}
    ts, rounds = optimise_theta_star(cfg, task, theta0, grad_fn)
    return ts, {"theta_star": "optimise", "opt_rounds": rounds}


def run_local(cfg: RunConfig, task: Task | None = None, write: bool = True,
              keep_trace: bool = False, progress: bool | None = None, wire: bool = True) -> RunResult:
    """Run one chain of ``cfg`` without Flower.

    ``wire=False`` skips encoding and decoding each message (``decode(encode(q)) == q`` is
    tested on its own) and the bit counts; the chain is the same. For fast statistical tests.
    """
    task = task if task is not None else C.load_task(cfg)
    d = task.dim
    blocks = C.blocks_for(cfg, task)
    specs = [C.client_spec(cfg, i, task.clients[i].n_data, d, task.prior, blocks) for i in range(cfg.b)]
    states = [ClientState() for _ in range(cfg.b)]
    theta0 = C.theta0_of(task)
    theta_star, ts_info = resolve_theta_star(
        cfg, task, theta0,
        lambda th: C.combine_grads(cfg, task.prior, [full_local_grad(s, task.clients[s.index], th) for s in specs], th))
    spec = C.server_spec(cfg, task, theta_star, blocks)
    st = sampler.init_state(spec, theta0)
    seed = cfg.seed

    rec = None
    run_dir = None
    if write:
        run_dir = make_run_dir(cfg.get("output-dir"), cfg.get("run-name"), cfg.variant)
        rec = Recorder(run_dir, cfg.to_dict(), d, 1, cfg.burn_in, cfg.thin)
    trace = np.empty((cfg.num_rounds, d)) if keep_trace else None
    show = cfg.get("progress") if progress is None else progress
    bar = progress_bar(cfg.num_rounds, show, f"{cfg.variant} local")
    for k in range(cfg.num_rounds):
        t0 = time.perf_counter()
        sampler.refresh_anchor(spec, st)
        active = participation.active_mask(seed, k, cfg.p)
        g_hat: dict[int, np.ndarray] = {}
        bits_bound = bits_exact = nbytes = 0
        for i in np.flatnonzero(active):
            s_i, pot = specs[i], task.clients[i]
            anchor, version = (st.zeta, st.zeta_version) if cfg.oracle == "svrg" else (theta_star, 0)
            if cfg.oracle in ("svrg", "star") and states[i].anchor_version != version:
                set_anchor(s_i, pot, states[i], anchor, version)
            q, g = client_round(s_i, pot, states[i], seed, k, st.theta)
            if not wire:
                g_hat[int(i)] = g
                continue
            payload = s_i.compressor.encode(q)
            q_server = s_i.compressor.decode(payload, d)
            g_hat[int(i)] = s_i.compressor.dequantise(q_server)
            bits_bound += s_i.compressor.bound_bits(d)
            bits_exact += s_i.compressor.code_length_bits(q)
            nbytes += len(payload)
        facts = sampler.server_step(spec, st, seed, g_hat)
        if keep_trace:
            trace[k] = st.theta
        if rec is not None:
            rec.record_round({"round": k + 1, "n_active": int(active.sum()), "n_replied": len(g_hat),
                              "n_rejected": 0, "skipped": int(facts["skipped"]),
                              "bits_bound": bits_bound, "bits_exact": bits_exact,
                              "bytes_payload": nbytes, "bytes_message": 0,
                              "seconds": time.perf_counter() - t0})
            rec.record_sample(k + 1, st.theta)
        bar.update(1)
    bar.close()
    summary = {"engine": "local", **ts_info}
    if rec is not None:
        summary = rec.close(summary_extra(cfg, task, summary))
    return RunResult(summary=summary, run_dir=run_dir, trace=trace, server=st, clients=states)


def summary_extra(cfg: RunConfig, task: Task, extra: dict) -> dict:
    """Facts every engine adds to its summary."""
    out = dict(extra)
    out.update({"variant": cfg.variant, "task": task.name, "b": cfg.b, "d": task.dim,
                "gamma": cfg.gamma, "num_rounds": cfg.num_rounds, "seed": cfg.seed})
    if task.posterior_mean is not None:
        out["posterior_mean_exact"] = np.asarray(task.posterior_mean).tolist()
        out["posterior_var_exact"] = np.asarray(task.posterior_var).tolist()
        # ULA with exact gradients on this Gaussian target has variance 1/(τ(1 − γτ/2)), τ = 1/var:
        # the discretisation bias every variant carries at this γ, before any gradient noise.
        v = np.asarray(task.posterior_var)
        out["ula_var_exact"] = (v / (1.0 - cfg.gamma / (2.0 * v))).tolist()
    return out
