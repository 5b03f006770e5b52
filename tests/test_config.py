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


@pytest.mark.parametrize("value, expected", [(True, True), ("true", True), ("yes", True), ("on", True), ("1", True),
                                             (False, False), ("false", False), ("no", False), ("off", False),
                                             ("0", False), (0, False)])
def test_booleans_parse_the_usual_words(value, expected):
    cfg = resolve({"verbose": value, "progress": value})
    assert cfg.verbose is expected and cfg.progress is expected


@pytest.mark.parametrize("overrides, words", [
    ({"verbose": "maybe"}, ["verbose", "true or false", "maybe"]),
    ({"progress": 2}, ["progress", "true or false"]),
    ({"num-clients": 4.9}, ["num-clients", "expected an integer", "4.9"]),
    ({"num-rounds": "100.5"}, ["num-rounds", "expected an integer"]),
    ({"seed": True}, ["seed", "expected an integer"]),
    ({"thin": "two"}, ["thin", "expected an integer"]),
    ({"s": "2.5"}, ["s", "as integer values"]),
    ({"opt-rounds": 0}, ["opt-rounds", ">= 1"]),
    ({"opt-tol": -1}, ["opt-tol", "> 0"]),
    ({"reply-timeout": 0}, ["reply-timeout", "> 0"]),
    ({"num_rouns": 5}, ["unknown config key", "num-rounds"]),  # did-you-mean on the whole key
])
def test_parsing_rules_refuse_with_the_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        resolve(overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_integral_values_are_integers():
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve({"num-clients": "7.0", "num-rounds": 300.0, "burn-in": "1e2", "s": "4.0", "checkpoint-every": "10"})
    assert (cfg.b, cfg.num_rounds, cfg.burn_in, cfg.s.tolist(), cfg.checkpoint_every) == (7, 300, 100, [4] * 7, 10)
    assert load_task(cfg).b == 7  # every reader takes the parsed value, not the raw one


def test_the_flower_app_declares_every_key():
    # Flower refuses a --run-config key its app does not declare: pyproject.toml declares them all
    import tomllib
    from pathlib import Path

    from qlsd_flwr.config import DEFAULTS

    py = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    declared = py["tool"]["flwr"]["app"]["config"]
    assert list(declared) == list(DEFAULTS)
    cfg = resolve(declared)  # and every declared value is valid
    assert cfg.num_rounds == declared["num-rounds"]
    assert py["project"]["requires-python"] == ">=3.11"  # what flwr 1.41 and 1.42 themselves require


# ---- the key table (qlsd_flwr/keys.py) drives validation, pyproject, --help, `config`, the README --
def _bad_value(key):
    return {"int": 1.5, "float": "x", "bool": "maybe", "choice": "nonsense", "text": 5, "ints": "x",
            "floats": "x", "float|word": "x"}[key.kind]


def test_every_key_of_the_table_is_validated_and_named():
    from qlsd_flwr.keys import KEYS

    for key in KEYS:
        with pytest.raises(ConfigError) as err:
            resolve({key.name: _bad_value(key)})
        assert key.name in str(err.value), (key.name, str(err.value))


@pytest.mark.parametrize("overrides, words", [
    ({"gamma": True}, ["gamma", "expected a number"]),  # TOML gamma = true is not γ = 1
    ({"num-rounds": True}, ["num-rounds", "expected an integer"]),
    ({"num-rounds": 2.9}, ["num-rounds", "expected an integer"]),
    ({"num-rounds": float("inf")}, ["num-rounds", "expected an integer"]),
    ({"s": 2**40}, ["s", "at most"]),
    ({"seed": -1}, ["seed", "[0, 2^63 - 1]"]),
    ({"seed": 1e23}, ["seed", "[0, 2^63 - 1]"]),
    ({"dim": 1e9}, ["dim", "at most"]),
    ({"num-clients": 1e6}, ["num-clients", "at most"]),
    ({"reply-timeout": float("nan")}, ["reply-timeout", "expected a number"]),
    ({"client-cpus": -4}, ["client-cpus", "> 0"]),
    ({"opt-rounds": -3}, ["opt-rounds", ">= 1"]),
    ({"run-name": "a\x00b"}, ["run-name", "NUL"]),
    ({"progress": "no way"}, ["progress", "true or false"]),
    ({"variant": "sgld", "p": 0.5}, ["p must be 1 for variant sgld"]),
])
def test_each_parsing_rule_has_a_failing_case(overrides, words):
    with pytest.raises(ConfigError) as err:
        resolve(overrides)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize("value, expected", [(True, True), ("yes", True), ("on", True), (1, True), ("1", True),
                                             (False, False), ("no", False), ("off", False), ("0", False)])
def test_booleans_read_the_usual_words(value, expected):
    assert resolve({"verbose": value}).verbose is expected


def test_pyproject_declares_the_table_with_valid_values(monkeypatch):
    import tomllib
    from pathlib import Path

    from qlsd_flwr.keys import KEYS, parse
    from qlsd_flwr.keys_text import pyproject_block

    py = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    declared = py["tool"]["flwr"]["app"]["config"]
    assert list(declared) == [k.name for k in KEYS]
    for name, value in declared.items():
        parse(name, value)
    assert list(tomllib.loads(pyproject_block())["tool"]["flwr"]["app"]["config"]) == list(declared)
    from qlsd_flwr import keys
    from qlsd_flwr.keys import FLWR_APP_DEFAULTS  # what a resume under flwr run reads as "not given"

    monkeypatch.setitem(keys.DEFAULTS, "plot", True)  # the package's default (conftest sets false for speed)

    assert tomllib.loads(pyproject_block(FLWR_APP_DEFAULTS))["tool"]["flwr"]["app"]["config"] == declared


def test_readme_help_and_config_command_come_from_the_table(capsys):
    from pathlib import Path

    from qlsd_flwr.cli import main
    from qlsd_flwr.keys import KEYS
    from qlsd_flwr.keys_text import markdown_table

    readme = (Path(__file__).resolve().parents[1] / "docs" / "CONFIGURATION.md").read_text()
    assert markdown_table() in readme
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {k.name} = " in out for k in KEYS)
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert all(f"  {k.name} = " in out for k in KEYS) and "allowed: qlsd, qlsd-sharp" in " ".join(out.split())
    assert main(["config", "--toml"]) == 0
    assert capsys.readouterr().out.startswith("[tool.flwr.app.config]\ntask = ")


def test_config_fuzz_every_key_any_toml_value_one_line_error_naming_the_key_or_a_valid_config():
    # random TOML values of every type for every key: either resolve() accepts the configuration,
    # or it refuses with one line naming the key; nothing else (no other exception, no traceback)
    import datetime

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from qlsd_flwr.keys import KEYS

    toml_value = st.one_of(
        st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
        st.sampled_from(["auto", "flat", "off", "1e3", "0.5", "2,4", "qlsd-pp", "", "\x00", "../x"]),
        st.lists(st.integers(-5, 40), max_size=4), st.dates().map(lambda d: datetime.datetime(d.year, d.month, d.day)),
    )

    @settings(max_examples=600, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from([k.name for k in KEYS]), toml_value)
    def prop(key, value):
        try:
            resolve({key: value})
        except ConfigError as exc:
            msg = str(exc)
            assert key in msg and "\n" not in msg, (key, value, msg)

    prop()
