"""The server's side of one round: anchor, aggregation, memory, prior and Langevin step.

Read next to Algorithm 2 of the paper (QLSD++; the other variants switch parts off):

1. ``ζ_k = θ_k`` if ``k ≡ 0 (mod l)`` else ``ζ_{k−1}``                       (:func:`refresh_anchor`)
2. clients in ``A_{k+1}`` send ``g_i``; the server decodes ``ĝ_i``
3. ``g_{k+1} = Σ_{i∈A} w_i ĝ_i  [+ η_k]  + ∇U_0(θ_k) [− ∇U_0(θ*)]``          (:func:`langevin_step`)
   (prior terms only when the prior stays on the server; ``− ∇U_0(θ*)`` for QLSD*)
4. ``η_{k+1}^{(i)} = η_k^{(i)} + α_i ĝ_i`` for ``i ∈ A``;  ``η_{k+1} = Σ_i η_{k+1}^{(i)}``
5. ``θ_{k+1} = θ_k − γ g_{k+1} + √(2γ) Z_{k+1}``, ``Z`` from stream ``(seed, NOISE, k, 0)``;
   with a metric ``M`` and a temperature ``T`` (:mod:`qlsd_flwr.core.metric`),
   ``θ_{k+1} = θ_k − γ M g_{k+1} + √(2γT) M^{1/2} Z_{k+1}`` (the identity metric at ``T = 1`` runs
   the paper's expression unchanged, so its chains are bit for bit those of before); under ``downlink = qsgd``
   with ``downlink-correction``, the prior at the clients' point ``w_k`` and ``− γβ (θ_k − w_k)`` more
   (:mod:`qlsd_flwr.core.downlink`); with ``noise-correction = metric`` the noise's covariance ``2γT M`` times
   ``1 − γ/2`` (:func:`noise_factor`)

Sums run over clients in ascending index order, always, so the result does not depend on
the order replies arrive in. The server keeps a mirror of every ``η_i`` and recomputes
``η = Σ_i η_i`` from the mirrors, so ``η`` equals the sum of the clients' terms exactly.

Every function takes an optional leading chain axis: ``θ`` of shape ``(d,)`` for one chain (the
Flower and local paths) or ``(C, d)`` for ``C`` chains side by side (the vectorised engine's
numpy backend), with ``seed`` then a ``(C,)`` array. :func:`langevin_step` is the one place the QLSD
family's server step is written (the rivals' are their samplers', :mod:`qlsd_flwr.samplers`, and
:func:`server_step` calls whichever the spec's estimator names); chain ``c`` of a vectorised step is
bit for bit the one-chain step with seed ``seed[c]`` (numpy's reductions over a leading axis add rows
in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qlsd_flwr.core import participation, rng
from qlsd_flwr.core.metric import Identity, Metric
from qlsd_flwr.core.potential import GaussianPrior
from qlsd_flwr.errors import ConfigError


@dataclass
class ServerState:
    """The chain's state between rounds (arrays carry the leading chain axis when there is one)."""

    k: int  # the next round to run (θ_k is current)
    theta: np.ndarray  # θ_k, (d,) or (C, d)
    zeta: np.ndarray | None = None  # SVRG anchor ζ_k (QLSD++)
    zeta_version: int = -1  # increments at each refresh
    eta_i: np.ndarray | None = None  # (b, d) or (C, b, d): mirror of the clients' memory terms
    eta: np.ndarray | None = None  # Σ_i η_i
    # downlink = qsgd: w_k, where this round's clients evaluate (set by the broadcast before the step; the step reads it
    # only with ServerSpec.lag)
    w: np.ndarray | None = None


