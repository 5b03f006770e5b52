"""An in-process Flower ``Grid``: the real ClientApp, Message and record classes, no engine.

Each virtual node has its own :class:`flwr.app.Context` (``partition-id`` in its node
config, a persistent ``state``), and ``send_and_receive`` calls the ``ClientApp`` directly.
Messages can be processed and returned in a shuffled order (``shuffle_seed``) to show that
the chain does not depend on it. A ClientApp exception becomes an error reply, as in Flower.
"""

from __future__ import annotations

import copy
import random
from typing import Callable, Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity


class InProcessGrid(Grid):
    """A Grid whose nodes run ``client_app`` in this process."""

    all_nodes_at_start = True  # the handshake has no later node to wait for

    def __init__(self, client_app: ClientApp, num_nodes: int, run_config: dict | None = None,
                 shuffle_seed: int | None = None, node_id_base: int = 7_000_000,
                 is_up: Callable[[int, int], bool] | None = None):
        self.client_app = client_app
        self.node_ids = [node_id_base + 97 * i for i in range(num_nodes)]
        self.contexts = {
            nid: Context(run_id=1, node_id=nid, node_config={"partition-id": i, "num-partitions": num_nodes},
                         state=RecordDict(), run_config=dict(run_config or {}))
            for i, nid in enumerate(self.node_ids)
        }
        self._rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(run_id=1) if hasattr(Run, "create_empty") else None
        self.is_up = is_up  # is_up(node_index, call_number) -> whether the node answers
        self.calls = 0
        # what Flower's runtime sets for a ServerApp process before ``main`` runs
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        if self._rng is not None:
            self._rng.shuffle(msgs)
        ids = []
        self.calls += 1
        for msg in msgs:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            ids.append(msg.metadata.message_id)
            index = self.node_ids.index(msg.metadata.dst_node_id)
            if self.is_up is not None and not self.is_up(index, self.calls):
                continue  # the node is down: no reply ever comes
            # like Flower's engine: the ClientApp works on a copy of the context, which is kept
            # only if it succeeds; an exception becomes an error reply. The configs hold scalars
            # only, so a dict copy is a whole copy (deep-copying ~100 keys a message was an eighth
            # of an in-process run's time)
            src = self.contexts[msg.metadata.dst_node_id]
            ctx = copy.copy(src)  # every other field as it is (run_id, node_id, series_id, ...)
            ctx.state, ctx.run_config = copy.deepcopy(src.state), dict(src.run_config)
            ctx.node_config = dict(src.node_config)
            try:
                reply = self.client_app(msg, ctx)
                self.contexts[msg.metadata.dst_node_id] = ctx
            except Exception as exc:
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            self._replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = [self._replies.pop(m) for m in list(message_ids) if m in self._replies]
        if self._rng is not None:
            self._rng.shuffle(out)
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = self.push_messages(messages)
        return self.pull_messages(ids)

    def reset_node(self, index: int) -> None:
        """Wipe a node's state, as when a SuperNode restarts."""
        nid = self.node_ids[index]
        self.contexts[nid].state = RecordDict()
