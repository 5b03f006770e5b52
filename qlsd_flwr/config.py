"""The run configuration: one flat key/value mapping drives every engine.

The keys, their types, ranges, defaults and meanings are the table of :mod:`qlsd_flwr.keys` (also
``[tool.flwr.app.config]`` in ``pyproject.toml``, the files in ``conf/``, ``qlsd-flwr config``). :func:`resolve` reads every key by the table's rules, then checks what involves
several keys, and raises :class:`ConfigError` naming the bad key and its allowed values, so a
mistake costs a second, not an hour of sampling.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from qlsd_flwr.keys import BY_NAME, DEFAULTS, ConfigError, close_keys, flag, parse  # noqa: F401 (DEFAULTS, ConfigError: re-exported)

from qlsd_flwr import samplers
from qlsd_flwr.core.downlink import CORRECTIONS, DITHERS, FEEDBACKS, check_correction, check_downlink
from qlsd_flwr.core.server_step import NOISE_CORRECTIONS, check_noise, langevin_step
from qlsd_flwr.samplers import ALIASES  # noqa: F401 (re-exported)
ENGINES = ("ray", "inprocess", "local", "vectorised")
TASKS = ("gaussian", "logistic", "mnist")
# "external": the clients bring their own potentials (qlsd_flwr.flower.make_client_app(potential_fn)),
# set by QLSDStrategy's keyword constructor; "<module>:<callable>" names a task plug-in.


def _per_client(key: str, vals: list, b: int) -> np.ndarray:
    """A key's values (one, or one per client; see :func:`qlsd_flwr.keys.parse`), one per client."""
    if len(vals) == 1:
        vals = vals * b
    if len(vals) != b:
        raise ConfigError(
            f"{key}: mismatched dimensions: {len(vals)} values given but num-clients = {b}"
            " (give one value for all clients, or exactly one per client)")
    return np.asarray(vals)


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
    gamma_auto: bool = False  # gamma = auto: γ is chosen before sampling (gamma is NaN until then)
    metric: str = "identity"  # identity, diagonal, dense, or a .npy path
    temperature: float = 1.0
    init: str = "theta0"

    def get(self, key: str) -> Any:
        return self.raw[key]

    @property
    def sampler(self) -> samplers.Sampler:
        """The ``variant``'s declaration (:mod:`qlsd_flwr.samplers`)."""
        return samplers.SAMPLERS[self.variant]

    @property
    def kind(self) -> samplers.Estimator:
        """What its clients' messages estimate (:class:`qlsd_flwr.samplers.Estimator`)."""
        return samplers.ESTIMATORS[self.oracle]

    def to_dict(self) -> dict:
        """``config.json``'s content: ``config``, the keys that apply to this run (what a resume
        reads), ``not_applicable``, the names of the others, and ``resolved``."""
        d = asdict(self)
        d.pop("raw")
        d["s"] = self.s.tolist()
        d["p"] = self.p.tolist()
        skip = not_applicable(self.raw)
        return {"config": {k: v for k, v in self.raw.items() if k not in skip}, "not_applicable": sorted(skip),
                "resolved": d}


def not_applicable(raw: dict) -> set[str]:
    """The keys whose values cannot change this run (a data key of another task, the θ* descent's
    keys where no point is sought, ``metric-from`` without a built metric, ``partition-alpha``
    without a Dirichlet split): left out of ``config.json`` and of a resume's comparison."""
    task = str(raw.get("task", "gaussian"))
    out: set[str] = set()
    if task == "gaussian":
        out |= {"dataset", "partition", "partition-alpha", "model", "device"}
    elif task == "logistic":
        out |= {"dim", "model", "device"}
    elif task == "mnist":
        out |= {"dim"}
    elif task == "external":  # a user's ServerApp: the clients bring data, model and device
        out |= {"dim", "data-seed", "dataset", "partition", "partition-alpha", "model", "device"}
    else:  # a task plug-in: make(num_clients, data_seed)
        out |= {"dim", "dataset", "partition", "partition-alpha", "model"}
    if str(raw.get("partition", "auto")).lower() not in ("dirichlet", "auto") or \
            (task == "mnist" and str(raw.get("partition", "auto")).lower() == "auto"):
        out.add("partition-alpha")
    metric = str(raw.get("metric", "identity")).strip()
    named = samplers.find(raw.get("variant", ""))
    needs_point = ((named is not None and named.estimator.needs_theta_star) or metric != "identity"
                   or str(raw.get("gamma", "")).lower() == "auto" or str(raw.get("init", "theta0")) == "dispersed"
                  or str(raw.get("metric-rank", 0)).strip() not in ("0", ""))
    if not needs_point:
        out |= {"theta-star", "opt-rounds", "opt-tol", "opt-accept-unconverged"}
    # the keys its sampler does not read (an unknown variant: the QLSD family's, until resolve names it)
    out |= (named or samplers.SAMPLERS["qlsd-pp"]).not_applicable
    if metric in ("identity",) or metric.endswith(".npy"):
        out.add("metric-from")
    if (metric == "identity" and str(raw.get("metric-rank", 0)).strip() in ("0", "")) or \
            (named is not None and named.estimator.local):
        out.add("compression-basis")  # no metric, the two bases are one; the rivals' messages are their local steps
    if "metric-from" in out or str(raw.get("metric-from", "curvature")).strip().lower() != "adapt":
        out.add("adapt-rounds")
    if str(raw.get("gamma", "")).lower() != "auto":
        out.add("gamma-c")
    if str(raw.get("downlink", "off")).strip().lower() != "qsgd":
        out |= {"downlink-s", "downlink-feedback", "downlink-correction", "downlink-dither", "downlink-support"}
    return out & set(raw)


