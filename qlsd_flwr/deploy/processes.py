"""Processes of a deployment on one machine: start, log, wait for a port, stop by PID; the SuperLink,
SuperNode and Ray head command lines."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent  # the venv's bin: flwr, flower-superlink, flower-supernode


# ---- processes ------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now (bind to port 0 and read what the kernel gave)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 60.0, proc: "Proc | None" = None) -> None:
    """Block until something accepts TCP connections on ``host:port``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.returncode()} before listening on "
                               f"{host}:{port}; its log:\n{proc.log_tail()}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


def flwr_env(flwr_home: str | os.PathLike, extra: dict | None = None) -> dict:
    """Environment for Flower processes: own ``FLWR_HOME``, the venv's ``bin`` first on ``PATH``
    (the SuperLink and SuperNodes start ``flower-superexec`` by name), no runtime dependency
    installation, no update check, no telemetry."""
    env = dict(os.environ)
    env.update({
        "FLWR_HOME": str(flwr_home),
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "200",
    })
    env.update(extra or {})
    return env


@dataclass
class Proc:
    """A long-running process started in its own session (its PID is its process group id),
    logging to ``log``; :meth:`stop` ends it and everything it started, by that PID."""

    name: str
    argv: list[str]
    env: dict
    log: Path
    cwd: Path | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> "Proc":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(self.log, "ab")
        fh.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self.argv)}\n".encode())
        fh.flush()
        self.popen = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=fh,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        fh.close()
        return self

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def returncode(self):
        return None if self.popen is None else self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the process and its process group now (a node dying)."""
        self._signal(signal.SIGKILL)
        if self.popen is not None:
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds."""
        if self.popen is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)  # also whatever it left in its group
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def _signal(self, sig) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, sig)  # the group of the session we started: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def stop_all(procs, grace: float = 5.0) -> None:
    """Stop every :class:`Proc`: SIGTERM to all their process groups at once, wait up to
    ``grace`` seconds in all, then SIGKILL the groups; never raises."""
    procs = [p for p in procs if p.popen is not None]
    for p in procs:
        p._signal(signal.SIGTERM)
    deadline = time.time() + grace
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        p._signal(signal.SIGKILL)  # the process if still there, and whatever it left in its group
        try:
            p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


# ---- SuperLink, SuperNodes ------------------------------------------------------------------
def superlink_argv(port: int, host: str = "127.0.0.1", tls: dict | None = None,
                   node_auth: bool = False, database: str | None = None) -> list[str]:
    argv = [str(BIN / "flower-superlink"), "--host", host, "--port", str(port),
            "--disable-runtime-dependency-installation"]
    if tls is None:
        argv.append("--insecure")
    else:
        argv += ["--ssl-ca-certfile", str(tls["ca_cert"]), "--ssl-certfile", str(tls["server_cert"]),
                 "--ssl-keyfile", str(tls["server_key"])]
    if node_auth:
        argv.append("--enable-supernode-auth")
    if database:
        argv += ["--database", database]
    return argv


def node_config_arg(partition_id: int, num_partitions: int, data_path: str | None = None) -> str:
    cfg = f"partition-id={int(partition_id)} num-partitions={int(num_partitions)}"
    if data_path:
        cfg += f' data-path="{data_path}"'
    return cfg


def supernode_argv(superlink: str, runtime_port: int, node_config: str, root_cert=None,
                   private_key=None, max_retries: int | None = None) -> list[str]:
    argv = [str(BIN / "flower-supernode"), "--superlink", superlink, "--host", "127.0.0.1",
            "--port", str(runtime_port), "--node-config", node_config]
    if root_cert is None:
        argv.append("--insecure")
    else:
        argv += ["--root-certificates", str(root_cert)]
    if private_key is not None:
        argv += ["--auth-supernode-private-key", str(private_key)]
    if max_retries is not None:
        argv += ["--max-retries", str(max_retries)]
    return argv



# ---- Ray cluster (scale-out of the simulation) ----------------------------------------------
RAY_JOBS_SCRIPT = """
import json, sys
import ray
import ray._private.state as state

__all__ = ["BIN", "free_port", "wait_port", "flwr_env", "Proc", "stop_all", "superlink_argv", "node_config_arg", "supernode_argv", "RAY_JOBS_SCRIPT", "ray_cluster_state", "ray_head_argv"]
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
out = {"jobs": state.jobs(), "actors": list(state.actors().values()),
       "nodes": [n["NodeID"] for n in ray.nodes()]}
print("RAYSTATE " + json.dumps(out, default=str))
"""


def ray_cluster_state(address: str, timeout: float = 120.0) -> dict:
    """Jobs (with their driver PIDs), actors (class, job, state) and nodes that the Ray
    cluster at ``address`` knows, read from its GCS by a separate short-lived driver (no
    dashboard needed). This is how one shows a simulation ran on that cluster."""
    cp = subprocess.run([sys.executable, "-c", RAY_JOBS_SCRIPT, address], capture_output=True,
                        text=True, timeout=timeout, env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    for line in cp.stdout.splitlines():
        if line.startswith("RAYSTATE "):
            return json.loads(line[len("RAYSTATE "):])
    raise RuntimeError(f"could not read Ray cluster state at {address}: {cp.stderr[-2000:]}")


def ray_head_argv(port: int, temp_dir: str, num_cpus: int = 2) -> list[str]:
    """``ray start --head --block``: the cluster's processes stay in this process's group, so
    :meth:`Proc.stop` ends them by PID (never ``ray stop``, which ends every Ray on the host)."""
    return [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", f"--num-cpus={num_cpus}",
            "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
            f"--temp-dir={temp_dir}"]
