"""``QLSDStrategy``: the QLSD family as a Flower Message-API strategy.

The strategy only translates between Flower messages and the framework-free round protocol
(:class:`~qlsd_flwr.protocol.server.QLSDServer`), and it keeps Flower's ``Strategy`` contract:
Flower's own :meth:`Strategy.start` drives the rounds; :meth:`QLSDStrategy.configure_train`
builds one ``Message`` per active client from the protocol's fields; :meth:`aggregate_train`
hands every reply back to the protocol (validated, decoded or rejected and counted) and takes
the server step, returning the new sample ``θ_{k+1}`` as the round's ``ArrayRecord``.

Parameters (all from the run config, see :mod:`qlsd_flwr.config`; defaults in brackets):
    variant [qlsd-pp], gamma γ [4.9e-4], p ``p_i`` [1.0], s ``s_i`` [16], aggregation
    [unbiased], l [100], alpha α [auto = 1/(ω+1)], batch-fraction [0.1], prior-var [flat],
    prior-on [server], theta-star [closed-form], num-rounds K [2000], burn-in [500], thin [1],
    seed [0], reply-timeout [600 s].

What :meth:`start` adds around Flower's loop, and why:

* before it: the node handshake (:class:`~qlsd_flwr.flower.nodes.NodeRegistry`: client index
  ``i`` ↔ node id), the θ* phase for QLSD* (:mod:`qlsd_flwr.core.theta_star`), and the start of
  the chain (or its restart from a checkpoint);
* after it: the memory audit (every client's own η_i against the server's mirror) and the run's
  summary;
* one documented override of one step: on Flower's simulation engine the grid passed to
  Flower's loop hands replies to :meth:`aggregate_train` *as they arrive* (push, then pull every
  ``pull_interval``: the loop of ``send_and_receive``), so decoding overlaps the clients still at
  work. Other grids (deployment, the in-process test grid) use ``send_and_receive`` as it is.
  The chain does not depend on the order replies are taken in.

Participation is drawn per client from the counter stream ``(seed, PARTICIPATION, k, i)``,
never with Flower's ``sample_nodes``. A diverging chain raises
:class:`~qlsd_flwr.protocol.divergence.DivergenceError` (also handed to
``failure_sink["error"]``, so that the Ray engine, which runs the ServerApp inside Flower, can
re-raise it).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Iterator

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from qlsd_flwr.config import RunConfig
from qlsd_flwr.core.potential import Task
from qlsd_flwr.core.theta_star import resolve_theta_star
from qlsd_flwr.flower.nodes import NodeRegistry
from qlsd_flwr.flower.records import RECORD, config_record, record_fields
from qlsd_flwr.flower.sizing import message_nbytes
from qlsd_flwr.outputs.checkpoint import resume_dir
from qlsd_flwr.outputs.observer import RunOutputs
from qlsd_flwr.outputs.progress import progress_bar
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.divergence import DivergenceError
from qlsd_flwr.protocol.server import QLSDServer
from qlsd_flwr.protocol.wire import arr_to_bytes, bytes_to_arr

log = logging.getLogger("qlsd_flwr")


def theta_from_arrays(arrays: ArrayRecord, d: int) -> np.ndarray:
    """``θ`` as one float64 vector: the record's arrays flattened and joined in their order
    (``ArrayRecord(model.state_dict())`` gives a torch model's parameters in its own order)."""
    parts = [np.asarray(a.numpy(), dtype=np.float64).ravel() for a in arrays.values()]
    theta = np.concatenate(parts) if parts else np.zeros(0)
    if theta.shape[0] != d:
        raise ValueError(f"initial_arrays: {theta.shape[0]} values in {len(parts)} array(s), the model "
                         f"has d = {d} parameters")
    if not np.all(np.isfinite(theta)):
        raise ValueError("initial_arrays: θ_0 has non-finite values")
    return theta


class _RepliesAsTheyArrive:
    """The grid Flower's loop sees: ``send_and_receive`` returns the replies as an iterator that
    yields each one as a poll brings it in, on a grid that polls in process (``pull_interval``);
    anything else is the real grid's (see the module docstring)."""

    def __init__(self, grid: Grid, on_pushed: Callable[[list[Message]], None]):
        self._grid, self._on_pushed = grid, on_pushed

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None):
        msgs = list(messages)
        if not msgs:  # Flower's evaluation step of every round: nothing to send
            return []
        interval = getattr(self._grid, "pull_interval", None)
        if interval is None:
            replies = self._grid.send_and_receive(msgs, timeout=timeout)
            self._on_pushed(msgs)
            return replies
        return self._stream(msgs, timeout, interval)

    def _stream(self, msgs: list[Message], timeout: float | None, interval: float) -> Iterator[Message]:
        pending = {m for m in self._grid.push_messages(msgs) if m}  # Flower marks unpushable ones None
        self._on_pushed(msgs)
        end = None if timeout is None else time.time() + timeout
        while pending:
            for msg in self._grid.pull_messages(pending):
                pending.discard(msg.metadata.reply_to_message_id)
                yield msg
            if not pending or (end is not None and time.time() >= end):
                return
            time.sleep(interval)


