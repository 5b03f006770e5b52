"""What a careless file does (issue 38): one line naming the file and the key (exit 2 from the CLI), never a
traceback, and never a wrong run.

* A ``.npy`` metric whose header claims 93 GiB, a ``.npz`` renamed ``.npy``, an empty file, a string array,
  an empty array, entries of 1e300 or 1e-300: refused by the header or the values, before anything is
  allocated.
* A resume whose ``draws.f8`` is empty, deleted or truncated; a checkpoint with θ stored as strings; a
  checkpoint's γ that is not the configuration's (or its preparation's), and a metric put into an
  identity-metric run's checkpoint: refused with one line naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qlsd_flwr.core.metric import Diagonal, MetricError
from qlsd_flwr.core.metric_codec import to_array
from qlsd_flwr.outputs import checkpoint as ckpt
from qlsd_flwr.outputs.checkpoint import CheckpointError
from qlsd_flwr.outputs.metric_file import metric_from_file
from qlsd_flwr.run import simulate

ROOT = Path(__file__).resolve().parents[1]
D = 5


def _npy_files(tmp: Path) -> dict:
    np.save(tmp / "ok.npy", np.ones(D))
    raw = (tmp / "ok.npy").read_bytes()
    (tmp / "huge.npy").write_bytes(raw.replace(b"(5,)", b"(12500000000,)"))  # claims 93 GiB of float64
    np.savez(tmp / "x.npz", a=np.ones(D))
    os.replace(tmp / "x.npz", tmp / "npz.npy")
    np.save(tmp / "str.npy", np.array(["a"] * D))
    np.save(tmp / "empty.npy", np.array([]))
    (tmp / "zero.npy").write_bytes(b"")
    (tmp / "cut.npy").write_bytes(raw[:-9])  # a header for 5 numbers, 3.9 of them
    np.save(tmp / "big.npy", np.full(D, 1e300))
    np.save(tmp / "tiny.npy", np.full(D, 1e-300))
    return {"huge": "holds an array of shape (12500000000,)", "npz": "is a zip archive",
            "str": "holds <U1 values; expected numbers", "empty": "holds an array of shape (0,)",
            "zero": "is not a .npy file", "cut": "cannot read", "big": "entries must lie within",
            "tiny": "entries must lie within"}


def test_a_careless_metric_file_is_one_line_naming_it(tmp_path):
    for name, words in _npy_files(tmp_path).items():
        with pytest.raises(MetricError, match=re.escape(words)) as exc:
            metric_from_file(str(tmp_path / f"{name}.npy"), D)
        assert f"{name}.npy" in str(exc.value) and "\n" not in str(exc.value)
    assert isinstance(metric_from_file(str(tmp_path / "ok.npy"), D), Diagonal)


def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path):
    _npy_files(tmp_path)
    cp = subprocess.run([sys.executable, "-m", "qlsd_flwr.cli", "run", "--set", "engine=local", "--set", f"dim={D}",
                         "--set", "num-clients=3", "--set", "num-rounds=3", "--set", "burn-in=0", "--set",
                         f"metric={tmp_path / 'huge.npy'}", "--set", f"output-dir={tmp_path / 'out'}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cp.returncode == 2, cp.stderr[-2000:]
    assert "Traceback" not in cp.stderr and "huge.npy' holds an array of shape (12500000000,)" in cp.stderr


KILLER = """
import json, os, signal, sys
from qlsd_flwr.protocol import server
from qlsd_flwr.run import simulate
end_round = server.QLSDServer.end_round
def killing(self):
    row = end_round(self)
    if self.state.k == 12 and self.observer is not None:
        rec = self.observer.recorder
        rec._flush(); rec._csv_file.flush(); rec._raw.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return row
server.QLSDServer.end_round = killing
simulate.run(json.loads(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A local run killed at round 12 after its checkpoint at round 10: its folder, to copy and damage."""
    out = tmp_path_factory.mktemp("careless")
    o = {"engine": "local", "dim": D, "num-clients": 3, "num-rounds": 20, "burn-in": 0, "checkpoint-every": 5,
         "progress": False, "loo": "off", "plot": False, "output-dir": str(out), "run-name": "ref"}
    cp = subprocess.run([sys.executable, "-c", KILLER, json.dumps(o)], cwd=ROOT, capture_output=True, text=True,
                        timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert cp.returncode == -9, cp.stderr[-2000:]
    return out / "ref"


def _damaged(killed: Path, tmp_path: Path, damage) -> Path:
    d = tmp_path / "run"
    shutil.copytree(killed, d)
    (d / ".lock").unlink(missing_ok=True)
    damage(d)
    return d


def _checkpoint(change):
    def damage(d):
        path = ckpt.path_in(d)
        meta, arrays = ckpt.load(path)
        change(meta, arrays)
        ckpt.save(path, arrays, {k: v for k, v in meta.items() if k != "format"})
    return damage


def _truncate(d):
    raw = (d / "draws.f8").read_bytes()
    (d / "draws.f8").write_bytes(raw[: len(raw) // 3 + 3])


CASES = {
    "draws emptied": (lambda d: (d / "draws.f8").write_bytes(b""), "draws.f8 holds 0 bytes, the checkpoint counts"),
    "draws deleted": (lambda d: (d / "draws.f8").unlink(), "draws.f8 is missing"),
    "draws truncated": (_truncate, "draws.f8 holds 163 bytes, the checkpoint counts 400"),
    "theta as strings": (_checkpoint(lambda m, a: a.__setitem__("theta", np.array([repr(x) for x in a["theta"]]))),
                         "array 'theta' holds <U"),
    "gamma 1e-300": (_checkpoint(lambda m, a: m.__setitem__("gamma", 1e-300)),
                     "gamma: its step 1e-300 is not the configuration's gamma = 0.00049"),
    "gamma-c 1e-300": (_checkpoint(lambda m, a: m["ts_info"].__setitem__("gamma_c", 1e-300)),
                       "gamma-c: its c 1e-300 is not the configuration's"),
    "a metric put in": (_checkpoint(lambda m, a: a.__setitem__("metric", to_array(Diagonal(np.full(D, 1e-6))))),
                        "metric: its array 'metric' holds a diagonal metric, the run's is identity"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_run_folder_is_refused_by_its_resume_naming_the_file(killed, tmp_path, case):
    damage, words = CASES[case]
    d = _damaged(killed, tmp_path, damage)
    with pytest.raises(CheckpointError, match=words):
        simulate.run({"resume": str(d)})


def test_the_undamaged_copy_resumes(killed, tmp_path):
    d = _damaged(killed, tmp_path, lambda d: None)
    res = simulate.run({"resume": str(d)})
    assert res.summary["resumed_from_round"] == 10 and res.summary["rounds"] == 20


def test_data_too_big_for_memory_is_refused_before_it_is_made():
    """dim = 100000 with num-clients = 100000: about 10^4 GiB of points, refused by name in a second or two
    (the clients' sizes are drawn, not their points)."""
    from qlsd_flwr.config import ConfigError
    from qlsd_flwr.tasks.gaussian import build_gaussian_task

    with pytest.raises(ConfigError, match=r"num-clients × dim: the task's data alone need about \d+\.\d GiB"):
        build_gaussian_task(b=100_000, d=100_000)