@dataclass(frozen=True)
class ServerSpec:
    """Static server settings (paper symbols: ``b`` clients, step ``γ``, ``p_i``, ``α_i``, ``l``)."""

    b: int
    gamma: float
    p: np.ndarray
    rule: str
    memory: bool
    alpha: np.ndarray  # α_i per client
    l: int
    kind: Any  # what the clients' messages are: a qlsd_flwr.samplers.Estimator (its step is this round's)
    prior: GaussianPrior
    prior_on_server: bool
    theta_star: np.ndarray | None = None
    metric: Metric = Identity()  # M: identity, diagonal, dense or Kronecker (constant during the run)
    temperature: float = 1.0  # T: the chain targets π^{1/T}
    # QLSD*/LSD* once a client has left the federation: Σ_{j kept} ∇U_j(θ*) (+ ∇U_0(θ*) with the prior on the
    # server), the control variate's sum, no longer zero without the client's term (None: zero, the paper's)
    offset: np.ndarray | None = None
    # FALD, VR-FALD* (oracle fald, fald-star): the clients' data shares w_i of this round (core.fald); the
    # step then averages the clients' local steps instead of taking a Langevin step of its own
    local_weights: np.ndarray | None = None
    # DG-LMC (oracle dglmc): 1/ρ_i of the clients kept (0 for one excluded), the exact θ | z draw's couplings
    coupling: np.ndarray | None = None
    spectrum: Any = None  # DG-LMC with a metric: M in its eigenbasis (core.dglmc.Spectrum)
    # compression-basis = metric: the replies, the memory and the step's g are in the metric's coordinates
    # φ = S⁻¹ θ (M = S Sᵀ): the server applies S (langevin_step)
    whitened: bool = False
    # compression-basis = block: the clients' basis B when it is not M's own root S (core.block_basis): g then
    # estimates B ∇U and the step applies M B⁻¹ g; None: S
    basis: Any = None
    # downlink-correction = metric: β of the lag's correction (0: none). The clients evaluate at w_k ≠ θ_k; the step
    # takes the prior at w_k too and adds −γβ (θ_k − w_k), M⁻¹ standing for the curvature (core.downlink). β =
    # min(1, 1/γ), so that γβ ≤ 1 and the recursion is stable wherever ULA's is (core.downlink.stable)
    lag: float = 0.0
    # noise-correction = metric: the Langevin noise's scale √(1 − γ/2) (1: ULA's own; :func:`noise_factor`)
    noise: float = 1.0

    @property
    def oracle(self) -> str:
        """The estimator's label (``full``, ``svrg``, ...)."""
        return self.kind.name

    @property
    def whitening(self):
        """What the clients' messages are quantised in under ``whitened``: ``basis``, else ``M``'s own root."""
        return self.metric if self.basis is None else self.basis

    @property
    def plain(self) -> bool:
        """Whether the step is the paper's own (identity metric, ``T = 1``)."""
        return self.metric.is_identity and self.temperature == 1.0


#: ``noise-correction``: ``metric`` scales the Langevin noise so that the chain's law is exact on the Gaussian whose
#: precision is ``M⁻¹`` (:func:`noise_factor`); ``off``: ULA's noise
NOISE_CORRECTIONS = ("off", "metric")


def check_noise(v: str, identity: bool, langevin: bool, gamma: float = float("nan")) -> str:
    """``noise-correction``'s value ``v``, or ``ConfigError`` naming the key where ``metric`` has no curvature to take
    (``identity``: ``M`` is the identity) or no Langevin step of the QLSD family's to act on (``langevin``: the
    sampler's step is :func:`langevin_step`; the rivals take their own), or where a numeric ``gamma`` is not below 2
    (:func:`noise_factor`; ``gamma = auto``'s γ is checked when it is chosen)."""
    if v == "metric" and identity:
        raise ConfigError("noise-correction: metric takes M⁻¹ as the curvature, and metric = identity has none; "
                          "allowed with it: off")
    if v == "metric" and not langevin:
        raise ConfigError("noise-correction: metric scales the QLSD family's Langevin noise; this variant takes its "
                          "own step; allowed with it: off")
    if np.isfinite(gamma):
        noise_factor(v, gamma)
    return v


