"""The interface every task implements: local potentials ``U_i`` and a prior ``U_0``.

The target is ``π(θ) ∝ exp(−U(θ))`` with ``U = U_0 + Σ_i Σ_j U_ij`` (paper §2). A task
splits the data part across ``b`` clients; the prior ``U_0`` is either kept whole on the
server or shared across clients with weights ``w_i`` (``Σ w_i = 1``), see
:mod:`qlsd_flwr.core.oracles`.

Everything here works on flat ``float64`` numpy vectors ``θ ∈ R^d``; a torch model is
wrapped so that it exposes the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class LocalPotential(Protocol):
    """The data part of one client's potential, ``U_i^data(θ) = Σ_{j<N_i} U_ij(θ)``.

    Optional: ``grad_sum_batch(thetas, idx=None)``, ``thetas`` ``(C, d)`` and ``idx`` ``(C, n)``
    (row ``c``: the minibatch for ``thetas[c]``) or ``None``, returning ``(C, d)`` whose row ``c``
    is ``grad_sum(thetas[c], idx[c])``. Where it exists, the vectorised engine and a
    several-chain Flower client compute all their chains' gradients in one call
    (:func:`qlsd_flwr.core.oracles.oracle_batch`). Make it bitwise equal to ``grad_sum`` row by
    row if chains are to agree bit for bit across engines
    (:meth:`qlsd_flwr.tasks.logistic.LogisticLocal.grad_sum_batch` shows how).
    """

    n_data: int  # N_i
    dim: int  # d

    def grad_sum(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        """``Σ_{j ∈ idx} ∇U_ij(θ)`` as a ``(d,)`` float64 array; ``idx=None`` means all ``j``.

        ``idx`` is a sorted int64 array of distinct indices in ``[0, N_i)``.
        """
        ...

    def value(self, theta: np.ndarray) -> float:
        """``U_i^data(θ) = Σ_j U_ij(θ)`` (used for HPD regions and MALA)."""
        ...


class Prior(Protocol):
    """The prior potential ``U_0`` (negative log prior up to a constant): any object with these
    (:mod:`qlsd_flwr.core.priors` has Student-t, log half-normal, a user's function and blocks).
    ``curvature_diag`` (the diagonal of ``∇²U_0``) enters the metric; ``is_flat`` says ``U_0 = 0``."""

    is_flat: bool

    def grad(self, theta: np.ndarray) -> np.ndarray: ...

    def value(self, theta: np.ndarray) -> float: ...

    def curvature_diag(self, theta: np.ndarray) -> np.ndarray: ...


def declares_log_concave(obj) -> bool:
    """Whether ``obj`` (a local potential or a prior) says that its density is log-concave in θ
    (``log_concave = True``; the Gaussian and logistic tasks' potentials, a torch model that is one
    ``nn.Linear`` under cross-entropy, the Gaussian prior). What does not say so is taken as not
    log-concave (a network): ``gamma-c = auto`` then takes the smaller step, a cost in mixing, never a
    bias. Anything but ``True`` (a client's handshake field included) reads as no."""
    return getattr(obj, "log_concave", False) is True


def declared_support(obj, d: int) -> np.ndarray | None:
    """The coordinates of θ that ``obj``'s (a local potential's) gradient reads, as it declares them: ``support()``, a
    boolean ``(d,)`` array (a softmax regression: the weights of the inputs its data are not all 0 on), or ``None``,
    every coordinate (what declares nothing). ``downlink-support = data`` codes the broadcast on their union
    (:class:`qlsd_flwr.core.downlink.Downlink`): a potential whose gradient reads a coordinate it leaves out would
    be evaluated where that coordinate is stale. ``ValueError`` naming ``support()`` when it is not such an array."""
    fn = getattr(obj, "support", None)
    m = fn() if callable(fn) else None
    if m is None:
        return None
    m = np.asarray(m)
    if m.dtype != np.bool_ or m.shape != (d,):
        raise ValueError(f"support(): expected a boolean array of shape ({d},), got {m.dtype} {m.shape}")
    return m


@dataclass(frozen=True)
class GaussianPrior:
    """``U_0(θ) = ‖θ − mean‖² / (2 var)``; ``var = inf`` is the flat prior."""

    var: float = float("inf")
    mean: float = 0.0
    log_concave = True  # U_0 is a quadratic (or 0)

    def grad(self, theta: np.ndarray) -> np.ndarray:
        if np.isinf(self.var):
            return np.zeros_like(theta)
        return (theta - self.mean) / self.var

    def value(self, theta: np.ndarray) -> float:
        if np.isinf(self.var):
            return 0.0
        return float(np.sum((theta - self.mean) ** 2) / (2.0 * self.var))

    def curvature_diag(self, theta: np.ndarray) -> np.ndarray:
        """``∂²U_0/∂θ_j² = 1/var`` (0 for the flat prior)."""
        return np.full(np.shape(theta), 0.0 if np.isinf(self.var) else 1.0 / self.var)

    @property
    def is_flat(self) -> bool:
        return bool(np.isinf(self.var))


@dataclass
class Task:
    """A federated posterior: ``b`` local potentials, a prior, and what is known in closed form.

    ``theta_star`` is ``argmin U`` when known in closed form (else ``None``: QLSD* then runs a
    federated optimisation phase first). ``posterior_mean``/``posterior_var`` hold the exact
    posterior moments when known (Gaussian task), for tests and metrics.
    """

    name: str
    dim: int
    clients: Sequence[LocalPotential]
    prior: Prior = field(default_factory=GaussianPrior)  # any Prior when it stays on the server
    theta_star: np.ndarray | None = None
    posterior_mean: np.ndarray | None = None
    posterior_var: np.ndarray | None = None
    theta0: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def b(self) -> int:
        return len(self.clients)

    @property
    def n_data(self) -> np.ndarray:
        return np.array([c.n_data for c in self.clients], dtype=np.int64)

    @property
    def log_concave(self) -> bool:
        """The posterior is declared log-concave: the prior and every client's potential say so
        (:func:`declares_log_concave`); a task without clients (a user's ServerApp: they live on the
        nodes, whose handshakes say it) is not."""
        return bool(self.clients) and declares_log_concave(self.prior) and \
            all(declares_log_concave(c) for c in self.clients)

    def potential(self, theta: np.ndarray) -> float:
        """``U(θ)``, the full negative log posterior (up to a constant)."""
        return self.prior.value(theta) + sum(c.value(theta) for c in self.clients)

    def grad_potential(self, theta: np.ndarray) -> np.ndarray:
        """``∇U(θ)`` summed over clients in index order (deterministic)."""
        g = self.prior.grad(theta).astype(np.float64, copy=True)
        for c in self.clients:
            g += c.grad_sum(theta)
        return g
