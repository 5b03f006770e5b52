"""Helpers for running qlsd-flwr on a real Flower deployment (``flower-superlink`` +
``flower-supernode`` + ``flwr run``), used by ``tests/test_deployment.py``,
``benchmarks/bench_deployment.py`` and described in ``docs/DEPLOYMENT.md``.

* certificates and keys: :func:`make_tls_certificates` (a CA and a server certificate signed
  by it, with the server's addresses as SANs) and :func:`make_node_keypair` (an EC P-384
  key pair in OpenSSH format, the format ``flower-supernode --auth-supernode-private-key``
  and ``flwr supernode register`` read);
* processes: :class:`Proc` (start a process in its own session, log to a file, stop it by
  its PID: SIGTERM to its process group, then SIGKILL), :func:`free_port`, :func:`wait_port`;
* the Flower CLI: :func:`write_connection` (a SuperLink connection in ``$FLWR_HOME/config.toml``),
  :func:`stage_app` (a copy of the app without the simulation federations of
  ``pyproject.toml``, which ``flwr run`` would otherwise migrate and comment out),
  :func:`flwr_run`, :func:`run_status`, :func:`wait_run`.

Nothing here fetches anything: runtime dependency installation is off everywhere.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's bin: flwr, flower-superlink, flower-supernode


# ---- certificates and keys ------------------------------------------------------------------
def make_tls_certificates(out_dir: str | os.PathLike, hosts=("127.0.0.1", "localhost"),
                          days: int = 365) -> dict[str, Path]:
    """A self-signed CA and a SuperLink server certificate signed by it.

    Writes ``ca.crt``, ``ca.key``, ``server.pem`` and ``server.key`` (PEM) to ``out_dir`` and
    returns their paths. ``hosts`` are the SuperLink's addresses as the SuperNodes and the
    CLI reach it (IPs and DNS names, all put in the certificate's subjectAltName).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
    later = now + _dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qlsd-flwr test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(later)
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))

    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    srv_key = ec.generate_private_key(ec.SECP384R1())
    srv_cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]))]))
                .issuer_name(ca_name).public_key(srv_key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(later)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))

    def key_pem(k):
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    paths = {"ca_cert": out / "ca.crt", "ca_key": out / "ca.key",
             "server_cert": out / "server.pem", "server_key": out / "server.key"}
    paths["ca_cert"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["ca_key"].write_bytes(key_pem(ca_key))
    paths["server_cert"].write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    paths["server_key"].write_bytes(key_pem(srv_key))
    for p in ("ca_key", "server_key"):
        os.chmod(paths[p], 0o600)
    return paths


def make_node_keypair(out_dir: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """An EC P-384 key pair for SuperNode authentication: ``<name>`` (OpenSSH private key, for
    ``flower-supernode --auth-supernode-private-key``) and ``<name>.pub`` (OpenSSH public key,
    for ``flwr supernode register``). Same as ``ssh-keygen -t ecdsa -b 384 -N '' -f <name>``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    priv, pub = out / name, out / f"{name}.pub"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                       serialization.NoEncryption()))
    os.chmod(priv, 0o600)
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                  serialization.PublicFormat.OpenSSH) + b"\n")
    return priv, pub


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


# ---- the Flower CLI -------------------------------------------------------------------------
def write_connection(flwr_home: str | os.PathLike, name: str, address: str,
                     root_cert=None) -> Path:
    """Write ``$FLWR_HOME/config.toml`` with one SuperLink connection ``name`` (the default)."""
    home = Path(flwr_home)
    home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f'address = "{address}"']
    if root_cert is None:
        lines.append("insecure = true")
    else:
        lines.append(f'root-certificates = "{Path(root_cert).resolve()}"')
    path = home / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def app_config(src: str | os.PathLike = REPO, config_file: str | os.PathLike | None = None,
               overrides: dict | None = None) -> dict:
    """The ``[tool.flwr.app.config]`` of a staged app: every key of
    :data:`qlsd_flwr.config.DEFAULTS`, then the repository's ``pyproject.toml`` values, then
    ``config_file`` (e.g. ``conf/deploy.toml``), then ``overrides``. Flower refuses
    ``--run-config`` keys the app's config lacks, so the staged app declares them all."""
    import tomllib

    from .config import DEFAULTS, resolve

    with open(Path(src) / "pyproject.toml", "rb") as f:
        cfg = {**DEFAULTS, **tomllib.load(f)["tool"]["flwr"]["app"]["config"]}
    if config_file is not None:
        with open(config_file, "rb") as f:
            cfg.update(tomllib.load(f))
    cfg.update(overrides or {})
    resolve(cfg)  # fail here, not in the ServerApp, on a bad key or value
    return cfg


def stage_app(dst: str | os.PathLike, src: str | os.PathLike = REPO,
              config_file: str | os.PathLike | None = None, overrides: dict | None = None) -> Path:
    """Copy the Flower app (``pyproject.toml`` + ``qlsd_flwr``) to ``dst`` for ``flwr run``.

    The copy's ``[tool.flwr.app.config]`` is :func:`app_config` (all keys), and it lacks
    ``[tool.flwr.federations]``: with that section present, ``flwr run`` (1.41) migrates
    those simulation federations into ``$FLWR_HOME/config.toml`` and comments the section
    out of the file, i.e. it would edit the repository's ``pyproject.toml``."""
    import tomllib

    import tomli_w

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src / "qlsd_flwr", dst / "qlsd_flwr", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    with open(src / "pyproject.toml", "rb") as f:
        py = tomllib.load(f)
    py["tool"]["flwr"].pop("federations", None)
    py["tool"]["flwr"]["app"]["config"] = app_config(src, config_file, overrides)
    py["tool"].pop("pytest", None)
    (dst / "pyproject.toml").write_text(tomli_w.dumps(py))
    return dst


def flwr_cli(args: list[str], env: dict, cwd=None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "flwr"), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _json_out(cp: subprocess.CompletedProcess) -> dict:
    """The JSON object ``flwr ... --format json`` prints (last ``{...}`` block of stdout)."""
    text = cp.stdout
    start = text.find("{")
    if start < 0:
        raise RuntimeError(f"flwr printed no JSON (rc={cp.returncode}):\n{cp.stdout}\n{cp.stderr}")
    return json.loads(text[start:])


def format_run_config(overrides: dict) -> str:
    """``--run-config`` string: ``key=value`` pairs, strings quoted, TOML style."""
    parts = []
    for k, v in overrides.items():
        if isinstance(v, bool):
            val = "true" if v else "false"
        elif isinstance(v, (int, float)):
            val = repr(v)
        else:
            val = json.dumps(str(v))
        parts.append(f"{k}={val}")
    return " ".join(parts)


def flwr_run(app_dir, connection: str, env: dict, run_config: dict | None = None) -> int:
    """``flwr run <app_dir> <connection> --run-config ... --format json``; returns the run id."""
    args = ["run", str(app_dir), connection, "--format", "json"]
    if run_config:
        args += ["--run-config", format_run_config(run_config)]
    cp = flwr_cli(args, env)
    out = _json_out(cp)
    if not out.get("success") or out.get("run-id") is None:
        raise RuntimeError(f"flwr run failed: {out}\n{cp.stderr}")
    return int(out["run-id"])


def run_status(run_id: int, connection: str, env: dict) -> dict:
    """The run's row of ``flwr ls --run-id <id> --format json``: ``status`` is e.g.
    ``pending``, ``starting``, ``running``, ``finished:completed``, ``finished:failed``."""
    cp = flwr_cli(["ls", connection, "--run-id", str(run_id), "--format", "json"], env)
    out = _json_out(cp)
    runs = out.get("runs") or []
    if not out.get("success", True) or not runs:
        raise RuntimeError(f"flwr ls --run-id {run_id}: {out}")
    return runs[0]


def wait_run(run_id: int, connection: str, env: dict, timeout: float = 300.0, poll: float = 2.0,
             hint=None, ls_every: float = 30.0) -> dict:
    """Wait until ``flwr ls`` reports the run ``finished``; returns its row.

    Each ``flwr ls`` is a CLI process (seconds of CPU), so with ``hint`` (a cheap callable,
    e.g. "the SuperLink log says the run's task finished") it is called only when ``hint()``
    is true or every ``ls_every`` seconds; the run status itself always comes from ``flwr ls``."""
    deadline = time.time() + timeout
    row: dict = {}
    last_ls = 0.0
    while time.time() < deadline:
        now = time.time()
        if hint is None or hint() or now - last_ls >= ls_every:
            last_ls = now
            row = run_status(run_id, connection, env)
            if str(row.get("status", "")).startswith("finished"):
                return row
            time.sleep(poll if hint is None or hint() else 0.5)
        else:
            time.sleep(0.5)
    raise TimeoutError(f"run {run_id} not finished after {timeout:.0f} s (last: {row})")


def run_log(run_id: int, connection: str, env: dict, timeout: float = 30.0) -> str:
    """The run's logs (``flwr log <id> <connection> --show``)."""
    try:
        cp = flwr_cli(["log", str(run_id), connection, "--show"], env, timeout=timeout)
        return cp.stdout + cp.stderr
    except subprocess.TimeoutExpired:
        return ""


def register_node(public_key, connection: str, env: dict) -> int:
    """``flwr supernode register <key.pub> <connection>``; returns the node id."""
    return register_nodes([public_key], connection, env)[0]


def register_nodes(public_keys, connection: str, env: dict, timeout: float = 120.0) -> list[int]:
    """``flwr supernode register`` for several keys, the CLI processes running side by side."""
    procs = [subprocess.Popen([str(BIN / "flwr"), "supernode", "register", str(k), connection,
                               "--format", "json"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
             for k in public_keys]
    ids = []
    for k, p in zip(public_keys, procs):
        out, err = p.communicate(timeout=timeout)
        res = _json_out(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        if not res.get("success"):
            raise RuntimeError(f"flwr supernode register {k} failed: {res}\n{err}")
        ids.append(int(res["node-id"]))
    return ids


def count_in_log(path: str | os.PathLike, needle: str) -> int:
    try:
        return Path(path).read_text(errors="replace").count(needle)
    except OSError:
        return 0


# ---- node data ------------------------------------------------------------------------------
def write_partition(cfg_overrides: dict, i: int, path: str | os.PathLike) -> Path:
    """Export client ``i``'s partition to ``path`` (``.npz``) for ``--node-config data-path=...``:
    ``y`` for the Gaussian task, ``X``, ``y``, ``n_classes`` for logistic regression."""
    import numpy as np

    from . import components as C
    from .config import resolve

    cfg = resolve(cfg_overrides)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if str(cfg.get("task")).lower() == "gaussian":
        from .tasks.gaussian import client_data

        np.savez(path, y=client_data(i, int(cfg.get("dim")), int(cfg.get("data-seed"))))
        return path
    task = C.load_task(cfg)
    pot = task.clients[i]
    if not hasattr(pot, "Xa"):
        raise ValueError(f"task {task.name!r}: no partition file format (only gaussian and logistic)")
    np.savez(path, X=pot.Xa[:, :-1], y=pot.y, n_classes=np.int64(pot.n_classes),
             prior_var=np.float64(task.prior.var))
    return path


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


# ---- Ray cluster (scale-out of the simulation) ----------------------------------------------
RAY_JOBS_SCRIPT = """
import json, sys
import ray
import ray._private.state as state
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


# ---- command line ---------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``python -m qlsd_flwr.deploy {certs,node-key,stage-app,partition,ray-state} ...``"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m qlsd_flwr.deploy", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("certs", help="CA + SuperLink server certificate (ca.crt, server.pem, server.key)")
    c.add_argument("out_dir")
    c.add_argument("--host", action="append", help="SuperLink IP or DNS name (repeatable); "
                   "default 127.0.0.1 and localhost")
    c.add_argument("--days", type=int, default=365)
    k = sub.add_parser("node-key", help="SuperNode auth key pair <name>, <name>.pub (EC P-384, OpenSSH)")
    k.add_argument("out_dir")
    k.add_argument("name")
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

    if args.cmd == "certs":
        paths = make_tls_certificates(args.out_dir, tuple(args.host or ("127.0.0.1", "localhost")), args.days)
        print("\n".join(f"{k}: {v}" for k, v in paths.items()))
    elif args.cmd == "node-key":
        priv, pub = make_node_keypair(args.out_dir, args.name)
        print(f"private: {priv}\npublic:  {pub}")
    elif args.cmd == "stage-app":
        print(stage_app(args.dst, config_file=args.config, overrides=overrides(args)))
    elif args.cmd == "partition":
        print(write_partition(overrides(args), args.partition_id, args.out))
    elif args.cmd == "ray-state":
        print(json.dumps(ray_cluster_state(args.address), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
