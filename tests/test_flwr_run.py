"""``flwr run`` in Flower's local simulation, as a Flower user runs it (the front-door issue).

A real ``flower-superlink --simulation`` is started here on a free port of 127.0.0.1 and stopped
by its PID; ``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT`` points ``flwr``'s default ``local`` connection
at it (``flwr run`` would otherwise start its own, detached, that no test could stop). Runtime
dependency installation is off (the environment already has everything; the runtime install
would fetch the dependencies from the index). The federation has 4 SuperNodes, set with
``flwr federation simulation-config``, the command the README gives.

* ``flwr run . --run-config <file>``: the repository's own app from a config file; its samples
  equal the ``local`` engine's, bit for bit.
* ``flwr run examples/quickstart-torch``: a user's project (own model and data, public API only),
  stopped and resumed; its samples equal the same posterior as a task plug-in on the ``local`` and
  ``vectorised`` engines, bit for bit.
* Every ``conf/*.toml`` is a valid ``--run-config`` file for the app (keys declared, values valid).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from qlsd_flwr import deploy as D
from qlsd_flwr.config import resolve
from qlsd_flwr.deploy.processes import BIN, Proc
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.run.simulate import run

pytestmark = [pytest.mark.deployment, pytest.mark.ray]  # a SuperLink and flwr-simulation's Ray: the group ray

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "quickstart-torch"
B = 4


def _declared() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["flwr"]["app"]["config"]


@pytest.mark.parametrize("conf", sorted((REPO / "conf").glob("*.toml")), ids=lambda p: p.name)
def test_every_conf_file_is_a_valid_run_config(conf):
    with open(conf, "rb") as f:
        values = tomllib.load(f)
    assert set(values) <= set(_declared()), set(values) - set(_declared())  # flwr refuses undeclared keys
    resolve({**_declared(), **values})


@pytest.fixture(scope="module")
def local_sim(tmp_path_factory, ray_cluster):
    root = tmp_path_factory.mktemp("flwr-run")
    port = D.free_port()
    # RAY_ADDRESS: Flower's Ray backend calls ray.init(), which attaches to the session's head
    # (tests/conftest.py) instead of starting and stopping a Ray instance at every run
    env = D.flwr_env(root / "flwr-home", {"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(port),
                                          "FLWR_LOCAL_CONTROL_API_PORT": str(D.free_port()),
                                          "RAY_ADDRESS": ray_cluster})
    link = Proc("superlink", [str(BIN / "flower-superlink"), "--insecure", "--simulation", "--isolation",
                              "subprocess", "--host", "127.0.0.1", "--port", str(port),
                              "--disable-runtime-dependency-installation"],
                env, root / "superlink.log", cwd=root).start()
    try:
        D.wait_port(port, proc=link)
        cp = D.flwr_cli(["federation", "simulation-config", "--num-supernodes", str(B),
                         "--client-resources-num-cpus", "1"], env, cwd=root)
        assert cp.returncode == 0, cp.stdout + cp.stderr
        yield root, env
    finally:
        link.stop()
    assert not link.alive()


def _flwr_run(app: Path, run_config, env: dict) -> int:
    """``flwr run <app> local --run-config ...`` to the end; the run's own status (``flwr ls``)
    must be completed (``flwr run`` exits 0 once the run is submitted)."""
    run_id = D.flwr_run(app, "local", env, run_config)
    row = D.wait_run(run_id, "local", env, timeout=300, poll=1.0, ls_every=3.0)
    assert row["status"] == "finished:completed", (row, D.run_log(run_id, "local", env))
    return run_id


def test_flwr_run_dot_from_a_conf_file_stopped_by_flwr_stop_and_resumed_bitwise(local_sim):
    """``flwr run . --run-config <file>`` (a file derived from conf/gaussian_qlsdpp_ray.toml, with the
    rival VR-FALD*) runs the repository's app; ``flwr stop`` mid-run leaves a readable, closed run folder (samples.nc,
    summary.json, no .lock); ``flwr run . --run-config 'resume=...'`` reads the folder's saved
    configuration (here num-clients = 4, where the app's default is 20) and ends with the draws of
    the ``local`` engine's run that was never stopped, bit for bit. The file then carries the
    federated LOO's pointwise log-likelihood (az.loo, az.compare and az.plot_trace take it as it is,
    with the CLI run's numbers) and overview.png. (One flwr run for the two checks: each costs about
    20 s of Flower start-up.)"""
    import json
    import time

    import arviz as az

    root, env = local_sim
    out = root / "out"
    with open(REPO / "conf" / "gaussian_qlsdpp_ray.toml", "rb") as f:
        values = tomllib.load(f)
    # so many rounds that the stop always comes first, however fast the machine; the resume then
    # names the rounds it ends at (num-rounds may change at a resume), the rest from config.json
    values.update({"num-clients": B, "num-rounds": 10**6, "burn-in": 10, "thin": 5, "checkpoint-every": 5,
                   "output-dir": str(out), "run-name": "dot", "progress": False, "loo": "pointwise"})
    # a rival (issue 23) on this path: VR-FALD*'s θ* claims, local steps, QSGD-coded messages and its reference
    # refreshed (q: every client's ∇U_i(θ_k) in the refresh rounds), stopped and resumed (the QLSD family's
    # flwr run: test_example_project_through_flwr_run, tests/test_deployment.py)
    values.update({"variant": "vr-fald-star", "local-steps": 2, "tau": 0.5, "compressor": "qsgd", "q": 0.2})
    conf = root / "run.toml"
    conf.write_text("".join(D.format_run_config({k: v}).replace("=", " = ", 1) + "\n" for k, v in values.items()))
    run_id = D.flwr_run(REPO, "local", env, conf)
    folder = out / "dot"
    deadline = time.time() + 240
    while not (folder / "checkpoint.npz").exists() and time.time() < deadline:
        time.sleep(0.5)
    assert (folder / "checkpoint.npz").exists()
    cp = D.flwr_cli(["stop", str(run_id), "local"], env, cwd=root)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    while not (folder / "summary.json").exists() and time.time() < deadline:
        time.sleep(0.5)
    summary = json.loads((folder / "summary.json").read_text())
    assert "stopped" in summary and summary["rounds"] < 10**6, summary
    assert (folder / "samples.nc").exists() and not (folder / ".lock").exists()
    end = summary["rounds"] + 60
    _flwr_run(REPO, {"resume": str(folder), "num-rounds": end}, env)  # other keys: the folder's config.json
    ref = run({**values, "num-rounds": end, "engine": "local", "output-dir": str(root / "ref"), "run-name": "dot"})
    theirs = load_samples(folder)
    assert theirs.shape[0] == 1 and theirs.shape[2] == 50 and theirs.shape[1] > 10
    facts = json.loads((folder / "summary.json").read_text())["reference_refresh"]  # counted across the resume
    assert facts["installed"] >= 1 and facts == ref.summary["reference_refresh"], facts
    assert np.array_equal(theirs, load_samples(ref.run_dir))
    # the federated LOO's pointwise log-likelihood reached the flwr run file: az.loo takes it as it is,
    # and gives the CLI run's number (tests/test_loo.py checks that one against a pooled computation)
    a, b = (az.from_netcdf(Path(d) / "samples.nc") for d in (folder, ref.run_dir))
    la, lb = az.loo(a), az.loo(b)
    assert np.isfinite(la.elpd_loo) and la.elpd_loo == lb.elpd_loo and la.n_data_points == lb.n_data_points
    assert np.allclose(az.compare({"flwr run": a, "local": b})["elpd_diff"], 0.0)
    first = a.posterior["theta_dim_0"].values[:2].tolist()
    assert az.plot_trace(a, var_names=["theta"], coords={"theta_dim_0": first}).shape == (1, 2)
    assert (folder / "overview.png").stat().st_size > 10_000  # drawn by the app (plot = true, the default)


def test_example_project_through_flwr_run_stopped_and_resumed_bitwise(local_sim, monkeypatch):
    """``flwr run examples/quickstart-torch`` with a ``--run-config`` override (gamma), stopped by
    ``flwr stop`` and resumed as the docs say (``resume=...`` and the rounds to end at): the app
    passes its initial arrays and its pyproject's own gamma and burn-in again, and the run's own
    values are kept. The draws equal, bit for bit, the same posterior never stopped as a task
    plug-in on the ``local`` and ``vectorised`` engines, and the held-out evaluation the app asks
    for (``heldout``) is written, its verdict read from the predictive."""
    import json
    import time

    root, env = local_sim
    out = root / "out-example"
    first = {"num-rounds": 10**6, "burn-in": 10, "gamma": 0.002, "checkpoint-every": 5, "output-dir": str(out)}
    run_id = D.flwr_run(EXAMPLE, "local", env, first)
    folder = out / "quickstart"
    deadline = time.time() + 240  # a slow, busy machine: Flower and Ray start, then the first 5 rounds
    while not (folder / "checkpoint.npz").exists() and time.time() < deadline:
        time.sleep(0.5)
    assert (folder / "checkpoint.npz").exists(), D.run_log(run_id, "local", env)
    cp = D.flwr_cli(["stop", str(run_id), "local"], env, cwd=root)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    deadline = time.time() + 120
    while not (folder / "summary.json").exists() and time.time() < deadline:
        time.sleep(0.5)
    stopped = json.loads((folder / "summary.json").read_text())
    assert "stopped" in stopped and stopped["rounds"] < 10**6, stopped
    end = stopped["rounds"] + 30
    resumed = _flwr_run(EXAMPLE, {"resume": str(folder), "num-rounds": end, "output-dir": str(out)}, env)
    log = D.run_log(resumed, "local", env)
    assert "the run's own gamma=0.002, burn-in=10 kept" in log and "initial_arrays ignored" in log, log
    theirs = load_samples(folder)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    with open(EXAMPLE / "pyproject.toml", "rb") as f:
        c = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    assert c["gamma"] != first["gamma"] and c["burn-in"] != first["burn-in"]  # the resume kept the run's own
    for engine in ("local", "vectorised"):
        mine = run({"task": "qlsd_quickstart.task:make_task", "num-clients": B, "gamma": first["gamma"],
                    "s": c["s"], "seed": c["seed"], "num-rounds": end, "burn-in": 10, "engine": engine,
                    "progress": False, "output-dir": str(root / "ref"), "run-name": engine})
        assert np.array_equal(theirs, load_samples(mine.run_dir)), engine
    assert theirs.shape == (1, end - 10, 275)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["convergence"]["criterion"] == "predictive" and (folder / "evaluation.json").exists()
    sys.modules.pop("qlsd_quickstart", None)


@pytest.mark.parametrize("app", [REPO, EXAMPLE], ids=["repository-app", "user-app"])
def test_a_package_error_reaches_flwr_log_as_one_line_and_fails_the_run(local_sim, app):
    """The repository's ServerApp, and a user's own (the quickstart: QLSDStrategy built from its run
    config), given a bad gamma: the run fails and flwr log shows one line naming the key."""
    root, env = local_sim
    run_id = D.flwr_run(app, "local", env, {"num-clients": B, "gamma": -1.0, "output-dir": str(root / "out-err")})
    row = D.wait_run(run_id, "local", env, timeout=300, poll=1.0, ls_every=3.0)
    assert row["status"] == "finished:failed", row
    log = D.run_log(run_id, "local", env)
    lines = [ln for ln in log.splitlines() if "gamma must be a finite number > 0 or 'auto' (got -1.0)" in ln]
    assert len(lines) == 1 and "ConfigError" in lines[0], log
    assert "Traceback" not in log, log


