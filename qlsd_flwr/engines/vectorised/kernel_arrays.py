"""The numba kernel's inputs and outputs (:mod:`.kernel`): three named tuples of arrays.

:class:`KernelParams` is read only; :class:`ChainArrays` holds each chain's state, updated in
place and sliced per thread; :class:`BlockOutputs` is what a block of rounds reports.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

GAUSSIAN, LOGISTIC = 0, 1  # KernelParams.task


class KernelParams(NamedTuple):
    """What the kernel reads: the data, the settings of each of ``V`` configurations run side by
    side (axis 0), and the settings they share."""

    p: np.ndarray  # (b,) participation probabilities p_i
    Ns: np.ndarray  # (b,) N_i
    ns: np.ndarray  # (b,) minibatch sizes n_i
    y: np.ndarray  # (Σ N_i, d) every client's points (logistic: its rows [x, 1]), client after client
    yoff: np.ndarray  # (b + 1,) where client i's rows start
    ysum: np.ndarray  # (b, d) Σ_j y_ij (Gaussian only)
    labels: np.ndarray  # (Σ N_i,) class labels (logistic only; else empty)
    n_classes: int  # K (logistic; θ is the row-major (p+1)×K matrix W), else 1
    task: int  # GAUSSIAN or LOGISTIC
    oracle: np.ndarray  # (V,) Oracle values
    compressed: np.ndarray  # (V,) QSGD (True) or the float64 identity
    memory: np.ndarray  # (V,) η_i on
    encoding: np.ndarray  # (V,) Encoding values
    l: np.ndarray  # (V,) anchor period
    gamma: np.ndarray  # (V,) γ
    sqrt2gamma: np.ndarray  # (V,) √(2γ), as the reference computes it
    s: np.ndarray  # (V, b) levels s_i
    packed: np.ndarray  # (V, b) packed code length (bits); the identity's raw length
    bound: np.ndarray  # (V, b) analytic bound (bits)
    alpha: np.ndarray  # (V, b) α_i
    theta_star: np.ndarray  # (V, d) θ* (QLSD*)
    star_prior: np.ndarray  # (V, d) ∇U_0(θ*)
    active_fraction: bool  # aggregation rule b/|A| (else 1/p_i)
    burn_in: int
    thin: int
    prior_flat: bool
    prior_on_server: bool
    noise_in_kernel: bool  # libm's Box–Muller equals numpy's here (else noise comes in `BlockOutputs`)
    need_minibatch: bool  # some configuration's oracle reads a minibatch
    need_dither: bool  # some configuration quantises
    prior_var: float
    prior_mean: float
    prior_weight: float  # w_i, the clients' share of the prior


class ChainArrays(NamedTuple):
    """Each chain's state (axis 0: chains; axis 1: configurations), updated in place."""

    seeds: np.ndarray  # (C,) uint64
    theta: np.ndarray  # (C, V, d)
    zeta: np.ndarray  # (C, V, d)
    agrad: np.ndarray  # (C, V, b, d or 1) ∇U_i(ζ)
    eta_i: np.ndarray  # (C, V, b, d or 1)
    eta: np.ndarray  # (C, V, d)
    s_th: np.ndarray  # (C, V, d) Σ θ over kept draws
    s_th2: np.ndarray  # (C, V, d) Σ θ²
    s_f: np.ndarray  # (C, V) Σ ‖θ‖
    s_f2: np.ndarray  # (C, V) Σ ‖θ‖²
    kept: np.ndarray  # (C,) kept draws
    ties: np.ndarray  # (C,) subset boundary ties
    err: np.ndarray  # (C, V) QuantiseError of the round the chain stopped at (0: none)

    def rows(self, a: int, z: int) -> ChainArrays:
        return ChainArrays(*(x[a:z] for x in self))


class BlockOutputs(NamedTuple):
    """What one block reports (axis 0: chains)."""

    noise: np.ndarray  # (C, R, d) Langevin noise when not drawn in the kernel, else (C, 0, d)
    states: np.ndarray  # (C, V, R, d) θ after each round, or (C, V, 0, d)
    m_act: np.ndarray  # (C, R) active clients
    m_skip: np.ndarray  # (C, R) skipped rounds
    m_bits: np.ndarray  # (C, V, R) exact code bits
    m_bound: np.ndarray  # (C, V, R) analytic bound
    m_bytes: np.ndarray  # (C, V, R) payload bytes

    def rows(self, a: int, z: int) -> BlockOutputs:
        return BlockOutputs(*(x[a:z] for x in self))
