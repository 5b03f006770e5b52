"""DG-LMC (Plassier, Vono, Durmus & Moulines, ICML 2021): each client keeps ``z_i`` and takes ULA steps
toward ``exp(−U_i(z) − ‖z − θ‖²_{M⁻¹}/(2ρ_i))``; the server draws ``θ | z`` exactly
(:mod:`qlsd_flwr.core.dglmc`). ``z_i`` is kept on both sides as QLSD++'s memory is (``α = 1``).
It samples the augmented model π_ρ, whose θ-marginal is wider than the posterior by O(ρ).
"""

from __future__ import annotations

from qlsd_flwr.errors import ConfigError
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings

DGLMC = Estimator("dglmc", local=True, coupled=True, measure="coupling pull")


def no_low_rank(sampler: Sampler, s: Settings) -> None:
    """The exact θ | z draw takes the metric in its own eigenbasis, which a correction changes."""
    if int(s.metric_rank):
        raise ConfigError(f"metric-rank: {sampler.name}'s exact θ | z draw takes its metric in the metric's own "
                          "eigenbasis, which a low-rank correction changes; allowed: metric-rank = 0")


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
