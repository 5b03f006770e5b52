"""Closing a run's outputs when Flower stops its process (``flwr stop``, SIGTERM).

Flower (1.42) answers both by running its exit handlers and then ``sys.exit`` in the process's
main thread, with a 5 s force-exit timer once the first handlers have run. Under the
simulation engine the ServerApp runs in another thread, which that exit never reaches: the run
folder was left with ``draws.f8`` and a stale ``.lock``, and no ``samples.nc`` or
``summary.json``. Here one handler (registered once per process, before the force-exit timer)
asks the run in progress to stop at its next step — :func:`check`, called by the strategy every
round and every reply poll, raises ``KeyboardInterrupt`` there, and the strategy closes the
outputs as after Ctrl-C — and waits until they are closed. In the main thread (a deployment's
ServerApp process) it only asks: Flower's ``sys.exit`` then reaches the strategy, which closes
them the same way.
"""

from __future__ import annotations

import threading

WAIT_S = 120.0  # the longest the handler holds Flower's exit while the outputs close
_active: "Stopper | None" = None
_registered = False


class Stopper:
    """The run in progress in this process, while its ``with`` block lasts."""

    def __init__(self):
        self.requested = threading.Event()
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> "Stopper":
        global _active
        _register()
        self.thread = threading.current_thread()
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        self.closed.set()
        if _active is self:
            _active = None


def check() -> None:
    """``KeyboardInterrupt`` when Flower has asked the run in progress to stop."""
    run = _active
    if run is not None and run.requested.is_set():
        raise KeyboardInterrupt("the run was stopped by Flower (flwr stop or SIGTERM)")


def _on_exit() -> None:
    run = _active
    if run is None:
        return
    run.requested.set()
    if threading.current_thread() is not run.thread:
        run.closed.wait(WAIT_S)


def _register() -> None:
    global _registered
    if _registered:
        return
    try:
        from flwr.supercore.exit import add_exit_handler
    except ImportError:  # another Flower: Ctrl-C and SIGTERM of our own CLI still close the outputs
        return
    add_exit_handler(_on_exit, run_before_force_exit=True)
    _registered = True