def _choice(key: str, value: Any, allowed) -> str:
    v = str(value).strip().lower()
    if v not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r}; allowed: {', '.join(allowed)}")
    return v


MODELS = ("logistic", "mlp", "lenet5", "resnet20", "lenet", "resnet", "linear")
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
            close = close_keys(kk)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown config key {k!r}{hint}; allowed keys: {', '.join(DEFAULTS)}")
        raw[kk] = v

    v = {key: parse(key, raw[key]) for key in DEFAULTS}  # every key by its own rules (keys.py)
    name = str(raw["variant"]).strip().lower()
    variant = _choice("variant", ALIASES.get(name, name), tuple(samplers.SAMPLERS))
    sampler = samplers.SAMPLERS[variant]
    oracle, compressed, memory = sampler.oracle, sampler.compressed, sampler.memory
    task = _task_key(raw["task"])
    engine = _choice("engine", raw["engine"], ENGINES)
    b, dim, K = v["num-clients"], v["dim"], v["num-rounds"]
    gamma_auto = v["gamma"] == "auto"
    gamma = math.nan if gamma_auto else float(v["gamma"])
    burn, thin, chains = v["burn-in"], v["thin"], v["num-chains"]
    if not burn < K:
        raise ConfigError(f"burn-in must be in [0, num-rounds) = [0, {K}) (got {burn})")
    if chains > 1 and engine == "local":
        raise ConfigError(f"num-chains = {chains} needs engine = ray, inprocess or vectorised (the local engine "
                          "runs one chain); allowed engines for several chains: ray, inprocess, vectorised")

    # SGLD is centralised: the task's data is pooled into one client that always takes part.
    b_eff = 1 if sampler.pooled else b
    s = _per_client("s", v["s"], b_eff)
    p = _per_client("p", v["p"], b_eff).astype(np.float64)
    if sampler.pooled and np.any(p != 1.0):
        raise ConfigError(f"p must be 1 for variant sgld (centralised: its one pooled client takes part in "
                          f"every round; got {raw['p']!r})")
    aggregation = _choice("aggregation", raw["aggregation"], ("unbiased", "active-fraction"))
    alpha = None if v["alpha"] == "auto" else float(v["alpha"])
    prior_var = math.inf if isinstance(v["prior-var"], str) else float(v["prior-var"])
    prior_on = _choice("prior-on", raw["prior-on"], ("server", "clients"))
    if sampler.estimator.local:  # n/a: FALD shares U_0 by w_i, DG-LMC draws it exactly
        prior_on = "server"
    block_norm = _choice("block-norm", raw["block-norm"], ("vector", "tensor"))
    encoding = _choice("encoding", raw["encoding"], ("auto", "elias", "packed", "arith"))
    compressor = _choice("compressor", str(raw["compressor"]).strip().lower(), ("auto", "qsgd", "identity"))
    if compressor != "auto":  # qsgd: any variant's messages QSGD-coded (the rivals' too); identity: none
        compressed = compressor == "qsgd"
    raw["compression-basis"] = _choice("compression-basis", raw["compression-basis"], BY_NAME["compression-basis"].choices)
    theta_star = _choice("theta-star", raw["theta-star"], ("closed-form", "optimise"))
    raw["vectorised-backend"] = _choice("vectorised-backend", raw["vectorised-backend"], ("auto", "numba", "numpy", "torch"))
    raw["resume"] = v["resume"]
    metric = _metric_key(raw["metric"])
    raw["metric-from"] = _choice("metric-from", raw["metric-from"], ("curvature", "adapt"))
    if raw["metric-from"] == "adapt" and metric not in ("diagonal", "dense", "identity") and not metric.endswith(".npy"):
        raise ConfigError(f"metric-from: adapt refines a diagonal or dense metric (metric = {metric} has no "
                          "covariance to learn); use metric = diagonal or dense, or metric-from = curvature")
    if v["metric-rank"] > 0 and raw["metric-from"] == "adapt" and metric != "identity":
        raise ConfigError("metric-rank: corrects a metric built from the curvature, a file or the identity, not "
                          "metric-from = adapt's; use metric-rank = 0, or metric-from = curvature")
    if v["metric-block"] > 0 and (metric != "kronecker" or raw["metric-from"] != "curvature"):
        raise ConfigError(f"metric-block: makes K-FAC's curvature exact on its top input directions, so it needs "
                          f"metric = kronecker with metric-from = curvature; got metric = {metric}, metric-from = "
                          f"{raw['metric-from']}")
    init = _choice("init", raw["init"], ("theta0", "dispersed"))
    raw["convergence-criterion"] = _choice("convergence-criterion", raw["convergence-criterion"],
                                           ("auto", "theta", "predictive"))
    raw["loo"] = _choice("loo", raw["loo"], ("psis", "pointwise", "off"))
    _check_biased_aggregation(sampler, aggregation, p, raw)
    if not sampler.estimator.refreshable and float(raw.get("q", 0.0)) != 0.0:
        raise ConfigError(f"q: only vr-fald-star refreshes a reference point (QLSD++'s anchor period is l); "
                          f"{variant} takes q = 0")
    sampler.refuse(samplers.Settings(raw=raw, p=p, aggregation=aggregation, metric_rank=int(v["metric-rank"])))
    raw["downlink"] = _choice("downlink", raw["downlink"], ("off", "qsgd"))
    raw["downlink-feedback"], raw["downlink-dither"], raw["downlink-support"] = (_choice(k, raw[k], v) for k, v in (
        ("downlink-feedback", FEEDBACKS), ("downlink-dither", DITHERS), ("downlink-support", ("data", "all"))))
    check_downlink(raw["downlink"], sampler.name, sampler.estimator.local, raw["vectorised-backend"])
    no_metric = metric == "identity" and not v["metric-rank"]
    raw["downlink-correction"] = check_correction(_choice("downlink-correction", raw["downlink-correction"], CORRECTIONS), no_metric)
    raw["noise-correction"] = check_noise(_choice("noise-correction", raw["noise-correction"], NOISE_CORRECTIONS), no_metric, sampler.estimator.step is langevin_step, gamma)
    _check_data_keys(raw)
    return RunConfig(
        raw=raw, variant=variant, oracle=oracle, compressed=compressed, memory=memory, b=b_eff,
        gamma=gamma, num_rounds=K, burn_in=burn, thin=thin, seed=v["seed"],
        num_chains=chains, s=s.astype(np.int64), p=p,
        aggregation=aggregation, batch_fraction=v["batch-fraction"], l=v["l"], alpha=alpha, prior_var=prior_var,
        prior_on=prior_on, block_norm=block_norm, encoding=encoding, theta_star=theta_star,
        engine=engine, task=task, num_clients=b, dim=dim, data_seed=v["data-seed"], opt_rounds=v["opt-rounds"],
        opt_tol=v["opt-tol"], checkpoint_every=v["checkpoint-every"], reply_timeout=v["reply-timeout"],
        verbose=v["verbose"], progress=v["progress"], gamma_auto=gamma_auto, metric=metric,
        temperature=float(v["temperature"]), init=init,
    )


