"""The run configuration's keys: one declarative table (:data:`KEYS`).

Each :class:`Key` gives the type, the allowed range or choices, the default, the paper's symbol and one line of
documentation. The table drives:

* validation — :func:`parse` reads one value by its key's rules (called by :func:`qlsd_flwr.config.resolve` for every
  key, before the checks that involve several keys);
* ``[tool.flwr.app.config]`` in ``pyproject.toml`` — :func:`qlsd_flwr.keys_text.pyproject_block` (a test checks that
  the declared keys are the table's and their values valid);
* ``qlsd-flwr config`` and ``qlsd-flwr run --help`` — :func:`qlsd_flwr.keys_text.help_text`;
* the key table of docs/CONFIGURATION.md — :func:`qlsd_flwr.keys_text.markdown_table` (a test checks the page holds it).

Parsing rules, the same for a TOML file, ``--set``, ``flwr run --run-config`` and Python: booleans are
``true/false/yes/no/on/off/1/0`` (anything else is refused, never ``bool("no")``); integers refuse fractions, booleans
and infinities (``4.9`` is an error, not 4); numbers refuse booleans (TOML ``gamma = true`` is an error, not γ = 1),
NaN and infinities unless allowed.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from qlsd_flwr import samplers
from qlsd_flwr.errors import ConfigError  # noqa: F401 (the key table's error, re-exported)


@dataclass(frozen=True)
class Key:
    """One run-config key. ``kind``: ``int``, ``float``, ``bool``, ``choice``, ``text``,
    ``ints`` / ``floats`` (one value or one per client, comma-separated), or ``float|word``
    (a number, or one of ``words``). ``lo``/``hi`` bound numbers (``open_lo``/``open_hi``: strict)."""

    name: str
    default: Any
    kind: str
    doc: str
    symbol: str = ""
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    choices: tuple = ()
    words: tuple = ()
    group: str = "run"
    cap: float | None = None  # a safety limit (memory, overflow), not part of the key's meaning

    def allowed(self) -> str:
        """The allowed values, in words (``an integer >= 1``, ``(0, 1]``, ``qlsd, qlsd-sharp, …``)."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return ", ".join(self.choices)
        if self.kind == "text":
            return "text"
        rng = _range_text(self)
        if rng.startswith(("(", "[")):
            rng = "in " + rng
        cap = f" (at most {_num(self.cap)})" if self.cap is not None else ""
        word = " or " + " or ".join(f"'{w}'" for w in self.words) if self.words else ""
        what = "an integer" if self.kind in ("int", "ints") else "a finite number"
        return f"{what} {rng}".rstrip() + cap + word


def _range_text(k: Key) -> str:
    if k.lo is not None and k.hi is not None:
        return f"{'(' if k.open_lo else '['}{_num(k.lo)}, {_num(k.hi)}{')' if k.open_hi else ']'}"
    if k.lo is not None:
        return f"{'>' if k.open_lo else '>='} {_num(k.lo)}"
    if k.hi is not None:
        return f"{'<' if k.open_hi else '<='} {_num(k.hi)}"
    return ""


def _num(x: float) -> str:
    if x == SEED_MAX:
        return "2^63 - 1"
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


