"""The framework-free path: the same algorithm as the Flower strategy, in one process.

One Python loop over rounds and clients calling exactly the functions the Flower
``ClientApp`` and ``Strategy`` call (:func:`qlsd_flwr.core.oracles.client_round`,
:func:`qlsd_flwr.core.server_step.server_step`), with the message encoded and decoded as it would be
on the wire. For one seed it produces the same chain, bit for bit, as Flower does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core import participation
from qlsd_flwr.core import server_step as sampler
from qlsd_flwr.core.oracles import (
    ClientState,
    client_round,
    full_local_grad,
    set_anchor,
)
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol.claims import claims_over_bound
from qlsd_flwr.protocol.traffic import count_claims
from qlsd_flwr.protocol import broadcast, precondition
from qlsd_flwr.outputs import loo
from qlsd_flwr.outputs.checkpoint import resume_dir
from qlsd_flwr.outputs.warmup import warmup_store
from qlsd_flwr.outputs.observer import RunOutputs
from qlsd_flwr.outputs.progress import progress_bar
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.client import handle
from qlsd_flwr.protocol.divergence import DivergenceError, divergence_message
from qlsd_flwr.protocol.server import QLSDServer
from qlsd_flwr.protocol.wire import vectors_to_bytes
from qlsd_flwr.tasks import loading
from qlsd_flwr.tasks.threads import pin_blas


@dataclass
class RunResult:
    summary: dict
    run_dir: Path | None
    trace: np.ndarray | None = None  # θ_1..θ_K when keep_trace
    server: sampler.ServerState | None = None
    clients: list = field(default_factory=list)


def run_local(cfg: RunConfig, task: Task | None = None, write: bool = True,
              keep_trace: bool = False, progress: bool | None = None, wire: bool = True) -> RunResult:
    """Run one chain of ``cfg`` without Flower.

    ``wire=True`` runs the very protocol the Flower apps run (:class:`~qlsd_flwr.protocol.server.QLSDServer`
    on one side, :func:`qlsd_flwr.protocol.client.handle` on the other, messages encoded as bytes), with
    direct calls in place of Flower. ``wire=False`` skips the encoding, the protocol counters and
    the outputs and calls the numerics directly (``decode(encode(q)) == q`` is tested on its own):
    the same chain, faster, for statistical tests.
    """
    task = task if task is not None else loading.load_task(cfg)
    pin_blas()  # a task passed in was not loaded here (tasks/threads)
    build.check_clients(task)
    d = task.dim
    blocks = build.blocks_for(cfg, task)
    specs = [build.client_spec(cfg, i, task.clients[i].n_data, d, task.prior, blocks) for i in range(cfg.b)]
    states = [ClientState() for _ in range(cfg.b)]
    resuming = resume_dir(cfg) is not None
    if resuming and not wire:
        raise ValueError("resume needs the protocol path (wire=True)")
    prep = None if resuming else precondition.prepare(  # resume: θ*, M and γ are in the checkpoint
        cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs, states),
        warm=warmup_store(cfg) if write and wire else None,
        supports=broadcast.task_supports(task) if build.support_on(cfg) else None)
    theta_star, ts_info = (None, {}) if prep is None else (prep.theta_star, prep.info)
    bound = str(cfg.raw.get("norm-bound", "auto"))
    wants = cfg.kind.at_theta_star or (cfg.kind.cv_theta_star and bound.strip().lower() != "off")
    claims = None if prep is None or not wants else [
        full_local_grad(s, task.clients[s.index], prep.theta_star) for s in specs]
    if claims is not None:  # as the Flower path asks them: θ* down, ∇U_i(θ*) up
        count_claims(prep.info, cfg.b, d)
    # QLSD*'s replies carry c_i (judged as c_i + ĝ_i); VR-FALD*'s and FSGLD's local steps carry Σ_j c_j
    if claims is not None and cfg.kind.needs_theta_star and (over := claims_over_bound(cfg, d, prep.metric, claims)):
        # this engine's clients are honest: a claim over a fixed B means B is too small for the data
        raise ConfigError("norm-bound: " + "; ".join(f"client {i}: {w}" for i, w in over.items())
                          + "; every reply of theirs would be refused, a bias: raise norm-bound or use auto")
    bar = progress_bar(cfg.num_rounds, cfg.progress if progress is None else progress, f"{cfg.variant} local")
    if not wire:
        if cfg.kind.local:
            raise ValueError(f"{cfg.variant} runs on the protocol path (wire=True)")
        return _run_direct(precondition.apply(cfg, prep), task, specs, states, prep, keep_trace, bar)
    server = QLSDServer(cfg, task, keep_trace=keep_trace, engine_label="local",
                        observer=RunOutputs(cfg, task.dim) if write else None)
    server.begin(theta_star, ts_info, None, prep)
    if claims is not None:  # QLSD*: what each reply to θ* repeats (protocol.claims)
        server.set_claims(claims)
    bar.update(server.state.k)
    try:
        _rounds(cfg, server, specs, states, task, d, bar)
    except BaseException as exc:  # Ctrl-C, SIGTERM (the CLI makes it KeyboardInterrupt), an error
        server.stop(exc)
        raise
    finally:
        bar.close()
    summary = server.finish()
    if server.run_dir is not None:  # the federated LOO, each client's part computed as its node would
        loo.attach(server.run_dir, cfg.get("loo"), task.n_data, loo.local_ask(task.clients, cfg.get("loo")), summary,
                   ceiling=loo.log_lik_ceiling(cfg))
    trace = np.array(server.trace) if keep_trace else None
    return RunResult(summary=summary, run_dir=server.run_dir, trace=trace, server=server.state, clients=states)


def _rounds(cfg, server, specs, states, task, d, bar) -> None:
    """The protocol's rounds from the server's ``k`` to ``K``, clients called directly."""
    for _ in range(server.state.k, cfg.num_rounds):
        direct_round(server, specs, states, task, cfg.seed, d)
        bar.update(1)


def direct_round(server, specs, states, task, seed: int, d: int) -> dict:
    """One round of ``server`` with its clients called directly (``states[i]``: client ``i``'s state,
    ``seed``: the chain's); returns the round's row. Also the vectorised engine's rivals' round."""
    for i in server.begin_round():
        fields = vectors_to_bytes(server.fields_for(i))  # a message as bytes, as on a wire
        saved = copy.copy(states[i])  # handle() rebinds the state's arrays, never writes into them
        try:
            reply = handle(specs[i], task.clients[i], states[i], seed, fields, d)
        except Exception as exc:  # as Flower does: an error reply, the client's state unchanged
            states[i] = saved
            server.accept(i, None, error=f"{type(exc).__name__}: {exc}")
            continue
        server.accept(i, reply)
    return server.end_round()


def _run_direct(cfg, task, specs, states, prep, keep_trace, bar) -> RunResult:
    theta_star = prep.theta_star
    spec = build.server_spec(cfg, task, theta_star, build.blocks_for(cfg, task), prep.metric)
    for cspec, state in zip(specs, states):  # compression-basis = metric, block: what the server sends its clients
        if cspec.whitened:
            state.metric = spec.whitening
    st = sampler.init_state(spec, build.theta0_of(task) if prep.theta0 is None else prep.theta0[0])
    trace = np.empty((cfg.num_rounds, task.dim)) if keep_trace else None
    support = broadcast.task_support(task) if build.support_on(cfg) else None
    down, w = broadcast.downlink_of(cfg, support), None  # downlink = qsgd: the clients evaluate at w_k (core.downlink)
    for k in range(cfg.num_rounds):
        if down is not None:
            try:
                w = st.w = down.send(st.theta, w, cfg.seed, k)[0]
            except ValueError as exc:  # the chain ran away: θ_k − w_{k−1} cannot be coded
                raise DivergenceError(divergence_message(k, cfg.gamma, stable=build.stable_gamma(task, prep.info))
                                      + f" [{exc}]") from exc
        if sampler.refresh_anchor(spec, st) and down is not None:
            st.zeta = w.copy()
        point = st.theta if down is None else w
        anchor, version = (st.zeta, st.zeta_version) if cfg.kind.cv_zeta else (theta_star, 0)
        g_hat = {}
        for i in np.flatnonzero(participation.active_mask(cfg.seed, k, cfg.p)):
            if cfg.kind.control_variate and states[i].anchor_version != version:
                set_anchor(specs[i], task.clients[i], states[i], anchor, version)
            try:
                g_hat[int(i)] = client_round(specs[i], task.clients[i], states[i], cfg.seed, k, point)[1]
            except ValueError as exc:  # the message cannot be formed: the chain has run away
                raise DivergenceError(divergence_message(k + 1, cfg.gamma, stable=build.stable_gamma(task, prep.info))
                                      + f" [{exc}]") from exc
        sampler.server_step(spec, st, cfg.seed, *sampler.stack_replies(g_hat, cfg.b, task.dim))
        if not np.all(np.isfinite(st.theta)):
            raise DivergenceError(divergence_message(k + 1, cfg.gamma, stable=build.stable_gamma(task, prep.info)))
        if keep_trace:
            trace[k] = st.theta
        bar.update(1)
    bar.close()
    return RunResult(summary={"engine": "local-direct"}, run_dir=None, trace=trace, server=st, clients=states)
