"""The server's side of one round: anchor, aggregation, memory, prior and Langevin step.

Read next to Algorithm 2 of the paper (QLSD++; the other variants switch parts off):

1. ``ζ_k = θ_k`` if ``k ≡ 0 (mod l)`` else ``ζ_{k−1}``                       (:func:`refresh_anchor`)
2. clients in ``A_{k+1}`` send ``g_i``; the server decodes ``ĝ_i``
3. ``g_{k+1} = Σ_{i∈A} w_i ĝ_i  [+ η_k]  + ∇U_0(θ_k) [− ∇U_0(θ*)]``          (:func:`server_step`)
   (prior terms only when the prior stays on the server; ``− ∇U_0(θ*)`` for QLSD*)
4. ``η_{k+1}^{(i)} = η_k^{(i)} + α_i ĝ_i`` for ``i ∈ A``;  ``η_{k+1} = Σ_i η_{k+1}^{(i)}``
5. ``θ_{k+1} = θ_k − γ g_{k+1} + √(2γ) Z_{k+1}``, ``Z`` from stream ``(seed, NOISE, k, 0)``

Sums run over clients in ascending index order, always, so the result does not depend on
the order replies arrive in. The server keeps a mirror of every ``η_i`` and recomputes
``η = Σ_i η_i`` from the mirrors, so ``η`` equals the sum of the clients' terms exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import participation, rng
from .tasks.base import GaussianPrior


@dataclass
class ServerState:
    """The chain's state between rounds."""

    k: int  # the next round to run (θ_k is current)
    theta: np.ndarray
    zeta: np.ndarray | None = None  # SVRG anchor ζ_k (QLSD++)
    zeta_version: int = -1  # increments at each refresh
    eta_i: np.ndarray | None = None  # (b, d) mirror of the clients' memory terms
    eta: np.ndarray | None = None  # Σ_i η_i
    counters: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ServerSpec:
    """Static server settings."""

    b: int
    gamma: float
    p: np.ndarray
    rule: str
    memory: bool
    alpha: np.ndarray  # α_i per client
    l: int
    oracle: str
    prior: GaussianPrior
    prior_on_server: bool
    theta_star: np.ndarray | None = None


def init_state(spec: ServerSpec, theta0: np.ndarray) -> ServerState:
    d = theta0.shape[0]
    st = ServerState(k=0, theta=np.array(theta0, dtype=np.float64, copy=True))
    if spec.memory:
        st.eta_i = np.zeros((spec.b, d))
        st.eta = np.zeros(d)
    return st


def refresh_anchor(spec: ServerSpec, st: ServerState) -> bool:
    """Step 1: set ``ζ_k = θ_k`` when ``k ≡ 0 (mod l)``; returns whether it changed."""
    if spec.oracle == "svrg" and st.k % spec.l == 0:
        st.zeta = st.theta.copy()
        st.zeta_version += 1
        return True
    return False


def prior_term(spec: ServerSpec, theta: np.ndarray) -> np.ndarray | None:
    """The server's exact prior contribution, or ``None`` when clients share the prior."""
    if not spec.prior_on_server or spec.prior.is_flat:
        return None
    t = spec.prior.grad(theta)
    if spec.oracle == "star":
        t = t - spec.prior.grad(spec.theta_star)
    return t


def server_step(spec: ServerSpec, st: ServerState, seed: int, g_hat: dict[int, np.ndarray]) -> dict:
    """Steps 3–5 for round ``k = st.k`` given the decoded messages ``{i: ĝ_i}`` of clients
    whose reply was valid. Advances ``st`` to ``k+1`` and returns the round's facts."""
    k = st.k
    replied = np.zeros(spec.b, dtype=bool)
    replied[list(g_hat)] = True
    skipped = bool(participation.skips_round(replied, spec.rule))
    if skipped:
        st.k += 1
        return {"skipped": True, "n_replied": 0}
    w = participation.weights(replied, spec.p, spec.rule)
    g = np.zeros_like(st.theta)
    for i in sorted(g_hat):
        g = g + w[i] * g_hat[i]
    if spec.memory:
        g = g + st.eta
        for i in sorted(g_hat):
            st.eta_i[i] = st.eta_i[i] + spec.alpha[i] * g_hat[i]
        st.eta = st.eta_i.sum(axis=0)
    pt = prior_term(spec, st.theta)
    if pt is not None:
        g = g + pt
    z = rng.normal(seed, rng.Stream.NOISE, k, 0, st.theta.shape[0])
    st.theta = st.theta - spec.gamma * g + np.sqrt(2.0 * spec.gamma) * z
    st.k += 1
    return {"skipped": False, "n_replied": int(replied.sum())}
