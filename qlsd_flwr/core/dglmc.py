"""DG-LMC (Plassier, Vono, Durmus, Moulines, ICML 2021): Langevin within Gibbs on the augmented
model

    π_ρ(θ, z_1, …, z_b) ∝ exp(−U_0(θ) − Σ_i [U_i(z_i) + ‖z_i − θ‖² / (2ρ_i)]).

One round ``k → k+1`` (the paper's Algorithm 1, full local gradients):

1. each client ``i`` takes ``K`` ULA steps on its auxiliary ``z_i``, targeting
   ``exp(−U_i(z) − ‖z − θ_k‖² / (2ρ_i))``::

       z ← z − γ_i (∇U_i(z) + (z − θ_k)/ρ_i) + √(2γ_i) ξ,     ξ from stream (seed, LOCAL, k, i)

   (step ``j`` of ``K`` uses positions ``[2jd, 2(j+1)d)`` of that stream);
2. the server draws ``θ_{k+1} | z`` exactly: ``N(Q⁻¹ Σ_i z_i/ρ_i, Q⁻¹)`` with
   ``Q = Σ_i 1/ρ_i + 1/σ_0²`` for the prior ``N(0, σ_0² I)`` (a flat prior drops the last term),
   the noise from stream ``(seed, NOISE, k, 0)``.

**What it samples.** Exactly Gibbs (ULA replaced by exact draws), the chain targets ``π_ρ``, whose
θ-marginal tends to ``π`` as ``ρ → 0``. For the toy Gaussian, ``U_i(z) = N_i ‖z − ȳ_i‖²/2 +
const``, integrating ``z_i`` out is a Gaussian convolution: the θ-marginal is Gaussian with
precision ``Σ_i 1/(1/N_i + ρ_i) + 1/σ_0²`` and mean its inverse times ``Σ_i ȳ_i/(1/N_i + ρ_i)``
(``tests/laws_dglmc.py``'s ``gaussian_marginal``). ULA on ``z`` moves that law by ``O(γ)``; for the Gaussian the whole
round is a linear Gaussian recursion, whose stationary law ``tests/laws_dglmc.py``'s ``gaussian_stationary`` gives
exactly (a discrete Lyapunov equation), and the tests compare the chain with it.

**On the round protocol** (``variant = dg-lmc``, :mod:`qlsd_flwr.protocol.server`) each active client
(probability ``p_i``) updates its ``z_i``; an inactive client's ``z_i`` stays, which keeps ``π_ρ``
invariant (a random scan over the ``z_i`` blocks, each step a conditional update), so ``p`` changes
how fast the chain mixes, not what it samples. The client sends ``C(z_i' − z_i)`` and both sides add
the decoded difference to their copy of ``z_i`` (the memory mirrors ``η_i`` of QLSD++ with ``α = 1``:
the server's copy equals the client's bit for bit, and a client that lost its ``z_i`` is sent the
server's). With QSGD the ``z_i`` chain moves by the coded difference, an unbiased perturbation of the
ULA step that widens its law. The client's ULA step is ``γ_i = (1/γ + 1/(c ρ_i))⁻¹`` (``c`` =
``gamma-c``), so that ``γ_i (L_i + 1/ρ_i) ≤ 2c`` whenever ``γ ≤ c/L_i``: stable on every client when
``γ`` is ``gamma = auto``'s. ``tests/laws_dglmc.py``'s ``gaussian_stationary`` gives the exact law with partial
participation too.
"""

from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from qlsd_flwr.core import rng
from qlsd_flwr.core.kron import Kron
from qlsd_flwr.core.metric import Dense, Diagonal, Kronecker


def local_steps(grad_u, z: np.ndarray, theta: np.ndarray, rho: float, gamma: float, steps: int, seed: int,
                k: int, i: int, metric=None) -> np.ndarray:
    """Client ``i``'s ``K = steps`` ULA steps on ``z`` at round ``k`` (``grad_u(z) = ∇U_i(z)``).

    ``metric``: a metric ``M`` (a :class:`~qlsd_flwr.core.metric.Metric`, diagonal, dense or Kronecker;
    ``None``: the identity). The augmented model then couples in the metric's norm,
    ``π_ρ ∝ exp(−U_0(θ) − Σ_i [U_i(z_i) + (z_i − θ)ᵀ M⁻¹ (z_i − θ)/(2ρ_i)])``, and each step is ULA on
    ``z``'s conditional preconditioned by ``M``: ``z ← z − γ (M ∇U_i(z) + (z − θ)/ρ) + √(2γ) M^{1/2} ξ``.
    In ``M``'s eigenbasis coordinate ``j`` is DG-LMC with ``(γ s_j, ρ s_j)``: the ρ-bias is measured in
    the metric's scale (with ``M`` near the posterior covariance, in posterior standard deviations), and
    the θ-marginal still tends to ``π`` as ``ρ → 0``. The server's draw: :func:`metric_draw`."""
    d = z.shape[-1]
    xi = rng.normal(seed, rng.Stream.LOCAL, k, i, steps * d).reshape(steps, d)
    noise_sd = np.sqrt(2.0 * gamma)
    if metric is None:
        for j in range(steps):
            z = z - gamma * (grad_u(z) + (z - theta) / rho) + noise_sd * xi[j]
        return z
    for j in range(steps):
        z = z - gamma * (metric.apply(grad_u(z)) + (z - theta) / rho) + noise_sd * metric.apply_root(xi[j])
    return z


