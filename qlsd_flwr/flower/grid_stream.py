"""The grid Flower's round loop sees on a real grid: replies handed over *as they arrive*.

Flower's ``send_and_receive`` pushes a round's messages, then returns once every reply is in (its
deployment grid sleeps a fixed 3 s between polls in Flower 1.42). :class:`RepliesAsTheyArrive`
keeps the same push, then pull, but yields each reply as a poll brings it in, waiting 5 ms after
a poll that brought one and doubling the wait after each empty poll, up to the grid's
``pull_interval`` (or 0.1 s on the deployment's grid). Decoding then overlaps the clients still
at work, and a reply is taken within a few ms of its arrival. The in-process test grid keeps its
own ``send_and_receive``. The chain does not depend on the order replies are taken in.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator

from flwr.app import Message
from flwr.serverapp import Grid

from qlsd_flwr.flower import stopping

FIRST_POLL_S = 0.005  # the reply poll's shortest wait (see RepliesAsTheyArrive._stream)
DEPLOY_POLL_S = 0.1  # its longest on a Flower grid without pull_interval (the SuperLink's)


class RepliesAsTheyArrive:
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
        if interval is None and type(self._grid).__module__.startswith("flwr."):
            interval = DEPLOY_POLL_S  # Flower's deployment grid: its own loop sleeps 3 s between polls
        if interval is None:
            replies = self._grid.send_and_receive(msgs, timeout=timeout)
            self._on_pushed(msgs)
            return replies
        return self._stream(msgs, timeout, interval)

    def _stream(self, msgs: list[Message], timeout: float | None, interval: float) -> Iterator[Message]:
        pending = {m for m in self._grid.push_messages(msgs) if m}  # Flower marks unpushable ones None
        self._on_pushed(msgs)
        end = None if timeout is None else time.time() + timeout
        wait = FIRST_POLL_S
        while pending:
            stopping.check()
            arrived = False
            for msg in self._grid.pull_messages(pending):
                pending.discard(msg.metadata.reply_to_message_id)
                arrived = True
                yield msg
            if not pending or (end is not None and time.time() >= end):
                return
            # Replies of a round come in a stream: poll again soon after one came, back off
            # (10, 20, 40 ms, ...) while none comes, never slower than Flower's own interval. A
            # flat ``interval`` (0.1 s) left the round's last reply waiting 0.05 s on average.
            wait = FIRST_POLL_S if arrived else min(interval, 2 * wait)
            time.sleep(min(wait, interval))