def _metric_key(value: Any) -> str:
    """``identity``, ``diagonal``, ``dense``, or the path of an existing ``.npy`` file."""
    v = str(value).strip()
    if v.lower() in ("identity", "diagonal", "dense", "kronecker"):
        return v.lower()
    if v.endswith(".npy"):
        from pathlib import Path

        if not Path(v).expanduser().is_file():
            raise ConfigError(f"metric: no such file {v!r}; allowed: identity, diagonal, dense, kronecker, or a path to a .npy")
        return v
    raise ConfigError(f"metric: unknown value {value!r}; allowed: identity, diagonal, dense, kronecker, or a path to a .npy")


def _check_biased_aggregation(sampler: samplers.Sampler, aggregation: str, p: np.ndarray, raw: dict) -> None:
    """``active-fraction`` weighs a reply by ``b/|A_k|``, so ``E[w_i 1_i] = p_i E[b/|A_k|]``, which is 1
    for every client only when the ``p_i`` are equal. A variant whose messages carry ``∇U_i`` itself
    (no control variate: QLSD, QLSD#, SGLD) then follows ``Σ_i p_i E[b/|A|] ∇U_i``, a different
    potential: its chain is centred off the posterior (61 posterior sd on a heterogeneous Gaussian with
    p_i from 0.1 to 0.95). The control-variate variants send differences whose mean vanishes at the
    mode, so only their spread changes. Refused unless ``accept-biased-aggregation`` is set."""
    if aggregation != "active-fraction" or sampler.estimator.control_variate or np.all(p == p[0]):
        return
    if flag("accept-biased-aggregation", raw.get("accept-biased-aggregation", False)):
        return
    raise ConfigError(
        f"aggregation: active-fraction with unequal p_i (from {float(p.min()):g} to {float(p.max()):g}) biases "
        f"{sampler.name}: client i's gradient enters with mean weight p_i·E[b/|A_k|] ≠ 1, so the chain samples a "
        "shifted target; use aggregation = unbiased, or a control-variate variant (qlsd-star, qlsd-pp, lsd-star, "
        "lsd-pp), or set accept-biased-aggregation = true")


