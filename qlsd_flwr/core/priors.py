"""Priors the modeller chooses, kept whole on the server: ``U_0(θ) = −log p_0(θ)`` up to a constant.

The server adds ``∇U_0(θ_k)`` to every step (``prior-on = server``), so any prior with a value and a
gradient works, not only an isotropic Gaussian; its curvature (``curvature_diag``) enters the
metric (:mod:`qlsd_flwr.core.metric`). Each class has ``grad``, ``value``, ``curvature_diag`` and
``is_flat`` (what the server step and :func:`qlsd_flwr.protocol.curvature_exchange.prior_curvature` read).

* :class:`~qlsd_flwr.core.potential.GaussianPrior` — ``‖θ − m‖²/(2σ²)`` (the default; it may also be
  shared by the clients, ``prior-on = clients``, since each client can compute it from two numbers).
* :class:`StudentTPrior` — independent Student-t coordinates (heavy tails: shrinks small effects and
  leaves large ones alone).
* :class:`LogHalfNormalPrior` — a scale ``σ = exp(u) ~ HalfNormal(s)`` sampled on the log scale, with
  the Jacobian of ``σ = e^u``: ``U_0(u) = e^{2u}/(2s²) − u``.
* :class:`FunctionPrior` — a user's own ``value`` and ``grad`` (and optionally the curvature).
* :class:`BlockPrior` — different priors on different coordinates (e.g. Student-t on regression
  weights, a log half-normal on the noise scale's log).

Keeping the prior on the clients instead (``prior-on = clients``) splits ``U_0`` as ``Σ_i w_i U_0``
with ``Σ w_i = 1`` (``w_i = 1/b`` here), and a client's minibatch oracle adds ``w_i ∇U_0`` once per
message, not per data point, so the stochastic gradient stays unbiased. Only the Gaussian prior
travels that way (its two numbers go with the client settings); the others stay on the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from qlsd_flwr.core.potential import declares_log_concave


@dataclass(frozen=True)
class StudentTPrior:
    """Independent ``t_ν(loc, scale)`` coordinates: ``U_0 = Σ_j (ν+1)/2 · log(1 + r_j²/ν)``,
    ``r_j = (θ_j − loc)/scale``."""

    df: float = 3.0
    scale: float = 1.0
    loc: float = 0.0
    is_flat: bool = field(default=False, init=False)

    def __post_init__(self):
        if not (self.df > 0 and self.scale > 0 and np.isfinite(self.loc)):
            raise ValueError(f"StudentTPrior: df and scale must be positive, loc finite (got {self})")

    def value(self, theta):
        r = (np.asarray(theta) - self.loc) / self.scale
        return float(0.5 * (self.df + 1) * np.sum(np.log1p(r * r / self.df)))

    def grad(self, theta):
        x = np.asarray(theta) - self.loc
        return (self.df + 1) * x / (self.df * self.scale**2 + x * x)

    def curvature_diag(self, theta):
        """``∂²U_0/∂θ_j² = (ν+1)(νs² − x²)/(νs² + x²)²``, set to 0 where it is negative (beyond
        ``|x| > s√ν`` the potential is concave); at most ``(ν+1)/(νs²)``, at ``loc``."""
        x = np.asarray(theta) - self.loc
        a = self.df * self.scale**2
        h = (self.df + 1) * (a - x * x) / (a + x * x) ** 2
        return np.maximum(h, 0.0)


@dataclass(frozen=True)
class LogHalfNormalPrior:
    """``σ = e^u ~ HalfNormal(scale)``, sampled as ``u``: ``U_0(u) = e^{2u}/(2 scale²) − u`` (the
    ``− u`` is the log-Jacobian of ``σ = e^u``)."""

    scale: float = 1.0
    is_flat: bool = field(default=False, init=False)
    log_concave = True  # U_0'' = 2 e^{2u}/scale² > 0

    def value(self, theta):
        u = np.asarray(theta)
        return float(np.sum(np.exp(2 * u) / (2 * self.scale**2) - u))

    def grad(self, theta):
        u = np.asarray(theta)
        return np.exp(2 * u) / self.scale**2 - 1.0

    def curvature_diag(self, theta):
        return 2.0 * np.exp(2 * np.asarray(theta)) / self.scale**2


@dataclass(frozen=True)
class FunctionPrior:
    """A user's prior: ``value(θ) -> float`` and ``grad(θ) -> (d,)``; ``curvature_diag(θ) -> (d,)``
    optional (without it the metric takes the prior as flat in curvature). ``log_concave``: say
    ``True`` if ``U_0`` is convex (``gamma-c = auto`` then keeps the log-concave step)."""

    value_fn: Callable
    grad_fn: Callable
    curvature_fn: Callable | None = None
    log_concave: bool = False
    is_flat: bool = field(default=False, init=False)

    def value(self, theta):
        return float(self.value_fn(theta))

    def grad(self, theta):
        return np.asarray(self.grad_fn(theta), dtype=np.float64)

    def curvature_diag(self, theta):
        if self.curvature_fn is None:
            return np.zeros(np.shape(theta))
        return np.asarray(self.curvature_fn(theta), dtype=np.float64)


@dataclass(frozen=True)
class BlockPrior:
    """Priors on blocks of coordinates: ``blocks`` is a list of ``(indices, prior)`` covering every
    coordinate once (``indices``: a slice, or a sequence of ints)."""

    blocks: Sequence
    dim: int
    is_flat: bool = field(default=False, init=False)

    def __post_init__(self):
        seen = np.zeros(self.dim, dtype=int)
        for idx, _ in self.blocks:
            seen[np.arange(self.dim)[idx]] += 1
        if not np.all(seen == 1):
            raise ValueError("BlockPrior: the blocks must cover every coordinate exactly once")

    def _each(self, theta, what):
        theta = np.asarray(theta, dtype=np.float64)
        return [(idx, getattr(pr, what)(theta[..., idx])) for idx, pr in self.blocks]

    def value(self, theta):
        return float(sum(v for _, v in self._each(theta, "value")))

    def grad(self, theta):
        out = np.zeros(np.shape(theta))
        for idx, g in self._each(theta, "grad"):
            out[..., idx] = g
        return out

    @property
    def log_concave(self) -> bool:
        """Every block's prior is (a sum of convex functions of disjoint coordinates is convex)."""
        return all(declares_log_concave(pr) for _, pr in self.blocks)

    def curvature_diag(self, theta):
        out = np.zeros(np.shape(theta))
        for idx, pr in self.blocks:
            part = np.asarray(theta)[..., idx]
            h = pr.curvature_diag(part) if hasattr(pr, "curvature_diag") else np.zeros(np.shape(part))
            out[..., idx] = h
        return out


def check_prior(prior, prior_var="flat") -> None:
    """``ValueError`` naming what a user's ``prior`` lacks (``value``, ``grad``, ``is_flat``), or that
    ``prior_var`` (the Gaussian prior's variance) was given too."""
    if str(prior_var) != "flat":
        raise ValueError("prior and prior_var: give one or the other (prior_var is the Gaussian prior's variance)")
    missing = [a for a in ("value", "grad") if not callable(getattr(prior, a, None))]
    if missing:
        raise ValueError(f"prior: needs value(theta) and grad(theta); it lacks {', '.join(missing)}")
    if not hasattr(prior, "is_flat"):
        raise ValueError("prior: needs an is_flat attribute (False for a proper prior); see qlsd_flwr.core.priors")
