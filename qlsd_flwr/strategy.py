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

Checkpoint and resume (``checkpoint-every``, ``resume``; :mod:`qlsd_flwr.checkpoint`): the
server core saves and restores the chain; a resumed strategy skips the θ* phase (θ* is in the
checkpoint), starts at the checkpoint's round and sends each client the anchor and its η_i
mirror with its first message, so clients whose ``context.state`` was lost compute exactly
the replies of an uninterrupted run. A diverging chain raises
:class:`~qlsd_flwr.checkpoint.DivergenceError` (also handed to ``failure_sink["error"]``, so that
the Ray engine, which runs the ServerApp inside Flower, can re-raise it).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore.inflatable.inflatable_object import get_object_id, no_object_id_recompute

try:  # the per-context set of object ids Flower will not recompute (see message_nbytes)
    from flwr.supercore.inflatable.inflatable_object import _get_computed_object_ids as _computed_ids
except ImportError:  # pragma: no cover - another Flower layout: deflate as Flower does
    _computed_ids = None

from . import components as C
from .checkpoint import DivergenceError, resume_dir
from .config import RunConfig
from .engine import optimise_theta_star
from .progress import progress_bar
from .server import QLSDServer
from .tasks.base import Task
from .wire import RECORD, arr_to_bytes, bytes_to_arr, config_record, record_fields

log = logging.getLogger("qlsd_flwr")


def message_nbytes(obj) -> int:
    """Bytes of a Flower message as it is serialised for transport (every object in its tree).

    Each object is deflated once, children first, and its object id is set from that very
    content, inside Flower's ``no_object_id_recompute`` (what Flower itself uses when it ships
    a message), so that the parent's deflation reuses it: the same bytes as deflating the
    whole tree naively (:func:`message_nbytes_reference`, checked equal in the tests) in about
    half the time. Where Flower's id cache is not where this expects, every object is
    deflated as Flower would."""
    with no_object_id_recompute():
        return _tree_nbytes(obj)


def _tree_nbytes(obj) -> int:
    if isinstance(obj, Message):
        kids = [obj.content] if obj.has_content() else []
    elif isinstance(obj, RecordDict):
        kids = list(obj.values())
    else:
        kids = list((obj.children or {}).values())
    total = sum(_tree_nbytes(k) for k in kids)
    content = obj.deflate()
    if _computed_ids is not None:
        oid = get_object_id(content)
        obj.__dict__["_object_id"] = oid
        _computed_ids().add(oid)
    return total + len(content)


def message_nbytes_reference(obj) -> int:
    """``message_nbytes`` by deflating every object of the tree as it comes (the reference)."""
    with no_object_id_recompute():
        return _naive_nbytes(obj)


def _naive_nbytes(obj) -> int:
    return len(obj.deflate()) + sum(_naive_nbytes(c) for c in (obj.children or {}).values())


class HandshakeError(RuntimeError):
    """The expected clients did not all announce themselves."""


