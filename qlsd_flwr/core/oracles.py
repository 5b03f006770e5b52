"""What an active client computes in one round: the oracle ``H_i``, the memory, the message.

With ``S_i`` a uniform ``n_i``-subset of ``[N_i]`` and ``w_i`` the client's share of the prior
``U_0`` (``0`` when the prior stays on the server), the oracles are (ALGORITHMS.md):

* ``full``       (QLSD):   ``H_i(θ) = ∇U_i(θ)``
* ``minibatch``  (QLSD#):  ``H_i(θ) = (N_i/n_i) Σ_{j∈S_i} ∇U_ij(θ) + w_i ∇U_0(θ)``
* ``star``       (QLSD*):  ``H_i(θ) = (N_i/n_i) Σ_{j∈S_i} [∇U_ij(θ) − ∇U_ij(θ*)] + w_i[∇U_0(θ) − ∇U_0(θ*)]``
* ``svrg``       (QLSD++): ``H_i(θ) = (N_i/n_i) Σ_{j∈S_i} [∇U_ij(θ) − ∇U_ij(ζ)] + w_i[∇U_0(θ) − ∇U_0(ζ)] + ∇U_i(ζ)``

(the QLSD family's message: :func:`qlsd_flwr.samplers.qlsd.message`; the rivals' messages are their
samplers' own, :mod:`qlsd_flwr.samplers`).

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
    kind: Any  # what its message is: a qlsd_flwr.samplers.Estimator (its flags, its update functions)
    batch_size: int  # n_i
    compressor: Any  # qlsd_flwr.compression.qsgd.QSGD or Identity
    memory: bool
    alpha: float  # α_i (0 switches memory off)
    prior: GaussianPrior
    prior_weight: float  # w_i
    local_steps: int = 0  # FALD, VR-FALD*: K local Langevin steps a round (core.fald)
    tau: float = 0.0  # FALD: the share of the noise common to all clients
    temperature: float = 1.0  # FALD: T, the noise's variance factor (the QLSD family's T is the server's)
    metric: str = "identity"  # the rivals: "sent" when the server sends a metric M for the local steps
    downlink: Any = None  # downlink = qsgd: the broadcast's rule (core.downlink.Downlink); None: θ in full

    @property
    def oracle(self) -> str:
        """The estimator's label (``full``, ``svrg``, ...), as the client settings carry it."""
        return self.kind.name

    @property
    def whitened(self) -> bool:
        """``compression-basis = metric``: the client quantises ``Sᵀ H_i`` (``M = S Sᵀ``, sent by the server)."""
        return self.metric == "sent" and not self.kind.local


@dataclass
class ClientState:
    """What a client keeps between rounds (Flower: ``context.state``)."""

    eta: np.ndarray | None = None  # η_i, the memory term
    eta_count: int = 0  # memory updates applied so far (the server keeps the same count)
    anchor_version: int = -1  # which anchor (ζ or θ*) the cache below belongs to
    anchor: np.ndarray | None = None  # ζ (QLSD++) or θ* (QLSD*)
    anchor_grad: np.ndarray | None = None  # ∇U_i(ζ) (QLSD++); Σ_j ∇U_ij(θ*) (VR-FALD*)
    anchor_total: np.ndarray | None = None  # VR-FALD*, FSGLD: ∇U(θ*), the federation's, sent with θ*
    surrogate: np.ndarray | None = None  # FSGLD: λ_i, this client's surrogate precision, sent with θ*
    surrogate_total: np.ndarray | None = None  # FSGLD: Λ = Σ_j λ_j over the clients kept, sent with θ*
    metric: Any = None  # the local steps' metric M (core.metric.Metric; ClientSpec.metric = "sent")
    w: np.ndarray | None = None  # downlink = qsgd, ef21-p: the point w_k the broadcast's codes build
    w_round: int = -1  # the round of that w_k
    w_support: np.ndarray | None = None  # downlink-support = data: 1 on the coordinates the codes carry, 0 elsewhere
    point: np.ndarray | None = None  # before sampling: the last point θ the server sent (protocol.client.prep_point)
    point_id: int = -1  # and its number, which the server sends instead of θ while the point is the same
    block_dirs: np.ndarray | None = None  # metric-block: the rows of input directions received (core.block_basis.BasisRef)


def set_anchor(spec: ClientSpec, pot: LocalPotential, state: ClientState,
               anchor: np.ndarray, version: int) -> None:
    """Cache a new anchor; for QLSD++ compute ``∇U_i(ζ)`` once (one pass over local data)."""
    state.anchor = np.array(anchor, dtype=np.float64, copy=True)
    state.anchor_version = int(version)
    if spec.kind.cv_zeta:
        state.anchor_grad = full_local_grad(spec, pot, state.anchor)
    elif spec.kind.at_theta_star:  # the data part; the prior's share is the round's (qlsd_flwr.samplers.fald.message)
        state.anchor_grad = pot.grad_sum(state.anchor)


