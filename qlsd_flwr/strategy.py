"""``QLSDStrategy``: the QLSD family as a Flower Message-API strategy.

The strategy only translates: ``configure_train`` turns :class:`~qlsd_flwr.server.QLSDServer`'s
per-client fields into one ``Message`` per active client, ``aggregate_train`` hands each reply's
fields back to it. The round protocol and all numerics live in the framework-free core.

Parameters (all from the run config, see :mod:`qlsd_flwr.config`; defaults in brackets):
    variant [qlsd-pp], gamma γ [4.9e-4], p ``p_i`` [1.0], s ``s_i`` [16], aggregation
    [unbiased], l [100], alpha α [auto = 1/(ω+1)], batch-fraction [0.1], prior-var [flat],
    prior-on [server], theta-star [closed-form], num-rounds K [2000], burn-in [500], thin [1],
    seed [0], reply-timeout [600 s].

Participation is drawn per client from the counter stream ``(seed, PARTICIPATION, k, i)``,
never with Flower's ``sample_nodes``. A reply that is an error, is malformed, fails to decode
or decodes to non-finite values is rejected and counted; that client is treated as inactive
for the round and the chain goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from . import components as C
from .config import RunConfig
from .engine import optimise_theta_star
from .progress import progress_bar
from .server import QLSDServer
from .tasks.base import Task
from .wire import RECORD, arr_to_bytes, bytes_to_arr, record_fields

log = logging.getLogger("qlsd_flwr")


def message_nbytes(obj) -> int:
    """Bytes of a Flower message as it is serialised for transport (every object in its tree)."""
    total = len(obj.deflate())
    for child in (obj.children or {}).values():
        total += message_nbytes(child)
    return total


class HandshakeError(RuntimeError):
    """The expected clients did not all announce themselves."""


class QLSDStrategy(Strategy):
    """QLSD, QLSD#, QLSD*, QLSD++ and the uncompressed LSD*/LSD++/SGLD (see module docstring)."""

    def __init__(self, cfg: RunConfig, task: Task, run_dir=None, write: bool = True,
                 keep_trace: bool = False, on_round=None, engine_label: str = "flower"):
        self.cfg, self.task, self.d = cfg, task, task.dim
        self.server = QLSDServer(cfg, task, run_dir, write, keep_trace, engine_label)
        self.node_of: dict[int, int] = {}
        self.on_round = on_round  # called with the strategy after each round (tests, monitoring)
        self._sent: dict[int, int] = {}

    # the chain's facts, for callers and tests
    state = property(lambda self: self.server.state)
    trace = property(lambda self: self.server.trace)
    run_dir = property(lambda self: self.server.run_dir)
    summary_data = property(lambda self: self.server.summary_data)
    rejected = property(lambda self: self.server.rejected)
    missed_rounds = property(lambda self: self.server.missed_rounds)

    # ---- Flower Strategy interface -------------------------------------------------
    def summary(self) -> None:
        c = self.cfg
        log.info("QLSDStrategy variant=%s b=%d d=%d gamma=%g K=%d s=%s p=%s rule=%s", c.variant,
                 c.b, self.d, c.gamma, c.num_rounds, c.s.tolist(), c.p.tolist(), c.aggregation)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per active client ``i ∈ A_{k+1}`` (``k = server_round − 1``)."""
        self._sent = {}
        msgs = []
        for i in self.server.begin_round():
            node = self.node_of[i]
            msgs.append(Message(RecordDict({RECORD: ConfigRecord(self.server.fields_for(i))}), node,
                                MessageType.TRAIN, group_id=str(server_round)))
            self._sent[node] = i
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Hand each reply to the server core, then take the server step."""
        for msg in replies:
            i = self._sent.get(msg.metadata.src_node_id)
            if msg.has_error():
                self.server.accept(i, None, error=str(msg.error.reason))
            else:
                self.server.accept(i, record_fields(msg.content), message_bytes=message_nbytes(msg))
        row = self.server.end_round()
        return None, MetricRecord({k: float(v) for k, v in row.items()})

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    # ---- the sampler's loop ----------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config=None, evaluate_config=None,
              evaluate_fn=None) -> Result:
        """Handshake, optional θ* phase, then ``num-rounds`` sampling rounds."""
        cfg = self.cfg
        timeout = float(cfg.get("reply-timeout")) if timeout is None else timeout
        K = cfg.num_rounds if num_rounds is None else num_rounds
        self.handshake(grid, timeout)
        theta_star, ts_info = None, {}
        if C.needs_theta_star(cfg):
            if cfg.theta_star == "closed-form":
                theta_star, ts_info = C.closed_form_theta_star(cfg, self.task), {"theta_star": "closed-form"}
            else:
                theta_star, r = optimise_theta_star(cfg, self.task, C.theta0_of(self.task),
                                                    lambda th: self._full_grad(grid, th, timeout))
                ts_info = {"theta_star": "optimise", "opt_rounds": r}
        self.server.begin(theta_star, ts_info)
        bar = progress_bar(K, bool(cfg.get("progress")), f"{cfg.variant} {self.server.engine_label}")
        for k in range(K):
            replies = grid.send_and_receive(self.configure_train(k + 1, ArrayRecord(), ConfigRecord(), grid),
                                            timeout=timeout)
            self.aggregate_train(k + 1, replies)
            if self.on_round is not None:
                self.on_round(self)
            bar.update(1)
        bar.close()
        self.server.finish()
        result = Result()
        result.arrays = ArrayRecord({"theta": Array(np.asarray(self.state.theta))})
        return result

    def handshake(self, grid: Grid, timeout: float) -> None:
        """Wait for the ``b`` clients and map client index → node id (``partition-id``)."""
        b = self.cfg.b
        deadline = time.time() + timeout
        while len(nodes := list(grid.get_node_ids())) < b:
            if time.time() > deadline:
                raise HandshakeError(f"expected {b} client nodes, only {len(nodes)} connected after "
                                     f"{timeout:.0f} s (check num-clients and that every SuperNode is up)")
            time.sleep(0.2)
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"hello": 1})}), n, MessageType.QUERY) for n in nodes]
        seen: dict[int, int] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if msg.has_error():
                raise HandshakeError(f"node {msg.metadata.src_node_id} failed the handshake: {msg.error.reason}")
            rec = msg.content.config_records[RECORD]
            i, d = int(rec["client"]), int(rec["dim"])
            if d != self.d:
                raise HandshakeError(f"client {i} has dim {d}, the server expects {self.d}")
            if i in seen:
                raise HandshakeError(f"two nodes claim partition-id {i}")
            seen[i] = msg.metadata.src_node_id
        missing = sorted(set(range(b)) - set(seen))
        if missing:
            raise HandshakeError(f"no node answered for partition-id(s) {missing}; got {sorted(seen)} "
                                 f"(num-clients = {b})")
        self.node_of = {i: seen[i] for i in range(b)}

    def _full_grad(self, grid: Grid, theta: np.ndarray, timeout: float) -> np.ndarray:
        """``∇U(θ)`` from every client's full local gradient (the θ* optimisation phase)."""
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"phase": "grad", "round": -1, "client": i,
                                                          "theta": arr_to_bytes(theta)})}),
                        self.node_of[i], MessageType.TRAIN) for i in range(self.cfg.b)]
        grads: dict[int, np.ndarray] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if not msg.has_error():
                rec = msg.content.config_records[RECORD]
                grads[int(rec["client"])] = bytes_to_arr(rec["payload"], self.d)
        if len(grads) != self.cfg.b:
            raise RuntimeError(f"optimisation phase: {self.cfg.b - len(grads)} clients did not answer")
        return C.combine_grads(self.cfg, self.task.prior, [grads[i] for i in range(self.cfg.b)], theta)
