"""FSGLD (El Mekkaoui, Mesquita, Blomstedt & Kaski, 2021): one client a round, drawn by its data share
``f_s = N_s/N``, takes local Langevin steps on a conducive gradient built from every client's Taylor
surrogate at θ* (:mod:`qlsd_flwr.core.fsgld`); the server steps ``θ − γ Δ_s``.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.errors import ConfigError
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings

FSGLD = Estimator("fsgld", local=True, at_theta_star=True, surrogate=True, measure="share*displacement")


def one_client_a_round(sampler: Sampler, s: Settings) -> None:
    if np.any(np.asarray(s.p) < 1.0):
        raise ConfigError(f"p: {sampler.name} asks one client a round, drawn with probability f_i = N_i/N (its data "
                          "share); the participation probabilities do not apply; allowed: 1")


SAMPLERS = (
    Sampler("fsgld", "FSGLD", FSGLD, compressed=False, memory=False,
            reference="El Mekkaoui, Mesquita, Blomstedt & Kaski, UAI 2021; docs/RIVALS.md",
            not_applicable=frozenset({"batch-fraction", "l", "alpha", "prior-on", "tau", "aggregation", "rho", "q"}),
            checks=(one_client_a_round,)),
)
