"""Checkpoint and resume: a killed run continues where its last checkpoint left it.

``checkpoint-every = N`` (rounds; ``0``, the default, switches it off) makes a writing run save
``checkpoint.npz`` in its run folder after every ``N``-th round. The file holds everything the
chain needs to go on: ``θ_k``, the anchor ``ζ`` and its version, the server's ``η_i`` mirrors and
``η``, the per-client memory counters and anchor versions, the round counter ``k`` (the random
streams are counter-based, keyed by ``(seed, stream, round, client)``, so ``k`` *is* the state
of every stream), ``θ*``, the rejection and bit totals, and the position of the output
recorder (draws and metric rows written so far, the running sums of the summary). The
vectorised engine saves its per-chain state and streamed statistics instead.

It is written atomically: a temporary file in the same folder, flushed and ``fsync``-ed, then
``os.replace``-d over the old one (and the folder ``fsync``-ed), so a kill at any moment leaves
either the previous complete checkpoint or the new complete one. Before it is written, the
draws and metric rows it counts are flushed and ``fsync``-ed, so the files on disk always hold
at least what the checkpoint says. The draws always stream to an append-only raw file
``draws.f8`` (HDF5 is not crash-safe: a process killed while ``samples.nc`` is open for writing
can leave it unreadable); ``samples.nc`` is built from it when the run stops. A run stopped by
Ctrl-C or SIGTERM after a checkpoint keeps ``draws.f8`` and may resume (``summary.json`` then
has ``stopped``); a second process on a folder that a run is writing is refused
(:func:`qlsd_flwr.outputs.run_dir.lock_run_dir`).

Resume: ``qlsd-flwr run --set resume=<run folder>`` (or ``simulate.run({"resume": path})``)
reads the folder's ``config.json``, applies the keys given with it (only those in
:data:`RESUME_FREE_KEYS` may differ from the original, e.g. ``num-rounds``, ``progress``, or
``engine`` among ``local``/``inprocess``/``ray``, which run the same chain), truncates
``draws.f8`` and ``metrics.csv`` to the checkpoint's round and appends to them. The resumed
chain is bitwise the chain an uninterrupted run with the same seed produces, and the final
``samples.nc``/``metrics.csv`` hold each round exactly once.

On the Flower path the clients' ``context.state`` (their ``η_i`` and anchor cache) may be gone
after a restart: the resumed server marks every client as needing a resync, so its first
message to each client carries the anchor (ζ or θ*) and the server's mirror of the client's
``η_i`` with its update count; the client installs them and computes the round exactly as it
would have (see :mod:`qlsd_flwr.protocol.wire`), with no ``resync`` round lost.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from qlsd_flwr.outputs.jsonio import dumps

from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.errors import CheckpointError
from qlsd_flwr.outputs.checkpoint_checks import (
    check_runner_parts,
    check_server_parts,
    check_step_and_metric,
    validate,
)

NAME = "checkpoint.npz"
FORMAT = 3  # 2: the metric in its tagged encoding (qlsd_flwr.core.metric_codec.to_array); 3: metrics.csv counts the downlink
# keys that may differ between a run and its resumption (they do not change the chain)
RESUME_FREE_KEYS = ("num-rounds", "progress", "plot", "verbose", "checkpoint-every", "resume", "engine",
                    "convergence-criterion", "loo",  # what is judged and reported after the chain, not the chain
                    "client-cpus", "reply-timeout", "output-dir", "run-name", "device",
                    "vectorised-backend")  # the backend itself is checked against the checkpoint's
_SAME_CHAIN_ENGINES = ("local", "inprocess", "ray")



def path_in(run_dir) -> Path:
    return Path(run_dir) / NAME


def due(cfg: RunConfig, rounds_done: int) -> bool:
    """Whether a checkpoint is written after ``rounds_done`` rounds."""
    n = cfg.checkpoint_every
    return n > 0 and rounds_done > 0 and rounds_done % n == 0


def enabled(cfg: RunConfig) -> bool:
    return cfg.checkpoint_every > 0 or bool(cfg.get("resume"))


def resume_dir(cfg: RunConfig) -> Path | None:
    r = str(cfg.get("resume") or "")
    return Path(r) if r else None


# ------------------------------------------------------------------------------ file I/O
def save(path, arrays: dict, meta: dict) -> None:
    """Write ``arrays`` and the JSON ``meta`` to ``path`` atomically (temp file, fsync, replace)."""
    path = Path(path)
    buf = io.BytesIO()
    payload = {f"a_{k}": np.asarray(v) for k, v in arrays.items() if v is not None}
    payload["meta"] = np.frombuffer(dumps({"format": FORMAT, **meta}, strict=False).encode(), dtype=np.uint8)
    np.savez(buf, **payload)
    for stale in path.parent.glob(".checkpoint-*.tmp"):  # left by a write that was killed
        try:
            stale.unlink()
        except OSError:
            pass
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def load(path) -> tuple[dict, dict]:
    """``(meta, arrays)`` of a checkpoint file; raises :class:`CheckpointError` if unreadable."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path} (was the run started with checkpoint-every > 0?)")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {k[2:]: z[k] for k in z.files if k.startswith("a_")}
    except Exception as exc:  # a damaged file: zip, npy or JSON errors
        raise CheckpointError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')!r}, expected {FORMAT}")
    return meta, arrays


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(f) -> None:
    f.flush()
    os.fsync(f.fileno())