def full_local_grad(spec: ClientSpec, pot: LocalPotential, theta: np.ndarray) -> np.ndarray:
    """``∇U_i(θ)``: all local data plus the client's share of the prior."""
    return pot.grad_sum(theta) + spec.prior_weight * spec.prior.grad(theta)


def oracle(spec: ClientSpec, pot: LocalPotential, state: ClientState, theta: np.ndarray,
           idx: np.ndarray | None) -> np.ndarray:
    """``H_i(θ_k)`` for the client's oracle kind (see module docstring)."""
    w, kind = spec.prior_weight, spec.kind
    if not kind.minibatch:
        return full_local_grad(spec, pot, theta)
    scale = pot.n_data / len(idx)
    if not kind.control_variate:
        return scale * pot.grad_sum(theta, idx) + w * spec.prior.grad(theta)
    c = state.anchor
    h = scale * (pot.grad_sum(theta, idx) - pot.grad_sum(c, idx)) + w * (spec.prior.grad(theta) - spec.prior.grad(c))
    if kind.cv_zeta:
        h = h + state.anchor_grad
    return h


def batched(pot: LocalPotential) -> bool:
    """Whether ``pot`` computes many ``grad_sum`` at once (``grad_sum_batch``)."""
    return callable(getattr(pot, "grad_sum_batch", None))


def full_local_grad_batch(spec: ClientSpec, pot: LocalPotential, thetas: np.ndarray) -> np.ndarray:
    """:func:`full_local_grad` of each row of ``thetas`` ``(C, d)``, bit for bit (``(C, d)``)."""
    if not batched(pot):
        return np.stack([full_local_grad(spec, pot, t) for t in thetas])
    return pot.grad_sum_batch(thetas) + spec.prior_weight * spec.prior.grad(thetas)


def oracle_batch(spec: ClientSpec, pot: LocalPotential, thetas: np.ndarray, idx: np.ndarray | None,
                 anchor: np.ndarray | None = None, anchor_grad: np.ndarray | None = None) -> np.ndarray:
    """``H_i`` for ``C`` chains at once: ``thetas`` ``(C, d)``, ``idx`` ``(C, n_i)`` (row ``c``: chain
    ``c``'s minibatch; ``None`` for the full oracle), ``anchor`` the control variate's point
    (QLSD*: ``θ*``, ``(d,)``; QLSD++: each chain's ``ζ``, ``(C, d)``), ``anchor_grad`` each
    chain's ``∇U_i(ζ)`` ``(C, d)`` (QLSD++). Returns ``(C, d)``.

    Row ``c`` equals :func:`oracle` with a state holding ``anchor[c]`` and ``anchor_grad[c]``,
    bit for bit: the same expression, evaluated elementwise over the chain axis, on
    ``pot.grad_sum_batch`` (bitwise equal to ``grad_sum`` row by row, see
    :meth:`qlsd_flwr.tasks.logistic.LogisticLocal.grad_sum_batch`). The control variate's two
    gradients (at ``θ`` and at the anchor, on the same minibatch) are one call of ``2C`` rows.
    A potential without ``grad_sum_batch`` is called row by row through :func:`oracle`.
    """
    thetas = np.asarray(thetas, dtype=np.float64)
    C = thetas.shape[0]
    if not batched(pot):
        out = np.empty_like(thetas)
        for c in range(C):
            st = ClientState(anchor=None if anchor is None else (anchor if anchor.ndim == 1 else anchor[c]),
                             anchor_grad=None if anchor_grad is None else anchor_grad[c])
            out[c] = oracle(spec, pot, st, thetas[c], None if idx is None else idx[c])
        return out
    w, kind = spec.prior_weight, spec.kind
    if not kind.minibatch:
        return full_local_grad_batch(spec, pot, thetas)
    scale = pot.n_data / idx.shape[-1]
    if not kind.control_variate:
        return scale * pot.grad_sum_batch(thetas, idx) + w * spec.prior.grad(thetas)
    c = np.broadcast_to(anchor, thetas.shape)
    g = pot.grad_sum_batch(np.concatenate([thetas, c]), np.concatenate([idx, idx]))
    h = scale * (g[:C] - g[C:]) + w * (spec.prior.grad(thetas) - spec.prior.grad(c))
    if kind.cv_zeta:
        h = h + anchor_grad
    return h


def batched_clients(specs, pots) -> bool:
    """Whether :func:`oracle_batch_clients` computes these clients together (else client by
    client): one potential class with ``grad_sum_clients``, one oracle kind, one prior."""
    cls = type(pots[0])
    return (callable(getattr(cls, "grad_sum_clients", None)) and all(type(p) is cls for p in pots)
            and len({s.kind for s in specs}) == 1 and all(s.prior == specs[0].prior for s in specs))


