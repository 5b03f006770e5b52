"""The run configuration: one flat key/value mapping drives every engine.

The keys are the ones of ``[tool.flwr.app.config]`` in ``pyproject.toml`` and of the files
in ``conf/`` (``flwr run . --run-config conf/x.toml``). :func:`resolve` checks every key at
start-up and raises :class:`ConfigError` naming the bad key and its allowed values, so a
mistake costs a second, not an hour of sampling.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np


class ConfigError(ValueError):
    """A run configuration value is missing, unknown or out of range."""


# variant -> (oracle, compressed?, memory?)
#   oracle: "full" ∇U_i(θ); "minibatch" QLSD#; "star" control variate at θ*; "svrg" QLSD++.
VARIANTS: dict[str, tuple[str, bool, bool]] = {
    "qlsd": ("full", True, False),
    "qlsd-sharp": ("minibatch", True, False),
    "qlsd-star": ("star", True, False),
    "qlsd-pp": ("svrg", True, True),
    "lsd-star": ("star", False, False),
    "lsd-pp": ("svrg", False, True),
    "sgld": ("minibatch", False, False),
}
ALIASES = {"qlsd#": "qlsd-sharp", "qlsd*": "qlsd-star", "qlsd++": "qlsd-pp",
           "lsd*": "lsd-star", "lsd++": "lsd-pp"}
ENGINES = ("ray", "inprocess", "local", "vectorised")
TASKS = ("gaussian", "logistic", "mnist")
# "external": the clients bring their own potentials (qlsd_flwr.flower.make_client_app(potential_fn)),
# set by QLSDStrategy's keyword constructor; "<module>:<callable>" names a task plug-in.

DEFAULTS: dict[str, Any] = {
    # what to sample
    "task": "gaussian",
    "num-clients": 20,
    "dim": 50,
    "data-seed": 0,
    "dataset": "auto",  # auto: breast_cancer (task logistic), mnist_subset (task mnist)
    "partition": "auto",  # auto: dirichlet (logistic), dominant_label (mnist)
    "partition-alpha": 0.5,
    "model": "logistic",  # task mnist: logistic | mlp | lenet5
    "device": "cpu",  # torch models (task mnist): cpu | cuda | cuda:<k>
    "prior-var": "flat",
    "prior-on": "server",
    # the sampler
    "variant": "qlsd-pp",
    "num-rounds": 2000,
    "burn-in": 500,
    "thin": 1,
    "gamma": 4.9e-4,
    "seed": 0,
    "num-chains": 1,
    "compressor": "qsgd",
    "s": "16",
    "block-norm": "vector",
    "encoding": "auto",
    "p": "1.0",
    "aggregation": "unbiased",
    "batch-fraction": 0.1,
    "l": 100,
    "alpha": "auto",
    "theta-star": "closed-form",
    "opt-rounds": 500,
    "opt-tol": 1e-6,
    # how to run it
    "engine": "ray",
    "output-dir": "outputs",
    "run-name": "",
    "progress": True,
    "verbose": False,
    "client-cpus": 0.5,
    "reply-timeout": 600.0,
    "checkpoint-every": 0,  # write checkpoint.npz every N rounds (0: off); see qlsd_flwr.outputs.checkpoint
    "resume": "",  # a run folder: continue that run from its checkpoint
}


def _per_client(key: str, raw: Any, b: int, cast) -> np.ndarray:
    """A scalar or comma-separated list, broadcast to one value per client."""
    if isinstance(raw, str):
        parts = [x.strip() for x in raw.split(",") if x.strip()]
    elif isinstance(raw, (list, tuple, np.ndarray)):
        parts = list(raw)
    else:
        parts = [raw]
    try:
        vals = [cast(x) for x in parts]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot read {raw!r} as {cast.__name__} values") from exc
    if len(vals) == 1:
        vals = vals * b
    if len(vals) != b:
        raise ConfigError(
            f"{key}: mismatched dimensions: {len(vals)} values given but num-clients = {b}"
            " (give one value for all clients, or exactly one per client)")
    return np.asarray(vals)


def integer(x) -> int:
    """One per-client integer (``s_i``): an integral value, else ``ValueError``."""
    return _integer("value", x)


@dataclass(frozen=True)
class RunConfig:
    """A validated run configuration (see ``DEFAULTS`` for keys and defaults).

    Symbols follow the paper: ``gamma`` γ the step size, ``p`` the participation
    probabilities ``p_i``, ``s`` the QSGD levels ``s_i``, ``l`` the SVRG anchor period,
    ``alpha`` α the memory rate (``None`` = per-client default ``1/(ω_i+1)``).
    """

    raw: dict
    variant: str
    oracle: str
    compressed: bool
    memory: bool
    b: int
    gamma: float
    num_rounds: int
    burn_in: int
    thin: int
    seed: int
    num_chains: int
    s: np.ndarray = field(repr=False)
    p: np.ndarray = field(repr=False)
    aggregation: str = "unbiased"
    batch_fraction: float = 0.1
    l: int = 100
    alpha: float | None = None
    prior_var: float = math.inf
    prior_on: str = "server"
    block_norm: str = "vector"
    encoding: str = "auto"
    theta_star: str = "closed-form"
    engine: str = "ray"
    task: str = "gaussian"
    num_clients: int = 20  # the data's clients (b is 1 for SGLD, which pools them)
    dim: int = 50  # d of the Gaussian task (other tasks: the model's)
    data_seed: int = 0
    opt_rounds: int = 500
    opt_tol: float = 1e-6
    checkpoint_every: int = 0
    reply_timeout: float = 600.0
    verbose: bool = False
    progress: bool = True

    def get(self, key: str) -> Any:
        return self.raw[key]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw")
        d["s"] = self.s.tolist()
        d["p"] = self.p.tolist()
        return {"config": dict(self.raw), "resolved": d}


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _flag(key: str, value: Any) -> bool:
    """A boolean key: a bool, or one of true/false, 1/0, yes/no, on/off (never ``bool("no")``)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    v = str(value).strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _integer(key: str, value: Any) -> int:
    """An integer key: an int, or a number or string with an integral value (``"5"``, ``5.0``,
    ``"1e3"``); a fraction (``4.9``), a bool, or anything else is refused, never truncated."""
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    try:
        return int(str(value).strip())
    except ValueError:
        pass
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if not math.isfinite(f) or f != math.floor(f):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    return int(f)


