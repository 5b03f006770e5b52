"""Issue 5, deployment: the ServerApp and ClientApp under ``flwr run`` against a real
``flower-superlink`` with ``flower-supernode`` processes, all on 127.0.0.1, started and stopped
by PID here (see :mod:`qlsd_flwr.deploy`). Each SuperNode loads only its own partition
(``--node-config 'partition-id=i num-partitions=3 data-path=...'``); runtime dependency
installation is off. The run's real outcome is read with ``flwr ls`` (``flwr run`` only
submits a run and exits 0 even when the run then fails).

A deployment round takes ~6-9 s (the SuperNodes and the ServerApp poll every 3 s and each
message starts a ClientApp process), so the runs are short. The tests at the bottom need no
processes (certificates, keys, partitions, staging).
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from qlsd_flwr import deploy as D
from qlsd_flwr.config import DEFAULTS, resolve
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.tasks.gaussian import build_gaussian_task

B = 3
BASE = {"num-clients": B, "dim": 5, "variant": "qlsd-pp", "s": "16", "p": "1.0", "l": 100,
        "burn-in": 1, "progress": False}
RECEIVE_TRAIN = "Receiving: train message"
FILE_SEED = 7  # the nodes' files hold other data than partition-id would generate (data-seed 0)


def node_data(root: Path, i: int) -> str:
    """Node i's own partition file (what its operator would put on that machine)."""
    return str(D.write_partition({**BASE, "data-seed": FILE_SEED}, i, root / f"data-node{i}" / "partition.npz"))


