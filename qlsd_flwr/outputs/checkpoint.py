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

NAME = "checkpoint.npz"
FORMAT = 3  # 2: the metric in its tagged encoding (qlsd_flwr.core.metric.to_array); 3: metrics.csv counts the downlink
# keys that may differ between a run and its resumption (they do not change the chain)
RESUME_FREE_KEYS = ("num-rounds", "progress", "plot", "verbose", "checkpoint-every", "resume", "engine",
                    "client-cpus", "reply-timeout", "output-dir", "run-name", "device",
                    "vectorised-backend")  # the backend itself is checked against the checkpoint's
_SAME_CHAIN_ENGINES = ("local", "inprocess", "ray")


#: the largest magnitude a checkpoint's float may hold (a damaged or crafted state is refused by name)
VALUE_MAX = 1e150


class CheckpointError(ConfigError):
    """A checkpoint is missing, damaged or belongs to another run (one line, naming the file)."""


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
        _check_server_parts(cfg, meta, arrays, path_in(run_dir))
    elif cfg.kind.local:  # the rivals' servers (engines.vectorised.rivals)
        _check_runner_parts(cfg, meta, arrays, path_in(run_dir))
    old = meta["config"]
    from qlsd_flwr.config import not_applicable

    skip = not_applicable(cfg.raw)  # config.json leaves them out: a resume may not know their values
    bad = [k for k in set(old) | set(cfg.raw)
           if k not in RESUME_FREE_KEYS and k not in skip and not same_value(k, old.get(k), cfg.raw.get(k))]
    if bad:
        raise ConfigError(f"resume: {', '.join(sorted(bad))} differ from the checkpointed run in {run_dir}")
    if int(meta["k"]) > cfg.num_rounds:
        raise ConfigError(f"resume: the checkpoint is at round {meta['k']}, past num-rounds = {cfg.num_rounds}")
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


def validate(meta: dict, arrays: dict, path) -> None:
    """Check a checkpoint's contents before any state is built from them (a valid CRC says the
    bytes are those written, not that they are sane): ``CheckpointError`` naming the field."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {why}")

    try:
        k = meta["k"]
        rec = meta["recorder"]
        if not isinstance(meta["config"], dict):
            raise bad("'config' is not a table")
        if not isinstance(rec, dict):
            raise bad("'recorder' is not a table")
        for name, v in (("k", k), *((f"recorder.{f}", rec[f]) for f in ("n_draws", "rounds", "csv_bytes"))):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= 2**62:
                raise bad(f"{name} must be an integer >= 0 (got {v!r})")
        if rec["rounds"] > k and meta.get("kind") == "server":
            raise bad(f"recorder.rounds = {rec['rounds']} is past k = {k}")
        if not isinstance(rec["totals"], dict):
            raise bad("recorder.totals is not a table")
    except KeyError as exc:
        raise bad(f"missing field {exc}") from None
    for name, a in arrays.items():
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise bad(f"array {name!r} has non-finite values")
        if a.dtype.kind == "f" and a.size and float(np.max(np.abs(a))) > VALUE_MAX:
            raise bad(f"array {name!r} holds {float(np.max(np.abs(a))):.3g}, beyond ±{VALUE_MAX:.0e} (no chain "
                      f"state reaches it: the run would stop as run away first)")
        if a.dtype.kind in "iu" and a.size and (int(a.min()) < -2 or int(a.max()) >= 2**62):
            raise bad(f"array {name!r} holds an integer outside [-2, 2^62)")
    for name in ("rejected", "missed_rounds"):
        _check_table(meta.get(name, {}), name, bad)
    for c, m in enumerate(meta.get("chain_meta") or []):
        if isinstance(m, dict):
            for name in ("rejected", "missed_rounds"):
                _check_table(m.get(name, {}), f"chain_meta[{c}].{name}", bad)
    if meta.get("kind") == "server" and not (isinstance(meta.get("ts_info"), dict)
                                             and isinstance(meta.get("rejected"), dict)):
        raise bad("'ts_info' and 'rejected' must be tables")
    if meta.get("kind") == "server" and "chains" in meta:  # a several-chain run (protocol.chains)
        C, metas = meta["chains"], meta.get("chain_meta")
        if isinstance(C, bool) or not isinstance(C, int) or C < 2:
            raise bad(f"chains must be an integer >= 2 (got {C!r})")
        if not isinstance(metas, list) or len(metas) != C or not all(isinstance(m, dict) for m in metas):
            raise bad(f"chain_meta must be a list of {C} tables")
        for c, m in enumerate(metas):
            if m.get("k") != k:
                raise bad(f"chain_meta[{c}].k = {m.get('k')!r}, the checkpoint is at k = {k}")
            _check_server_chain(m, {n[len(f"c{c}."):]: a for n, a in arrays.items() if n.startswith(f"c{c}.")},
                                lambda why, c=c: bad(f"chain {c}: {why}"))
    elif meta.get("kind") == "server":
        _check_server_chain(meta, arrays, bad)
    if meta.get("kind") == "vectorised" and "runner" in meta:  # the rivals' chains' servers (engines.vectorised.rivals)
        metas = (run := meta["runner"] if isinstance(meta["runner"], dict) else {}).get("chain_meta")
        if not isinstance(metas, list) or not metas or not all(isinstance(m, dict) for m in metas):
            raise bad("runner.chain_meta must be a list of tables")
        if not isinstance(run.get("ts_info"), dict):
            raise bad("runner.ts_info must be a table")
        _check_table(run.get("rejected"), "runner.rejected", bad)
        for c, m in enumerate(metas):
            if m.get("k") != k:
                raise bad(f"runner.chain_meta[{c}].k = {m.get('k')!r}, the checkpoint is at k = {k}")
            for name in ("rejected", "missed_rounds"):
                _check_table(m.get(name, {}), f"runner.chain_meta[{c}].{name}", bad)
            _check_server_chain(m, {n[len(f"run_c{c}."):]: a for n, a in arrays.items() if n.startswith(f"run_c{c}.")},
                                lambda why, c=c: bad(f"chain {c}: {why}"))


def _check_server_parts(cfg: RunConfig, meta: dict, arrays: dict, path) -> None:
    """What the run ``cfg`` will read from a server checkpoint is there: one chain per
    ``num-chains`` and, for a variant with memory, each chain's ``η_i`` mirrors and ``η``."""
    chains = meta.get("chains", 1)
    if chains != cfg.num_chains:
        raise CheckpointError(f"checkpoint {path}: it holds {chains} chain(s), the run has num-chains = "
                              f"{cfg.num_chains}")
    prefixes = [""] if chains == 1 else [f"c{c}." for c in range(chains)]
    need = ("theta", "eta_i", "eta") if cfg.memory else ("theta",)
    for pre in prefixes:
        for name in need:
            if pre + name not in arrays:
                raise CheckpointError(f"checkpoint {path}: array {pre + name!r} is missing")


