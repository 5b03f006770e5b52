"""Deployment benchmark (issue 5): seconds per round and bytes per message on the wire.

One SuperLink and 3 SuperNodes (``--nodes``; insecure, or TLS with ``--tls``) on 127.0.0.1 (started and stopped by PID, see
:mod:`qlsd_flwr.deploy`), and in that same deployment, alternately:

* ``qlsd``: QLSD++ (d = 50, s = 16, p = 1) with ``flwr run``; seconds per round from the
  run's ``metrics.csv`` (``send_and_receive`` + decoding + server step), bytes per reply
  message from ``bytes_message`` (the reply's serialised Flower message: every object in its
  tree), ``bytes_payload`` (the QSGD code) against ``bits_bound`` (the analytic bound,
  header excluded) and ``bits_exact``;
* ``noop``: a no-op ServerApp/ClientApp pair with the same handshake and message pattern (one
  TRAIN message to each node per round, carrying only the round number; the reply carries
  ``ok = 1``); seconds per round around ``send_and_receive``, bytes per reply measured the same way.

The SuperLink's own traffic counters (``flwr ls``: inbound/outbound bytes of the run) are
recorded too. Usage: ``python benchmarks/bench_deployment.py [--rounds 10] [--pairs 2] [--nodes 3]
[--tls] [--out FILE]``; writes ``benchmarks/deployment.json`` unless ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qlsd_flwr import deploy as D  # noqa: E402
from qlsd_flwr.compression.qsgd import QSGD  # noqa: E402

from benchmarks.smoke import small  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402

B, DIM, S = 3, 50, 16

NOOP_APP = '''
"""No-op ServerApp/ClientApp: same handshake and message pattern as QLSD, no work."""
import json, time
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from qlsd_flwr.flower.sizing import message_nbytes

server = ServerApp()
client = ClientApp()


@client.query()
def query(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"r": ConfigRecord({"client": int(context.node_config["partition-id"])})}), reply_to=msg)


@client.train()
def train(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"r": ConfigRecord({"ok": 1})}), reply_to=msg)


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    b, K, timeout = int(cfg["num-clients"]), int(cfg["num-rounds"]), float(cfg["reply-timeout"])
    deadline = time.monotonic() + timeout  # a SuperNode that never connects (its port taken) ends the run, not waits
    while len(nodes := sorted(grid.get_node_ids())) < b:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(nodes)} of {b} SuperNodes connected within reply-timeout = {timeout:g} s")
        time.sleep(0.2)
    hello = [Message(RecordDict({"r": ConfigRecord({"hello": 1})}), n, MessageType.QUERY) for n in nodes]
    assert len(list(grid.send_and_receive(hello, timeout=timeout))) == b
    rounds = []
    for k in range(K):
        t0 = time.perf_counter()
        msgs = [Message(RecordDict({"r": ConfigRecord({"round": k})}), n, MessageType.TRAIN, group_id=str(k))
                for n in nodes]
        replies = list(grid.send_and_receive(msgs, timeout=timeout))
        rounds.append({"seconds": time.perf_counter() - t0, "n_replied": len(replies),
                       "bytes_message": [message_nbytes(r) for r in replies]})
    with open(str(cfg["output-file"]), "w") as f:
        json.dump(rounds, f)
'''


def stage_noop(dep: D.LocalDeployment, rounds: int, out_file: Path, b: int = B) -> Path:
    app = D.stage_app(dep.root / "app-noop", overrides={"num-clients": b, "dim": DIM})
    (app / "noop_app.py").write_text(NOOP_APP)
    with open(app / "pyproject.toml", "rb") as f:
        py = tomllib.load(f)
    py["project"]["name"] = "qlsd-noop"
    py["tool"]["flwr"]["app"]["components"] = {"serverapp": "noop_app:server", "clientapp": "noop_app:client"}
    py["tool"]["flwr"]["app"]["config"] = {"num-clients": b, "num-rounds": rounds, "reply-timeout": 120.0,
                                           "output-file": str(out_file)}
    py["tool"].setdefault("hatch", {}).setdefault("build", {}).setdefault("targets", {})["wheel"] = {
        "packages": ["qlsd_flwr"]}
    (app / "pyproject.toml").write_text(tomli_w.dumps(py))
    return app


def traffic(dep: D.LocalDeployment, run_id: int) -> dict:
    row = dep.status(run_id)
    return {"status": row["status"], **row.get("network-traffic", {}), "elapsed": row.get("elapsed")}


def summarise(seconds: list[float]) -> dict:
    return {"mean": statistics.fmean(seconds), "median": statistics.median(seconds),
            "min": min(seconds), "max": max(seconds), "n": len(seconds)}


#: the longest a run may take before the script stops the deployment and fails with its log: at a smoke size (one
#: pair: two runs) twice this and the start stay under the docs' smoke test's own timeout (600 s), which kills the
#: script with no chance to stop the processes it started
WAIT = small(600, 240)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).with_name("deployment.json")))
    ap.add_argument("--nodes", type=int, default=B, help="SuperNodes, one client each")
    ap.add_argument("--tls", action="store_true", help="a TLS SuperLink (self-made CA), the nodes verifying it")
    args = ap.parse_args()
    args.rounds, args.pairs, args.nodes = small(args.rounds, 2), small(args.pairs, 1), small(args.nodes, 2)
    b = args.nodes
    root = Path(tempfile.mkdtemp(prefix="qlsd-bench-deploy-"))
    results: dict = {"b": b, "d": DIM, "s": S, "tls": args.tls, "rounds_per_run": args.rounds, "runs": [],
                     "command": "python benchmarks/bench_deployment.py " + " ".join(sys.argv[1:])}
    t_all = time.time()
    with D.LocalDeployment(root, secure=args.tls) as dep:
        dep.start_superlink()
        for i in range(b):
            dep.start_node(f"sn{i}", i, b)
        qlsd_app = dep.stage(overrides={"num-clients": b, "dim": DIM, "variant": "qlsd-pp", "s": str(S),
                                        "p": "1.0", "burn-in": 0, "progress": False})
        for pair in range(args.pairs):
            noop_out = root / f"noop-{pair}.json"
            noop_app = stage_noop(dep, args.rounds, noop_out, b)
            rid = dep.run(noop_app)
            row = dep.wait(rid, timeout=WAIT)
            assert row["status"] == "finished:completed", dep.log(rid)[-3000:]
            rounds = json.loads(noop_out.read_text())
            per_msg = [x for r in rounds for x in r["bytes_message"]]
            results["runs"].append({"kind": "noop", "seconds_per_round": summarise([r["seconds"] for r in rounds]),
                                    "bytes_message_per_reply": statistics.fmean(per_msg),
                                    "superlink_traffic": traffic(dep, rid)})
            print(results["runs"][-1], flush=True)

            rc = {"num-rounds": args.rounds, "reply-timeout": 120.0, "output-dir": str(root / "out"),
                  "run-name": f"qlsd-{pair}"}
            rid = dep.run(qlsd_app, rc)
            row = dep.wait(rid, timeout=WAIT)
            assert row["status"] == "finished:completed", dep.log(rid)[-3000:]
            run_dir = root / "out" / f"qlsd-{pair}"
            with open(run_dir / "metrics.csv") as f:
                m = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]
            n = sum(r["n_replied"] for r in m)
            summary = json.loads((run_dir / "summary.json").read_text())
            results["runs"].append({
                "kind": "qlsd-pp", "seconds_per_round": summarise([r["seconds"] for r in m]),
                "bytes_message_per_reply": sum(r["bytes_message"] for r in m) / n,
                "bytes_payload_per_reply": sum(r["bytes_payload"] for r in m) / n,
                "bits_exact_per_reply": sum(r["bits_exact"] for r in m) / n,
                "bits_bound_per_reply": sum(r["bits_bound"] for r in m) / n,
                "memory_check": summary.get("memory_check"), "missed_rounds": summary["missed_rounds"],
                "superlink_traffic": traffic(dep, rid)})
            print(results["runs"][-1], flush=True)
    q = QSGD(s=S)
    results["analytic"] = {"bound_bits": q.bound_bits(DIM), "bound_bytes": q.bound_bits(DIM) / 8,
                           "dense_float64_bytes": 8 * DIM}
    results["wall_seconds"] = time.time() - t_all
    smoke_out(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results["analytic"]), "->", smoke_out(args.out))


if __name__ == "__main__":
    main()