SAMPLE, SAMPLER, RUN = "what to sample", "the sampler", "how to run it"
SEED_MAX = 2**63 - 1
KEYS: tuple[Key, ...] = (
    # what to sample
    Key("task", "gaussian", "choice", "the target: the toy Gaussian, Bayesian logistic regression (numpy), a torch "
        "classifier (any dataset), or a task plug-in '<module>:<callable>'", "",
        choices=("gaussian", "logistic", "mnist", "<module>:<callable>"), group=SAMPLE),
    Key("num-clients", 20, "int", "number of clients", "b", lo=1, cap=100_000, group=SAMPLE),
    Key("dim", 50, "int", "the Gaussian task's dimension (other tasks: the model's)", "d", lo=1, cap=100_000, group=SAMPLE),
    Key("data-seed", 0, "int", "seed of the data, its split and the model's initial weights", "", lo=0, hi=2**32 - 1,
        group=SAMPLE),
    Key("dataset", "auto", "text", "breast_cancer, digits, mnist_subset, synthetic (offline); mnist, fashion_mnist, "
        "femnist, cifar10, svhn (hub); '<module>:<callable>'; auto: breast_cancer (logistic), mnist_subset (mnist)",
        group=SAMPLE),
    Key("partition", "auto", "choice", "how the data is split over clients (auto: dirichlet for logistic, "
        "dominant_label for mnist)", choices=("auto", "natural", "iid", "dirichlet", "pathological",
                                              "dominant_label"), group=SAMPLE),
    Key("partition-alpha", 0.5, "float", "Dirichlet concentration of the dirichlet split", "", lo=0, open_lo=True,
        group=SAMPLE),
    Key("model", "logistic", "text", "torch model of task mnist: logistic, mlp, lenet5, resnet20, or "
        "'<module>:<callable>'", group=SAMPLE),
    Key("device", "cpu", "text", "torch device: cpu, cuda, cuda:<k> (CUDA ran on an H200 with the vectorised engine; "
        "the Flower engines with cuda have not run on a GPU)", group=SAMPLE),
    Key("prior-var", "flat", "float|word", "variance of the Gaussian prior U_0 (flat: none; logistic and torch "
        "tasks use their own default when flat)", "σ₀²", lo=0, open_lo=True, words=("flat", "none", "inf"), group=SAMPLE),
    Key("prior-on", "server", "choice", "where ∇U_0 is added: on the server, or shared by the clients (1/b each)",
        choices=("server", "clients"), group=SAMPLE),
    # the sampler
    Key("variant", "qlsd-pp", "choice", "QLSD, QLSD# (minibatch), QLSD* (control variate at θ*), QLSD++ (SVRG "
        "anchor and memory), LSD*, LSD++ (uncompressed), SGLD (centralised); the rivals FALD, VR-FALD* (local "
        "Langevin steps, averaged), DG-LMC (local chains on z_i, exact θ | z) and FSGLD (one client a round, "
        "conducive gradients from surrogates at θ*): docs/RIVALS.md", "",
        choices=tuple(samplers.SAMPLERS), group=SAMPLER),  # the registry (qlsd_flwr.samplers)
    Key("local-steps", 1, "int", "FALD, VR-FALD*: local Langevin steps of step γ/w_i per round on each active "
        "client (w_i = N_i/N its data share); DG-LMC: ULA steps on each active client's z_i; FSGLD: Langevin "
        "steps of step γ on the round's one client", "K_loc", lo=1,
        cap=10**5, group=SAMPLER),
    Key("rho", "auto", "float|word", "DG-LMC: the variance coupling each client's z_i to θ in the augmented target "
        "exp(−U_0(θ) − Σ_i [U_i(z_i) + ‖z_i − θ‖²/(2ρ)]), whose θ-marginal tends to π as ρ → 0 (auto: ρ = γ/10)",
        "ρ", lo=0, open_lo=True, words=("auto",), group=SAMPLER),
    Key("tau", 0.0, "float", "FALD, VR-FALD*: the share of the Langevin noise common to the clients (1: one "
        "shared draw, 0: each client its own); the chain targets π for every τ", "τ", lo=0, hi=1, group=SAMPLER),
    Key("q", 0.0, "float", "VR-FALD*: the probability that a round refreshes the reference θ_r of the control "
        "variates (0: θ_r = θ* for the whole run). In such a round every client kept takes part (p_i = 1 that round) "
        "and also sends ∇U_i(θ_k); θ_r becomes θ_k from the next round, once every reply has come (docs/RIVALS.md)",
        "q", lo=0, hi=1, group=SAMPLER),
    Key("num-rounds", 2000, "int", "number of rounds (one sample each)", "K", lo=1, cap=10**12, group=SAMPLER),
    Key("burn-in", 500, "int", "rounds dropped before samples are kept (< num-rounds)", "", lo=0, cap=10**12,
        group=SAMPLER),
    Key("thin", 1, "int", "keep every thin-th sample after burn-in", "", lo=1, cap=10**12, group=SAMPLER),
    Key("gamma", 4.9e-4, "float|word", "Langevin step size; auto: gamma-c / λ_max of M^½ ∇²U(θ*) M^½, estimated "
        "by the Lanczos method on federated Hessian-vector products before sampling", "γ", lo=0, open_lo=True,
        words=("auto",), group=SAMPLER),
    Key("gamma-c", "auto", "float|word", "gamma = auto's c in γ = c / λ_max: the chain is stable below 2; a larger c "
        "mixes faster and inflates the variance along the stiffest direction by 1/(1 − c/2) (1.14 at 0.25, 2 at 1); "
        "auto: 0.25 where every client's potential and the prior are declared log-concave (the Gaussian and "
        "logistic tasks, one nn.Linear), 0.125 otherwise (a network: its curvature at θ* understates the chain's)",
        "c", lo=0, hi=2, open_lo=True, open_hi=True, words=("auto",), group=SAMPLER),
    Key("metric", "identity", "text", "the preconditioner M of the step θ − γ M g + √(2γT) M^½ Z: identity (the "
        "paper's chain), diagonal, dense (d ≤ 2000; noise by its Cholesky factor), kronecker (one dense softmax "
        "layer's K-FAC factors: the logistic tasks), or a path to a .npy of d positive numbers or an SPD d × d "
        "matrix. FALD, VR-FALD*, FSGLD: M preconditions the clients' local steps; DG-LMC: also its coupling "
        "‖z_i − θ‖², taken in M⁻¹'s norm (docs/RIVALS.md)", "M", group=SAMPLER),
    Key("metric-from", "curvature", "choice", "how a diagonal or dense M is built: curvature (the inverse of the "
        "prior's curvature plus the clients' curvature reports at θ*, exchanges before sampling) or adapt (that "
        "metric refined by the covariance of a warm-up chain on exact gradients, in doubling windows, frozen "
        "before the first round: docs/METRIC.md)", "", choices=("curvature", "adapt"), group=SAMPLER),
    Key("metric-rank", 0, "int", "directions in which the metric is corrected exactly: a block Krylov method on "
        "federated Hessian-vector products at θ* (metric-rank-exchanges of 16 vectors) finds where M^½ᵀ ∇²U M^½ is "
        "farthest from 1 and maps those k directions to 1 (0: none; docs/METRIC.md)", "k", lo=0, cap=512, group=SAMPLER),
    Key("metric-rank-exchanges", 32, "int", "metric-rank's exchanges of 16 products", "q", lo=1, cap=32, group=SAMPLER),
    Key("metric-block", 0, "int", "K-FAC (metric = kronecker) exact on its top k input directions, one block report "
        "a client; metric-rank then corrects off them (0: none; docs/METRIC.md)", "k", lo=0, cap=400, group=SAMPLER),
    Key("adapt-rounds", 300, "int", "rounds of metric-from = adapt's warm-up (each: one exact-gradient exchange "
        "per chain with every client); the sampling chains continue from its end", "", lo=20, cap=10**7, group=SAMPLER),
    Key("temperature", 1.0, "float", "the chain targets π^(1/T): T = 1 the posterior, T < 1 a cooled one (the "
        "noise is scaled by √T)", "T", lo=0, open_lo=True, cap=1e6, group=SAMPLER),
    Key("noise-correction", "off", "choice", "metric: the Langevin noise's covariance 2γT M times 1 − γ/2, which makes "
        "the chain's law exact on the Gaussian of precision M⁻¹ with exact gradients (γ < 2; off: "
        "ULA's; docs/METRIC.md)", "", choices=("off", "metric"), group=SAMPLER),
    Key("init", "theta0", "choice", "where chains start: the task's θ_0 (all chains alike), or dispersed: θ* + 2 M^½ "
        "z_c per chain (without a metric: the prior's sd, for a layered network at most each tensor's own scale in "
        "θ_0), so that R-hat can show chains that have not met", choices=("theta0", "dispersed"), group=SAMPLER),
    Key("seed", 0, "int", "the run's seed (participation, minibatches, quantisation, noise)", "", lo=0, hi=SEED_MAX,
        group=SAMPLER),
    Key("num-chains", 1, "int", "independent chains in one run (chain c: seed + c; every engine but local)", "", lo=1, cap=100_000, group=SAMPLER),
    Key("compressor", "auto", "choice", "the uplink compressor: auto (the variant's: QSGD for the QLSD family, "
        "none for LSD, SGLD, FALD, VR-FALD*), qsgd (any variant's messages QSGD-coded), identity (none)", "C",
        choices=("auto", "qsgd", "identity"), group=SAMPLER),
    Key("compression-basis", "auto", "choice", "the coordinates a compressed message is quantised in: metric "
        "(C(Sᵀ H_i − η_i) with M = S Sᵀ, the server applying S, so that the compression's noise takes M's shape as "
        "the Langevin noise does; M travels to the clients once and stays in their state), theta (the paper's "
        "C(H_i − η_i), whose noise M multiplies in the flat directions), block (C(B H_i − η_i), B K-FAC's root on "
        "metric-block's directions, the server applying M B⁻¹: 9e3 numbers a client holding them, not M's MB), or auto "
        "(metric for a diagonal M or a dense one of d ≤ 512, block for K-FAC with metric-block, else theta). QLSD "
        "with a metric (docs/METRIC.md)", "", choices=("auto", "block", "metric", "theta"), group=SAMPLER),
    Key("s", "16", "ints", "QSGD levels, one value or one per client ('2,4,...'); s = 2^k is 'k bits'", "s_i",
        lo=1, cap=2**31 - 1, group=SAMPLER),
    Key("block-norm", "vector", "choice", "one QSGD norm for the whole vector, or one per tensor", choices=("vector", "tensor"), group=SAMPLER),
    Key("encoding", "auto", "choice", "QSGD's Elias or packed code, the shorter per message (auto), or an arithmetic "
        "code of its levels (arith: the same chain)", choices=("auto", "elias", "packed", "arith"), group=SAMPLER),
    Key("downlink", "off", "choice", "the broadcast of θ_k: off (64 d bits of float64 to every active client), or qsgd "
        "(a QSGD code of θ_k − w_{k−1} with downlink-s levels, the clients evaluating at the point w_k it gives; a client "
        "that missed the last round is sent w_k in full). The QLSD family on every engine (the vectorised one on its "
        "numpy backend; docs/ARCHITECTURE.md, the compressed downlink)", "", choices=("off", "qsgd"), group=SAMPLER),
    Key("downlink-s", 256, "int", "QSGD levels of the compressed downlink", "s_↓", lo=1, cap=2**31 - 1, group=SAMPLER),
    Key("downlink-feedback", "ef21-p", "choice", "ef21-p (both sides keep w_k = w_{k−1} + α C(θ_k − w_{k−1}), α = 1/(ω_↓ + 1)) "
        "or none (w_k = C(θ_k), unbiased but with an error of θ's own size)", "", choices=("ef21-p", "none"), group=SAMPLER),
    Key("downlink-dither", "stochastic", "choice", "the broadcast's rounding: stochastic (QSGD's) or subtractive (the clients "
        "take the shared dither out: the error uniform, (N/s_↓)²/12)", "", choices=("stochastic", "subtractive"), group=SAMPLER),
    Key("downlink-support", "data", "choice", "data: the broadcast codes only the coordinates some client's gradient reads (as "
        "each potential declares them: core.potential.declared_support), w_k = θ_k elsewhere; all: every one", "", choices=("data", "all"), group=SAMPLER),
    Key("downlink-correction", "auto", "choice", "metric: the step adds −γ (θ_k − w_k) and takes the prior at w_k, "
        "the lag's first-order term with M⁻¹ as the curvature (exact where M⁻¹ = ∇²U); auto: metric where M is not the "
        "identity, else off (docs/ARCHITECTURE.md, compressed downlink)", "", choices=("auto", "metric", "off"), group=SAMPLER),
    Key("p", "1.0", "floats", "participation probabilities, one value or one per client", "p_i", lo=0, hi=1,
        open_lo=True, group=SAMPLER),
    Key("aggregation", "unbiased", "choice", "weights 1/p_i (the supplement's theory) or b/|A_k| (Algorithm 1)",
        choices=("unbiased", "active-fraction"), group=SAMPLER),
    Key("batch-fraction", 0.1, "float", "minibatch size n_i = max(1, floor(N_i * fraction))", "n_i/N_i", lo=0, hi=1,
        open_lo=True, group=SAMPLER),
    Key("l", 100, "int", "SVRG anchor period (QLSD++, LSD++)", "l", lo=1, cap=10**12, group=SAMPLER),
    Key("alpha", "auto", "float|word", "memory rate of QLSD++ (auto: 1/(ω_i+1); 0: no memory)", "α", lo=0, hi=1,
        words=("auto",), group=SAMPLER),
    Key("norm-bound", "auto", "float|word", "bounded influence of one client (docs/DEPLOYMENT.md): auto = each "
        "reply's norm per datum against the federation's (probation 30×, then 1000× per reply and 100× typical; "
        "a steadily false client is excluded) and run-away detection; a number B: each client's gradient "
        "estimate (and QLSD*'s ∇U_i(θ*)) held to norm ≤ B, which bounds what one client, even a consistent liar, "
        "does to the stationary law (W2 ≤ B/m for m-strongly convex other clients, docs/DEPLOYMENT.md); off: neither",
        "B", lo=0, open_lo=True, words=("auto", "off"), group=SAMPLER),
    Key("theta-star", "closed-form", "choice", "QLSD*/LSD*'s θ*: the task's closed form, or a federated gradient "
        "descent first", "θ*", choices=("closed-form", "optimise"), group=SAMPLER),
    Key("opt-rounds", 500, "int", "most rounds of the θ* descent", "", lo=1, cap=10**9, group=SAMPLER),
    Key("opt-tol", 1e-6, "float", "the θ* descent stops when ‖∇U‖ falls below this times 1 + ‖∇U(θ_0)‖ (with a "
        "metric from the curvature, also ∇UᵀM∇U ≤ d)", "", lo=0, open_lo=True, group=SAMPLER),
    Key("convergence-criterion", "auto", "choice", "what the convergence report's verdict reads: θ's coordinates, "
        "or the held-out predictive (for networks, whose weights have symmetries); auto: predictive for torch "
        "networks and for a QLSDStrategy given heldout data, theta otherwise", choices=("auto", "theta", "predictive"), group=SAMPLER),
    Key("loo", "psis", "choice", "the federated leave-one-out over the training points after sampling (docs/"
        "ARVIZ.md): psis = each client Pareto-smooths its own points and sends 3 numbers a point (qlsd_flwr.loo "
        "gives az.compare's input); pointwise = each client sends its S × N_i log-likelihoods, held as "
        "samples.nc's log_likelihood for az.loo as it is; off", choices=("psis", "pointwise", "off"), group=SAMPLER),
    Key("accept-biased-aggregation", False, "bool", "run aggregation = active-fraction with unequal p_i on a "
        "variant without a control variate (QLSD, QLSD#, SGLD), whose chain is then centred off the posterior; "
        "otherwise that is an error", group=SAMPLER),
    Key("opt-accept-unconverged", False, "bool", "sample with a θ* whose descent stopped at opt-rounds above "
        "opt-tol (QLSD*/LSD* then drift by ∇U(θ*)); otherwise that is an error", group=SAMPLER),
    # how to run it
    Key("engine", "ray", "choice", "Flower's Ray engine, in-process Flower, the framework-free loop, or many chains "
        "vectorised", choices=("ray", "inprocess", "local", "vectorised"), group=RUN),
    Key("vectorised-backend", "auto", "choice", "the vectorised engine's backend: auto (numba where its chains are "
        "the reference's bit for bit, the toy Gaussian; numpy otherwise), numba (also the logistic task, its chains "
        "within float rounding of the reference's), numpy (the only one for the rivals), torch (a torch network's QLSD "
        "chains with every part of a round on the clients' device; auto picks it on CUDA)", choices=("auto", "numba", "numpy", "torch"),
        group=RUN),
    Key("output-dir", "outputs", "text", "where run folders go (relative: to the working directory; under flwr run, "
        "the SuperLink's)", group=RUN),
    Key("run-name", "", "text", "the run folder's name ('': a timestamp and the variant)", group=RUN),
    Key("progress", True, "bool", "a progress bar in a terminal, a line every 15 s in a log", group=RUN),
    Key("plot", True, "bool", "overview.png when the run ends: traces and marginals, the convergence verdict, the "
        "bits per round (every path: qlsd-flwr run, flwr run, a user's ServerApp)", group=RUN),
    Key("verbose", False, "bool", "Flower's and Ray's own logs", group=RUN),
    Key("client-cpus", 0.5, "float", "CPUs per virtual client on the Ray engine", "", lo=0, open_lo=True, cap=1024,
        group=RUN),
    Key("torch-threads", "auto", "float|word", "torch's threads in each process that computes gradients (auto: "
        "⌊client-cpus⌋, at least 1, in a Ray actor or a SuperNode; the process's cores less one, at least 1, on the "
        "other engines)", "", lo=1, cap=1024, words=("auto",), group=RUN),
    Key("reply-timeout", 600.0, "float", "seconds to wait for replies and for nodes", "", lo=0, open_lo=True,
        cap=10**7, group=RUN),
    Key("node-keys", "", "text", "a folder with node0.pub, node1.pub, …: with node authentication, client i must be "
        "the node that registered the key nodei.pub ('': any node may claim partition-id i)", group=RUN),
    Key("checkpoint-every", 0, "int", "write checkpoint.npz every N rounds (0: off)", "", lo=0, cap=10**12, group=RUN),
    Key("resume", "", "text", "a run folder to continue from its checkpoint ('': a new run)", group=RUN),
)
BY_NAME = {k.name: k for k in KEYS}
DEFAULTS: dict[str, Any] = {k.name: k.default for k in KEYS}
#: The repository app's ``[tool.flwr.app.config]`` values where they differ from :data:`DEFAULTS`
#: (a test checks ``pyproject.toml`` against them): a resume under ``flwr run`` treats a key at
#: these values as not given (``flwr run`` always sends every declared key).
FLWR_APP_DEFAULTS = {"num-rounds": 200, "burn-in": 50}