def _check_runner_parts(cfg: RunConfig, meta: dict, arrays: dict, path) -> None:
    """A rival's vectorised checkpoint: a server state per chain, ``b`` clients each, the claims at θ*."""
    metas = meta["runner"].get("chain_meta") if isinstance(meta.get("runner"), dict) else None
    if not isinstance(metas, list) or len(metas) != cfg.num_chains:
        raise CheckpointError(f"checkpoint {path}: 'runner' must hold {cfg.num_chains} chain(s) (num-chains)")
    for c in range(cfg.num_chains):
        acked = arrays.get(f"run_c{c}.anchor_acked")
        if acked is None or acked.shape != (cfg.b,):
            raise CheckpointError(f"checkpoint {path}: chain {c}: array 'anchor_acked' must hold num-clients = {cfg.b}")
        if cfg.kind.at_theta_star and f"run_c{c}.claims" not in arrays:
            raise CheckpointError(f"checkpoint {path}: chain {c}: the claims at θ* ('claims') are missing")


def _check_table(t, name: str, bad) -> None:
    """``rejected`` ({reason: count}) and ``missed_rounds`` ({client: [rounds]}) as written."""
    if not isinstance(t, dict):
        raise bad(f"{name!r} must be a table")
    for k, v in t.items():
        if name.endswith("rejected"):
            ok = isinstance(k, str) and _small_int(v)
        else:
            ok = isinstance(k, str) and k.isdigit() and isinstance(v, list) and all(_small_int(r) for r in v)
        if not ok:
            raise bad(f"{name!r} holds {k!r}: {str(v)[:40]!r}, not a "
                      f"{'count' if name.endswith('rejected') else 'list of rounds of a client index'}")


def _small_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and 0 <= v < 2**62


def _check_server_chain(meta: dict, arrays: dict, bad) -> None:
    """One chain's fields in a server checkpoint (:meth:`QLSDServer.snapshot`)."""
    zv = meta.get("zeta_version")
    if isinstance(zv, bool) or not isinstance(zv, int) or not -1 <= zv < 2**62:
        raise bad(f"zeta_version must be an integer in [-1, 2^62) (got {zv!r})")
    if not isinstance(meta.get("rejected"), dict) or not isinstance(meta.get("missed_rounds"), dict):
        raise bad("'rejected' and 'missed_rounds' must be tables")
    theta = arrays.get("theta")
    if theta is None or theta.ndim != 1:
        raise bad("array 'theta' must be one vector")
    d = theta.shape[0]
    for name in ("anchor_acked", "eta_count", "needs_resync"):
        if name not in arrays or arrays[name].ndim != 1:
            raise bad(f"array {name!r} missing or not one vector")
    b = arrays["anchor_acked"].shape[0]
    for name, shape in (("eta_count", (b,)), ("needs_resync", (b,)), ("eta_i", (b, d)), ("eta", (d,)),
                        ("zeta", (d,)), ("theta_star", (d,))):
        if name in arrays and arrays[name].shape != shape:
            raise bad(f"array {name!r} has shape {arrays[name].shape}, expected {shape}")
    metric_array = arrays.get("metric")
    if metric_array is not None:
        from qlsd_flwr.core.metric import MetricError, from_array

        try:
            from_array(metric_array, d)
        except MetricError as exc:
            raise bad(f"array 'metric': {exc}") from None
    g = meta.get("gamma", 1.0)
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not (0 < g < float("inf")):
        raise bad(f"gamma must be a positive finite number (got {g!r})")


def recorder_part(meta: dict, arrays: dict) -> dict:
    """The output recorder's saved position (for :class:`qlsd_flwr.outputs.recorder.Recorder`)."""
    return {**meta["recorder"], **{k[4:]: v for k, v in arrays.items() if k.startswith("rec_")}}
