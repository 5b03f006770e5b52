"""Rounds per second of the Flower strategy and ClientApp over the in-process grid: real Flower
messages and records, no engine and no polling, so the per-message CPU cost shows undiluted.

    python benchmarks/bench_inprocess.py [--clients 20] [--rounds 300] [--repeats 3] [--messages]

Run it from two checkouts (``PYTHONPATH=<checkout> python benchmarks/bench_inprocess.py``) to
compare codes on one machine; the first repeat warms up (imports, numba cache).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.smoke import small  # noqa: E402
from qlsd_flwr.run.simulate import run  # noqa: E402


def message_costs(n: int = 2000, d: int = 50) -> None:
    """Flower's cost to build, serialise and parse one server → client message, three shapes:
    θ as bytes in a ``ConfigRecord`` (before), in an ``ArrayRecord``, and with the settings record."""
    import numpy as np
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.supercore.task_identity import TaskIdentity

    from qlsd_flwr.config import resolve
    from qlsd_flwr.core.potential import GaussianPrior
    from qlsd_flwr.flower.records import to_content
    from qlsd_flwr.protocol.build import client_settings

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    theta = np.random.default_rng(0).random(d)
    settings = client_settings(resolve({}), 0, d, GaussianPrior())
    fields = {"phase": "sample", "round": 3, "client": 1, "theta": theta, "anchor_version": 0, "eta_count": 3}
    shapes = {"theta as bytes in a ConfigRecord": lambda: RecordDict({"qlsd": ConfigRecord(
                  {**fields, "theta": theta.astype("<f8").tobytes()})}),
              "theta in an ArrayRecord": lambda: to_content(fields),
              "ArrayRecord + settings record": lambda: to_content(fields, settings)}
    for name, make in shapes.items():
        t = time.perf_counter()
        for _ in range(n):
            proto = message_to_proto(Message(make(), 5, MessageType.TRAIN))
            message_from_proto(proto)
        print(f"{name}: {(time.perf_counter() - t) / n * 1e6:.0f} µs a message, {len(proto.SerializeToString())} bytes")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", action="store_true", help="also time one message's shapes (Flower's cost)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    a.rounds, a.repeats = small(a.rounds, 12), small(a.repeats, 1)
    if a.messages:
        message_costs(small(2000, 20))
    for rep in range(a.repeats):
        t = time.perf_counter()
        run({"engine": "inprocess", "num-clients": a.clients, "num-rounds": a.rounds, "burn-in": 10,
             "progress": False, "output-dir": tempfile.mkdtemp()})
        print(f"repeat {rep}: {a.rounds / (time.perf_counter() - t):.1f} rounds/s")


if __name__ == "__main__":
    main()
