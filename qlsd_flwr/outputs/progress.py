"""Progress of a long run: a tqdm bar in a terminal, one-line summaries in a log, or nothing.

Where standard error is not a terminal (``flwr log``, a CI log, a file), a bar's carriage-return
redraws would arrive as one long stream of fragments; there a line is written every
``interval`` seconds and at the end instead, each readable on its own.
"""

from __future__ import annotations

import sys
import time


_SINK = None  # where lines go instead of a stream (set_sink): Flower's log under `flwr run`


def set_sink(sink) -> None:
    """Send every progress and announcement line to ``sink(line)`` instead of standard error
    (``None``: back to standard error). The ``flwr run`` ServerApp sets Flower's logger here: a
    deployment's ServerApp process does not copy standard error into ``flwr log``, Flower's
    logger reaches it on every path."""
    global _SINK
    _SINK = sink


class _SinkStream:
    def write(self, text: str) -> None:
        if _SINK is not None and text.strip():
            _SINK(text.rstrip("\n"))

    def flush(self) -> None:
        pass


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


class _Lines:
    """``desc: 120/400 rounds (30 %), 5.3 rounds/s, 23 s`` every ``interval`` seconds and at the end."""

    def __init__(self, total: int, desc: str, stream, interval: float):
        self.total, self.desc, self.stream, self.interval = int(total), desc, stream, float(interval)
        self.n = self._shown = 0
        self._t0 = self._last = time.monotonic()
        self.postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += int(n)
        now = time.monotonic()
        if now - self._last >= self.interval or self.n >= self.total:
            self._line(now)

    def set_postfix(self, values: dict, refresh: bool = False) -> None:
        self.postfix = ", " + ", ".join(f"{k} {v}" for k, v in values.items())

    def close(self) -> None:
        if self.n != self._shown:
            self._line(time.monotonic())

    def _line(self, now: float) -> None:
        dt = max(now - self._t0, 1e-9)
        pct = 100.0 * self.n / max(self.total, 1)
        self.stream.write(f"{self.desc}: {self.n}/{self.total} rounds ({pct:.0f} %), "
                          f"{self.n / dt:.1f} rounds/s, {dt:.0f} s{self.postfix}\n")
        self.stream.flush()
        self._shown, self._last = self.n, now


def progress_bar(total: int, enabled: bool, desc: str, stream=None, interval: float = 15.0):
    """A tqdm bar (rounds per second) when ``stream`` (default: standard error) is a terminal,
    one-line summaries every ``interval`` seconds when it is not, nothing when not ``enabled``."""
    if not enabled:
        return _Silent()
    if stream is None and _SINK is not None:
        return _Lines(total, desc, _SinkStream(), interval)
    stream = sys.stderr if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return _Lines(total, desc, stream, interval)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="round", file=stream, dynamic_ncols=True,
                mininterval=0.5, smoothing=0.05)


def announce(message: str, enabled: bool, stream=None) -> None:
    """One line beside the progress display (where a run writes, what it wrote): the place a
    user of ``flwr log`` looks."""
    if enabled:
        stream = stream or (_SinkStream() if _SINK is not None else sys.stderr)
        stream.write(message + "\n")
        stream.flush()
