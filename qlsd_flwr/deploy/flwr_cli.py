"""The Flower CLI: connections, staging the app, ``flwr run`` and reading a run's real status,
registering nodes; and writing one node's partition file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from qlsd_flwr.deploy.processes import BIN

__all__ = ["REPO", "write_connection", "app_config", "stage_app", "flwr_cli", "format_run_config", "flwr_run", "run_status", "wait_run", "run_log", "register_node", "register_nodes", "count_in_log", "write_partition"]

REPO = Path(__file__).resolve().parents[2]  # qlsd_flwr/deploy/flwr_cli.py -> the repository


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

    from qlsd_flwr.config import DEFAULTS, resolve

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


def flwr_run(app_dir, connection: str, env: dict, run_config: dict | str | os.PathLike | None = None) -> int:
    """``flwr run <app_dir> <connection> --run-config ... --format json``; returns the run id.
    ``run_config``: a dict of values, or a TOML file's path."""
    args = ["run", str(app_dir), connection, "--format", "json"]
    if run_config:
        args += ["--run-config", format_run_config(run_config) if isinstance(run_config, dict) else str(run_config)]
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

    from qlsd_flwr.config import resolve
    from qlsd_flwr.tasks import loading

    cfg = resolve(cfg_overrides)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if cfg.task == "gaussian":
        from qlsd_flwr.tasks.gaussian import client_data

        np.savez(path, y=client_data(i, cfg.dim, cfg.data_seed))
        return path
    task = loading.load_task(cfg)
    pot = task.clients[i]
    if not hasattr(pot, "Xa"):
        raise ValueError(f"task {task.name!r}: no partition file format (only gaussian and logistic)")
    np.savez(path, X=pot.Xa[:, :-1], y=pot.y, n_classes=np.int64(pot.n_classes),
             prior_var=np.float64(task.prior.var))
    return path
