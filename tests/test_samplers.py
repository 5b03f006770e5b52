"""The sampler registry (issue 36): one declaration per ``variant`` that the rest of the package reads.

The chains themselves are pinned by ``tests/test_equivalence.py`` (the refactor changed none); here, that
the registry is the one list of samplers the key table, the configuration and the client settings know,
and that each sampler's refusals and inapplicable keys are its own declaration's.
"""

from __future__ import annotations

import pytest

from qlsd_flwr import samplers
from qlsd_flwr.config import ConfigError, not_applicable, resolve
from qlsd_flwr.keys import KEYS


def test_the_key_table_the_configuration_and_the_registry_list_the_same_samplers():
    choices = next(k for k in KEYS if k.name == "variant").choices
    assert tuple(choices) == tuple(samplers.SAMPLERS)
    for name, s in samplers.SAMPLERS.items():
        cfg = resolve({"variant": name, "p": "1"})
        assert cfg.sampler is s and cfg.kind is s.estimator and cfg.oracle == s.oracle
        assert (cfg.compressed, cfg.memory) == (s.compressed, s.memory)
    for alias, name in samplers.ALIASES.items():
        assert samplers.find(alias.upper()) is samplers.SAMPLERS[name]
    with pytest.raises(KeyError, match="allowed: qlsd, qlsd-sharp"):
        samplers.get("qlsd+++")


def test_the_client_settings_accept_the_registry_s_estimators_and_no_other():
    from qlsd_flwr.core.potential import GaussianPrior
    from qlsd_flwr.protocol import build

    for name in samplers.SAMPLERS:
        cfg = resolve({"variant": name, "p": "1", "num-clients": 2, "dim": 3, "local-steps": 2})
        settings = build.client_settings(cfg, 0, 3, GaussianPrior())
        spec, _ = build.client_spec_from_settings(settings, 0, 10, 3)
        assert spec.kind is cfg.kind
        with pytest.raises(ValueError, match="bad value for oracle"):
            build.client_spec_from_settings({**settings, "oracle": "fald-pp"}, 0, 10, 3)


@pytest.mark.parametrize("name", list(samplers.SAMPLERS))
def test_a_sampler_s_inapplicable_keys_are_its_declaration_s(name):
    """Of the keys some sampler does not read, a run leaves out of its comparison exactly its own."""
    declared = set().union(*(s.not_applicable for s in samplers.SAMPLERS.values()))
    raw = resolve({"variant": name, "p": "1"}).raw
    assert not_applicable(raw) & declared == samplers.SAMPLERS[name].not_applicable


@pytest.mark.parametrize("name, over, words", [
    ("fsgld", {"p": "0.5"}, "p: fsgld asks one client a round"),
    ("dg-lmc", {"metric": "diagonal", "metric-rank": 2}, "metric-rank: dg-lmc"),
    ("dg-lmc", {"temperature": 0.5}, "temperature: dg-lmc samples T = 1"),
    ("fald", {"p": "0.5", "aggregation": "active-fraction"}, "aggregation: fald averages"),
    ("qlsd-pp", {"q": 0.2}, "q: only vr-fald-star"),
])
def test_each_refusal_names_its_key_and_the_sampler(name, over, words):
    with pytest.raises(ConfigError, match=words):
        resolve({"variant": name, **over})
