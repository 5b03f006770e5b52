"""Byzantine benchmark (issue: Hardening): one attacker sending the largest valid reply.

Client 0's real reply is rewritten by a Flower client mod: its QSGD norm becomes float32's largest
value (3.4e38), a code that passes every format check. The run goes through Flower's in-process
path (real messages and records, the project's ServerApp strategy and ClientApp). Measured:

1. the distance of θ_k from the honest chain (no attacker) over the rounds, with the norm bound
   (``norm-bound = auto``) and without it (``off``); and, with the bound, against the chain in which
   client 0 is silent (what the bound should reduce the attack to);
2. the acceptance rate of honest replies under the bound at the default settings, on the toy
   Gaussian (QLSD++ and QLSD) and on the logistic task, at p = 1 and p = 0.5.

    python benchmarks/bench_byzantine.py [--rounds 1000] [--out benchmarks/byzantine.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def attacker(mode: str):
    from flwr.app import ConfigRecord

    def mod(msg, ctx, call_next):
        reply = call_next(msg, ctx)
        if msg.metadata.message_type != "train" or int(ctx.node_config["partition-id"]) != 0:
            return reply
        if mode == "silent":
            raise RuntimeError("client 0 is silent")
        rec = reply.content["qlsd"]
        if rec.get("status") == "ok":
            p = bytes(rec["payload"])
            reply.content["qlsd"] = ConfigRecord({**dict(rec), "payload": p[:5] + struct.pack(">f", 3.4028235e38) + p[9:]})
        return reply

    return mod


def main() -> None:
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.run.simulate import run

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--out", default="benchmarks/byzantine.json")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    out: dict = {"machine": platform.processor() or platform.machine(), "rounds": a.rounds,
                 "command": "python benchmarks/bench_byzantine.py " + " ".join(sys.argv[1:]), "attack": {}, "honest": {}}

    def chain(o, name, mods=None):
        t = time.perf_counter()
        kw = {"mods": mods} if mods else {}
        r = run({**o, "run-name": name, "output-dir": tmp, "progress": False}, **kw)
        return load_samples(r.run_dir)[0], r.summary, time.perf_counter() - t

    for variant in ("qlsd-pp", "qlsd"):
        o = {"variant": variant, "engine": "inprocess", "num-rounds": a.rounds, "burn-in": 0}
        honest, s_h, _ = chain(o, f"{variant}-honest")
        silent, _, _ = chain(o, f"{variant}-silent", [attacker("silent")])
        guarded, s_g, dt = chain(o, f"{variant}-guarded", [attacker("max")])
        off, s_o, _ = chain({**o, "norm-bound": "off"}, f"{variant}-off", [attacker("max")])
        sd = float(np.sqrt(np.mean(np.var(honest[a.rounds // 2:], axis=0))))  # the posterior's scale

        def dist(x):
            return np.linalg.norm(x - honest, axis=1)

        row = {"posterior_sd": sd,
               "guarded_max_dist": float(dist(guarded).max()), "guarded_final_dist": float(dist(guarded)[-1]),
               "guarded_equals_silent": bool(np.array_equal(guarded, silent)),
               "silent_max_dist": float(dist(silent).max()),
               "off_max_dist": float(dist(off).max()), "off_final_dist": float(dist(off)[-1]),
               "rejected_guarded": s_g["rejected"], "rejected_off": s_o["rejected"], "seconds_guarded": dt}
        out["attack"][variant] = row
        print(variant, json.dumps(row))
    for task, extra in (("gaussian", {"variant": "qlsd-pp"}), ("gaussian", {"variant": "qlsd"}),
                        ("logistic", {"variant": "qlsd-pp", "gamma": 1e-3})):
        for p in ("1.0", "0.5"):
            o = {"task": task, "engine": "local", "num-rounds": a.rounds, "burn-in": 0, "p": p, **extra}
            _, s, _ = chain(o, f"{task}-{extra['variant']}-{p}")
            t = s["totals"]
            replies = t["n_replied"] + s["rejected"].get("norm_bound", 0)
            row = {"replies": replies, "norm_bound_rejected": s["rejected"].get("norm_bound", 0),
                   "acceptance": 1.0 - s["rejected"].get("norm_bound", 0) / max(replies, 1)}
            out["honest"][f"{task} {extra['variant']} p={p}"] = row
            print(task, extra, p, json.dumps(row))
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
