"""FSGLD (El Mekkaoui, Mesquita, Blomstedt & Kaski, 2021): one client a round, drawn by its data share
``f_s = N_s/N``, takes local Langevin steps on a conducive gradient built from every client's Taylor
surrogate at θ* (:mod:`qlsd_flwr.core.fsgld`); the server steps ``θ − γ Δ_s``
(:func:`qlsd_flwr.samplers.fald.average_step`, with the one client's weight 1).
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import fsgld as numerics
from qlsd_flwr.errors import ConfigError
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings
from qlsd_flwr.samplers.fald import average_step


def message(spec, pot, state, seed: int, round_: int, theta: np.ndarray, local) -> np.ndarray:
    """The round's one client's message (:func:`qlsd_flwr.core.fsgld.message`): local steps on the
    conducive gradient of its surrogate and the others' (:func:`qlsd_flwr.core.fsgld.conducive_grad`),
    held in ``state`` since θ* was sent; ``local = (h, f_s, 1, 1)``."""
    h, f_s = float(local[0]), float(local[1])
    prior, star = spec.prior, state.anchor
    g = numerics.conducive_grad(pot.grad_sum, prior.grad, f_s, state.surrogate, state.surrogate_total, star,
                                state.anchor_grad, state.anchor_total - prior.grad(star))
    return numerics.message(g, theta, h, spec.local_steps, seed, round_, spec.index, spec.temperature, state.metric)


FSGLD = Estimator("fsgld", local=True, at_theta_star=True, surrogate=True, measure="share*displacement",
                  message=message, step=average_step,
                  down=("local", "anchor", "anchor_total", "surrogate", "surrogate_total"), up=("anchor_grad",),
                  kept=("surrogate",))


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
