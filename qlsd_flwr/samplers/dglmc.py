"""DG-LMC (Plassier, Vono, Durmus & Moulines, ICML 2021): each client keeps ``z_i`` and takes ULA steps
toward ``exp(−U_i(z) − ‖z − θ‖²_{M⁻¹}/(2ρ_i))``; the server draws ``θ | z`` exactly
(:mod:`qlsd_flwr.core.dglmc`). ``z_i`` is kept on both sides as QLSD++'s memory is (``α = 1``).
It samples the augmented model π_ρ, whose θ-marginal is wider than the posterior by O(ρ).

The client's update is :func:`message` (``z_i' − z_i``, sent compressed or not), the server's
:func:`gibbs_step`.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import dglmc as numerics
from qlsd_flwr.core import rng
from qlsd_flwr.errors import ConfigError
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings


def message(spec, pot, state, seed: int, round_: int, theta: np.ndarray, local) -> np.ndarray:
    """DG-LMC's ``z_i'``: ``K`` ULA steps on ``z_i`` (the client's memory ``η_i``: the chain's ``θ_0``, sent
    with the first message, at the start) toward ``exp(−U_i(z) − ‖z − θ‖²/(2ρ_i))``
    (:func:`qlsd_flwr.core.dglmc.local_steps`); ``local = (γ_i, ρ_i, 1, 1)``. The client then sends
    ``C(z_i' − z_i)`` and adds it to ``z_i`` (its memory, ``α = 1``: :func:`qlsd_flwr.core.oracles.compress_round`)."""
    gamma, rho = float(local[0]), float(local[1])
    z = np.zeros_like(theta) if state.eta is None else state.eta
    return numerics.local_steps(pot.grad_sum, z, theta, rho, gamma, spec.local_steps, seed, round_, spec.index,
                                state.metric)


def gibbs_step(spec, st, seed, g_hat: np.ndarray, replied: np.ndarray) -> np.ndarray:
    """DG-LMC's server step: the replied clients' ``z_i ← z_i + ĝ_i`` (the mirrors), then
    ``θ_{k+1} ~ N(Q⁻¹ (Σ_i z_i/ρ_i + μ_0/σ_0²), Q⁻¹)`` exactly, ``Q = Σ_i 1/ρ_i + 1/σ_0²`` over the clients
    kept, the noise from stream ``(seed, NOISE, k, 0)``; with a metric, the coupling in its norm
    (:func:`qlsd_flwr.core.dglmc.metric_draw`). Never skipped."""
    for i in np.flatnonzero(np.any(replied.reshape(-1, spec.b), axis=0)):  # index order
        eta_i = st.eta_i[..., i, :]
        np.add(eta_i, spec.alpha[i] * g_hat[..., i, :], out=eta_i, where=replied[..., i, None])
    st.eta = st.eta_i.sum(axis=-2)
    prec0 = 0.0 if spec.prior.is_flat else 1.0 / float(spec.prior.var)
    pull = np.tensordot(spec.coupling, st.eta_i, axes=([0], [-2]))
    z = rng.normal(seed, rng.Stream.NOISE, st.k, 0, st.theta.shape[-1])
    if spec.spectrum is not None:  # the coupling in M's norm: the draw in M's eigenbasis
        st.theta = numerics.metric_draw(spec.spectrum, pull, float(np.sum(spec.coupling)), prec0,
                                        float(spec.prior.mean), z)
    else:
        q = float(np.sum(spec.coupling)) + prec0
        st.theta = (pull + prec0 * float(spec.prior.mean)) / q + z / np.sqrt(q)
    st.k += 1
    return np.zeros(np.shape(replied)[:-1], dtype=bool)


DGLMC = Estimator("dglmc", local=True, coupled=True, measure="coupling pull", message=message, step=gibbs_step,
                  down=("local", "eta"))


def no_low_rank(sampler: Sampler, s: Settings) -> None:
    """The exact θ | z draw takes the metric in its own eigenbasis, which a correction changes."""
    for key in ("metric-rank", "metric-block"):  # both make M a low-rank correction of its base
        if int(s.metric_rank if key == "metric-rank" else s.raw.get(key) or 0):
            raise ConfigError(f"{key}: {sampler.name}'s exact θ | z draw takes its metric in the metric's own "
                              f"eigenbasis, which a low-rank correction changes; allowed: {key} = 0")


def untempered(sampler: Sampler, s: Settings) -> None:
    if float(s.raw["temperature"]) != 1.0:
        raise ConfigError(f"temperature: {sampler.name} samples T = 1 only (its exact θ | z draw and the clients' "
                          "steps are not tempered yet); allowed: 1.0")


SAMPLERS = (
    Sampler("dg-lmc", "DG-LMC", DGLMC, compressed=False, memory=True,
            reference="Plassier, Vono, Durmus & Moulines, ICML 2021; docs/RIVALS.md",
            not_applicable=frozenset({"batch-fraction", "l", "alpha", "prior-on", "tau", "aggregation", "q"}),
            checks=(no_low_rank, untempered)),
)
