"""A whole deployment on one machine (the tests and the deployment benchmark use it)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from qlsd_flwr.deploy.certs import make_node_keypair, make_tls_certificates
from qlsd_flwr.deploy.flwr_cli import (
    flwr_run,
    register_nodes,
    run_log,
    run_status,
    stage_app,
    wait_run,
    write_connection,
)
from qlsd_flwr.deploy.processes import (
    Proc,
    flwr_env,
    free_port,
    node_config_arg,
    stop_all,
    superlink_argv,
    supernode_argv,
    wait_port,
)


# ---- a whole deployment on one machine (tests, benchmark) -----------------------------------
class LocalDeployment:
    """A SuperLink and SuperNodes on 127.0.0.1, each process with its own ``FLWR_HOME`` under
    ``root``, started and stopped by PID; optionally TLS (certificates made here) and SuperNode
    authentication (key pairs made here, registered with ``flwr supernode register``).

    ``with LocalDeployment(root, secure=True, node_auth=True) as dep: ...`` always stops
    every process it started on exit."""

    CONNECTION = "qlsd-deploy"

    def __init__(self, root: str | os.PathLike, secure: bool = False, node_auth: bool = False):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.secure, self.node_auth = secure or node_auth, node_auth
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.nodes: dict[str, Proc] = {}
        self.tls = make_tls_certificates(self.root / "certs") if self.secure else None
        self.cli_home = self.root / "home-cli"
        self.cli_env = flwr_env(self.cli_home)
        write_connection(self.cli_home, self.CONNECTION, self.address,
                         root_cert=self.tls["ca_cert"] if self.tls else None)
        self.superlink: Proc | None = None

    def __enter__(self) -> "LocalDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start_superlink(self, timeout: float = 90.0) -> Proc:
        argv = superlink_argv(self.port, tls=self.tls, node_auth=self.node_auth)
        self.superlink = Proc("superlink", argv, flwr_env(self.root / "home-superlink"),
                              self.root / "superlink.log", cwd=self.root).start()
        self.procs.append(self.superlink)
        wait_port(self.port, timeout=timeout, proc=self.superlink)
        return self.superlink

    def node_key(self, name: str) -> tuple[Path, Path]:
        return make_node_keypair(self.root / "keys", name)

    def register(self, *public_keys) -> list[int]:
        """Register SuperNode public keys (``flwr supernode register``); their node ids."""
        return register_nodes(public_keys, self.CONNECTION, self.cli_env)

    def start_node(self, name: str, partition_id: int, num_partitions: int, private_key=None,
                   data_path: str | None = None, max_retries: int | None = None) -> Proc:
        argv = supernode_argv(self.address, free_port(), node_config_arg(partition_id, num_partitions, data_path),
                              root_cert=self.tls["ca_cert"] if self.tls else None,
                              private_key=private_key, max_retries=max_retries)
        proc = Proc(name, argv, flwr_env(self.root / f"home-{name}"), self.root / f"{name}.log",
                    cwd=self.root).start()
        self.procs.append(proc)
        self.nodes[name] = proc
        return proc

    def stage(self, config_file=None, overrides: dict | None = None) -> Path:
        return stage_app(self.root / "app", config_file=config_file, overrides=overrides)

    def run(self, app_dir, run_config: dict | None = None) -> int:
        return flwr_run(app_dir, self.CONNECTION, self.cli_env, run_config)

    def finished_in_log(self, run_id: int) -> bool:
        """The SuperLink logged that the run's ServerApp task ended (a hint; status via flwr ls)."""
        try:
            text = self.superlink.log.read_text(errors="replace")
        except OSError:
            return False
        return re.search(rf"Finished task \d+ of run {run_id}\b", text) is not None

    def wait(self, run_id: int, timeout: float = 300.0) -> dict:
        return wait_run(run_id, self.CONNECTION, self.cli_env, timeout=timeout,
                        hint=lambda: self.finished_in_log(run_id))

    def status(self, run_id: int) -> dict:
        return run_status(run_id, self.CONNECTION, self.cli_env)

    def log(self, run_id: int) -> str:
        return run_log(run_id, self.CONNECTION, self.cli_env)

    def stop(self) -> None:
        stop_all(self.procs)
