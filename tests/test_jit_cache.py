"""Numba's cache is shared by identical copies of the package and by nothing else (``qlsd_flwr/jit.py``).

``flwr run`` and a SuperNode run the app from a fresh copy of ``qlsd_flwr`` each time; each copy
must load the kernels the first compiled, and a copy whose numba sources differ must compile its own.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "qlsd_flwr"
PROBE = ("import numpy as np\n"
         "from qlsd_flwr.core import rng\n"
         "assert rng.__file__.startswith({where!r}), rng.__file__\n"
         "print(int(rng.mix_nb(np.uint64(3))), sum(rng.mix_nb.stats.cache_hits.values()))\n")


def _copy(dst: Path, edit: bool = False) -> Path:
    shutil.copytree(PKG, dst / "qlsd_flwr", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if edit:  # a copy whose numba sources differ (a comment is enough: the hash reads the bytes)
        with open(dst / "qlsd_flwr" / "core" / "rng.py", "a") as f:
            f.write("\n# an edited copy\n")
    return dst


def _probe(where: Path, cache: Path) -> tuple[int, int]:
    env = {**os.environ, "PYTHONPATH": str(where), "NUMBA_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", PROBE.format(where=str(where))], env=env, cwd=where,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    value, hits = out.stdout.split()
    return int(value), int(hits)


def test_copies_of_the_package_share_compiled_kernels_and_an_edited_copy_does_not(tmp_path):
    cache = tmp_path / "cache"
    a, b, c = (_copy(tmp_path / "a"), _copy(tmp_path / "b"), _copy(tmp_path / "c", edit=True))
    first, hits_a = _probe(a, cache)
    value_b, hits_b = _probe(b, cache)
    value_c, hits_c = _probe(c, cache)
    assert hits_a == 0 and hits_b == 1, (hits_a, hits_b)  # b, at another path, loads a's kernel
    assert hits_c == 0  # c's sources differ: compiled again, into its own folder
    assert first == value_b == value_c
    folders = sorted(p.name for p in cache.iterdir())
    assert len(folders) == 2 and all(f.startswith("src-") for f in folders), folders
    for f in folders:
        assert any((cache / f / "qlsd_flwr_core").glob("rng.mix_nb-*.nbi")), f
