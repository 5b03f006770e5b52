"""``QLSDStrategy``: the QLSD family as a Flower Message-API strategy.

The strategy only translates: ``configure_train`` turns the chain's state into one message
per active client, ``aggregate_train`` validates and decodes the replies and hands them to
:func:`qlsd_flwr.sampler.server_step`. All numerics live in the framework-free core.

Parameters (all from the run config, see :mod:`qlsd_flwr.config`):
    variant (``qlsd-pp``), gamma γ (4.9e-4), p ``p_i`` (1.0), s ``s_i`` (16), aggregation
    (``unbiased``), l (100), alpha α (``auto`` = 1/(ω+1)), batch-fraction (0.1), prior-var
    (``flat``), prior-on (``server``), theta-star (``closed-form``), num-rounds K (2000),
    burn-in (500), thin (1), seed (0), reply-timeout (600 s).

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
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from . import components as C
from . import participation, sampler
from .compression import DecodeError
from .config import RunConfig
from .engine import optimise_theta_star, summary_extra
from .outputs import Recorder, make_run_dir
from .progress import progress_bar
from .tasks.base import Task
from .wire import RECORD, ReplyError, arr_to_bytes, bytes_to_arr, parse_reply

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
        self.cfg = cfg
        self.task = task
        self.d = task.dim
        self.blocks = C.blocks_for(cfg, task)
        self.compressors = [C.compressor_for(cfg, i, self.blocks) for i in range(cfg.b)]
        self.node_of: dict[int, int] = {}
        self.write = write
        self.run_dir = run_dir
        self.keep_trace = keep_trace
        self.trace: list[np.ndarray] = []
        self.on_round = on_round  # test hook: called with (strategy) after each round
        self.spec: sampler.ServerSpec | None = None
        self.state: sampler.ServerState | None = None
        self.recorder: Recorder | None = None
        self.anchor_acked = np.full(cfg.b, -2, dtype=np.int64)  # anchor version each client holds
        self.eta_count = np.zeros(cfg.b, dtype=np.int64)
        self.needs_resync = np.zeros(cfg.b, dtype=bool)
        self.rejected: dict[str, int] = {}
        self.missed_rounds: dict[int, list[int]] = {}
        self._active = np.zeros(cfg.b, dtype=bool)
        self._sent: dict[int, int] = {}
        self._sent_ids: dict[str, int] = {}  # message id -> client, to attribute SuperLink errors
        self._foreign: set[int] = set()  # nodes that are none of our clients
        self.rejoined: dict[int, list[int]] = {}  # client -> rounds it came back as a new node
        self.summary_data: dict = {}
        self.engine_label = engine_label

    # ---- Flower Strategy interface -------------------------------------------------
    def summary(self) -> None:
        c = self.cfg
        log.info("QLSDStrategy variant=%s b=%d d=%d gamma=%g K=%d s=%s p=%s rule=%s", c.variant,
                 c.b, self.d, c.gamma, c.num_rounds, c.s.tolist(), c.p.tolist(), c.aggregation)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per active client ``i ∈ A_{k+1}``, with ``k = server_round − 1``."""
        st, k = self.state, server_round - 1
        anchor, version = self._anchor()
        msgs = []
        self._sent = {}
        for i in np.flatnonzero(self._active):
            fields = {"phase": "sample", "round": k, "client": int(i), "theta": arr_to_bytes(st.theta),
                      "anchor_version": int(version), "eta_count": int(self.eta_count[i])}
            if anchor is not None and (self.anchor_acked[i] != version or self.needs_resync[i]):
                fields["anchor"] = arr_to_bytes(anchor)
            if self.cfg.memory and self.needs_resync[i]:
                fields["eta"] = arr_to_bytes(st.eta_i[i])
            msg = Message(RecordDict({RECORD: ConfigRecord(fields)}), self.node_of[int(i)],
                          MessageType.TRAIN, group_id=str(server_round))
            msgs.append(msg)
            self._sent[self.node_of[int(i)]] = int(i)
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and decode replies, then take the server step for round ``k``."""
        g_hat: dict[int, np.ndarray] = {}
        bits_bound = bits_exact = nbytes = nmsg = 0
        n_rejected = 0
        _, version = self._anchor()
        answered = set()
        for msg in replies:
            node = msg.metadata.src_node_id
            i = self._sent.get(node)
            if i is None and msg.has_error():  # e.g. NODE_UNAVAILABLE, sent by the SuperLink itself
                i = self._sent_ids.get(msg.metadata.reply_to_message_id)
            if i is None or i in answered:
                n_rejected += self._reject("unexpected_sender")
                continue
            answered.add(i)
            if msg.has_error():
                n_rejected += self._reject("client_error")
                continue
            try:
                rep = parse_reply(msg.content, i)
                if rep["status"] == "resync":
                    self.needs_resync[i] = True
                    self._count("resync")
                    continue
                comp = self.compressors[i]
                q = comp.decode(rep["payload"], self.d)
                g = comp.dequantise(q)
                if not np.all(np.isfinite(g)):
                    raise ReplyError("non-finite values")
            except (ReplyError, DecodeError) as exc:
                n_rejected += self._reject("malformed" if isinstance(exc, ReplyError) else "decode_error")
                log.debug("client %d: rejected reply: %s", i, exc)
                continue
            g_hat[i] = g
            self.anchor_acked[i] = rep["anchor_version"]
            self.needs_resync[i] = False
            if self.cfg.memory:
                self.eta_count[i] += 1
            bits_bound += comp.bound_bits(self.d)
            bits_exact += comp.code_length_bits(q)
            nbytes += len(rep["payload"])
            nmsg += message_nbytes(msg)
        for i in set(self._sent.values()) - answered:
            n_rejected += self._reject("no_reply")
        for i in set(self._sent.values()) - set(g_hat):
            self.missed_rounds.setdefault(i, []).append(server_round)
        facts = sampler.server_step(self.spec, self.state, self.cfg.seed, g_hat)
        row = {"round": server_round, "n_active": len(self._sent), "n_replied": len(g_hat),
               "n_rejected": n_rejected, "skipped": int(facts["skipped"]), "bits_bound": bits_bound,
               "bits_exact": bits_exact, "bytes_payload": nbytes, "bytes_message": nmsg}
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
        theta0 = C.theta0_of(self.task)
        ts_info: dict = {}
        theta_star = None
        if C.needs_theta_star(cfg):
            if cfg.theta_star == "closed-form":
                theta_star, ts_info = C.closed_form_theta_star(cfg, self.task), {"theta_star": "closed-form"}
            else:
                theta_star, r = optimise_theta_star(cfg, self.task, theta0, lambda th: self._full_grad(grid, th, timeout))
                ts_info = {"theta_star": "optimise", "opt_rounds": r}
        self.spec = C.server_spec(cfg, self.task, theta_star, self.blocks)
        self.state = sampler.init_state(self.spec, theta0)
        if self.write:
            self.run_dir = self.run_dir or make_run_dir(cfg.get("output-dir"), cfg.get("run-name"), cfg.variant)
            self.recorder = Recorder(self.run_dir, cfg.to_dict(), self.d, 1, cfg.burn_in, cfg.thin)
        bar = progress_bar(K, bool(cfg.get("progress")), f"{cfg.variant} flower")
        result = Result()
        for k in range(K):
            t0 = time.perf_counter()
            sampler.refresh_anchor(self.spec, self.state)
            self._active = participation.active_mask(cfg.seed, k, cfg.p)
            self.rediscover(grid, k + 1, timeout)
            msgs = list(self.configure_train(k + 1, ArrayRecord(), ConfigRecord(), grid))
            replies = grid.send_and_receive(msgs, timeout=timeout)
            self._sent_ids = {m.metadata.message_id: self._sent[m.metadata.dst_node_id] for m in msgs
                              if m.metadata.message_id}
            _, metrics = self.aggregate_train(k + 1, replies)
            row = {key: metrics[key] for key in metrics}
            row["seconds"] = time.perf_counter() - t0
            if self.keep_trace:
                self.trace.append(self.state.theta.copy())
            if self.recorder is not None:
                self.recorder.record_round(row)
                self.recorder.record_sample(k + 1, self.state.theta)
            if self.on_round is not None:
                self.on_round(self)
            bar.update(1)
        bar.close()
        extra = {"engine": self.engine_label, **ts_info, "rejected": dict(self.rejected),
                 "missed_rounds": {str(i): r for i, r in sorted(self.missed_rounds.items())},
                 "rejoined": {str(i): r for i, r in sorted(self.rejoined.items())}}
        if cfg.memory:
            extra["memory_check"] = self.check_memory(grid, timeout)
        extra = summary_extra(cfg, self.task, extra)
        self.summary_data = self.recorder.close(extra) if self.recorder is not None else extra
        result.arrays = ArrayRecord({"theta": _array(self.state.theta)})
        return result

    def handshake(self, grid: Grid, timeout: float) -> None:
        """Wait for the ``b`` clients and map client index → node id (``partition-id``)."""
        wait = min(timeout, float(self.cfg.get("reply-timeout")))
        deadline = time.time() + wait
        b = self.cfg.b
        while True:
            nodes = list(grid.get_node_ids())
            if len(nodes) >= b:
                break
            if time.time() > deadline:
                raise HandshakeError(
                    f"expected {b} client nodes, only {len(nodes)} connected after {wait:.0f} s "
                    f"(check num-clients and the SuperNodes: each needs --node-config "
                    f"'partition-id=<i> num-partitions={b}'; the wait is reply-timeout)")
            time.sleep(0.5)
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"hello": 1})}), n, MessageType.QUERY) for n in nodes]
        replies = grid.send_and_receive(msgs, timeout=timeout)
        seen: dict[int, int] = {}
        for msg in replies:
            if msg.has_error():
                raise HandshakeError(f"node {msg.metadata.src_node_id} failed the handshake: {msg.error}")
            rec = msg.content.config_records[RECORD]
            i, d = int(rec["client"]), int(rec["dim"])
            if d != self.d:
                raise HandshakeError(f"client {i} has dim {d}, the server expects {self.d}")
            if i in seen:
                raise HandshakeError(f"two nodes claim partition-id {i}")
            seen[i] = msg.metadata.src_node_id
        missing = sorted(set(range(b)) - set(seen))
        if missing:
            raise HandshakeError(f"no node answered for partition-id(s) {missing}; "
                                 f"got {sorted(seen)} (num-clients = {b})")
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
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"hello": 1})}), n, MessageType.QUERY)
                for n in sorted(new)]
        self._foreign |= new
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            node = msg.metadata.src_node_id
            if msg.has_error() or node not in new:
                continue
            try:
                rec = msg.content.config_records[RECORD]
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
        st = self.state
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"hello": 1, "report": "memory"})}),
                        self.node_of[i], MessageType.QUERY) for i in range(self.cfg.b)]
        got: dict[int, tuple[np.ndarray, int]] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if msg.has_error():
                continue
            try:
                rec = msg.content.config_records[RECORD]
                i = int(rec["client"])
                if self.node_of.get(i) != msg.metadata.src_node_id:
                    continue
                eta = bytes_to_arr(rec["eta"], self.d) if "eta" in rec else np.zeros(self.d)
                got[i] = (eta, int(rec.get("eta_count", 0)))
            except (KeyError, TypeError, ValueError):
                continue
        out: dict = {"clients_reported": sorted(got), "max_abs_eta": float(np.max(np.abs(st.eta))),
                     "eta_count_agrees": {str(i): bool(c == self.eta_count[i]) for i, (_, c) in sorted(got.items())}}
        if got:
            out["max_abs_mirror_diff"] = float(max(np.max(np.abs(st.eta_i[i] - e)) for i, (e, _) in got.items()))
        if len(got) == self.cfg.b:
            total = np.sum([got[i][0] for i in range(self.cfg.b)], axis=0)
            out["max_abs_eta_minus_sum"] = float(np.max(np.abs(st.eta - total)))
        if out.get("max_abs_mirror_diff", 0.0) > 1e-9 * (1.0 + float(np.max(np.abs(st.eta_i)))):
            log.warning("memory check: server mirrors and clients' η_i differ: %s", out)
        return out

    # ---- helpers ------------------------------------------------------------------------
    def _anchor(self):
        if self.cfg.oracle == "svrg":
            return self.state.zeta, self.state.zeta_version
        if self.cfg.oracle == "star":
            return self.spec.theta_star, 0
        return None, -1

    def _full_grad(self, grid: Grid, theta: np.ndarray, timeout: float) -> np.ndarray:
        """``∇U(θ)`` from every client's full local gradient (the θ* optimisation phase)."""
        msgs = [Message(RecordDict({RECORD: ConfigRecord({"phase": "grad", "round": -1, "client": i,
                                                          "theta": arr_to_bytes(theta)})}),
                        self.node_of[i], MessageType.TRAIN) for i in range(self.cfg.b)]
        grads: dict[int, np.ndarray] = {}
        for msg in grid.send_and_receive(msgs, timeout=timeout):
            if msg.has_error():
                continue
            rec = msg.content.config_records[RECORD]
            grads[int(rec["client"])] = bytes_to_arr(rec["payload"], self.d)
        if len(grads) != self.cfg.b:
            raise RuntimeError(f"optimisation phase: {self.cfg.b - len(grads)} clients did not answer")
        return C.combine_grads(self.cfg, self.task.prior, [grads[i] for i in range(self.cfg.b)], theta)

    def _reject(self, why: str) -> int:
        self._count(why)
        return 1

    def _count(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1


def _array(x: np.ndarray):
    from flwr.app import Array

    return Array(np.asarray(x))
