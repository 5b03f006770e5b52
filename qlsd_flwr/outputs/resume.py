"""A resumed run's configuration: the run folder's saved keys under the ones given, and only the keys
that cannot change the chain (:data:`~qlsd_flwr.outputs.checkpoint.RESUME_FREE_KEYS`) may differ; the same
rule for ``flwr run``'s run config, which sends every declared key (:func:`flwr_run_config`). The
checkpoint itself (its file, its validation) is :mod:`qlsd_flwr.outputs.checkpoint`."""

from __future__ import annotations

import json
from pathlib import Path

from qlsd_flwr.config import ConfigError
from qlsd_flwr.outputs.checkpoint import RESUME_FREE_KEYS, same_value


def flwr_run_config(run_config: dict, where: str = "server") -> dict:
    """A ``flwr run`` run config as the keys given: with ``resume`` set, the keys whose values differ
    from the app's declared defaults (:data:`qlsd_flwr.keys.FLWR_APP_DEFAULTS` over ``DEFAULTS``)
    are the overrides and the run folder's saved configuration
    supplies the rest (:func:`resume_overrides`), as ``qlsd-flwr run --set resume=...`` does;
    ``flwr run`` itself always sends every declared key, defaults included. A client
    (``where = "client"``) whose machine does not hold the run folder keeps the keys it was given."""
    from qlsd_flwr.keys import DEFAULTS, FLWR_APP_DEFAULTS

    if not str(run_config.get("resume", "") or ""):
        return dict(run_config)
    declared = {**DEFAULTS, **FLWR_APP_DEFAULTS}
    given = {k: v for k, v in run_config.items() if k not in declared or not same_value(k, v, declared[k])}
    if where == "client" and not (Path(str(run_config["resume"])) / "config.json").is_file():
        return dict(run_config)
    return resume_overrides(given)


def app_resume(keys: dict) -> dict:
    """A user's ServerApp resuming (``QLSDStrategy(..., resume=<run folder>)``): it passes every key
    of its own, often straight from its ``pyproject.toml``, whose defaults are not the user's
    choice for this run, and it cannot tell them from ``--run-config`` overrides. So the
    resumed run's saved value of every key that fixes the chain is kept, one line names those
    the app gave otherwise, and the keys a resume may change (:data:`RESUME_FREE_KEYS`) are the
    app's. Without ``resume``: ``keys`` unchanged."""
    import logging

    if not str(keys.get("resume", "") or ""):
        return keys
    original = resume_overrides({"resume": keys["resume"]})
    kept = [k for k, v in keys.items() if k not in RESUME_FREE_KEYS and k in original
            and not same_value(k, original[k], v)]
    if kept:
        logging.getLogger("qlsd_flwr").warning(  # a warning: a user's app may set up no handler for info
            "resume: the run's own %s kept (this app gave %s; only %s may change at a resume)",
            ", ".join(f"{k}={original[k]!r}" for k in kept), ", ".join(f"{k}={keys[k]!r}" for k in kept),
            ", ".join(RESUME_FREE_KEYS))
    return {**keys, **original, **{k: v for k, v in keys.items() if k in RESUME_FREE_KEYS}}


def resume_overrides(overrides: dict | None) -> dict:
    """With ``resume`` set, the run folder's original configuration with ``overrides`` on top
    (keys outside :data:`RESUME_FREE_KEYS` must agree with the original); else ``overrides``."""
    overrides = dict(overrides or {})
    r = overrides.get("resume", "")
    if not r:
        return overrides
    run_dir = Path(str(r))
    conf = run_dir / "config.json"
    if not conf.exists():
        raise ConfigError(f"resume: {run_dir} is not a run folder (no config.json)")
    try:
        original = json.loads(conf.read_text())["config"]
        if not isinstance(original, dict):
            raise TypeError("'config' is not a table")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"resume: {conf} cannot be read ({type(exc).__name__}: {exc})") from None
    if str(original.get("downlink", "off")) == "qsgd":  # written before downlink-support (2026-12-06): every
        original.setdefault("downlink-support", "all")  # coordinate coded, as the run went on before its stop
    norm = {str(k).replace("_", "-"): v for k, v in overrides.items()}
    bad = [k for k, v in norm.items() if k not in RESUME_FREE_KEYS and k in original and not same_value(k, original[k], v)]
    if bad:
        raise ConfigError(f"resume: {', '.join(bad)} differ from the run being resumed "
                          f"({', '.join(f'{k}={original[k]!r}' for k in bad)}); only "
                          f"{', '.join(RESUME_FREE_KEYS)} may change")
    return {**original, **norm, "resume": str(run_dir)}