class QLSDStrategy(Strategy):
    """QLSD, QLSD#, QLSD*, QLSD++ and the uncompressed LSD*/LSD++/SGLD (see module docstring).

    Parameters
    ----------
    cfg : RunConfig
        The validated run configuration (:func:`qlsd_flwr.config.resolve`).
    task : Task
        The target: ``d``, the prior ``U_0`` and, for QLSD*, θ* in closed form.
    run_dir : path, optional
        The run folder (default: ``<output-dir>/<run-name>``, made at start).
    write : bool, default True
        Write the run folder (samples, metrics, summary, checkpoints).
    keep_trace : bool, default False
        Keep every ``θ_k`` in memory (``self.trace``).
    on_round : callable, optional
        Called with the strategy after each round.
    engine_label : str, default "flower"
        The ``engine`` recorded in the summary.
    failure_sink : dict, optional
        Receives a ``DivergenceError`` under ``"error"``.
    """

    def __init__(self, cfg: RunConfig, task: Task, run_dir=None, write: bool = True,
                 keep_trace: bool = False, on_round=None, engine_label: str = "flower",
                 failure_sink: dict | None = None):
        self.cfg, self.task, self.d = cfg, task, task.dim
        self.server = QLSDServer(cfg, task, keep_trace, engine_label,
                                 observer=RunOutputs(cfg, task.dim, run_dir) if write else None)
        self.nodes = NodeRegistry(cfg.b, task.dim)
        self.failure_sink = failure_sink
        self.on_round = on_round  # called with the strategy after each round (tests, monitoring)
        self._sent: dict[int, int] = {}  # node id -> client, this round
        self._sent_ids: dict[str, int] = {}  # message id -> client (replies the SuperLink made)
        self._grid: Grid | None = None  # the real grid (node management talks to it directly)
        self._timeout = cfg.reply_timeout
        self._bar = None

    # the chain's facts, for callers and tests
    state = property(lambda self: self.server.state)
    trace = property(lambda self: self.server.trace)
    run_dir = property(lambda self: self.server.run_dir)
    summary_data = property(lambda self: self.server.summary_data)
    rejected = property(lambda self: self.server.rejected)
    missed_rounds = property(lambda self: self.server.missed_rounds)
    node_of = property(lambda self: self.nodes.node_of)
    rejoined = property(lambda self: self.nodes.rejoined)

    # ---- Flower Strategy interface -------------------------------------------------
    def summary(self) -> None:
        c = self.cfg
        log.info("QLSDStrategy variant=%s b=%d d=%d gamma=%g K=%d s=%s p=%s rule=%s", c.variant,
                 c.b, self.d, c.gamma, c.num_rounds, c.s.tolist(), c.p.tolist(), c.aggregation)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per active client ``i ∈ A_{k+1}``; a non-empty ``config`` (Flower's
        ``train_config``) travels beside the protocol's fields as the ``"config"`` record."""
        k = self.state.k
        self.nodes.rediscover(self._grid or grid, k + 1, self._timeout)
        self._sent = {}
        msgs = []
        for i in self.server.begin_round():
            node = self.nodes.node_of[i]
            content = RecordDict({RECORD: ConfigRecord(self.server.fields_for(i))})
            if config:
                content["config"] = config
            msgs.append(Message(content, node, MessageType.TRAIN, group_id=str(k + 1)))
            self._sent[node] = i
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Hand each reply to the protocol, then take the server step. Returns ``θ_{k+1}``; the
        round's metrics go to ``metrics.csv`` (not into Flower's ``Result``, which would keep
        one record per round in memory for the whole run)."""
        for msg in replies:
            self.take_reply(msg)
        self.server.end_round()
        if self._bar is not None:
            self._bar.update(1)
        if self.on_round is not None:
            self.on_round(self)
        return ArrayRecord({"theta": Array(np.asarray(self.state.theta))}), None

    def take_reply(self, msg: Message) -> None:
        """Hand one reply of this round to the protocol (validated, decoded or rejected)."""
        i = self._sent.get(msg.metadata.src_node_id)
        if i is None and msg.has_error():  # e.g. NODE_UNAVAILABLE, made by the SuperLink itself
            i = self._sent_ids.get(msg.metadata.reply_to_message_id)
        if msg.has_error():
            self.server.accept(i, None, error=str(msg.error.reason))
        else:
            self.server.accept(i, record_fields(msg.content), message_bytes=message_nbytes(msg))

    def _note_sent(self, msgs: list[Message]) -> None:
        self._sent_ids = {m.metadata.message_id: self._sent[m.metadata.dst_node_id] for m in msgs
                          if m.metadata.message_id and m.metadata.dst_node_id in self._sent}

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []  # a posterior sampler has no client-side evaluation round

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    # ---- the run ------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        """Handshake, θ* phase, then Flower's round loop over the sampling rounds.

        ``initial_arrays``: ``θ_0`` (default: the task's); ``num_rounds``: ``K`` (default:
        ``num-rounds``); ``timeout``: seconds to wait for replies (default: ``reply-timeout``);
        ``train_config``: sent to the clients with every round's message; ``evaluate_fn(round,
        arrays)``: called by Flower before the first round and after each with the current
        ``θ`` (Flower counts the rounds of this start from 1: after a resume at round ``k_0``,
        its round ``r`` is the chain's ``θ_{k_0 + r}``).
        ``evaluate_config`` has no use here (there is no client-side evaluation round) and is
        refused. Returns Flower's ``Result`` with ``arrays`` = the last sample ``θ_K``.
        """
        try:
            return self._start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                               evaluate_fn)
        except DivergenceError as exc:
            if self.failure_sink is not None:
                self.failure_sink["error"] = exc
            raise

    def _start(self, grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
               evaluate_fn) -> Result:
        cfg = self.cfg
        if evaluate_config is not None and len(evaluate_config):
            raise ValueError("evaluate_config: QLSDStrategy has no client-side evaluation round; "
                             "evaluate θ_k on the server with evaluate_fn(round, arrays)")
        resuming = resume_dir(cfg) is not None
        if resuming and initial_arrays is not None:
            raise ValueError("initial_arrays: a resumed run continues from its checkpoint's θ; "
                             "pass no initial_arrays with resume")
        theta0 = None if initial_arrays is None else theta_from_arrays(initial_arrays, self.d)
        self._timeout = cfg.reply_timeout if timeout is None else float(timeout)
        K = cfg.num_rounds if num_rounds is None else int(num_rounds)
        self._grid = grid
        self.nodes.handshake(grid, self._timeout)
        theta_star, ts_info = (None, {}) if resuming else resolve_theta_star(  # resume: θ* is in the checkpoint
            cfg, self.task, build.theta0_of(self.task) if theta0 is None else theta0,
            lambda th: self._full_grad(grid, th, self._timeout))
        self.server.begin(theta_star, ts_info, theta0)
        saved = self.server.persist.get("rejoined", {})
        self.nodes.rejoined.update({int(i): list(r) for i, r in saved.items()})
        self.server.persist["rejoined"] = self.nodes.rejoined  # kept in the checkpoints
        self._bar = progress_bar(K, cfg.progress, f"{cfg.variant} {self.server.engine_label}")
        self._bar.update(self.state.k)
        try:
            result = super().start(_RepliesAsTheyArrive(grid, self._note_sent),
                                   ArrayRecord({"theta": Array(np.asarray(self.state.theta))}),
                                   num_rounds=max(K - self.state.k, 0), timeout=self._timeout,
                                   train_config=train_config, evaluate_fn=evaluate_fn)
        finally:
            self._bar.close()
        extra: dict = {"rejoined": {str(i): r for i, r in sorted(self.nodes.rejoined.items())}}
        if cfg.memory:
            extra["memory_check"] = self.server.memory_check(self.nodes.memory_reports(grid, self._timeout))
        self.server.ts_info = {**self.server.ts_info, **extra}  # finish() puts ts_info in the summary
        self.server.finish()
        result.arrays = ArrayRecord({"theta": Array(np.asarray(self.state.theta))})
        return result

    def _full_grad(self, grid: Grid, theta: np.ndarray, timeout: float) -> np.ndarray:
        """``∇U(θ)`` from every client's full local gradient (the θ* optimisation phase)."""
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"phase": "grad", "round": -1, "client": i,
                                                          "theta": arr_to_bytes(theta)})}),
                        self.nodes.node_of[i], MessageType.TRAIN) for i in range(self.cfg.b)]
        grads: dict[int, np.ndarray] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if not msg.has_error():
                rec = config_record(msg.content)
                grads[int(rec["client"])] = bytes_to_arr(rec["payload"], self.d)
        if len(grads) != self.cfg.b:
            raise RuntimeError(f"optimisation phase: {self.cfg.b - len(grads)} clients did not answer")
        return build.combine_grads(self.cfg, self.task.prior, [grads[i] for i in range(self.cfg.b)], theta)
