"""The package's errors in Flower's log as one line each, on every path that imports
:mod:`qlsd_flwr.flower`: the repository's ServerApp and a user's own (its ``QLSDStrategy`` raising
a ``ConfigError`` that names the key)."""

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


def one_line_errors() -> None:
    flwr_log = logging.getLogger("flwr")
    if not any(isinstance(f, OneLineErrors) for f in flwr_log.filters):
        flwr_log.addFilter(OneLineErrors())