def oracle_batch_clients(specs, pots, thetas: np.ndarray, idxs, anchor: np.ndarray | None = None,
                         anchor_grads: np.ndarray | None = None) -> np.ndarray:
    """:func:`oracle_batch` of ``G`` clients at once: ``specs``, ``pots`` and ``idxs`` (``(C, n_i)``,
    any ``n_i``, or ``None`` for the full oracle) per client, ``thetas``/``anchor`` as there
    (shared by the clients), ``anchor_grads`` ``(C, G, d)``. Returns ``(C, G, d)`` whose ``[:, g]``
    equals ``oracle_batch(specs[g], pots[g], ...)`` bit for bit: the same expression, with the
    clients' ``N_i/n_i`` and ``w_i`` as arrays over the client axis (the same float64 numbers)
    and ``grad_sum_clients`` of the potentials' class (bitwise equal to ``grad_sum`` slice by
    slice). Clients that :func:`batched_clients` rejects are computed one by one."""
    thetas = np.asarray(thetas, dtype=np.float64)
    if not batched_clients(specs, pots):
        return np.stack([oracle_batch(s, p, thetas, ix, anchor, None if anchor_grads is None else anchor_grads[:, g])
                         for g, (s, p, ix) in enumerate(zip(specs, pots, idxs))], axis=1)
    spec, kind = specs[0], specs[0].kind
    grad = type(pots[0]).grad_sum_clients
    w = np.array([s.prior_weight for s in specs])[:, None, None]  # (G, 1, 1)
    if not kind.minibatch:
        return (grad(pots, thetas[None], [None] * len(pots))[:, 0] + w * spec.prior.grad(thetas)).transpose(1, 0, 2)
    scale = np.array([p.n_data / np.shape(ix)[-1] for p, ix in zip(pots, idxs)])[:, None, None]
    if not kind.control_variate:
        return (scale * grad(pots, thetas[None], idxs)[:, 0] + w * spec.prior.grad(thetas)).transpose(1, 0, 2)
    c = np.broadcast_to(anchor, thetas.shape)
    g = grad(pots, np.stack([thetas, c]), idxs)  # (G, 2, C, d)
    h = (scale * (g[:, 0] - g[:, 1]) + w * (spec.prior.grad(thetas) - spec.prior.grad(c))).transpose(1, 0, 2)
    if kind.cv_zeta:
        h = h + anchor_grads
    return h


def minibatch(seed: int, round_: int, spec: ClientSpec, n_data: int) -> np.ndarray | None:
    if not spec.kind.minibatch:
        return None
    return rng.subset(seed, rng.Stream.MINIBATCH, round_, spec.index, n_data, spec.batch_size)


def client_round(spec: ClientSpec, pot: LocalPotential, state: ClientState, seed: int,
                 round_: int, theta: np.ndarray, local=None):
    """One active round of client ``i``: returns ``(quantised message, decoded ĝ_i)``.

    The message is the sampler's own (``spec.kind.message``: the QLSD family's ``H_i``, FALD's local steps,
    DG-LMC's ``z_i'``, ...), then :func:`compress_round`. Updates ``state.eta`` in place when memory is on.
    The caller encodes the message. ``local``: the round's numbers of the local-step samplers.
    """
    h = spec.kind.message(spec, pot, state, seed, round_, theta, local)
    return compress_round(spec, state, seed, round_, state.metric.apply_root_t(h) if spec.whitened else h)


def client_rounds(spec: ClientSpec, pot: LocalPotential, states: list[ClientState], seeds: list[int],
                  round_: int, thetas: np.ndarray, locals_=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`client_round` of several chains of one client (chain ``c``: ``states[c]``,
    ``seeds[c]``, ``thetas[c]``), with the chains' oracles in one :func:`oracle_batch` call
    (one batched gradient for a potential with ``grad_sum_batch``, bitwise equal to the
    per-chain oracle; row by row otherwise). Element ``c`` equals ``client_round`` of chain
    ``c`` bit for bit. ``locals_``: each chain's ``local`` (the local-step oracles, computed chain
    by chain)."""
    kind = spec.kind
    if not kind.batched:  # a message without batched forms: chain by chain
        locals_ = [None] * len(states) if locals_ is None else locals_
        return [client_round(spec, pot, st, s, round_, th, lc) for st, s, th, lc in zip(states, seeds, thetas, locals_)]
    idx = None if not kind.minibatch else np.stack([minibatch(s, round_, spec, pot.n_data) for s in seeds])
    anchor = np.stack([st.anchor for st in states]) if kind.control_variate else None
    anchor_grad = np.stack([st.anchor_grad for st in states]) if kind.cv_zeta else None
    h = oracle_batch(spec, pot, thetas, idx, anchor, anchor_grad)
    if spec.whitened:  # each chain's Sᵀ H_i (the same M in every chain's state)
        h = np.stack([st.metric.apply_root_t(h_c) for st, h_c in zip(states, h)])
    return [compress_round(spec, st, s, round_, h_c) for st, s, h_c in zip(states, seeds, h)]


def compress_round(spec: ClientSpec, state: ClientState, seed: int, round_: int, h: np.ndarray):
    """What :func:`client_round` does after the oracle ``h = H_i(θ_k)``: subtract the memory
    ``η_i``, quantise with the round's dither, update the memory. Returns ``(q, ĝ_i)``."""
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
