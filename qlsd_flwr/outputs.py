"""A run's output folder, the same on every engine.

``<output-dir>/<run-name>/``
  * ``samples.nc`` — ArviZ InferenceData (netCDF4/HDF5): group ``posterior`` with variable
    ``theta`` of dims ``(chain, draw, theta_dim_0)``, streamed to disk in chunks as the chain
    runs (memory stays flat). ``arviz.from_netcdf(path)`` loads it.
  * ``metrics.csv`` — one row per round: active and replying clients, rejected replies, bits
    (analytic bound, exact code length), bytes (payload, Flower message) and seconds.
  * ``config.json`` — the resolved configuration.
  * ``summary.json`` — totals, and posterior error when the task knows its posterior.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import h5netcdf
import numpy as np

METRIC_FIELDS = ["round", "n_active", "n_replied", "n_rejected", "skipped", "bits_bound",
                 "bits_exact", "bytes_payload", "bytes_message", "seconds"]


def make_run_dir(output_dir: str | os.PathLike, run_name: str, variant: str) -> Path:
    name = run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{variant}"
    path = Path(output_dir) / name
    i = 1
    while path.exists():
        path = Path(output_dir) / f"{name}-{i}"
        i += 1
    path.mkdir(parents=True)
    return path


class Recorder:
    """Writes samples, per-round metrics, config and summary of one run."""

    def __init__(self, run_dir: Path, config: dict, dim: int, num_chains: int, burn_in: int,
                 thin: int, chunk: int = 512):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.burn_in, self.thin, self.chunk = burn_in, thin, chunk
        self.dim, self.num_chains = dim, num_chains
        (self.dir / "config.json").write_text(json.dumps(config, indent=2, default=_jsonable))
        self._csv_file = open(self.dir / "metrics.csv", "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=METRIC_FIELDS, extrasaction="ignore")
        self._csv.writeheader()
        self._nc = h5netcdf.File(self.dir / "samples.nc", "w")
        g = self._nc.create_group("posterior")
        g.dimensions = {"chain": num_chains, "draw": None, "theta_dim_0": dim}
        self._theta = g.create_variable("theta", ("chain", "draw", "theta_dim_0"), dtype="f8",
                                        chunks=(num_chains, min(chunk, 4096), dim))
        g.create_variable("chain", ("chain",), data=np.arange(num_chains))
        g.create_variable("theta_dim_0", ("theta_dim_0",), data=np.arange(dim))
        g.attrs["inference_library"] = "qlsd_flwr"
        self._group = g
        self._buf: list[np.ndarray] = []
        self.n_draws = 0
        self.totals = {k: 0 for k in ("n_active", "n_replied", "n_rejected", "skipped",
                                      "bits_bound", "bits_exact", "bytes_payload", "bytes_message")}
        self.rounds = 0
        self.sum_theta = np.zeros((num_chains, dim))
        self.sum_theta2 = np.zeros((num_chains, dim))
        self.t0 = time.perf_counter()

    def keeps(self, j: int) -> bool:
        """Whether sample ``θ_j`` (after ``j`` rounds) is kept after burn-in and thinning."""
        return j > self.burn_in and (j - self.burn_in - 1) % self.thin == 0

    def record_round(self, row: dict) -> None:
        self._csv.writerow(row)
        self.rounds += 1
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
        block = np.stack(self._buf, axis=1)  # (chain, n, d)
        n0 = self._theta.shape[1]
        self._group.resize_dimension("draw", n0 + block.shape[1])
        self._theta[:, n0:, :] = block
        self.n_draws = n0 + block.shape[1]
        self._buf.clear()
        self._csv_file.flush()

    def posterior_moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Running per-chain sample mean and variance of the kept draws."""
        n = max(self.n_draws + len(self._buf), 1)
        mean = self.sum_theta / n
        return mean, np.maximum(self.sum_theta2 / n - mean**2, 0.0)

    def close(self, extra: dict | None = None) -> dict:
        self._flush()
        self._group.create_variable("draw", ("draw",), data=np.asarray(self._draw_rounds_all(), dtype=np.int64))
        self._nc.close()
        self._csv_file.close()
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
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable))
        return summary

    def _draw_rounds_all(self) -> list[int]:
        return list(range(self.burn_in + 1, self.burn_in + 1 + self.n_draws * self.thin, self.thin))


def _jsonable(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)


def load_samples(run_dir: str | os.PathLike) -> np.ndarray:
    """The kept samples of a run as an array ``(chain, draw, d)``."""
    with h5netcdf.File(Path(run_dir) / "samples.nc", "r") as f:
        return np.asarray(f["posterior"]["theta"][...])