@dataclass(frozen=True)
class Spectrum:
    """A metric ``M = V diag(s) Vᵀ`` in its eigenbasis, for DG-LMC's exact draw of θ | z when the
    coupling is ``Σ_i (z_i − θ)ᵀ M⁻¹ (z_i − θ)/(2ρ_i)``: then θ | z has precision ``c M⁻¹ + I/σ_0²``
    (``c = Σ_i 1/ρ_i``), which the prior's isotropic term keeps diagonal in that basis only. Diagonal,
    dense (``eigh`` once) and Kronecker metrics (already held in their eigenbasis); a low-rank correction
    is refused (its basis is another)."""

    s: np.ndarray  # M's eigenvalues (diagonal: m itself)
    vecs: np.ndarray | None = None  # dense: the eigenvectors V
    kron: Kron | None = None

    @staticmethod
    def of(metric) -> "Spectrum":
        if metric.has_correction or not isinstance(metric, (Diagonal, Dense, Kronecker)):
            raise ValueError(f"dg-lmc: no eigenbasis for a {metric.kind} metric"
                             f"{' with a correction' if metric.has_correction else ''}")
        if isinstance(metric, Diagonal):
            return Spectrum(metric.m)
        if isinstance(metric, Kronecker):
            return Spectrum(1.0 / metric.kron.den, kron=metric.kron)
        s, v = np.linalg.eigh(metric.m)
        return Spectrum(s, vecs=v)

    def map(self, x: np.ndarray, f) -> np.ndarray:
        """``f(M) x`` for ``x`` of shape ``(d,)`` or ``(C, d)`` (``f`` of the eigenvalues, element by element)."""
        if x.ndim > 1:
            return np.stack([self.map(r, f) for r in x])
        if self.kron is not None:
            return self.kron.map(x, lambda den: f(1.0 / den))
        if self.vecs is None:
            return f(self.s) * x
        return self.vecs @ (f(self.s) * (self.vecs.T @ x))


def metric_draw(spectrum: Spectrum, pull: np.ndarray, c: float, prec0: float, prior_mean: float,
                z: np.ndarray) -> np.ndarray:
    """θ | z with the coupling in ``M``'s norm, exactly: in ``M``'s eigenbasis coordinate ``j`` has precision
    ``c/s_j + 1/σ_0²`` and mean ``(pull_j/s_j + μ_0/σ_0²)/(c/s_j + 1/σ_0²)``, so ``θ = (c + s/σ_0²)⁻¹ pull +
    μ_0 s/(σ_0² c + s) + (s/(c + s/σ_0²))^{1/2} z`` as functions of ``M`` (``pull = Σ_i z_i/ρ_i``, ``z``
    standard normal)."""
    mean = spectrum.map(pull, lambda s: 1.0 / (c + prec0 * s))
    if prec0:
        mean = mean + spectrum.map(np.full(pull.shape, prior_mean * prec0), lambda s: s / (c + prec0 * s))
    return mean + spectrum.map(z, lambda s: np.sqrt(s / (c + prec0 * s)))


def server_draw(zs: np.ndarray, rho: np.ndarray, prior_var: float, seed: int, k: int) -> np.ndarray:
    """``θ_{k+1} | z`` (``zs`` ``(b, d)``), exactly (the identity metric; with one, :func:`metric_draw`)."""
    rho = np.asarray(rho, dtype=np.float64)
    q = float(np.sum(1.0 / rho)) + (0.0 if not np.isfinite(prior_var) else 1.0 / float(prior_var))
    mean = np.sum(zs / rho[:, None], axis=0) / q
    return mean + rng.normal(seed, rng.Stream.NOISE, k, 0, zs.shape[-1]) / np.sqrt(q)


def local_step(gamma: float, rho: float, c: float) -> float:
    """The client's ULA step ``γ_i = (1/γ + 1/(c ρ_i))⁻¹`` on the protocol (module docstring)."""
    return 1.0 / (1.0 / gamma + 1.0 / (c * rho))


def run(task, rho, gamma, steps: int, rounds: int, seed: int = 0, theta0=None) -> np.ndarray:
    """``rounds`` rounds of DG-LMC on ``task`` (its clients' ``grad_sum``; a Gaussian prior or a
    flat one); ``rho``, ``gamma``: per client (or one value for all). Returns ``θ_1 … θ_K``
    ``(rounds, d)``; ``z_i`` starts at ``θ_0``."""
    b, d = len(task.clients), task.dim
    rho = np.broadcast_to(np.asarray(rho, dtype=np.float64), (b,)).copy()
    gamma = np.broadcast_to(np.asarray(gamma, dtype=np.float64), (b,)).copy()
    prior_var = float(getattr(task.prior, "var", np.inf))
    theta = np.zeros(d) if theta0 is None else np.asarray(theta0, dtype=np.float64).copy()
    zs = np.tile(theta, (b, 1))
    out = np.empty((rounds, d))
    for k in range(rounds):
        for i, pot in enumerate(task.clients):
            zs[i] = local_steps(lambda z, p=pot: p.grad_sum(z), zs[i], theta, rho[i], gamma[i], steps, seed, k, i)
        theta = server_draw(zs, rho, prior_var, seed, k)
        out[k] = theta
    return out
