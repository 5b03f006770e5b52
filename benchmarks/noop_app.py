"""The Flower apps the benchmarks compare against. No QLSD code in either.

* ``noop_apps``: every round the ServerApp sends each node an empty TRAIN message and the
  ClientApp answers a one-field reply.
* ``shape_apps``: the same loop, but every message, reply and ``context.state`` has the
  shape QLSD++'s have (the same records, field names, types and byte lengths: θ as 8d bytes
  out, a coded payload back, η_i, ζ and ∇U_i(ζ) kept in ``context.state``), with no numerics:
  what Flower itself costs to carry QLSD++'s traffic and client state, i.e. the floor under
  any implementation of the protocol.
"""

from __future__ import annotations

import time


def _server_app(rounds: int, b: int, on_round, content_for, read_reply=None):
    """A ServerApp that waits for ``b`` nodes, then for ``rounds`` rounds sends node ``i`` a TRAIN
    message with ``content_for(r, i)``, hands each reply to ``read_reply`` and calls
    ``on_round(r, seconds)`` with the seconds the round took (messages built, ``send_and_receive``,
    replies read)."""
    from flwr.app import Context, Message, MessageType
    from flwr.serverapp import Grid, ServerApp

    server = ServerApp()

    @server.main()
    def main(grid: Grid, ctx: Context) -> None:
        while len(list(grid.get_node_ids())) < b:
            time.sleep(0.1)
        nodes = list(grid.get_node_ids())
        for r in range(1, rounds + 1):
            t0 = time.perf_counter()
            msgs = [Message(content_for(r, i), n, MessageType.TRAIN, group_id=str(r)) for i, n in enumerate(nodes)]
            for reply in grid.send_and_receive(msgs, timeout=600):
                if read_reply is not None:
                    read_reply(reply)
            on_round(r, time.perf_counter() - t0)

    return server


def noop_apps(rounds: int, b: int, on_round):
    """``(ServerApp, ClientApp)``; ``on_round(r, seconds)`` is called after round ``r`` (1-based)
    with the seconds its ``send_and_receive`` took."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp

    client = ClientApp()

    @client.train()
    def train(msg: Message, ctx: Context) -> Message:
        return Message(RecordDict({"r": ConfigRecord({"ok": 1})}), reply_to=msg)

    return _server_app(rounds, b, on_round, lambda r, i: RecordDict()), client


def shape_apps(rounds: int, b: int, on_round, d: int = 50, payload_bytes: int = 37):
    """``(ServerApp, ClientApp)`` moving QLSD++'s message and state shapes, computing nothing."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.clientapp import ClientApp

    client = ClientApp()
    vec, payload = bytes(8 * d), bytes(payload_bytes)

    @client.train()
    def train(msg: Message, ctx: Context) -> Message:
        rec = msg.content["qlsd"]
        old = ctx.state["qlsd-state"] if "qlsd-state" in ctx.state else None
        count = int(old["eta_count"]) + 1 if old is not None else 1
        ctx.state["qlsd-state"] = ConfigRecord({"dim": d, "eta_count": count, "anchor_version": 0,
                                                "eta": vec, "anchor": vec, "anchor_grad": vec})
        return Message(RecordDict({"qlsd": ConfigRecord({"client": rec["client"], "status": "ok",
                                                         "payload": payload, "anchor_version": 0})}),
                       reply_to=msg)

    import numpy as np
    from flwr.app import Array

    from qlsd_flwr.config import resolve
    from qlsd_flwr.core.potential import GaussianPrior
    from qlsd_flwr.flower.records import to_content
    from qlsd_flwr.protocol.build import client_settings

    theta = Array(np.zeros(d))  # one per round in the strategy; the same here
    settings = client_settings(resolve({"num-clients": b, "dim": d}), 0, d, GaussianPrior())

    def content_for(r: int, i: int) -> RecordDict:
        # QLSD++'s message as the strategy builds it: θ in an ArrayRecord, the scalars, and the
        # settings in the first round only
        return to_content({"phase": "sample", "round": r - 1, "client": i, "theta": np.zeros(d),
                           "anchor_version": 0, "eta_count": r - 1}, settings if r == 1 else None, theta)

    return _server_app(rounds, b, on_round, content_for, lambda reply: dict(reply.content["qlsd"])), client