# ------------------------------------------------------------------------------ resume
def load_for_resume(cfg: RunConfig, kind: str) -> tuple[Path, dict, dict]:
    """The run folder, meta and arrays of the checkpoint ``cfg`` resumes, checked against ``cfg``."""
    run_dir = resume_dir(cfg)
    meta, arrays = load(path_in(run_dir))
    if (run_dir / "summary.json").exists() and not _stopped(run_dir / "summary.json"):
        raise ConfigError(f"resume: the run in {run_dir} already finished (summary.json exists)")
    if meta.get("kind") != kind:
        raise ConfigError(f"resume: the checkpoint in {run_dir} was written by a {meta.get('kind')} "
                          f"engine run; resume it with engine = "
                          f"{'vectorised' if meta.get('kind') == 'vectorised' else 'local, inprocess or ray'}")
    validate(meta, arrays, path_in(run_dir))
    if kind == "server":
        check_server_parts(cfg, meta, arrays, path_in(run_dir))
    elif cfg.kind.local:  # the rivals' servers (engines.vectorised.rivals)
        check_runner_parts(cfg, meta, arrays, path_in(run_dir))
    old = meta["config"]
    from qlsd_flwr.config import not_applicable

    skip = not_applicable(cfg.raw)  # config.json leaves them out: a resume may not know their values
    bad = [k for k in set(old) | set(cfg.raw)
           if k not in RESUME_FREE_KEYS and k not in skip and not same_value(k, old.get(k), cfg.raw.get(k))]
    if bad:
        raise ConfigError(f"resume: {', '.join(sorted(bad))} differ from the checkpointed run in {run_dir}")
    if int(meta["k"]) > cfg.num_rounds:
        raise ConfigError(f"resume: the checkpoint is at round {meta['k']}, past num-rounds = {cfg.num_rounds}")
    check_step_and_metric(cfg, meta, arrays, path_in(run_dir))
    return run_dir, meta, arrays


def same_value(key: str, a, b) -> bool:
    """Whether two values of ``key`` mean the same, read by the key table's rules: ``p = 1`` and
    ``"1.0"`` agree, so do ``"0.5"`` and ``"0.5,0.5,0.5"`` (one value for all clients), variant
    aliases (``qlsd++``/``qlsd-pp``), and a key missing from an older checkpoint and its default;
    a task plug-in's ``module:callable`` is compared as written (it is case-sensitive)."""
    from qlsd_flwr.config import ALIASES
    from qlsd_flwr.keys import BY_NAME, DEFAULTS, parse

    if key in DEFAULTS:
        a = DEFAULTS[key] if a is None else a
        b = DEFAULTS[key] if b is None else b
    if key in BY_NAME:
        try:
            pa, pb = parse(key, a), parse(key, b)
        except ConfigError:
            return str(a) == str(b)
        if BY_NAME[key].kind == "choice":
            na, nb = str(pa).strip(), str(pb).strip()
            if ":" in na or ":" in nb:  # a plug-in path
                return na == nb
            na, nb = na.lower(), nb.lower()
            return ALIASES.get(na, na) == ALIASES.get(nb, nb)
        if isinstance(pa, list) and isinstance(pb, list):
            if len(pa) != len(pb):  # one value for all clients against one per client
                short, long_ = (pa, pb) if len(pa) < len(pb) else (pb, pa)
                return len(short) == 1 and all(x == short[0] for x in long_)
        return pa == pb
    return str(a) == str(b)


def _stopped(summary_path: Path) -> bool:
    """A summary written when the run was stopped (Ctrl-C, SIGTERM): the run may go on."""
    try:
        return "stopped" in json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return False


def recorder_part(meta: dict, arrays: dict) -> dict:
    """The output recorder's saved position (for :class:`qlsd_flwr.outputs.recorder.Recorder`)."""
    return {**meta["recorder"], **{k[4:]: v for k, v in arrays.items() if k.startswith("rec_")}}
