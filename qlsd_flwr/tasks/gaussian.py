"""The paper's toy Gaussian (§4, S5.1): ``U_i(θ) = Σ_j ‖θ − y_ij‖²/2``.

With ``b`` clients holding ``N_i ∈ [10, 200]`` points each, heterogeneous (each client's points
scatter around its own centre) and unbalanced (sizes skewed towards small), the posterior
under a flat prior is ``N(ȳ, I/N)`` with ``N = Σ N_i`` and ``θ* = ȳ``. Under a Gaussian prior
``N(0, σ₀² I)`` it is ``N(Σy/τ, I/τ)`` with ``τ = N + 1/σ₀²``.

The authors generated their data in a notebook that is not public; this generator follows
their description (S5.1) and is fully determined by ``data_seed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qlsd_flwr.config import check_data_memory
from qlsd_flwr.core import rng
from qlsd_flwr.core.potential import GaussianPrior, Task


@dataclass
class GaussianLocal:
    """One client's ``U_i(θ) = Σ_j ‖θ − y_ij‖²/2``; ``∇U_ij(θ) = θ − y_ij``."""

    y: np.ndarray  # (N_i, d)
    log_concave = True  # a quadratic in θ

    def __post_init__(self):
        self.y = np.ascontiguousarray(self.y, dtype=np.float64)
        self.n_data, self.dim = self.y.shape
        self.y_sum = self.y.sum(axis=0)

    def grad_sum(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        if idx is None:
            return self.n_data * theta - self.y_sum
        return len(idx) * theta - self.y[idx].sum(axis=0)

    def value(self, theta: np.ndarray) -> float:
        return float(0.5 * np.sum((theta - self.y) ** 2))

    def pointwise_log_lik(self, theta: np.ndarray) -> np.ndarray:
        """``log N(y_ij; θ, I)`` for every point, with its normalising constant (the federated LOO's input)."""
        return -0.5 * np.sum((theta - self.y) ** 2, axis=1) - 0.5 * self.dim * np.log(2.0 * np.pi)


def client_data(i: int, d: int = 50, data_seed: int = 0, n_min: int = 10, n_max: int = 200,
                spread: float = 5.0) -> np.ndarray:
    """Client ``i``'s points ``y_ij ~ N(μ_i, I)``, ``j < N_i``; generated from its own keys only.

    ``N_i = n_min + ⌊(n_max − n_min)·u_i²⌋`` (skewed towards small clients) and the client centre
    ``μ_i ~ N(0, spread² I)`` (centres far apart: the local posteriors disagree).
    """
    size = client_size(i, data_seed, n_min, n_max)
    centre = spread * rng.normal(data_seed, rng.Stream.DATA, 1, i, d)
    noise = rng.normal(data_seed, rng.Stream.DATA, 2, i, size * d)
    return centre + noise.reshape(size, d)


def client_size(i: int, data_seed: int = 0, n_min: int = 10, n_max: int = 200) -> int:
    """Client ``i``'s ``N_i`` (:func:`client_data`), drawn before its points."""
    u = rng.uniform(data_seed, rng.Stream.DATA, 0, i, 1)[0]
    return int(n_min + np.floor((n_max - n_min) * u**2))


def make_data(b: int = 20, d: int = 50, data_seed: int = 0) -> list[np.ndarray]:
    """All ``b`` clients' points (see :func:`client_data`), refused by name before they are made when they
    would not fit in memory (:func:`qlsd_flwr.config.check_data_memory`)."""
    check_data_memory(sum(client_size(i, data_seed) for i in range(b)), d)
    return [client_data(i, d, data_seed) for i in range(b)]


def build_gaussian_task(b: int = 20, d: int = 50, data_seed: int = 0,
                        prior_var: float = np.inf, pooled: bool = False) -> Task:
    """The toy task with its closed-form posterior and ``θ*``; ``pooled`` puts all data on one client."""
    ys = make_data(b, d, data_seed)
    all_y = np.concatenate(ys)
    n = all_y.shape[0]
    prior = GaussianPrior(var=float(prior_var))
    tau = n + (0.0 if prior.is_flat else 1.0 / prior.var)
    mean = all_y.sum(axis=0) / tau
    clients = [GaussianLocal(all_y)] if pooled else [GaussianLocal(y) for y in ys]
    return Task(
        name="gaussian", dim=d, clients=clients, prior=prior, theta_star=mean.copy(),
        posterior_mean=mean, posterior_var=np.full(d, 1.0 / tau), theta0=np.zeros(d),
        meta={"client_sizes": [int(y.shape[0]) for y in ys], "N": int(n), "data_seed": data_seed},
    )
