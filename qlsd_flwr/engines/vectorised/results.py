"""What the vectorised engine returns: per-chain running statistics and the run's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qlsd_flwr.config import RunConfig


def chain_seeds(cfg: RunConfig) -> np.ndarray:
    """Seeds of the chains: chain ``c`` uses ``seed + c``."""
    return np.arange(cfg.num_chains, dtype=np.int64) + int(cfg.seed)


@dataclass
class ChainStats:
    """Per-chain running statistics of the kept draws, and per-chain communication totals.

    ``f(θ) = ‖θ‖₂`` is the test function of the paper's toy experiment.
    """

    num_chains: int
    dim: int
    n_kept: int = 0
    sum_theta: np.ndarray = None  # (C, d)
    sum_theta2: np.ndarray = None  # (C, d)
    sum_f: np.ndarray = None  # (C,)
    sum_f2: np.ndarray = None  # (C,)
    rounds: int = 0
    n_active: np.ndarray = None  # (C,) client messages over the run
    skipped: np.ndarray = None  # (C,)
    bits_exact: np.ndarray = None  # (C,) exact code lengths, summed over messages
    bits_bound: np.ndarray = None  # (C,) analytic bound, summed over messages
    bytes_payload: np.ndarray = None  # (C,)
    subset_ties: np.ndarray = None  # (C,) boundary ties in a minibatch draw (numba backend)

    def __post_init__(self):
        c, d = self.num_chains, self.dim
        for name, shape, dt in (("sum_theta", (c, d), float), ("sum_theta2", (c, d), float),
                                ("sum_f", (c,), float), ("sum_f2", (c,), float),
                                ("n_active", (c,), np.int64), ("skipped", (c,), np.int64),
                                ("bits_exact", (c,), np.int64), ("bits_bound", (c,), float),
                                ("bytes_payload", (c,), np.int64), ("subset_ties", (c,), np.int64)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(shape, dtype=dt))

    def mean_f(self) -> np.ndarray:
        """Per-chain estimate of ``E[‖θ‖]`` (mean over kept draws)."""
        return self.sum_f / max(self.n_kept, 1)

    def mean_theta(self) -> np.ndarray:
        return self.sum_theta / max(self.n_kept, 1)

    def var_theta(self) -> np.ndarray:
        mean = self.mean_theta()
        return np.maximum(self.sum_theta2 / max(self.n_kept, 1) - mean * mean, 0.0)

    def add_round(self, theta: np.ndarray, kept: bool, out: dict, r: int) -> None:
        """Round ``r`` of a block's outputs ``out`` (``(C, R)`` counts), and θ ``(C, d)`` when its draw is kept."""
        if kept:
            f = np.sqrt(np.sum(theta * theta, axis=1))
            self.n_kept += 1
            self.sum_theta += theta
            self.sum_theta2 += theta * theta
            self.sum_f += f
            self.sum_f2 += f * f
        self.n_active += out["n_active"][:, r]
        self.skipped += out["skipped"][:, r]
        self.bits_exact += out["bits_exact"][:, r]
        self.bits_bound += out["bits_bound"][:, r]
        self.bytes_payload += out["bytes"][:, r]

    def bits_exact_per_round(self) -> np.ndarray:
        """Per-chain mean exact bits uploaded per iteration (all clients)."""
        return self.bits_exact / max(self.rounds, 1)

    def bits_bound_per_round(self) -> np.ndarray:
        return self.bits_bound / max(self.rounds, 1)

    def to_dict(self) -> dict:
        return {"n_kept": self.n_kept, "rounds": self.rounds, "mean_f": self.mean_f().tolist(),
                "bits_exact_per_round": self.bits_exact_per_round().tolist(),
                "bits_bound_per_round": self.bits_bound_per_round().tolist(),
                "n_active": self.n_active.tolist(), "skipped": self.skipped.tolist(),
                "subset_ties": self.subset_ties.tolist()}


@dataclass
class VectorisedResult:
    summary: dict
    run_dir: Path | None
    stats: ChainStats
    theta: np.ndarray  # (C, d) the chains' last state
    trace: np.ndarray | None = None  # (C, K, d) θ_1..θ_K when keep_trace
    backend: str = "numpy"
    extra: dict = field(default_factory=dict)


def keeps(j: np.ndarray, burn_in: int, thin: int) -> np.ndarray:
    """Whether draw ``j`` (1-based round) is kept: after burn-in, on the thinning grid."""
    return (j > burn_in) & ((j - burn_in - 1) % thin == 0)
