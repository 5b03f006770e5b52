"""FALD and VR-FALD* (Plassier, Durmus & Moulines, AISTATS 2023: federated averaging Langevin
dynamics): each active client takes ``K`` local Langevin steps on ``∇Ũ_i = ∇U_i + w_i ∇U_0`` with a
share ``τ`` of the noise common to all clients and sends ``Δ_i = (θ − θ_i)/h``; the server averages
them with the weights ``w_i/p_i`` (:mod:`qlsd_flwr.core.fald`). VR-FALD* adds the control variate
``−∇Ũ_i(θ_r) + w_i ∇U(θ_r)`` at a reference θ_r, θ* at the start, refreshed with probability ``q``.

The client's update is :func:`message`, the server's :func:`average_step` (FSGLD's too).
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import fald as numerics
from qlsd_flwr.errors import ConfigError
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings


def message(spec, pot, state, seed: int, round_: int, theta: np.ndarray, local) -> np.ndarray:
    r"""FALD's and VR-FALD\*'s message ``Δ_i = (θ − θ_i)/h`` (:func:`qlsd_flwr.core.fald.message`).
    ``local = (h, w_i, S_A, p_i)``: the step, the client's data share, the round's active share and its
    participation probability, sent by the server each round. The local gradient is
    ``∇Ũ_i = ∇U_i + w_i ∇U_0``; VR-FALD\* uses ``∇Ũ_i(x) − ∇Ũ_i(θ*) + w_i ∇U(θ*)``."""
    h, w, share, p = (float(x) for x in local)
    prior = spec.prior

    def grad(x):
        return pot.grad_sum(x) + w * prior.grad(x)

    g = grad
    if spec.kind.at_theta_star:  # VR-FALD*'s control variate at its reference
        c = w * state.anchor_total - (state.anchor_grad + w * prior.grad(state.anchor))

        def g(x):
            return grad(x) + c
    return numerics.message(g, theta, w, h, spec.tau, spec.local_steps, seed, round_, spec.index, share, p,
                            spec.temperature, state.metric)


def average_step(spec, st, seed, g_hat: np.ndarray, replied: np.ndarray) -> np.ndarray:
    """FALD's server step: ``θ_{k+1} = θ_k − h Σ_{i∈A} (w_i/p_i) Δ̂_i``, the Horvitz–Thompson average of the
    clients' local steps (the noise is in them); a round with no reply leaves θ (skipped). Sums run over
    the clients in index order, with the optional leading chain axis of
    :func:`qlsd_flwr.core.server_step.server_step`."""
    skipped = ~np.any(replied, axis=-1)
    w = np.where(replied, spec.local_weights / spec.p, 0.0)
    g = np.zeros_like(st.theta)
    tmp = np.empty_like(g)
    for i in np.flatnonzero(np.any(replied.reshape(-1, spec.b), axis=0)):  # index order
        np.add(g, np.multiply(w[..., i, None], g_hat[..., i, :], out=tmp), out=g, where=replied[..., i, None])
    st.theta = np.where(np.asarray(skipped)[..., None], st.theta, st.theta - spec.gamma * g)
    st.k += 1
    return skipped


FALD = Estimator("fald", local=True, measure="share*displacement", message=message, step=average_step,
                 down=("local",))
FALD_STAR = Estimator("fald-star", local=True, at_theta_star=True, refreshable=True,
                      measure="share*displacement", message=message, step=average_step,
                      down=("local", "refresh", "anchor", "anchor_total"), up=("anchor_grad", "ref_grad"),
                      kept=("reference_refresh",))

#: keys of the QLSD family's estimators and server, which no FALD run reads (FALD shares U_0 by w_i)
_QLSD_KEYS = frozenset({"batch-fraction", "l", "alpha", "prior-on", "rho"})
_REF = "Plassier, Durmus & Moulines, AISTATS 2023; docs/RIVALS.md"


def unbiased_weights(sampler: Sampler, s: Settings) -> None:
    """The weights ``w_i/p_i`` keep FALD's noise exact under partial participation."""
    if s.aggregation != "unbiased" and np.any(np.asarray(s.p) < 1.0):
        raise ConfigError(f"aggregation: {sampler.name} averages its clients with the weights w_i/p_i (unbiased), "
                          "which keep its noise exact under partial participation; allowed: unbiased")


SAMPLERS = (
    Sampler("fald", "FALD", FALD, compressed=False, memory=False, reference=_REF,
            not_applicable=_QLSD_KEYS | {"q"}, checks=(unbiased_weights,)),
    Sampler("vr-fald-star", "VR-FALD*", FALD_STAR, compressed=False, memory=False, reference=_REF,
            not_applicable=_QLSD_KEYS, checks=(unbiased_weights,)),
)
