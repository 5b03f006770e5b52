"""A run's output folder, the same on every engine.

``<output-dir>/<run-name>/``
  * ``samples.nc`` — ArviZ InferenceData (netCDF4/HDF5): group ``posterior`` with variable
    ``theta`` of dims ``(chain, draw, theta_dim_0)``, streamed to disk in chunks as the chain
    runs (memory stays flat: the kept draws go to ``draws.f8``, an append-only raw file that a
    kill cannot damage, and ``samples.nc`` is built from it when the run stops, whatever stops
    it: the end, a divergence, Ctrl-C or SIGTERM); group ``sample_stats`` with, per kept draw, the ``round`` it was
    taken at and that round's active, replying and rejected clients and exact uplink bits (the
    round's row of ``metrics.csv``; on the vectorised engine, totals over its chains); provenance attributes
    (package and Flower versions, the seed, a hash of the configuration) on both groups.
    ``draw`` counts the kept draws from 0, as ArviZ does. ``arviz.from_netcdf(path)`` loads it.
  * ``metrics.csv`` — one row per round: active and replying clients, rejected replies, uplink bits
    (analytic bound, exact code length), uplink bytes (payload, Flower message), seconds, and the
    downlink: ``bits_down`` (the code length of what the server sent) and ``bytes_message_down``
    (the Flower messages' size; 0 where no Flower message travels: the local and vectorised engines).
  * ``config.json`` — the resolved configuration.
  * ``summary.json`` — totals, ``bits`` (every bit of the run, both ways, phase by phase:
    :mod:`qlsd_flwr.outputs.bits`), and posterior error when the task knows its posterior.
  * while the run goes on, ``draws.f8`` (see above); with ``checkpoint-every > 0``,
    ``checkpoint.npz`` (:mod:`qlsd_flwr.outputs.checkpoint`).
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import time
import zlib
from pathlib import Path

import h5netcdf
import numpy as np

from qlsd_flwr.errors import CheckpointError
from qlsd_flwr.outputs.bits import bits_object
from qlsd_flwr.outputs.run_dir import lock_run_dir

from qlsd_flwr.outputs.jsonio import dumps, write as write_json

log = logging.getLogger("qlsd_flwr")

METRIC_FIELDS = ["round", "n_active", "n_replied", "n_rejected", "skipped", "bits_bound",
                 "bits_exact", "bytes_payload", "bytes_message", "seconds", "bits_down", "bytes_message_down"]


CHUNK_BYTES = 1 << 22  # an HDF5 chunk of samples.nc holds at most ~4 MiB (one draw at least)


def _chunk_draws(num_chains: int, dim: int, chunk: int) -> int:
    """Draws per HDF5 chunk: ``chunk`` (≤ 4096), fewer when a chunk would pass ``CHUNK_BYTES``
    (a LeNet-5 chain, d = 61,706, gets 8 draws a chunk, so a short run's file is not 250 MB)."""
    return max(1, min(chunk, 4096, CHUNK_BYTES // (8 * max(1, num_chains * dim))))


class Recorder:
    """Writes samples, per-round metrics, config and summary of one run.

    The kept draws stream to the append-only file ``draws.f8`` (float64, ``(draw, chain, d)``)
    and :meth:`close` builds ``samples.nc`` from it: unlike an HDF5 file open for writing, a raw
    file survives a kill (an HDF5 file left open by SIGTERM was unreadable), and
    :meth:`checkpoint_state` / ``resume`` cut it back to a checkpoint's position exactly.
    ``resume`` (a position from :meth:`checkpoint_state`) reopens a run folder and appends.
    """

    RAW = "draws.f8"

    def __init__(self, run_dir: Path, config: dict, dim: int, num_chains: int, burn_in: int,
                 thin: int, chunk: int = 512, resume: dict | None = None,
                 labels=None):
        self.provenance = provenance(config)
        self.config = config if isinstance(config, dict) else {}
        self.convergence: dict | None = None
        # names of θ's coordinates (``W[3,1]``, ``conv1.weight[0,0,2,4]``): the ``theta_dim_0``
        # coordinate ArviZ shows (``theta[W[3,1]]``); integers when the task has none
        if labels is None and resume is not None:  # a resumed run whose front end does not know them (a
            labels = resume.get("labels")  # user's ServerApp: initial_arrays named them, and go with resume)
        ok = isinstance(labels, (list, tuple, np.ndarray)) and len(labels) == dim  # a checkpoint's: any JSON
        self.labels = [str(x) for x in labels] if ok else None
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run_dir(self.dir)  # before any file of the folder is touched
        self._closed = False
        self.burn_in, self.thin, self.chunk = burn_in, thin, chunk
        self.dim, self.num_chains = dim, num_chains
        self._buf: list[np.ndarray] = []
        self.n_draws = 0
        self.totals = {k: 0 for k in ("n_active", "n_replied", "n_rejected", "skipped", "bits_bound", "bits_exact",
                                      "bytes_payload", "bytes_message", "bits_down", "bytes_message_down")}
        self.rounds = 0
        # CRC-32 of what draws.f8 and metrics.csv hold so far: a checkpoint records them, and a
        # resume refuses a file whose bytes up to the checkpoint are not those written
        self.crc = {"draws": 0, "csv": 0}
        self._csv_crc_pos = 0
        self.sum_theta = np.zeros((num_chains, dim))
        self.sum_theta2 = np.zeros((num_chains, dim))
        self.t0 = time.perf_counter()
        self._nc = None
        if resume is not None:
            self._reopen(resume)
            return
        (self.dir / "config.json").write_text(dumps(config, indent=2))
        self._csv_file = open(self.dir / "metrics.csv", "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=METRIC_FIELDS, extrasaction="ignore")
        self._csv.writeheader()
        self._raw = open(self.dir / self.RAW, "wb")

    def _open_nc(self, path: Path) -> None:
        num_chains, dim, chunk = self.num_chains, self.dim, self.chunk
        self._nc = h5netcdf.File(path, "w")
        g = self._nc.create_group("posterior")
        g.dimensions = {"chain": num_chains, "draw": None, "theta_dim_0": dim}
        self._theta = g.create_variable("theta", ("chain", "draw", "theta_dim_0"), dtype="f8",
                                        chunks=(num_chains, _chunk_draws(num_chains, dim, chunk), dim))
        g.create_variable("chain", ("chain",), data=np.arange(num_chains))
        if self.labels is None:
            g.create_variable("theta_dim_0", ("theta_dim_0",), data=np.arange(dim))
        else:
            import h5py

            g.create_variable("theta_dim_0", ("theta_dim_0",), data=np.array(self.labels, dtype=object),
                              dtype=h5py.string_dtype())
        for k, v in self.provenance.items():
            g.attrs[k] = v
        self._group = g

    def _reopen(self, pos: dict) -> None:
        """Continue a run folder from a checkpoint position: cut ``metrics.csv`` and ``draws.f8``
        back to it (anything written after the checkpoint goes) and append from there."""
        csv_path, raw_path = self.dir / "metrics.csv", self.dir / self.RAW
        n_csv, n_raw = int(pos["csv_bytes"]), int(pos["n_draws"]) * self.num_chains * self.dim * 8
        for path, n in ((csv_path, n_csv), (raw_path, n_raw)):
            have = path.stat().st_size if path.exists() else -1
            if have < n:
                held = "is missing" if have < 0 else f"holds {have} bytes"
                raise CheckpointError(f"resume: {path} {held}, the checkpoint counts {n} (the file was changed or "
                                      "lost after the checkpoint; the run cannot go on from it)")
            os.truncate(path, n)
        for key, path, n in (("draws", raw_path, n_raw), ("csv", csv_path, n_csv)):
            want = pos.get(f"{key}_crc32")
            if want is not None and _crc_of(path, n) != want:
                raise CheckpointError(f"cannot resume: {path}: its first {n} bytes are not those the checkpoint "
                                      f"recorded (CRC-32 differs): the file was damaged or changed after it")
            self.crc[key] = _crc_of(path, n) if want is None else int(want)
        self._csv_crc_pos = n_csv
        self._csv_file = open(csv_path, "a", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=METRIC_FIELDS, extrasaction="ignore")
        self._raw = open(raw_path, "ab")
        self.n_draws, self.rounds = int(pos["n_draws"]), int(pos["rounds"])
        self.totals = dict(pos["totals"])
        self.sum_theta = np.array(pos["sum_theta"], dtype=np.float64).reshape(self.num_chains, self.dim)
        self.sum_theta2 = np.array(pos["sum_theta2"], dtype=np.float64).reshape(self.num_chains, self.dim)
        self.t0 = time.perf_counter() - float(pos.get("elapsed", 0.0))

    def checkpoint_state(self) -> tuple[dict, dict]:
        """Flush and ``fsync`` what was written so far; returns ``(meta, arrays)`` of the position."""
        self._flush()
        from qlsd_flwr.outputs.checkpoint import fsync_file

        fsync_file(self._raw)
        fsync_file(self._csv_file)
        pos = self._csv_file.tell()
        with open(self.dir / "metrics.csv", "rb") as f:  # the rows since the last checkpoint
            f.seek(self._csv_crc_pos)
            self.crc["csv"] = zlib.crc32(f.read(pos - self._csv_crc_pos), self.crc["csv"])
        self._csv_crc_pos = pos
        meta = {"n_draws": self.n_draws, "rounds": self.rounds, "totals": dict(self.totals),
                "csv_bytes": pos, "elapsed": time.perf_counter() - self.t0,
                "draws_crc32": self.crc["draws"], "csv_crc32": self.crc["csv"]}
        if self.labels is not None:
            meta["labels"] = self.labels
        return meta, {"sum_theta": self.sum_theta.copy(), "sum_theta2": self.sum_theta2.copy()}

    def keeps(self, j: int) -> bool:
        """Whether sample ``θ_j`` (after ``j`` rounds) is kept after burn-in and thinning."""
        return j > self.burn_in and (j - self.burn_in - 1) % self.thin == 0

    def record_round(self, row: dict) -> None:
        self._csv.writerow(row)
        self.rounds += 1
        self._csv_file.flush()  # every round: a watcher (tail -f, a dashboard) sees each row as its round ends
        for key in self.totals:
            self.totals[key] += float(row.get(key, 0) or 0)

    def record_sample(self, j: int, theta: np.ndarray) -> None:
        """Offer ``θ_j`` (shape ``(d,)`` or ``(chains, d)``); kept if past burn-in and on the thinning grid."""
        if not self.keeps(j):
            return
        th = np.asarray(theta, dtype=np.float64).reshape(self.num_chains, self.dim)
        self._buf.append(th.copy())
        self.sum_theta += th
        self.sum_theta2 += th * th
        if len(self._buf) >= self.chunk:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        block = np.stack(self._buf, axis=0)  # (n, chain, d)
        data = np.ascontiguousarray(block, dtype="<f8").tobytes()
        self._raw.write(data)
        self.crc["draws"] = zlib.crc32(data, self.crc["draws"])
        self.n_draws += block.shape[0]
        self._buf.clear()
        self._csv_file.flush()

    def posterior_moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Running per-chain sample mean and variance of the kept draws."""
        n = max(self.n_draws + len(self._buf), 1)
        mean = self.sum_theta / n
        return mean, np.maximum(self.sum_theta2 / n - mean**2, 0.0)

    def close(self, extra: dict | None = None) -> dict:
        """Build ``samples.nc``, write ``summary.json`` (with ``extra``), release the folder. A
        run that was stopped (``extra`` has ``stopped``) with a checkpoint keeps ``draws.f8``, so
        that it can resume from that checkpoint."""
        if self._closed:  # once: a second close (an error path after a divergence) does nothing
            return {}
        self._closed = True
        try:
            self._flush()
            self._build_nc(keep_raw=bool(extra) and "stopped" in extra and (self.dir / "checkpoint.npz").exists())
        finally:
            self._csv_file.close()
            with contextlib.suppress(OSError):  # no stale .lock: removed while still held
                os.unlink(self.dir / ".lock")
            self._lock.close()  # releases the folder, whatever happened
        mean, var = self.posterior_moments()
        summary = {
            "rounds": self.rounds,
            "draws_kept": self.n_draws,
            "wall_seconds": time.perf_counter() - self.t0,
            "totals": self.totals,
            "per_round": {k: v / max(self.rounds, 1) for k, v in self.totals.items()},
            "sample_mean": mean.mean(axis=0).tolist(),
            "sample_var": var.mean(axis=0).tolist(),
        }
        summary.update(extra or {})
        summary["bits"] = bits_object(summary)
        if self.convergence is not None:
            from qlsd_flwr.outputs.convergence import log_report

            summary["convergence"] = self.convergence
            log_report(self.convergence)
        write_json(self.dir / "summary.json", summary)
        return summary

    def _build_nc(self, keep_raw: bool = False) -> None:
        """``samples.nc`` from ``draws.f8`` (written to a temporary name, then renamed)."""
        self._raw.close()
        raw_path, tmp = self.dir / self.RAW, self.dir / "samples.nc.tmp"
        self._open_nc(tmp)
        n, c, d = self.n_draws, self.num_chains, self.dim
        if n:
            self._group.resize_dimension("draw", n)
            mm = np.memmap(raw_path, dtype="<f8", mode="r", shape=(n, c, d))
            for a in range(0, n, self.chunk):
                z = min(n, a + self.chunk)
                self._theta[:, a:z, :] = np.transpose(np.asarray(mm[a:z]), (1, 0, 2))
            self.convergence = self._convergence(mm)
            del mm
        self._finish_nc()
        os.replace(tmp, self.dir / "samples.nc")
        if not keep_raw:
            os.unlink(raw_path)

    def _convergence(self, draws) -> dict | None:
        """The θ part of the convergence report (:mod:`qlsd_flwr.outputs.convergence`); never
        stops the closing of a run."""
        from qlsd_flwr.outputs import convergence as cv

        raw = self.config.get("config", {}) if isinstance(self.config.get("config"), dict) else {}
        try:
            rep = cv.theta_report(draws, self.labels, dispersed=str(raw.get("init", "")) == "dispersed")
            return cv.verdict(rep, criterion=cv.criterion_for(raw), raw=raw)
        except Exception as exc:  # noqa: BLE001 — a report must never lose the samples
            log.warning("convergence report failed: %s: %s", type(exc).__name__, exc)
            return None

    def _draw_rounds_all(self) -> list[int]:
        return list(range(self.burn_in + 1, self.burn_in + 1 + self.n_draws * self.thin, self.thin))

    def _finish_nc(self) -> None:
        """The ``draw`` coordinate, the ``sample_stats`` group, and close ``samples.nc``."""
        n, c = self.n_draws, self.num_chains
        self._group.create_variable("draw", ("draw",), data=np.arange(n, dtype=np.int64))
        rounds = np.asarray(self._draw_rounds_all(), dtype=np.int64)
        self._csv_file.flush()
        by_round = {}
        with open(self.dir / "metrics.csv", newline="") as f:
            for row in csv.DictReader(f):
                by_round[int(row["round"])] = row
        g = self._nc.create_group("sample_stats")
        g.dimensions = {"chain": c, "draw": n}
        g.create_variable("chain", ("chain",), data=np.arange(c))
        g.create_variable("draw", ("draw",), data=np.arange(n, dtype=np.int64))
        g.create_variable("round", ("chain", "draw"), data=np.broadcast_to(rounds, (c, n)).copy())
        for name in STAT_FIELDS:
            col = np.array([float(by_round[int(r)].get(name) or "nan") if int(r) in by_round else np.nan
                            for r in rounds])
            g.create_variable(name, ("chain", "draw"), data=np.broadcast_to(col, (c, n)).copy())
        for k, v in self.provenance.items():
            g.attrs[k] = v
        for k, v in self.provenance.items():
            self._nc.attrs[k] = v
        for k, v in self._run_attrs().items():  # what the step was: γ as used, M's kind, T, the verdict
            self._group.attrs[k] = v
            self._nc.attrs[k] = v
        self._nc.close()

    def _run_attrs(self) -> dict:
        res = self.config.get("resolved", {}) if isinstance(self.config.get("resolved"), dict) else {}
        raw = self.config.get("config", {}) if isinstance(self.config.get("config"), dict) else {}
        out = {}
        if isinstance(res.get("gamma"), (int, float)):
            out["gamma"] = float(res["gamma"])
        if "metric" in raw:
            out["metric"] = str(raw["metric"])
        if isinstance(res.get("temperature"), (int, float)):
            out["temperature"] = float(res["temperature"])
        if self.convergence is not None:
            out["convergence_verdict"] = str(self.convergence.get("verdict"))
            if self.convergence.get("rhat_max") is not None:
                out["rhat_max"] = float(self.convergence["rhat_max"])
        return out


def _crc_of(path: Path, n: int) -> int:
    """CRC-32 of the first ``n`` bytes of ``path``, read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while n > 0:
            piece = f.read(min(n, 1 << 24))
            if not piece:
                break
            crc = zlib.crc32(piece, crc)
            n -= len(piece)
    return crc


STAT_FIELDS = ["n_active", "n_replied", "n_rejected", "bits_exact"]  # sample_stats, per kept draw


def provenance(config: dict) -> dict:
    """Attributes that say what made a file: the package and Flower versions, the run's seed
    and variant, and a hash of its whole configuration."""
    import hashlib
    import sys

    # not `from qlsd_flwr import __version__`: tests/test_architecture.py's static import graph would see a
    # cycle (the root's lazy load_samples → evaluation.predict → here); at run time the root is loaded
    __version__ = sys.modules["qlsd_flwr"].__version__
    try:
        from importlib.metadata import version

        flwr_version = version("flwr")
    except Exception:  # noqa: BLE001 — provenance must never stop a run
        flwr_version = "unknown"
    raw = config.get("config", config) if isinstance(config, dict) else {}
    text = dumps(raw, strict=False, sort_keys=True)
    return {"inference_library": "qlsd_flwr", "inference_library_version": __version__,
            "flwr_version": flwr_version, "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seed": str(raw.get("seed", "")), "variant": str(raw.get("variant", "")),
            "config_sha256": hashlib.sha256(text.encode()).hexdigest()}


def load_samples(run_dir: str | os.PathLike) -> np.ndarray:
    """The kept samples of a run as an array ``(chain, draw, d)``."""
    with h5netcdf.File(Path(run_dir) / "samples.nc", "r") as f:
        return np.asarray(f["posterior"]["theta"][...])