def ensure_nodes(dep: D.LocalDeployment) -> None:
    for i in range(B):
        proc = dep.nodes.get(f"sn{i}")
        if proc is None or not proc.alive():
            dep.start_node(f"sn{i}", i, B, data_path=node_data(dep.root, i))


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics_of(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def assert_memory_in_sync(summary: dict) -> None:
    """η = Σ_i η_i, with each η_i as the client node itself reports it at the end of the run."""
    mc = summary["memory_check"]
    assert mc["clients_reported"] == list(range(B)), mc
    assert all(mc["eta_count_agrees"].values()), mc
    assert mc["max_abs_eta_minus_sum"] <= 1e-12 and mc["max_abs_mirror_diff"] <= 1e-12, mc
    assert mc["max_abs_eta"] > 0, mc  # the memory terms are not trivially zero


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """An insecure SuperLink (its SuperNodes are started by the tests, see ensure_nodes)."""
    dep = D.LocalDeployment(tmp_path_factory.mktemp("insecure"))
    try:
        dep.start_superlink()
        dep.app = dep.stage(overrides=BASE)
        yield dep
    finally:
        dep.stop()


@pytest.mark.deployment
def test_failed_run_is_noticed_from_run_status(cluster, tmp_path):
    """4 clients expected, 3 SuperNodes up: the ServerApp gives up after reply-timeout with a
    clear message; ``flwr run`` still exits 0, the run status says ``finished:failed``."""
    ensure_nodes(cluster)
    rc = {**BASE, "num-clients": 4, "num-rounds": 2, "reply-timeout": 3.0, "output-dir": str(tmp_path),
          "run-name": "fail"}
    cp = D.flwr_cli(["run", str(cluster.app), cluster.CONNECTION, "--run-config", D.format_run_config(rc),
                     "--format", "json"], cluster.cli_env)
    assert cp.returncode == 0, cp.stderr
    run_id = int(json.loads(cp.stdout[cp.stdout.find("{"):])["run-id"])
    row = cluster.wait(run_id, timeout=120)
    assert row["status"] == "finished:failed", row
    assert "expected 4 client nodes, only 3 connected" in cluster.log(run_id)
    assert not (tmp_path / "fail" / "summary.json").exists()


@pytest.mark.deployment
def test_node_killed_mid_run_rejoins_and_is_resynced(cluster, tmp_path):
    """SuperNode 2 is SIGKILLed while it works on round 2 and restarted at once with empty
    state (a new process; without node auth it also gets a new node id). The run goes on,
    the rounds it misses are reported, it answers ``resync`` once and gets the server's η_i
    mirror, and at the end η = Σ_i η_i with each η_i reported by the client node itself."""
    ensure_nodes(cluster)
    victim = cluster.nodes["sn2"]
    before = D.count_in_log(victim.log, RECEIVE_TRAIN)
    rc = {**BASE, "num-rounds": 5, "reply-timeout": 20.0, "output-dir": str(tmp_path), "run-name": "fault",
          "loo": "off"}  # the LOO exchange is tested by the secured run: one 6 s exchange less
    run_id = cluster.run(cluster.app, rc)
    deadline = time.time() + 150
    while D.count_in_log(victim.log, RECEIVE_TRAIN) < before + 2:  # it has pulled round 2
        assert time.time() < deadline and victim.alive(), victim.log_tail()
        time.sleep(0.1)
    victim.kill()
    cluster.start_node("sn2", 2, B, data_path=node_data(cluster.root, 2))
    row = cluster.wait(run_id, timeout=240)
    assert row["status"] == "finished:completed", cluster.log(run_id)[-3000:]

    run_dir = tmp_path / "fault"
    s = summary_of(run_dir)
    missed = s["missed_rounds"]
    # the killed node misses the round it was killed in. Another node may miss a round too on a slow machine: in a
    # fresh clone's CI run (2026-12-06, a slow hour: the suite took 666 s) node 1's first sampling reply came after
    # the 20 s reply-timeout (the later rounds took 9 s each), was counted as no reply, and node 1 was resynced. That
    # is the protocol working, not a fault, so it is allowed here: every node that missed a round before the last was
    # resynced (a new node id, as the killed node's, rejoins; a late node answers resync), and every node stays in
    # the federation
    assert "2" in missed and 2 in missed["2"], missed
    assert s["rejoined"].get("2"), s["rejoined"]
    rows = metrics_of(run_dir)
    assert len(rows) == 5
    last = int(rows[-1]["round"])
    assert s["rejected"].get("resync", 0) >= sum(min(m) < last for m in missed.values()), (s["rejected"], missed)
    assert s["rejected"].get("no_reply", 0) >= 1, s["rejected"]
    for r in rows:  # every node active every round, and its reply missing exactly in the rounds it is said to miss
        assert r["n_active"] == B, rows
        assert r["n_replied"] == B - sum(int(r["round"]) in m for m in missed.values()), (rows, missed)
    assert int(rows[-1]["round"]) not in missed["2"]  # the killed node back in the chain by the end
    assert_memory_in_sync(s)


@pytest.mark.deployment
def test_secured_run_tls_and_node_auth(tmp_path_factory, tmp_path):
    """The whole job on a deployment, secured as production runs it: TLS (certificates made here)
    and SuperNode authentication. The run is submitted before any SuperNode is up (the ServerApp
    waits for them); 3 registered nodes run it on their own partition files, and the chain is the
    framework-free chain on those files, bit for bit, with the federated LOO, overview.png and the
    progress lines in ``flwr log``. A 4th node with a registered key not bound to partition 0 that
    claims it is refused; an unregistered node and a plaintext client cannot talk to the SuperLink.
    (The insecure SuperLink runs the two tests above; one full run here, not two, as each costs
    about a minute of Flower processes.)"""
    root = tmp_path_factory.mktemp("secure")
    with D.LocalDeployment(root, secure=True, node_auth=True) as dep:
        dep.start_superlink()
        app = dep.stage(overrides=BASE)
        keys = [dep.node_key(f"node{i}") for i in range(B)]
        impostor_key, impostor_pub = dep.node_key("impostor")  # registered, but bound to no partition
        registered = set(dep.register(*[pub for _, pub in keys], impostor_pub))
        # node-keys binds partition i to keys/node<i>.pub: a registered node with another key
        # that claims partition 0 is refused, counted, and never gets a message of the run
        # reply-timeout bounds the wait for the rightful node 0 once the impostor has filled the count (counted from
        # the ServerApp's start, before any SuperNode): 90 s ran out on a busy CI machine (2026-12-06 18:25); a
        # passing run waits no longer for a larger bound
        rc = {**BASE, "num-rounds": 2, "burn-in": 0, "reply-timeout": 180.0, "output-dir": str(tmp_path),
              "run-name": "secure", "node-keys": str(root / "keys"), "progress": True}
        run_id = dep.run(app, rc)  # before any SuperNode is up: the ServerApp waits for them
        for i, (priv, _) in enumerate(keys):
            dep.start_node(f"sn{i}", i, B, private_key=priv, data_path=node_data(root, i))
        dep.start_node("impostor", 0, B, private_key=impostor_key, data_path=node_data(root, 0))
        intruder_key, _ = dep.node_key("intruder")  # never registered
        intruder = dep.start_node("intruder", 0, B, private_key=intruder_key)
        row = dep.wait(run_id, timeout=300)
        assert row["status"] == "finished:completed", dep.log(run_id)[-3000:]

        run_dir = tmp_path / "secure"
        samples = load_samples(run_dir)
        assert samples.shape == (1, 2, 5) and np.all(np.isfinite(samples))
        # the deployed chain is the framework-free chain on the nodes' files, bit for bit: each node
        # used its own data-path file (not the data its partition-id would generate)
        files_task = build_gaussian_task(b=B, d=5, data_seed=FILE_SEED)
        ref_cfg = {k: v for k, v in rc.items() if k != "node-keys"}
        trace = run_local(resolve(ref_cfg), task=files_task, write=False, keep_trace=True, progress=False).trace
        np.testing.assert_array_equal(samples[0], trace)

        s = summary_of(run_dir)
        t = s["totals"]
        assert t["n_replied"] == 2 * B and t["n_rejected"] == 0 and s["missed_rounds"] == {}
        assert list(s["refused_claims"]) == ["0"], s.get("refused_claims")  # the impostor
        assert t["bits_bound"] >= t["bits_exact"] > 0
        assert t["bytes_message"] > t["bytes_payload"] > 0
        assert_memory_in_sync(s)
        # what the run said reaches flwr log from a deployment's ServerApp process (it does not copy
        # standard error there): where it writes, its progress line, where its samples are
        log = dep.log(run_id)
        for said in ("qlsd-pp: writing", "2/2 rounds (100 %)", "2 rounds done; samples in"):
            assert said in log, (said, log[-3000:])
        # the federated LOO ran over the nodes' training points, and the ServerApp drew overview.png
        assert s["loo"]["mode"] == "psis" and np.isfinite(s["loo"]["elpd_loo"]), s["loo"]
        assert (run_dir / "overview.png").stat().st_size > 10_000
        # nothing is installed at run time
        assert "--disable-runtime-dependency-installation" in dep.superlink.argv
        assert dep.superlink.env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"
        assert all("--allow-runtime-dependency-installation" not in p.argv for p in dep.nodes.values())
        # the unregistered node was refused and gave up
        for _ in range(100):
            if not intruder.alive():
                break
            time.sleep(0.2)
        assert intruder.returncode() not in (None, 0), intruder.log_tail()
        assert "Failed to activate SuperNode" in intruder.log_tail()
        cp = D.flwr_cli(["supernode", "ls", dep.CONNECTION, "--format", "json"], dep.cli_env)
        nodes = json.loads(cp.stdout[cp.stdout.find("{"):])["nodes"]
        assert {int(n["node-id"]) for n in nodes} == registered
        assert sum(n["status"] == "online" for n in nodes) >= B
        # TLS only: the same SuperLink refuses a plaintext client
        plain = root / "home-plain"
        D.write_connection(plain, "plain", dep.address)
        cp = D.flwr_cli(["ls", "plain", "--format", "json"], D.flwr_env(plain), timeout=60)
        assert cp.returncode != 0 or '"success": false' in cp.stdout, cp.stdout


@pytest.mark.deployment
@pytest.mark.ray
def test_simulation_runs_on_an_existing_ray_cluster(tmp_path, attached_ray):
    """`ray start --head` (the session's, tests/conftest.py) then the simulation with QLSD_RAY_ADDRESS: the
    cluster's GCS lists this process as the driver of the run's job (its newest) and the run's ClientApp actors
    on the cluster's node."""
    from qlsd_flwr.run.simulate import run

    o = run({"engine": "ray", "num-clients": 3, "dim": 5, "num-rounds": 3, "burn-in": 1, "client-cpus": 1.0,
             "progress": False, "output-dir": str(tmp_path / "out"), "run-name": "ray"})
    assert o.summary["rounds"] == 3 and o.summary["engine"] == "flower-ray"

    state = D.ray_cluster_state(attached_ray)
    mine = [j for j in state["jobs"] if int(j["DriverPid"]) == os.getpid()]  # the earlier attached runs' too
    assert mine, state["jobs"]
    # Ray's job ids count up (4 bytes, little-endian in their hex form): the newest is this run's
    job = max(mine, key=lambda j: int.from_bytes(bytes.fromhex(j["JobID"]), "little"))
    actors = [a for a in state["actors"] if a["JobID"] == job["JobID"]]
    assert actors and all(a["ActorClassName"] == "ClientAppActor" for a in actors), actors
    assert {a["Address"]["NodeID"] for a in actors} <= set(state["nodes"])


# ---- no processes -----------------------------------------------------------------------------
def test_certificates_and_node_keys(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key

    paths = D.make_tls_certificates(tmp_path, hosts=("127.0.0.1", "superlink.example.org"))
    ca = x509.load_pem_x509_certificate(paths["ca_cert"].read_bytes())
    srv = x509.load_pem_x509_certificate(paths["server_cert"].read_bytes())
    srv.verify_directly_issued_by(ca)
    san = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert san.get_values_for_type(x509.DNSName) == ["superlink.example.org"]
    priv, pub = D.make_node_keypair(tmp_path, "node0")
    key = load_ssh_private_key(priv.read_bytes(), None)  # what flower-supernode does
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp384r1"
    assert try_load_public_key(pub)  # what `flwr supernode register` does


def test_node_loads_its_partition_from_data_path(tmp_path):
    from qlsd_flwr.tasks import loading
    from qlsd_flwr.tasks.gaussian import client_data

    cfg = resolve(BASE)
    path = D.write_partition(BASE, 1, tmp_path / "p1.npz")
    pot, _, d, _ = loading.load_client(cfg, 1, data_path=str(path))
    np.testing.assert_array_equal(pot.y, client_data(1, 5, 0))
    assert d == 5
    np.savez(tmp_path / "other.npz", y=np.ones((7, 5)))  # the file, not partition-id, decides
    pot, _, _, _ = loading.load_client(cfg, 1, data_path=str(tmp_path / "other.npz"))
    assert pot.n_data == 7
    np.savez(tmp_path / "bad.npz", y=np.ones((7, 4)))
    with pytest.raises(ValueError, match="dim"):
        loading.load_client(cfg, 1, data_path=str(tmp_path / "bad.npz"))


def test_staged_app_declares_every_key_and_leaves_pyproject_alone(tmp_path):
    import tomllib

    before = (D.REPO / "pyproject.toml").read_bytes()
    app = D.stage_app(tmp_path / "app", config_file=D.REPO / "conf" / "deploy.toml", overrides={"num-rounds": 7,
                                                                                                 "burn-in": 2})
    with open(app / "pyproject.toml", "rb") as f:
        py = tomllib.load(f)
    cfg = py["tool"]["flwr"]["app"]["config"]
    assert set(cfg) == set(DEFAULTS) and cfg["num-rounds"] == 7 and cfg["theta-star"] == "optimise"
    assert "federations" not in py["tool"]["flwr"]
    assert (app / "qlsd_flwr" / "flower" / "client_app.py").exists()
    assert (D.REPO / "pyproject.toml").read_bytes() == before
    assert D.format_run_config({"a": 1, "b": "x y", "c": True, "d": 0.5}) == 'a=1 b="x y" c=true d=0.5'
