"""The no-op Flower app the benchmarks compare against: every round the ServerApp sends each
node an empty TRAIN message and the ClientApp answers a one-field reply. No QLSD code."""

from __future__ import annotations

import time


def noop_apps(rounds: int, b: int, on_round):
    """``(ServerApp, ClientApp)``; ``on_round(r, seconds)`` is called after round ``r`` (1-based)
    with the seconds its ``send_and_receive`` took."""
    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    client = ClientApp()

    @client.train()
    def train(msg: Message, ctx: Context) -> Message:
        return Message(RecordDict({"r": ConfigRecord({"ok": 1})}), reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, ctx: Context) -> None:
        while len(list(grid.get_node_ids())) < b:
            time.sleep(0.1)
        nodes = list(grid.get_node_ids())
        for r in range(1, rounds + 1):
            t0 = time.perf_counter()
            msgs = [Message(RecordDict(), n, MessageType.TRAIN, group_id=str(r)) for n in nodes]
            list(grid.send_and_receive(msgs, timeout=600))
            on_round(r, time.perf_counter() - t0)

    return server, client
