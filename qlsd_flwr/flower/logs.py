"""The package's errors in Flower's log as one line each, on every path that imports
:mod:`qlsd_flwr.flower`: the repository's ServerApp and a user's own (its ``QLSDStrategy`` raising
a ``ConfigError`` that names the key); and none of Flower's errors while a stop tears a simulation down."""

from __future__ import annotations

import logging


class OneLineErrors(logging.Filter):
    """Flower logs an app's exception with its traceback (``flwr log``: 20 lines and more, the
    message at the bottom). For this package's own errors, which name the key, node or file at
    fault, the record becomes one line: Flower's message, the error's type and its text."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and type(exc).__module__.startswith("qlsd_flwr."):
            record.msg, record.args = f"{record.getMessage()}: {type(exc).__name__}: {exc}", ()
            record.exc_info, record.exc_text = None, None
        return True


_stopping = False


#: what Flower's Ray backend and its workers log for a message in flight when its actor is torn down
TEARDOWN = ("ActorDiedError", "RayActorError", "The actor died", "The actor is dead",
            "An exception was raised when processing a message by RayBackend")


class QuietWhileStopping(logging.Filter):
    """Flower's simulation workers log an ERROR with a traceback for each message in flight when a stop (SIGTERM,
    Ctrl-C, ``flwr stop``) tears their Ray actors down (``ActorDiedError``: a matter of timing, seen in the SIGTERM
    test). Those are the stop's, not the run's, whose folder says it was stopped: from the stop
    (:func:`quiet_errors`) until the next run starts, those records (:data:`TEARDOWN`) are dropped; every other
    error, a failure to close the run's outputs included, still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _stopping or record.levelno < logging.ERROR:
            return True
        text = record.getMessage()
        return not any(t in text for t in TEARDOWN)


def quiet_errors(on: bool) -> None:
    """Drop Flower's errors about actors torn down under a message (``True``: a stop was asked for), or let them
    through again (a run starts)."""
    global _stopping
    _stopping = bool(on)


def one_line_errors() -> None:
    flwr_log = logging.getLogger("flwr")
    for kind in (OneLineErrors, QuietWhileStopping):
        if not any(isinstance(f, kind) for f in flwr_log.filters):
            flwr_log.addFilter(kind())
