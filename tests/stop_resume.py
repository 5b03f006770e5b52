"""A local run stopped after a round as by SIGTERM, then resumed: for the tests that check a resumed chain is
the uninterrupted one bit for bit."""

from __future__ import annotations

import pytest

from qlsd_flwr.config import resolve
from qlsd_flwr.run.simulate import run


def stopped_and_resumed(o: dict, run_dir, after: int = 12):
    """Run ``o`` (a local engine's keys, with ``run-name`` and ``checkpoint-every``) until round ``after`` ends, stop
    it there (``KeyboardInterrupt``, as the SIGTERM handler raises), and resume ``run_dir``: the resumed run."""
    import qlsd_flwr.protocol.server as server_mod
    from qlsd_flwr.engines.local import run_local

    real_end, calls = server_mod.QLSDServer.end_round, {"n": 0}

    def end_round(self):
        calls["n"] += 1
        if calls["n"] == after + 1:
            raise KeyboardInterrupt("SIGTERM")
        return real_end(self)

    server_mod.QLSDServer.end_round = end_round
    try:
        with pytest.raises(KeyboardInterrupt):
            run_local(resolve(o))
    finally:
        server_mod.QLSDServer.end_round = real_end
    return run({"resume": str(run_dir), "progress": False})
