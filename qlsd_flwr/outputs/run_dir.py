"""A run's folder: made under ``output-dir`` (a name the user chose is never silently changed), and locked
for as long as a run writes it."""

from __future__ import annotations

import os
import time
from pathlib import Path


def refuse_taken(output_dir: str | os.PathLike, run_name: str) -> str:
    """The run name checked (:func:`~qlsd_flwr.keys.check_run_name`), and ``ConfigError`` if the user chose one
    whose folder exists: a name the user chose is never silently changed. :func:`qlsd_flwr.run.simulate.run`
    asks before the preparation, so a taken name costs no exchange."""
    from qlsd_flwr.keys import check_run_name  # a run never writes outside output-dir

    given = check_run_name(run_name)
    path = Path(output_dir) / given
    if given and path.exists():
        from qlsd_flwr.config import ConfigError

        raise ConfigError(f"run-name: {path} already exists; choose another run-name, leave it empty for a "
                          f"timestamped folder, or continue that run with resume = {path}")
    return given


def make_run_dir(output_dir: str | os.PathLike, run_name: str, variant: str) -> Path:
    given = refuse_taken(output_dir, run_name)
    name = given or f"{time.strftime('%Y%m%d-%H%M%S')}-{variant}"
    path = Path(output_dir) / name
    i = 1
    while path.exists():  # two timestamped runs started in the same second
        path = Path(output_dir) / f"{name}-{i}"
        i += 1
    path.mkdir(parents=True)
    return path


#: the run folders this process has locked, in order (the CLI names the last when a stop ends a run)
OPENED: list[Path] = []


def lock_run_dir(run_dir: Path):
    """An exclusive lock on ``<run_dir>/.lock`` for as long as a run writes the folder (two runs,
    e.g. two resumes of one folder, would corrupt each other's files); ``ConfigError`` naming the
    folder and the process that holds it. The lock goes with the process, however it ends."""
    import fcntl

    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        from qlsd_flwr.keys import ConfigError

        raise ConfigError(f"run folder {run_dir} is in use by another run (process {holder}); wait for it "
                          "to end, or resume into another copy of the folder") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    OPENED.append(Path(run_dir))
    return f
