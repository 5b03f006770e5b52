"""``python -m qlsd_flwr.deploy {certs,node-key,stage-app,partition,ray-state} ...``"""

from __future__ import annotations

import json

from qlsd_flwr.deploy.certs import (
    KeyFileError,
    make_node_keypair,
    make_tls_certificates,
)
from qlsd_flwr.deploy.flwr_cli import stage_app, write_partition
from qlsd_flwr.deploy.processes import ray_cluster_state


# ---- command line ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m qlsd_flwr.deploy {certs,node-key,stage-app,partition,ray-state} ...``"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m qlsd_flwr.deploy", description=(
        "Deployment tooling: certificates, node keys, staging the app, partition files, Ray cluster state."))
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("certs", help="CA + SuperLink server certificate (ca.crt, server.pem, server.key)")
    c.add_argument("out_dir")
    c.add_argument("--host", action="append", help="SuperLink IP or DNS name (repeatable); "
                   "default 127.0.0.1 and localhost")
    c.add_argument("--days", type=int, default=365, help="validity in days (>= 1)")
    c.add_argument("--force", action="store_true", help="replace existing files (default: keep them, refuse)")
    k = sub.add_parser("node-key", help="SuperNode auth key pair <name>, <name>.pub (EC P-384, OpenSSH)")
    k.add_argument("out_dir")
    k.add_argument("name")
    k.add_argument("--force", action="store_true", help="replace an existing pair (default: keep it, refuse)")
    s = sub.add_parser("stage-app", help="copy the app for `flwr run`, with every config key declared")
    s.add_argument("dst")
    s.add_argument("--config", help="a run-config TOML, e.g. conf/deploy.toml")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p = sub.add_parser("partition", help="write client i's partition to an .npz (node config data-path)")
    p.add_argument("out")
    p.add_argument("--partition-id", type=int, required=True)
    p.add_argument("--config", help="a run-config TOML, e.g. conf/deploy.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    r = sub.add_parser("ray-state", help="jobs/actors/nodes of a running Ray cluster (JSON)")
    r.add_argument("address")
    args = ap.parse_args(argv)

    def overrides(a) -> dict:
        import tomllib

        out = {}
        if getattr(a, "config", None) and a.cmd == "partition":
            with open(a.config, "rb") as f:
                out.update(tomllib.load(f))
        for kv in a.set:
            key, _, val = kv.partition("=")
            try:
                out[key] = tomllib.loads(f"v = {val}")["v"]
            except tomllib.TOMLDecodeError:
                out[key] = val
        return out

    try:
        if args.cmd == "certs":
            paths = make_tls_certificates(args.out_dir, tuple(args.host or ("127.0.0.1", "localhost")), args.days,
                                          force=args.force)
            print("\n".join(f"{k}: {v}" for k, v in paths.items()))
            return 0
        if args.cmd == "node-key":
            priv, pub = make_node_keypair(args.out_dir, args.name, force=args.force)
            print(f"private: {priv}\npublic:  {pub}")
            return 0
    except (KeyFileError, OSError) as exc:
        import sys

        print(f"qlsd_flwr.deploy {args.cmd}: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "stage-app":
        print(stage_app(args.dst, config_file=args.config, overrides=overrides(args)))
    elif args.cmd == "partition":
        print(write_partition(overrides(args), args.partition_id, args.out))
    elif args.cmd == "ray-state":
        print(json.dumps(ray_cluster_state(args.address), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
