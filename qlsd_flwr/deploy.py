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


def stop_all(procs) -> None:
    """Stop every :class:`Proc` (in reverse start order); never raises."""
    for p in reversed(list(procs)):
        try:
            p.stop()
        except Exception:  # noqa: BLE001 - cleanup must go on
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
             on_poll=None) -> dict:
    """Poll :func:`run_status` until the run is finished; returns its last row."""
    deadline = time.time() + timeout
    row: dict = {}
    while time.time() < deadline:
        row = run_status(run_id, connection, env)
        if str(row.get("status", "")).startswith("finished"):
            return row
        if on_poll is not None:
            on_poll(row)
        time.sleep(poll)
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
    cp = flwr_cli(["supernode", "register", str(public_key), connection, "--format", "json"], env)
    out = _json_out(cp)
    if not out.get("success"):
        raise RuntimeError(f"flwr supernode register failed: {out}\n{cp.stderr}")
    return int(out["node-id"])
