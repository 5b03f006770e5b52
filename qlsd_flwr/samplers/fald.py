"""FALD and VR-FALD* (Plassier, Durmus & Moulines, AISTATS 2023: federated averaging Langevin
dynamics): each active client takes ``K`` local Langevin steps on ``∇Ũ_i = ∇U_i + w_i ∇U_0`` with a
share ``τ`` of the noise common to all clients and sends ``Δ_i = (θ − θ_i)/h``; the server averages
them with the weights ``w_i/p_i`` (:mod:`qlsd_flwr.core.fald`). VR-FALD* adds the control variate
``−∇Ũ_i(θ_r) + w_i ∇U(θ_r)`` at a reference θ_r, θ* at the start, refreshed with probability ``q``.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.errors import ConfigError
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings

FALD = Estimator("fald", local=True, measure="share*displacement")
FALD_STAR = Estimator("fald-star", local=True, at_theta_star=True, refreshable=True,
                      measure="share*displacement")

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
