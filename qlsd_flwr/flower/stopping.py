"""Closing a run's outputs when Flower stops its process (``flwr stop``, SIGTERM), or when our CLI
is sent SIGTERM or SIGINT while the run goes on in Flower's ServerApp thread (``engine = ray``).

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

Our CLI's own SIGTERM and SIGINT handlers (:mod:`qlsd_flwr.outputs.stopsignal`) ask the same way
while a run goes on in another thread: raised in the main thread, their ``KeyboardInterrupt``
left that run waiting for replies, and the process hung at exit. The run closes its outputs, ends
with :class:`RunStopped` (Flower passes an ``Exception`` from its thread on to ``run_simulation``'s
caller), and the Ray engine raises the ``KeyboardInterrupt`` in the main thread.
"""

from __future__ import annotations

import threading

from qlsd_flwr.flower.logs import quiet_errors
from qlsd_flwr.outputs import stopsignal

WAIT_S = 120.0  # the longest the handler holds Flower's exit while the outputs close
_active: "Stopper | None" = None
_registered = False


class RunStopped(Exception):
    """A run in Flower's ServerApp thread was stopped by a signal to our CLI and has closed its
    outputs. Flower passes an ``Exception`` from that thread on to ``run_simulation``'s caller (a
    ``KeyboardInterrupt`` would die in the thread), whose engine raises the ``KeyboardInterrupt``."""


class Stopper:
    """The run in progress in this process, while its ``with`` block lasts."""

    def __init__(self):
        self.requested = threading.Event()
        self.closed = threading.Event()
        self.thread: threading.Thread | None = None
        self.reason = "the run was stopped by Flower (flwr stop or SIGTERM)"

    def __enter__(self) -> "Stopper":
        global _active
        _register()
        quiet_errors(False)  # an earlier stop's teardown is over
        self.thread = threading.current_thread()
        _active = self
        if self.thread is not threading.main_thread():  # our CLI's SIGTERM/SIGINT: stop here, not there
            stopsignal.forward_to(self.request)
        return self

    def __exit__(self, *exc) -> None:
        global _active
        self.closed.set()
        if _active is self:
            _active = None
            stopsignal.forward_to(None)

    def request(self, reason: str) -> None:
        """Stop at the next :func:`check` with ``KeyboardInterrupt(reason)``."""
        self.reason = reason
        quiet_errors(True)  # Flower's in-flight messages die with their actors: their tracebacks are the stop's
        self.requested.set()


def check() -> None:
    """``KeyboardInterrupt`` when Flower or a signal to our CLI has asked the run in progress to stop."""
    run = _active
    if run is not None and run.requested.is_set():
        raise KeyboardInterrupt(run.reason)


def hand_over(exc: BaseException, sink: dict | None) -> None:
    """Raise the error or stop (``KeyboardInterrupt``) that ended a run whose outputs are closed,
    left in ``sink["error"]`` (the Ray engine's failure sink) for the engine to raise. A stop in
    Flower's ServerApp thread goes as :class:`RunStopped`, which Flower passes on."""
    if sink is not None:
        sink["error"] = exc
        if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is not threading.main_thread():
            raise RunStopped(str(exc)) from None
    raise exc


def stop_in_thread(reason: str) -> bool:
    """Ask a run going on in another thread to stop, and wait until its outputs are closed; ``False``
    when there is none. (``ray.init`` in the main thread makes SIGTERM ``sys.exit(15)`` there, past
    our CLI's handler: the Ray engine then stops its ServerApp's run with this.)"""
    run = _active
    if run is None or run.thread is threading.current_thread():
        return False
    run.request(reason)
    run.closed.wait(WAIT_S)
    return True


def _on_exit() -> None:
    run = _active
    if run is not None and not stop_in_thread(run.reason):
        run.request(run.reason)  # in the run's own thread: only ask (Flower's sys.exit then reaches it)


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