#: the built-in tasks whose likelihood is a probability over labels (held-out evaluation; the LOO's log p ≤ 0)
CLASSIFICATION_TASKS = ("logistic", "mnist")

#: a run may plan for at most this share of the machine's physical memory
MEMORY_SHARE = 0.8


def memory_estimate(cfg: RunConfig, d: int, keep_trace: bool = False) -> int:
    """Bytes the server side of ``cfg`` holds for a task of dimension ``d``: per chain θ and the
    step's temporaries, the clients' memory mirrors ``η_i`` (``num-clients × d``), the anchor, a
    dense metric's two ``d × d`` matrices, the ``metric-from = adapt`` warm-up's kept window (at most
    three quarters of ``adapt-rounds`` draws per chain) and, with ``keep_trace`` (the programmatic
    API's every-state trace), ``num-rounds`` states per chain. Each key is within its own cap; this
    is their product."""
    per_chain = d * (6 + (cfg.b if cfg.memory else 0) + (1 if cfg.kind.cv_zeta else 0))
    if keep_trace:
        per_chain += d * int(cfg.num_rounds)
    if adapts(cfg):
        per_chain += d * (3 * int(cfg.get("adapt-rounds")) // 4)
    dense = 2 * d * d if cfg.metric == "dense" else 0
    return 8 * (int(cfg.num_chains) * per_chain + dense)


def adapts(cfg: RunConfig) -> bool:
    """Whether the metric is refined by the warm-up of :mod:`qlsd_flwr.core.adapt`."""
    return cfg.metric in ("diagonal", "dense") and str(cfg.get("metric-from")) == "adapt"


def _physical_memory() -> int | None:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no limit known
        return None


def check_data_memory(n_points: int, d: int, copies: int = 2) -> None:
    """Refuse, before the built-in Gaussian task makes its data, ``n_points × d`` float64 numbers held
    ``copies`` times (each client's array and the pooled one the closed form is computed from) beyond
    :data:`MEMORY_SHARE` of this machine's physical memory: ``ConfigError`` naming the keys."""
    phys = _physical_memory()
    need = 8 * int(n_points) * int(d) * int(copies)
    if phys is not None and need > MEMORY_SHARE * phys:
        raise ConfigError(f"num-clients × dim: the task's data alone need about {need / 2**30:.1f} GiB ({n_points} "
                          f"points × d = {d} × 8 bytes × {copies} copies), over {MEMORY_SHARE:.0%} of this machine's "
                          f"{phys / 2**30:.1f} GiB; lower num-clients or dim")


def check_memory(cfg: RunConfig, d: int, keep_trace: bool = False) -> None:
    """Refuse, before anything is allocated, a run whose :func:`memory_estimate` exceeds
    :data:`MEMORY_SHARE` of this machine's physical memory, naming the keys whose product it is."""
    phys = _physical_memory()
    if phys is None:
        return
    need = memory_estimate(cfg, d, keep_trace)
    if need > MEMORY_SHARE * phys:
        mirrors = f" × (6 + num-clients = {cfg.b} memory mirrors)" if cfg.memory else ""
        trace = f" + num-rounds = {cfg.num_rounds} kept states (keep_trace)" if keep_trace else ""
        adapt = f" + 3/4 × adapt-rounds = {cfg.get('adapt-rounds')} warm-up draws" if adapts(cfg) else ""
        raise ConfigError(f"num-chains × dim: the run needs about {need / 2**30:.1f} GiB (num-chains = "
                          f"{cfg.num_chains} × d = {d}{mirrors}{trace}{adapt} × 8 bytes), over {MEMORY_SHARE:.0%} of "
                          f"this machine's {phys / 2**30:.1f} GiB; lower num-chains or num-clients"
                          f"{', or num-rounds (or keep_trace = False)' if keep_trace else ''}")