def noise_factor(correction: str, gamma: float, identity: bool = False) -> float:
    r"""The Langevin noise's scale under ``noise-correction`` (``correction``) at the step ``γ``: 1 under ``off``
    (ULA) and where ``M`` is the identity (``identity``: a run whose correction left it so has no curvature to take),
    and under ``metric`` ``√(1 − γ/2)``, the noise's covariance then ``γ (2 − γ) T M``.

    Why: on a Gaussian target of precision ``P`` the step ``θ' = θ − γ M P (θ − μ) + ξ``, ``ξ ~ N(0, Q)``, has the
    stationary covariance ``Σ = A Σ Aᵀ + Q``, ``A = I − γ M P``. ULA's ``Q = 2γT M`` gives ``Σ ≠ T P⁻¹``: along a
    direction where ``M^½ P M^½`` has the eigenvalue ``λ`` the variance is ``1/(1 − γλ/2)`` times the target's
    (ULA's bias: 2 at ``γλ = 1``). ``Σ = T P⁻¹`` exactly needs ``Q = T (2γ M − γ² M P M)``, and where ``P = M⁻¹``, the
    curvature the metric models, that is ``γ (2 − γ) T M``. Elsewhere the ratio is ``(1 − γ/2)/(1 − γλ/2)``: 1 at
    ``λ = 1``, above 1 where the metric reads the curvature low and below where it reads it high. ``γ < 2`` (a
    positive covariance); ``ConfigError`` naming the key otherwise. Exact with exact gradients: the clients'
    quantisation, their minibatches and the broadcast's lag add variance of their own."""
    if correction != "metric" or identity:
        return 1.0
    if not 0.0 < float(gamma) < 2.0:
        raise ConfigError(f"noise-correction: metric needs 0 < γ < 2 (the noise's covariance γ (2 − γ) T M), "
                          f"and γ = {float(gamma):.6g}; allowed with it: off")
    return float(np.sqrt(1.0 - float(gamma) / 2.0))


def init_state(spec: ServerSpec, theta0: np.ndarray) -> ServerState:
    """``θ_0`` (``(d,)``, or ``(C, d)`` for chains side by side) and zero memory."""
    theta = np.array(theta0, dtype=np.float64, copy=True)
    st = ServerState(k=0, theta=theta)
    if spec.memory:
        lead = theta.shape[:-1]
        st.eta_i = np.zeros(lead + (spec.b, theta.shape[-1]))
        st.eta = np.zeros_like(theta)
    return st


def refresh_anchor(spec: ServerSpec, st: ServerState) -> bool:
    """Step 1: set ``ζ_k = θ_k`` when ``k ≡ 0 (mod l)``; returns whether it changed."""
    if spec.kind.cv_zeta and st.k % spec.l == 0:
        st.zeta = st.theta.copy()
        st.zeta_version += 1
        return True
    return False


def prior_term(spec: ServerSpec, theta: np.ndarray) -> np.ndarray | None:
    """The server's exact prior contribution ``∇U_0(θ) [− ∇U_0(θ*)]``, or ``None`` when the
    clients share the prior (or it is flat)."""
    if not spec.prior_on_server or spec.prior.is_flat:
        return None
    t = spec.prior.grad(theta)
    if spec.kind.cv_theta_star:
        t = t - spec.prior.grad(spec.theta_star)
    return t


def server_step(spec: ServerSpec, st: ServerState, seed, g_hat: np.ndarray,
                replied: np.ndarray) -> np.ndarray:
    """The sampler's server update for round ``k = st.k`` (``spec.kind.step``: :func:`langevin_step` for
    the QLSD family; FALD's average, DG-LMC's exact draw, :mod:`qlsd_flwr.samplers`); advances ``st`` to
    ``k + 1`` and returns the chains' ``skipped`` flags."""
    return spec.kind.step(spec, st, seed, g_hat, replied)