class QLSDStrategy(Strategy):
    """QLSD, QLSD#, QLSD*, QLSD++ and the uncompressed LSD*/LSD++/SGLD (see module docstring)."""

    def __init__(self, cfg: RunConfig, task: Task, run_dir=None, write: bool = True,
                 keep_trace: bool = False, on_round=None, engine_label: str = "flower",
                 failure_sink: dict | None = None):
        self.cfg, self.task, self.d = cfg, task, task.dim
        self.server = QLSDServer(cfg, task, run_dir, write, keep_trace, engine_label)
        self.failure_sink = failure_sink
        self.node_of: dict[int, int] = {}
        self.on_round = on_round  # called with the strategy after each round (tests, monitoring)
        self._sent: dict[int, int] = {}
        # deployment: attribute SuperLink-made error replies, find restarted SuperNodes
        self._sent_ids: dict[str, int] = {}  # message id -> client
        self._foreign: set[int] = set()  # node ids that are none of our clients (or dead ones)
        self.rejoined: dict[int, list[int]] = {}  # client -> rounds it came back as a new node

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
            self.take_reply(msg)
        return None, self.end_round()

    def take_reply(self, msg: Message) -> None:
        """Hand one reply of this round to the server core (validated, decoded or rejected)."""
        i = self._sent.get(msg.metadata.src_node_id)
        if i is None and msg.has_error():  # e.g. NODE_UNAVAILABLE, made by the SuperLink itself
            i = self._sent_ids.get(msg.metadata.reply_to_message_id)
        if msg.has_error():
            self.server.accept(i, None, error=str(msg.error.reason))
        else:
            self.server.accept(i, record_fields(msg.content), message_bytes=message_nbytes(msg))

    def end_round(self) -> MetricRecord:
        """The server step, once every reply of the round is in (or timed out)."""
        row = self.server.end_round()
        return MetricRecord({k: float(v) for k, v in row.items()})

    def exchange(self, grid: Grid, msgs: list[Message], timeout: float) -> None:
        """Send this round's messages and hand each reply to :meth:`take_reply`.

        On a grid that polls in-process (Flower's simulation engine: ``InMemoryGrid`` has a
        ``pull_interval``), replies are taken as each poll brings them in, so that decoding
        and validating them overlaps the clients still at work; ``send_and_receive`` would
        return them all at the end, and the server would then work through them while every
        client waits. The loop is ``send_and_receive``'s own: push, then pull every
        ``pull_interval`` until all have answered or ``timeout`` has passed. Other grids
        (deployment, which polls every 3 s, and the in-process test grid) use
        ``send_and_receive``. The chain does not depend on the order replies are taken in."""
        interval = getattr(grid, "pull_interval", None)
        if interval is None:
            replies = grid.send_and_receive(msgs, timeout=timeout)
            self._note_sent(msgs)
            for msg in replies:
                self.take_reply(msg)
            return
        pending = {m for m in grid.push_messages(msgs) if m}  # Flower marks unpushable ones None
        self._note_sent(msgs)
        end = time.time() + timeout
        while pending:
            for msg in grid.pull_messages(pending):
                pending.discard(msg.metadata.reply_to_message_id)
                self.take_reply(msg)
            if not pending or time.time() >= end:
                break
            time.sleep(interval)

    def _note_sent(self, msgs: list[Message]) -> None:
        self._sent_ids = {m.metadata.message_id: self._sent[m.metadata.dst_node_id] for m in msgs
                          if m.metadata.message_id}

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    # ---- the sampler's loop ----------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config=None, evaluate_config=None,
              evaluate_fn=None) -> Result:
        """Handshake, optional θ* phase, then ``num-rounds`` sampling rounds."""
        try:
            return self._start(grid, num_rounds, timeout)
        except DivergenceError as exc:
            if self.failure_sink is not None:
                self.failure_sink["error"] = exc
            raise

    def _start(self, grid: Grid, num_rounds: int | None, timeout: float | None) -> Result:
        cfg = self.cfg
        timeout = float(cfg.get("reply-timeout")) if timeout is None else timeout
        K = cfg.num_rounds if num_rounds is None else num_rounds
        self.handshake(grid, timeout)
        theta_star, ts_info = None, {}
        if C.needs_theta_star(cfg) and resume_dir(cfg) is None:  # resume: θ* is in the checkpoint
            if cfg.theta_star == "closed-form":
                theta_star, ts_info = C.closed_form_theta_star(cfg, self.task), {"theta_star": "closed-form"}
            else:
                theta_star, r = optimise_theta_star(cfg, self.task, C.theta0_of(self.task),
                                                    lambda th: self._full_grad(grid, th, timeout))
                ts_info = {"theta_star": "optimise", "opt_rounds": r}
        self.server.begin(theta_star, ts_info)
        saved = self.server.persist.get("rejoined", {})
        self.rejoined = {int(i): list(r) for i, r in saved.items()}
        self.server.persist["rejoined"] = self.rejoined  # kept in the checkpoints
        bar = progress_bar(K, bool(cfg.get("progress")), f"{cfg.variant} {self.server.engine_label}")
        bar.update(self.state.k)
        for k in range(self.state.k, K):
            self.rediscover(grid, k + 1, timeout)
            msgs = list(self.configure_train(k + 1, ArrayRecord(), ConfigRecord(), grid))
            self.exchange(grid, msgs, timeout)
            self.end_round()
            if self.on_round is not None:
                self.on_round(self)
            bar.update(1)
        bar.close()
        extra: dict = {"rejoined": {str(i): r for i, r in sorted(self.rejoined.items())}}
        if cfg.memory:
            extra["memory_check"] = self.check_memory(grid, timeout)
        self.server.ts_info = {**self.server.ts_info, **extra}  # finish() puts ts_info in the summary
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
                                     f"{timeout:.0f} s (check num-clients and that every SuperNode is up, "
                                     f"each with --node-config 'partition-id=<i> num-partitions={b}'; "
                                     f"the wait is reply-timeout)")
            time.sleep(0.2)
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"hello": 1})}), n, MessageType.QUERY) for n in nodes]
        seen: dict[int, int] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if msg.has_error():
                raise HandshakeError(f"node {msg.metadata.src_node_id} failed the handshake: {msg.error.reason}")
            rec = config_record(msg.content)
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
        self._foreign = set(nodes) - set(self.node_of.values())

    def rediscover(self, grid: Grid, server_round: int, timeout: float) -> None:
        """Map nodes that joined after the handshake (a SuperNode restarted without node
        authentication registers under a new node id): ask each new node its ``partition-id``
        and send client ``i``'s messages to it from now on. Its state is empty, so it answers
        ``resync`` and gets the anchor and the η_i mirror the round after (see :mod:`.wire`).
        Nodes that do not answer, or are none of our clients, are not asked again."""
        new = set(grid.get_node_ids()) - set(self.node_of.values()) - self._foreign
        if not new:
            return
        self._foreign |= new
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"hello": 1})}), n, MessageType.QUERY)
                for n in sorted(new)]
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            node = msg.metadata.src_node_id
            if msg.has_error() or node not in new:
                continue
            try:
                rec = config_record(msg.content)
                i, d = int(rec["client"]), int(rec["dim"])
            except (KeyError, TypeError, ValueError):
                continue
            if 0 <= i < self.cfg.b and d == self.d:
                log.info("round %d: client %d rejoined as node %d (was node %d)", server_round, i, node,
                         self.node_of.get(i, -1))
                if i in self.node_of:
                    self._foreign.add(self.node_of[i])  # the dead node's id may still look online
                self.node_of[i] = node
                self._foreign.discard(node)
                self.rejoined.setdefault(i, []).append(server_round)

    def check_memory(self, grid: Grid, timeout: float) -> dict:
        """Ask every client for its own η_i (from its ``context.state``) and compare with the
        server: ``max_abs_eta_minus_sum`` = ``max |η − Σ_i η_i^{client}|`` (when all answered)
        and ``max_abs_mirror_diff`` = ``max_i |η_i^{mirror} − η_i^{client}|``."""
        st, srv = self.state, self.server
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"hello": 1, "report": "memory"})}),
                        self.node_of[i], MessageType.QUERY) for i in range(self.cfg.b)]
        got: dict[int, tuple[np.ndarray, int]] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if msg.has_error():
                continue
            try:
                rec = config_record(msg.content)
                i = int(rec["client"])
                if self.node_of.get(i) != msg.metadata.src_node_id:
                    continue
                eta = bytes_to_arr(rec["eta"], self.d) if "eta" in rec else np.zeros(self.d)
                got[i] = (eta, int(rec.get("eta_count", 0)))
            except (KeyError, TypeError, ValueError):
                continue
        # a client not heard from since a resume (or a restart) holds no η_i yet: not comparable
        pending = sorted(i for i in got if srv.needs_resync[i])
        got = {i: v for i, v in got.items() if not srv.needs_resync[i]}
        out: dict = {"clients_reported": sorted(got), "clients_pending_resync": pending, "max_abs_eta": float(np.max(np.abs(st.eta))),
                     "eta_count_agrees": {str(i): bool(c == srv.eta_count[i]) for i, (_, c) in sorted(got.items())}}
        if got:
            out["max_abs_mirror_diff"] = float(max(np.max(np.abs(st.eta_i[i] - e)) for i, (e, _) in got.items()))
        if len(got) == self.cfg.b:
            total = np.sum([got[i][0] for i in range(self.cfg.b)], axis=0)
            out["max_abs_eta_minus_sum"] = float(np.max(np.abs(st.eta - total)))
        if out.get("max_abs_mirror_diff", 0.0) > 1e-9 * (1.0 + float(np.max(np.abs(st.eta_i)))):
            log.warning("memory check: server mirrors and clients' η_i differ: %s", out)
        return out

    def _full_grad(self, grid: Grid, theta: np.ndarray, timeout: float) -> np.ndarray:
        """``∇U(θ)`` from every client's full local gradient (the θ* optimisation phase)."""
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"phase": "grad", "round": -1, "client": i,
                                                          "theta": arr_to_bytes(theta)})}),
                        self.node_of[i], MessageType.TRAIN) for i in range(self.cfg.b)]
        grads: dict[int, np.ndarray] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if not msg.has_error():
                rec = config_record(msg.content)
                grads[int(rec["client"])] = bytes_to_arr(rec["payload"], self.d)
        if len(grads) != self.cfg.b:
            raise RuntimeError(f"optimisation phase: {self.cfg.b - len(grads)} clients did not answer")
        return C.combine_grads(self.cfg, self.task.prior, [grads[i] for i in range(self.cfg.b)], theta)
