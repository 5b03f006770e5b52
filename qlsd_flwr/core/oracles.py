"""What an active client computes in one round: the oracle ``H_i``, the memory, the message.

With ``S_i`` a uniform ``n_i``-subset of ``[N_i]`` and ``w_i`` the client's share of the prior
``U_0`` (``0`` when the prior stays on the server), the oracles are (ALGORITHMS.md):

* ``full``       (QLSD):   ``H_i(θ) = ∇U_i(θ)``
* ``minibatch``  (QLSD#):  ``H_i(θ) = (N_i/n_i) Σ_{j∈S_i} ∇U_ij(θ) + w_i ∇U_0(θ)``
* ``star``       (QLSD*):  ``H_i(θ) = (N_i/n_i) Σ_{j∈S_i} [∇U_ij(θ) − ∇U_ij(θ*)] + w_i[∇U_0(θ) − ∇U_0(θ*)]``
* ``svrg``       (QLSD++): ``H_i(θ) = (N_i/n_i) Σ_{j∈S_i} [∇U_ij(θ) − ∇U_ij(ζ)] + w_i[∇U_0(θ) − ∇U_0(ζ)] + ∇U_i(ζ)``

The prior enters both sides of every control-variate difference with the same weight (the
authors' code did not). The client then sends ``g_i = C(H_i − η_i)`` (QLSD++ with memory) or
``g_i = C(H_i)``, and with memory updates ``η_i ← η_i + α ĝ_i`` where ``ĝ_i`` is the *decoded*
message, so that its ``η_i`` and the server's mirror stay bit-identical (Algorithm 2; we do not
scale the increment by ``1/p_i`` as the supplement's analysis does — the two coincide at
``p = 1``, and Algorithm 2's form keeps ``η_i`` a contraction for any ``p``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from qlsd_flwr.core import rng
from qlsd_flwr.core.potential import GaussianPrior, LocalPotential


class Oracle(IntEnum):
    """The oracle kinds (the run config names them in lower case; compiled code takes the value)."""

    FULL = 0  # QLSD: ∇U_i(θ)
    MINIBATCH = 1  # QLSD#
    STAR = 2  # QLSD*: control variate at θ*
    SVRG = 3  # QLSD++: control variate at the anchor ζ

    @classmethod
    def of(cls, name: str) -> "Oracle":
        return cls[str(name).upper()]


@dataclass(frozen=True)
class ClientSpec:
    """Static settings of client ``i`` (the same on every path)."""

    index: int
    oracle: str  # full | minibatch | star | svrg
    batch_size: int  # n_i
    compressor: Any  # qlsd_flwr.compression.qsgd.QSGD or Identity
    memory: bool
    alpha: float  # α_i (0 switches memory off)
    prior: GaussianPrior
    prior_weight: float  # w_i


@dataclass
class ClientState:
    """What a client keeps between rounds (Flower: ``context.state``)."""

    eta: np.ndarray | None = None  # η_i, the memory term
    eta_count: int = 0  # memory updates applied so far (the server keeps the same count)
    anchor_version: int = -1  # which anchor (ζ or θ*) the cache below belongs to
    anchor: np.ndarray | None = None  # ζ (QLSD++) or θ* (QLSD*)
    anchor_grad: np.ndarray | None = None  # ∇U_i(ζ) (QLSD++ only)


def set_anchor(spec: ClientSpec, pot: LocalPotential, state: ClientState,
               anchor: np.ndarray, version: int) -> None:
    """Cache a new anchor; for QLSD++ compute ``∇U_i(ζ)`` once (one pass over local data)."""
    state.anchor = np.array(anchor, dtype=np.float64, copy=True)
    state.anchor_version = int(version)
    if spec.oracle == "svrg":
        state.anchor_grad = full_local_grad(spec, pot, state.anchor)


def full_local_grad(spec: ClientSpec, pot: LocalPotential, theta: np.ndarray) -> np.ndarray:
    """``∇U_i(θ)``: all local data plus the client's share of the prior."""
    return pot.grad_sum(theta) + spec.prior_weight * spec.prior.grad(theta)


def oracle(spec: ClientSpec, pot: LocalPotential, state: ClientState, theta: np.ndarray,
           idx: np.ndarray | None) -> np.ndarray:
    """``H_i(θ_k)`` for the client's oracle kind (see module docstring)."""
    w = spec.prior_weight
    if spec.oracle == "full":
        return full_local_grad(spec, pot, theta)
    scale = pot.n_data / len(idx)
    if spec.oracle == "minibatch":
        return scale * pot.grad_sum(theta, idx) + w * spec.prior.grad(theta)
    c = state.anchor
    h = scale * (pot.grad_sum(theta, idx) - pot.grad_sum(c, idx)) + w * (spec.prior.grad(theta) - spec.prior.grad(c))
    if spec.oracle == "svrg":
        h = h + state.anchor_grad
    return h


def minibatch(seed: int, round_: int, spec: ClientSpec, n_data: int) -> np.ndarray | None:
    if spec.oracle == "full":
        return None
    return rng.subset(seed, rng.Stream.MINIBATCH, round_, spec.index, n_data, spec.batch_size)


def client_round(spec: ClientSpec, pot: LocalPotential, state: ClientState, seed: int,
                 round_: int, theta: np.ndarray):
    """One active round of client ``i``: returns ``(quantised message, decoded ĝ_i)``.

    Updates ``state.eta`` in place when memory is on. The caller encodes the message.
    """
    idx = minibatch(seed, round_, spec, pot.n_data)
    h = oracle(spec, pot, state, theta, idx)
    if spec.memory:
        if state.eta is None:
            state.eta = np.zeros_like(h)
        h = h - state.eta
    u = rng.uniform(seed, rng.Stream.DITHER, round_, spec.index, h.shape[0])
    q = spec.compressor.quantise(h, u)
    g_hat = spec.compressor.dequantise(q)
    if spec.memory:
        if spec.alpha != 0.0:
            state.eta = state.eta + spec.alpha * g_hat
        state.eta_count += 1
    return q, g_hat
