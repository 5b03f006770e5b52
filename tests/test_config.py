"""Invalid configurations are refused at start with the key and its allowed range."""

import numpy as np
import pytest

from qlsd_flwr.config import ConfigError, resolve


@pytest.mark.parametrize("overrides, words", [
    ({"gamma": 0}, ["gamma", "> 0"]),
    ({"gamma": -1e-3}, ["gamma", "> 0"]),
    ({"p": "1.5"}, ["p", "(0, 1]"]),
    ({"p": "0"}, ["p", "(0, 1]"]),
    ({"s": "0"}, ["s", ">= 1"]),
    ({"alpha": 1.5}, ["alpha", "[0, 1]"]),
    ({"alpha": -0.1}, ["alpha", "[0, 1]"]),
    ({"l": 0}, ["l", ">= 1"]),
    ({"p": "0.5,0.5,0.5"}, ["p", "mismatched dimensions", "num-clients = 20"]),
    ({"s": "2,4"}, ["s", "mismatched dimensions"]),
    ({"variant": "qlsd-turbo"}, ["variant", "qlsd-turbo", "qlsd-pp", "qlsd-star", "qlsd-sharp"]),
    ({"aggregation": "mean"}, ["aggregation", "unbiased", "active-fraction"]),
    ({"engine": "spark"}, ["engine", "ray", "vectorised"]),
    ({"gama": 0.1}, ["unknown config key", "gama", "gamma"]),
    ({"burn-in": 5000, "num-rounds": 100}, ["burn-in", "[0, 100)"]),
])
def test_bad_config_names_key_and_range(overrides, words):
    with pytest.raises(ConfigError) as err:
        resolve(overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_good_config_and_aliases():
    cfg = resolve({"variant": "QLSD++", "p": "0.25", "s": "4", "num-clients": 3})
    assert cfg.variant == "qlsd-pp" and cfg.memory and cfg.compressed
    assert cfg.p.tolist() == [0.25] * 3 and cfg.s.tolist() == [4] * 3
    cfg = resolve({"variant": "lsd*"})
    assert cfg.oracle == "star" and not cfg.compressed
    cfg = resolve({"variant": "sgld"})
    assert cfg.b == 1
    cfg = resolve({"p": "0.5,1,1", "num-clients": 3})
    assert cfg.p.tolist() == [0.5, 1.0, 1.0]


def test_a_step_beyond_the_stability_limit_is_warned_at_start(caplog):
    # the Gaussian target's precision τ = Σ N_i grows with b: γ = 4.9e-4 is stable at b = 20
    # (γτ ≈ 0.74) but not at b = 100 (γτ ≈ 3.3), where exact-gradient Langevin diverges
    import logging

    from qlsd_flwr.protocol.server import QLSDServer
    from qlsd_flwr.tasks import loading

    for b, unstable in ((20, False), (100, True)):
        cfg = resolve({"num-clients": b, "gamma": 4.9e-4})
        task = loading.load_task(cfg)
        tau = 1.0 / float(np.min(task.posterior_var))
        assert (cfg.gamma * tau >= 2.0) == unstable
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qlsd_flwr"):
            QLSDServer(cfg, task)
        warned = [r.getMessage() for r in caplog.records if "stability limit" in r.getMessage()]
        assert bool(warned) == unstable
        if unstable:
            assert "gamma = 0.00049" in warned[0] and f"{2.0 / tau:.3g}" in warned[0]
