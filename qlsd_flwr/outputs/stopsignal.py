"""Stop signals (the CLI's SIGTERM and SIGINT) that end a run between rounds, and are never lost.

The CLI's handlers call :func:`stop_signal`. It raises ``KeyboardInterrupt`` at once, or, while a
round's metrics row and draw are being written (:func:`deferred_signals`), when that block ends, so
that a stopped run's folder has each round whole or not at all. (Masking the signal would not do:
CPython runs handlers in the main thread whichever thread the kernel hands the signal to.)

The signal stays remembered until the CLI has closed the run (:func:`clear`), and the end of every
round's block raises it again. CPython runs a handler at whatever bytecode the main thread is at; when
that is a finaliser (an object's ``__del__``, a generator closed by the collector, a weakref callback),
the ``KeyboardInterrupt`` is printed as "Exception ignored" and dropped, and the run went on: a CI
run's SIGTERM test waited 120 s on a run of 10⁷ rounds that kept running behind the suite.
"""

from __future__ import annotations

import contextlib

# open round blocks; the stop signal received, until cleared; where a run in another thread takes it
_STATE = {"depth": 0, "pending": None, "forward": None}


@contextlib.contextmanager
def deferred_signals():
    """A round's metrics row and its draw are written together or not at all: a stop signal that
    comes meanwhile, or came before and was dropped, is raised as ``KeyboardInterrupt`` when the
    block ends."""
    _STATE["depth"] += 1
    try:
        yield
    finally:
        _STATE["depth"] -= 1
        if _STATE["depth"] == 0 and _STATE["pending"] is not None:
            raise KeyboardInterrupt(_STATE["pending"])


def stop_signal(name: str) -> None:
    """From a signal handler: remember the stop and raise ``KeyboardInterrupt(name)`` now, or at
    the end of the round being written (:func:`deferred_signals`). While a run goes on in another
    thread (Flower's ServerApp under the simulation engine, see :func:`forward_to`), it is handed
    the stop instead and this thread raises nothing: that run closes its outputs and ends, and its
    engine raises the ``KeyboardInterrupt`` here."""
    _STATE["pending"] = name
    if _STATE["forward"] is not None:
        _STATE["forward"](name)
        return
    if not _STATE["depth"]:
        raise KeyboardInterrupt(name)


def forward_to(request) -> None:
    """``request(name)`` is to receive the stop signals from now on (``None``: nobody)."""
    _STATE["forward"] = request


def clear() -> None:
    """Forget a stop signal, once the run it stopped is closed (the CLI, before it returns)."""
    _STATE["pending"] = None