def _choice(key: str, value: Any, allowed) -> str:
    v = str(value).strip().lower()
    if v not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r}; allowed: {', '.join(allowed)}")
    return v


MODELS = ("logistic", "mlp", "lenet5")
PARTITION_NAMES = ("auto", "natural", "iid", "dirichlet", "pathological", "dominant_label",
                   "dominant", "heterogeneous", "non_iid", "shards")


def _task_key(value: Any) -> str:
    from qlsd_flwr.plugins import is_plugin, load_object

    if is_plugin(value):
        try:
            load_object(value, "task")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        return str(value).strip()
    v = str(value).strip().lower()
    if v == "external":
        return v
    return _choice("task", v, TASKS + ("<module>:<callable>",))


def _check_data_keys(raw: dict) -> None:
    """``dataset``, ``partition``, ``partition-alpha``, ``model`` and ``device`` (checked for every
    task, so a typo is caught even before it matters)."""
    from qlsd_flwr.plugins import is_plugin

    ds = str(raw["dataset"]).strip()
    if ds.lower() != "auto":
        from qlsd_flwr.data.datasets import canonical_name

        try:
            canonical_name(ds)
        except ValueError as exc:
            raise ConfigError(f"dataset: {exc} (or 'auto')") from exc
    _choice("partition", str(raw["partition"]).strip().lower().replace("-", "_"), PARTITION_NAMES)
    try:
        pa = float(raw["partition-alpha"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"partition-alpha: expected a number, got {raw['partition-alpha']!r}") from exc
    if not (pa > 0 and math.isfinite(pa)):
        raise ConfigError(f"partition-alpha must be a finite number > 0 (got {raw['partition-alpha']!r})")
    if is_plugin(raw["model"]):
        from qlsd_flwr.plugins import load_object

        try:
            load_object(raw["model"], "model")
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
    else:
        _choice("model", str(raw["model"]).strip().lower().replace("-", "").replace("_", ""),
                MODELS + ("<module>:<callable>",))
    dev = str(raw["device"]).strip().lower()
    head, _, idx = dev.partition(":")
    if head not in ("cpu", "cuda") or (idx and (head != "cuda" or not idx.isdigit())):
        raise ConfigError(f"device: unknown value {raw['device']!r}; allowed: cpu, cuda, cuda:<k>")


def resolve(overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Merge ``overrides`` into ``DEFAULTS``, check every key, and return a :class:`RunConfig`."""
    raw = dict(DEFAULTS)
    for k, v in (overrides or {}).items():
        kk = str(k).replace("_", "-")
        if kk not in DEFAULTS:
            close = difflib.get_close_matches(kk, list(DEFAULTS), n=3, cutoff=0.6)
            close += [x for x in DEFAULTS if x.split("-")[0] == kk.split("-")[0] and x not in close]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown config key {k!r}{hint}; allowed keys: {', '.join(DEFAULTS)}")
        raw[kk] = v

    name = str(raw["variant"]).strip().lower()
    name = ALIASES.get(name, name)
    variant = _choice("variant", name, tuple(VARIANTS))
    oracle, compressed, memory = VARIANTS[variant]
    task = _task_key(raw["task"])
    engine = _choice("engine", raw["engine"], ENGINES)

    def num(key, cast=float):
        if cast is int:
            return _integer(key, raw[key])
        try:
            return cast(raw[key])
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}: expected a number, got {raw[key]!r}") from exc

    def at_least_one(key):
        v = num(key, int)
        if v < 1:
            raise ConfigError(f"{key} must be >= 1 (got {v})")
        return v

    b = at_least_one("num-clients")
    dim = at_least_one("dim")
    gamma = num("gamma")
    if not (gamma > 0 and math.isfinite(gamma)):
        raise ConfigError(f"gamma must be a finite number > 0 (got {raw['gamma']!r})")
    K = at_least_one("num-rounds")
    burn = num("burn-in", int)
    if not 0 <= burn < K:
        raise ConfigError(f"burn-in must be in [0, num-rounds) = [0, {K}) (got {burn})")
    thin = at_least_one("thin")
    chains = at_least_one("num-chains")
    if chains > 1 and engine != "vectorised":
        raise ConfigError("num-chains > 1 needs engine = vectorised (Flower runs one chain per run)")

    # SGLD is centralised: the task's data is pooled into one client that always takes part.
    b_eff = 1 if variant == "sgld" else b
    s = _per_client("s", raw["s"], b_eff, integer)
    if np.any(s < 1):
        raise ConfigError(f"s must be an integer >= 1 for every client (got {raw['s']!r})")
    p = _per_client("p", raw["p"], b_eff, float)
    if np.any(~(p > 0)) or np.any(p > 1) or not np.all(np.isfinite(p)):
        raise ConfigError(f"p must be in (0, 1] for every client (got {raw['p']!r})")
    aggregation = _choice("aggregation", raw["aggregation"], ("unbiased", "active-fraction"))
    bf = num("batch-fraction")
    if not 0 < bf <= 1:
        raise ConfigError(f"batch-fraction must be in (0, 1] (got {raw['batch-fraction']!r})")
    l = num("l", int)
    if l < 1:
        raise ConfigError(f"l must be an integer >= 1 (got {raw['l']!r})")
    if str(raw["alpha"]).strip().lower() == "auto":
        alpha = None
    else:
        alpha = num("alpha")
        if not 0 <= alpha <= 1:
            raise ConfigError(f"alpha must be in [0, 1] or 'auto' = 1/(omega+1) (got {raw['alpha']!r})")
    pv = str(raw["prior-var"]).strip().lower()
    if pv in ("flat", "inf", "none"):
        prior_var = math.inf
    else:
        prior_var = num("prior-var")
        if not prior_var > 0:
            raise ConfigError(f"prior-var must be > 0 or 'flat' (got {raw['prior-var']!r})")
    prior_on = _choice("prior-on", raw["prior-on"], ("server", "clients"))
    block_norm = _choice("block-norm", raw["block-norm"], ("vector", "tensor"))
    encoding = _choice("encoding", raw["encoding"], ("auto", "elias", "packed"))
    _choice("compressor", raw["compressor"], ("qsgd", "identity"))
    if str(raw["compressor"]).lower() == "identity":
        compressed = False
    theta_star = _choice("theta-star", raw["theta-star"], ("closed-form", "optimise"))
    opt_rounds = num("opt-rounds", int)
    if opt_rounds < 1:
        raise ConfigError(f"opt-rounds must be an integer >= 1 (got {raw['opt-rounds']!r})")
    opt_tol = num("opt-tol")
    if not (opt_tol > 0 and math.isfinite(opt_tol)):
        raise ConfigError(f"opt-tol must be a finite number > 0 (got {raw['opt-tol']!r})")
    reply_timeout = num("reply-timeout")
    if not reply_timeout > 0:
        raise ConfigError(f"reply-timeout must be a number of seconds > 0 (got {raw['reply-timeout']!r})")
    ce = num("checkpoint-every", int)
    if ce < 0 or ce != num("checkpoint-every"):
        raise ConfigError(f"checkpoint-every must be an integer >= 0 (0: off) (got {raw['checkpoint-every']!r})")
    if hasattr(raw["resume"], "__fspath__"):
        raw["resume"] = str(raw["resume"])
    if not isinstance(raw["resume"], str):
        raise ConfigError(f"resume must be a run folder path or '' (got {raw['resume']!r})")
    _check_data_keys(raw)
    return RunConfig(
        raw=raw, variant=variant, oracle=oracle, compressed=compressed, memory=memory, b=b_eff,
        gamma=gamma, num_rounds=K, burn_in=burn, thin=thin, seed=num("seed", int),
        num_chains=chains, s=s.astype(np.int64), p=p.astype(np.float64),
        aggregation=aggregation, batch_fraction=bf, l=l, alpha=alpha, prior_var=prior_var,
        prior_on=prior_on, block_norm=block_norm, encoding=encoding, theta_star=theta_star,
        engine=engine, task=task, num_clients=b, dim=dim, data_seed=num("data-seed", int), opt_rounds=opt_rounds,
        opt_tol=opt_tol, checkpoint_every=ce, reply_timeout=reply_timeout,
        verbose=_flag("verbose", raw["verbose"]), progress=_flag("progress", raw["progress"]),
    )