def close_keys(name: str, keys=None) -> list[str]:
    """The keys (of the table, or of ``keys``) a mistyped ``name`` may mean, for a did-you-mean: the
    closest spellings, then the keys sharing its first word (``num-round`` → ``num-rounds``, …)."""
    keys = list(DEFAULTS if keys is None else keys)
    close = difflib.get_close_matches(name, keys, n=3, cutoff=0.6)
    return close + [x for x in keys if x.split("-")[0] == name.split("-")[0] and x not in close]


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def flag(key: str, value: Any) -> bool:
    """A boolean: a bool, or one of true/false, 1/0, yes/no, on/off (never ``bool("no")``)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    v = str(value).strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def integer(key: str, value: Any) -> int:
    """An integer: an int, or a number or string with an integral value (``"5"``, ``5.0``,
    ``"1e3"``); a fraction (``4.9``), a bool, an infinity or anything else is refused."""
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
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
    if not math.isfinite(f) or f != math.floor(f):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    return int(f)


def number(key: str, value: Any) -> float:
    """A real number; a bool, text that is no number, or NaN is refused."""
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        f = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if math.isnan(f):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    return f


def _in_range(k: Key, x: float) -> bool:
    if not math.isfinite(x):
        return False
    if k.lo is not None and (x <= k.lo if k.open_lo else x < k.lo):
        return False
    if k.hi is not None and (x >= k.hi if k.open_hi else x > k.hi):
        return False
    return k.cap is None or x <= k.cap


def _range_error(k: Key, value: Any) -> ConfigError:
    return ConfigError(f"{k.name} must be {k.allowed()} (got {value!r})")


def parse(name: str, value: Any) -> Any:
    """``value`` read by the rules of key ``name`` (see the module docstring); ``ConfigError``
    naming the key and its allowed values otherwise. Per-client keys (``s``, ``p``) return the
    list of values as given (their count is checked against ``num-clients`` by ``resolve``)."""
    k = BY_NAME[name]
    if k.kind == "bool":
        return flag(name, value)
    if k.kind == "int":
        x = integer(name, value)
        if not _in_range(k, x):
            raise _range_error(k, value)
        return x
    if k.kind == "float":
        x = number(name, value)
        if not _in_range(k, x):
            raise _range_error(k, value)
        return x
    if k.kind == "float|word":
        if isinstance(value, str) and value.strip().lower() in k.words:
            return value.strip().lower()
        try:
            x = number(name, value)
        except ConfigError:
            if isinstance(value, str):  # a word that is not one of the key's: name them ('auto', 'flat', …)
                raise _range_error(k, value) from None
            raise
        if not _in_range(k, x):
            raise _range_error(k, value)
        return x
    if k.kind in ("ints", "floats"):
        parts = _parts(value)
        try:
            vals = [integer(name, x) if k.kind == "ints" else number(name, x) for x in parts]
        except ConfigError:
            what = "integer" if k.kind == "ints" else "number"
            raise ConfigError(f"{name}: cannot read {value!r} as {what} values") from None
        if not vals or not all(_in_range(k, x) for x in vals):
            raise ConfigError(f"{name} must be {k.allowed()} for every client (got {value!r})")
        return vals
    if k.kind == "text":
        if hasattr(value, "__fspath__"):
            value = str(value)
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be text (got {value!r})")
        if "\x00" in value:
            raise ConfigError(f"{name} must not contain a NUL character (got {value!r})")
        return check_run_name(value) if name == "run-name" else value
    return value  # choice: resolve() reads it with its aliases and plug-ins


def check_run_name(run_name: Any) -> str:
    """A run name is one folder name inside ``output-dir``: no path separator, not ``.`` or ``..``,
    no NUL (a run must never write outside its output folder); ``ConfigError`` otherwise."""
    name = str(run_name)
    if name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ConfigError(f"run-name must be one folder name inside output-dir, without '/', '..' or NUL "
                          f"(got {run_name!r})")
    return name


def _parts(raw: Any) -> list:
    if isinstance(raw, str):
        return [x.strip() for x in raw.split(",") if x.strip()]
    if isinstance(raw, (list, tuple, np.ndarray)):
        return list(raw)
    return [raw]