def langevin_step(spec: ServerSpec, st: ServerState, seed, g_hat: np.ndarray,
                  replied: np.ndarray) -> np.ndarray:
    """Steps 3–5 for round ``k = st.k``; advances ``st`` to ``k + 1``.

    ``g_hat``: the decoded messages ``ĝ_i``, shape ``(b, d)`` (or ``(C, b, d)``); only rows with
    ``replied`` (``(b,)`` or ``(C, b)``) true are read. ``seed``: the chain's seed (or ``(C,)``
    seeds). Returns the chains' ``skipped`` flags (a round is skipped, θ and the memory kept,
    under the ``active-fraction`` rule when no client replied). Memory increments use ``ĝ_i``
    as decoded, so the server's mirror of ``η_i`` equals the client's bit for bit.
    """
    k = st.k
    skipped = participation.skips_round(replied, spec.rule)
    w = participation.weights(replied, spec.p, spec.rule)
    g = np.zeros_like(st.theta)
    tmp = np.empty_like(g)
    for i in np.flatnonzero(np.any(replied.reshape(-1, spec.b), axis=0)):  # index order
        on = replied[..., i, None]
        gi = g_hat[..., i, :]
        # g ← g + w_i ĝ_i and η_i ← η_i + α_i ĝ_i where client i replied (in place: the same two
        # roundings per element as the expression, without its temporaries, which cost more than
        # the arithmetic at d ≈ 6·10^4)
        np.add(g, np.multiply(w[..., i, None], gi, out=tmp), out=g, where=on)
        if spec.memory:
            eta_i = st.eta_i[..., i, :]
            np.add(eta_i, np.multiply(spec.alpha[i], gi, out=tmp), out=eta_i, where=on)
    if spec.memory:
        g = g + st.eta
        st.eta = st.eta_i.sum(axis=-2)
    lagged = bool(spec.lag) and st.w is not None
    pt = prior_term(spec, st.w if lagged else st.theta)
    if pt is not None:
        g = g + (spec.whitening.apply_root_t(pt) if spec.whitened else pt)
    if spec.offset is not None:
        g = g + (spec.whitening.apply_root_t(spec.offset) if spec.whitened else spec.offset)
    z = rng.normal(seed, rng.Stream.NOISE, k, 0, st.theta.shape[-1])
    if spec.whitened:  # g is Sᵀ ∇U's estimate: θ − γ S g + √(2γT) S z, the metric's step in θ's coordinates
        # (compression-basis = block: g estimates B ∇U, and M B⁻¹ g is M ∇U's estimate)
        drift = spec.metric.apply_root(g) if spec.basis is None else spec.metric.apply(spec.basis.apply_inv(g))
        new = st.theta - spec.gamma * drift + spec.noise * np.sqrt(2.0 * spec.gamma * spec.temperature) \
            * spec.metric.apply_root(z)
    elif spec.plain:
        new = st.theta - spec.gamma * g + np.sqrt(2.0 * spec.gamma) * z
    else:
        new = st.theta - spec.gamma * spec.metric.apply(g) \
            + spec.noise * np.sqrt(2.0 * spec.gamma * spec.temperature) * spec.metric.apply_root(z)
    if lagged:  # ĝ(w_k) + M⁻¹ (θ_k − w_k): ∇U(θ_k) to first order, with the curvature M models
        new = new - (spec.gamma * spec.lag) * (st.theta - st.w)
    st.theta = np.where(np.asarray(skipped)[..., None], st.theta, new)
    st.k += 1
    return skipped


def stack_replies(g_hat: dict[int, np.ndarray], b: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """``{i: ĝ_i}`` of the clients whose reply was valid → ``(g_hat (b, d), replied (b,))``."""
    arr = np.zeros((b, d))
    replied = np.zeros(b, dtype=bool)
    for i, g in g_hat.items():
        arr[i] = g
        replied[i] = True
    return arr, replied
