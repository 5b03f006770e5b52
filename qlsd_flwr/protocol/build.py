"""Builds the pieces of a run from its :class:`~qlsd_flwr.config.RunConfig`.

Every engine (Flower on Ray, in-process Flower, the framework-free loop, the vectorised
engine) calls these same functions, so they all run the same algorithm.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from qlsd_flwr.compression import fixed
from qlsd_flwr.compression.identity import Identity
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core.dglmc import Spectrum
from qlsd_flwr.core.downlink import DITHERS, FEEDBACKS, Downlink, broadcast_code, lag_beta
from qlsd_flwr.core.metric import Identity as IdentityMetric, Metric
from qlsd_flwr import samplers
from qlsd_flwr.core.oracles import ClientSpec
from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.core.priors import check_prior
from qlsd_flwr.core.server_step import ServerSpec, noise_factor
from qlsd_flwr.bases import whitening_of, whitens
from qlsd_flwr.protocol.gradients import ROWS, as_sent, theta_width


def check_clients(task: Task) -> None:
    """Every client holds at least one data point (``N_i ≥ 1``); ``ConfigError`` naming the first
    that does not (its oracle would divide by zero every round)."""
    for i, c in enumerate(task.clients):
        if int(c.n_data) < 1:
            raise ConfigError(f"client {i} holds no data points: every client needs at least one "
                              f"(check the partition, num-clients = {task.b})")


def warn_if_unstable(cfg: RunConfig, task: Task) -> None:
    """Log :func:`stability_warning`'s and :func:`participation_warnings`' messages (every engine
    calls this at start); a run in which no client is expected to take part at all is refused."""
    log = logging.getLogger("qlsd_flwr")
    if (why := stability_warning(cfg, task)) is not None:
        log.warning(why)
    for why in participation_warnings(cfg, task):
        log.warning(why)
    if cfg.kind.coupled:  # a known bias, named (docs/RIVALS.md)
        log.warning("dg-lmc samples the augmented model π_ρ (rho = %s; auto: γ/10): its θ-marginal is wider than "
                    "the posterior and, with clients of different data, shifted, by O(ρ); a smaller ρ mixes more "
                    "slowly (check R-hat; docs/RIVALS.md)", cfg.get("rho"))


def participation_warnings(cfg: RunConfig, task: Task) -> list[str]:
    """What extreme participation probabilities ``p_i`` do to the chain, in words.

    * ``K Σ_i p_i < 1``: no reply is expected in the whole run; the chain would sample the prior
      alone (or drift, under a flat prior): refused (``ConfigError``).
    * ``K p_i < 1``: client ``i`` is expected to take part in less than one round.
    * unbiased aggregation weighs a reply by ``1/p_i``: on a target whose curvature is known (the
      Gaussian task, ``∇²U_i = N_i I``), ``γ N_i / p_i ≥ 2`` means one weighted step overshoots
      the mode (θ is thrown far, the exact-gradient iteration diverges); elsewhere ``min p_i <
      0.01`` is flagged as a weight of over 100."""
    p, K = np.asarray(cfg.p, dtype=np.float64), int(cfg.num_rounds)
    if K * float(p.sum()) < 1.0:
        raise ConfigError(f"p: K · Σ_i p_i = {K * float(p.sum()):.3g} < 1 (num-rounds = {K}): no client is "
                          "expected to take part in the whole run, so the chain would sample the prior alone; "
                          "raise p or num-rounds")
    out = []
    rare = np.flatnonzero(K * p < 1.0)
    if rare.size:
        out.append(f"p: client(s) {rare[:5].tolist()}{' …' if rare.size > 5 else ''} are expected to take part "
                   f"in fewer than one of the {K} rounds (K · p_i < 1); their data barely enter the chain")
    cv = cfg.kind.control_variate  # active-fraction is biased without a control variate unless p is equal
    remedy = "aggregation = active-fraction" if cv or np.all(p == p[0]) else "a control-variate variant (qlsd-pp)"
    if cfg.aggregation == "unbiased" and cfg.kind.weighs_by_p:
        if task.posterior_var is not None and task.clients and not cfg.kind.cv_zeta and np.isfinite(cfg.gamma):
            over = cfg.gamma * task.n_data[: cfg.b] / p
            if float(over.max()) >= 2.0:
                i = int(np.argmax(over))
                out.append(f"p: client {i}'s reply is weighted 1/p_i = {1 / p[i]:.3g} (aggregation = unbiased), so "
                           f"one step moves θ by γ N_i / p_i = {over[i]:.3g} ≥ 2 times its distance to the "
                           f"client's mode: θ will be thrown far; raise p, lower gamma, or use "
                           f"{remedy}")
        elif float(p.min()) < 0.01:
            out.append(f"p: min p_i = {float(p.min()):.3g}: with aggregation = unbiased a reply is weighted "
                       f"up to {1 / float(p.min()):.3g}×, which multiplies its noise; check the traces, or use "
                       f"{remedy}")
    return out


def stability_warning(cfg: RunConfig, task: Task) -> str | None:
    """On a target whose posterior precision is known (the Gaussian task), the message to warn
    with when the step ``gamma`` is beyond the stability limit of Langevin with exact
    gradients, ``γ < 2/τ_max`` (``τ`` the precision: the iteration multiplies the error by
    ``1 − γτ``), i.e. when the chain will diverge; ``None`` otherwise."""
    if task.posterior_var is None or not np.isfinite(cfg.gamma) or cfg.metric != "identity" \
            or int(cfg.get("metric-rank") or 0):
        return None  # gamma = auto and a metric are checked against the estimated λ_max (protocol.precondition)
    tau = float(1.0 / np.min(task.posterior_var))
    if cfg.gamma * tau < 2.0:
        return None
    return (f"gamma = {cfg.gamma:g} is beyond this target's stability limit 2/τ = {2.0 / tau:.3g} "
            f"(τ = {tau:.4g}, the posterior precision, grows with the clients' data): the chain will "
            f"diverge; choose gamma below {2.0 / tau:.3g} (e.g. {1.0 / tau:.3g}, γτ = 1)")


def stable_gamma(task: Task, info: dict | None = None) -> float | None:
    """The step the divergence error suggests: ``c/λ_max`` where the run estimated ``λ_max`` of
    ``M^{1/2} ∇²U M^{1/2}`` before sampling (``info['lambda_max']``, :mod:`qlsd_flwr.protocol.precondition`,
    ``c`` as ``gamma = auto``); else ``1/τ`` (``γτ = 1``, half the stability limit ``2/τ``) on a
    target whose posterior precision ``τ`` is known; ``None`` otherwise."""
    lam = (info or {}).get("lambda_max")
    if isinstance(lam, (int, float)) and lam > 0:
        from qlsd_flwr.core.curvature import GAMMA_AUTO_C

        return float((info or {}).get("gamma_c", GAMMA_AUTO_C)) / float(lam)
    if task.posterior_var is None:
        return None
    return float(np.min(task.posterior_var))


def blocks_for(cfg: RunConfig, task: Task) -> tuple[int, ...] | None:
    """QSGD norm blocks: one for the whole vector, or one per tensor (``block-norm = tensor``)."""
    blocks = None if cfg.block_norm == "vector" else task.meta.get("blocks")
    return tuple(int(x) for x in blocks) if blocks else None


def compressor_for(cfg: RunConfig, i: int, blocks=None):
    if not cfg.compressed:
        return Identity()
    return QSGD(s=int(cfg.s[i]), blocks=blocks, encoding=cfg.encoding)


def alphas(cfg: RunConfig, d: int, blocks=None) -> np.ndarray:
    """``α_i``: the configured value, or ``1/(ω_i + 1)``; ``0`` when the variant has no memory."""
    if not cfg.memory:
        return np.zeros(cfg.b)
    if cfg.kind.coupled:  # z_i ← z_i + ĝ_i: the mirror is the client's z_i itself
        return np.ones(cfg.b)
    if cfg.alpha is not None:
        return np.full(cfg.b, float(cfg.alpha))
    return np.array([alpha_of(cfg, i, d, blocks) for i in range(cfg.b)])


def alpha_of(cfg: RunConfig, i: int, d: int, blocks=None) -> float:
    """Client ``i``'s ``α_i`` (one entry of :func:`alphas`)."""
    if not cfg.memory:
        return 0.0
    if cfg.kind.coupled:
        return 1.0
    if cfg.alpha is not None:
        return float(cfg.alpha)
    return 1.0 / (compressor_for(cfg, i, blocks).omega(d) + 1.0)


def batch_size(cfg: RunConfig, n_data: int) -> int:
    """``n_i = max(1, ⌊N_i · batch-fraction⌋)`` (the paper's toy: ``⌊N_i/10⌋``)."""
    return minibatch_size(cfg.batch_fraction, n_data)


def minibatch_size(fraction: float, n_data: int) -> int:
    return max(1, int(np.floor(n_data * fraction)))


def client_settings(cfg: RunConfig, i: int, d: int, prior: GaussianPrior, blocks=None) -> dict:
    """What client ``i`` needs to compute its message, as plain scalars (the server sends them
    with every message, so that a client needs no run config of its own): the oracle, QSGD's
    ``s_i`` (0: no compression), the encoding and norm blocks, memory and ``α_i``, the
    batch fraction, its share ``w_i`` of the prior ``U_0`` and the prior's variance, the seed.
    A prior other than Gaussian stays on the server (``ConfigError`` with ``prior-on = clients``)."""
    if cfg.prior_on == "clients" and not isinstance(prior, GaussianPrior):
        raise ConfigError(f"prior-on = clients: a {type(prior).__name__} stays on the server (only a Gaussian "
                          "prior's two numbers travel to the clients); set prior-on = server")
    return {
        "oracle": cfg.oracle, "memory": bool(cfg.memory), "alpha": float(alpha_of(cfg, i, d, blocks)),
        "s": int(cfg.s[i]) if cfg.compressed else 0, "encoding": cfg.encoding,
        "blocks": ",".join(str(int(x)) for x in blocks) if blocks else "",
        "batch_fraction": float(cfg.batch_fraction), "prior_var": float(getattr(prior, "var", math.inf)),
        "prior_mean": float(getattr(prior, "mean", 0.0)),
        "prior_weight": (1.0 / cfg.b) if cfg.prior_on == "clients" else 0.0,
        "seed": int(cfg.seed),
        # compression-basis = metric (block): M (B) travels to the clients (protocol.metric_sent): they quantise Sᵀ H_i
        **({"metric": "sent"} if whitens(cfg, d) else {}),
        # downlink = qsgd: the broadcast's levels and rule (core.downlink), the same on both sides
        **({"downlink_s": int(cfg.get("downlink-s")), "downlink_feedback": str(cfg.get("downlink-feedback"))}
           if downlink_on(cfg) else {}),
        # downlink-dither = subtractive: the clients take the dither out (sent only then: the default's bytes as before)
        **({"downlink_dither": "subtractive"} if downlink_on(cfg) and cfg.get("downlink-dither") == "subtractive"
           else {}),
        # downlink-support = data: the code carries the coordinates the server's theta_support names (core.downlink)
        **({"downlink_support": "data"} if support_on(cfg) else {}),
        # FALD, VR-FALD*: K local steps, the common share τ of the noise and T (0, 0, 1 for the others)
        **({"local_steps": int(cfg.get("local-steps")), "tau": float(cfg.get("tau")),
            "temperature": float(cfg.temperature),
            # M for the local steps travels with the first message (protocol.local_chains)
            "metric": "identity" if cfg.metric == "identity" and not int(cfg.get("metric-rank") or 0) else "sent"}
           if cfg.kind.local else {}),
    }


def downlink_on(cfg: RunConfig) -> bool:
    """Whether θ's broadcast is compressed (``downlink = qsgd``; :mod:`qlsd_flwr.protocol.broadcast`)."""
    return cfg.get("downlink") == "qsgd"


def support_on(cfg: RunConfig) -> bool:
    """Whether the broadcast codes only the clients' support (``downlink-support = data``): not where the clients
    take a share of the prior (``prior-on = clients``), whose gradient reads every coordinate."""
    return downlink_on(cfg) and cfg.get("downlink-support") == "data" and cfg.prior_on != "clients"


_ENCODINGS = ("auto", "elias", "packed", "arith")


def client_spec_from_settings(settings: dict, i: int, n_data: int, d: int) -> tuple[ClientSpec, int]:
    """``(spec, seed)`` of client ``i`` from :func:`client_settings` (as received: every value
    is checked, and a bad one raises ``ValueError`` naming it)."""
    try:
        oracle, encoding = str(settings["oracle"]), str(settings["encoding"])
        s, seed = int(settings["s"]), int(settings["seed"])
        alpha, bf = float(settings["alpha"]), float(settings["batch_fraction"])
        prior_var, w = float(settings["prior_var"]), float(settings["prior_weight"])
        prior_mean = float(settings.get("prior_mean", 0.0))
        memory = bool(settings["memory"])
        blocks_s = str(settings["blocks"])
        blocks = tuple(int(x) for x in blocks_s.split(",")) if blocks_s else None
        steps, tau = int(settings.get("local_steps", 0)), float(settings.get("tau", 0.0))
        temperature = float(settings.get("temperature", 1.0))
        metric = str(settings.get("metric", "identity"))
        down_s, feedback = int(settings.get("downlink_s", 0)), str(settings.get("downlink_feedback", "ef21-p"))
        dither = str(settings.get("downlink_dither", "stochastic"))
        on_support = str(settings.get("downlink_support", "all"))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"client settings: missing or malformed value ({type(exc).__name__}: {exc})") from None
    kind = samplers.ESTIMATORS.get(oracle)
    local = kind is not None and kind.local
    checks = {"oracle": kind is not None, "encoding": encoding in _ENCODINGS, "s": 0 <= s < 2 ** 31,
              "alpha": 0.0 <= alpha <= 1.0, "batch_fraction": 0.0 < bf <= 1.0, "prior_var": prior_var > 0,
              "prior_mean": np.isfinite(prior_mean),
              "prior_weight": 0.0 <= w <= 1.0, "seed": 0 <= seed < 2 ** 63,
              "blocks": blocks is None or (all(x > 0 for x in blocks) and sum(blocks) == d),
              "local_steps": (1 <= steps <= 10**5) if local else steps == 0,
              "tau": 0.0 <= tau <= 1.0, "temperature": 0.0 < temperature <= 1e6,
              "metric": metric in ("identity", "sent") and (metric == "identity" or local or s > 0),
              "downlink_s": 0 <= down_s < 2 ** 31 and not (local and down_s), "downlink_feedback": feedback in FEEDBACKS,
              "downlink_dither": dither in DITHERS, "downlink_support": on_support in ("data", "all")}
    if bad := [k for k, ok in checks.items() if not ok]:
        raise ValueError(f"client settings: bad value for {', '.join(bad)}")
    compressor = QSGD(s=s, blocks=blocks, encoding=encoding) if s else Identity()
    return ClientSpec(index=i, kind=kind, batch_size=minibatch_size(bf, n_data), compressor=compressor,
                      memory=memory, alpha=alpha, prior=GaussianPrior(var=prior_var, mean=prior_mean),
                      prior_weight=w, local_steps=steps, tau=tau, temperature=temperature, metric=metric,
                      downlink=Downlink(broadcast_code(down_s), feedback, dither, on_support == "data") if down_s
                      else None), seed


def client_spec(cfg: RunConfig, i: int, n_data: int, d: int, prior: GaussianPrior,
                blocks=None) -> ClientSpec:
    """Client ``i``'s :class:`ClientSpec`: the one the server's :func:`client_settings` give it."""
    return client_spec_from_settings(client_settings(cfg, i, d, prior, blocks), i, n_data, d)[0]


def server_spec(cfg: RunConfig, task: Task, theta_star: np.ndarray | None, blocks=None,
                metric: Metric | None = None) -> ServerSpec:
    """The server step's settings; ``metric``: what :mod:`qlsd_flwr.protocol.precondition` settled
    (the identity unless given)."""
    if not np.isfinite(cfg.gamma):
        raise ConfigError("gamma = auto: the step is chosen before sampling (protocol.precondition.prepare); "
                          "this path started a chain without it")
    metric = IdentityMetric() if metric is None else metric
    # DG-LMC coupled in M's norm draws θ | z in M's eigenbasis (a low-rank correction: refused by
    # protocol.local_chains, naming the key)
    spectrum = Spectrum.of(metric) if cfg.kind.coupled and not metric.is_identity and not metric.has_correction else None
    whitening = whitening_of(cfg, task.dim, metric)  # what the clients quantise in (None: θ's coordinates)
    return ServerSpec(
        b=cfg.b, gamma=cfg.gamma, p=cfg.p, rule=cfg.aggregation, memory=cfg.memory,
        alpha=alphas(cfg, task.dim, blocks), l=cfg.l, kind=cfg.kind, prior=task.prior,
        prior_on_server=(cfg.prior_on == "server"), theta_star=theta_star,
        metric=metric, temperature=float(cfg.temperature), spectrum=spectrum,
        whitened=whitening is not None, basis=None if whitening is metric else whitening,
        lag=lag_beta(str(cfg.get("downlink-correction")) if downlink_on(cfg) else "off", cfg.gamma, metric.is_identity),
        noise=noise_factor(str(cfg.get("noise-correction")), cfg.gamma, metric.is_identity))


def external_task(cfg: RunConfig, blocks=None, theta_star=None, prior=None, prior_var="flat",
                  heldout=None) -> Task:
    """The :class:`Task` of a user's own strategy (:class:`~qlsd_flwr.flower.QLSDStrategy`'s keyword
    parameters): ``d``, the prior, θ* when given, the tensors' sizes, the held-out data; ``ValueError``
    naming the first argument that does not fit ``cfg``. The clients' potentials live on the clients."""
    meta = {"blocks": tuple(int(x) for x in blocks)} if blocks else {}
    if heldout is not None:
        meta["heldout"] = _heldout(heldout)
    if cfg.block_norm == "tensor" and not blocks:
        raise ConfigError("block_norm = 'tensor' needs blocks (the sizes of θ's tensors)")
    if blocks is not None and sum(int(x) for x in blocks) != cfg.dim:
        raise ConfigError(f"blocks: the sizes add up to {sum(int(x) for x in blocks)}, dim is {cfg.dim}")
    if theta_star is not None:
        theta_star = np.asarray(theta_star, dtype=np.float64).ravel()
        if theta_star.shape != (cfg.dim,) or not np.all(np.isfinite(theta_star)):
            raise ConfigError(f"theta_star: expected {cfg.dim} finite values, got shape {theta_star.shape}")
    if prior is not None:
        check_prior(prior, prior_var)
    return Task(name="external", dim=cfg.dim, clients=[],
                prior=GaussianPrior(var=cfg.prior_var) if prior is None else prior,
                theta_star=theta_star, meta=meta)


def _heldout(heldout) -> tuple:
    """``(predictor, X, y)`` checked before the run starts, so that a mistake is not found after it."""
    if not isinstance(heldout, (tuple, list)) or len(heldout) != 3:
        raise ConfigError("heldout: expected a tuple (predictor, X, y), got "
                         f"{type(heldout).__name__}{'' if not hasattr(heldout, '__len__') else f' of {len(heldout)}'}")
    predictor, X, y = heldout
    if not callable(getattr(predictor, "predict_proba", None)):
        raise ConfigError(f"heldout: the predictor ({type(predictor).__name__}) has no predict_proba(thetas, X)")
    X, y = np.asarray(X), np.asarray(y)
    if X.ndim < 2 or y.ndim != 1 or len(X) != len(y) or len(y) == 0 or not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"heldout: X needs one row per label and y one integer label per row (got X {X.shape}, "
                         f"y {y.shape} {y.dtype})")
    return predictor, X, y


def theta0_of(task: Task) -> np.ndarray:
    return np.zeros(task.dim) if task.theta0 is None else np.asarray(task.theta0, dtype=np.float64)


def combine_grads(cfg: RunConfig, prior: GaussianPrior, grads, theta: np.ndarray) -> np.ndarray:
    """``∇U(θ)`` from the clients' full local gradients (in index order) and, when it stays on
    the server, the prior. Used by the θ* optimisation phase on every engine."""
    g = np.zeros_like(theta)
    for gi in grads:
        g = g + gi
    if cfg.prior_on == "server":
        g = g + prior.grad(theta)
    return g


class GradExchange:
    """``∇U(θ)`` from the kept clients' full gradients (one exchange of the θ* phase: ``grad_fn(θ)``), and each
    client's own (``clients(θ)``: ``{i: ∇U_i(θ)}``) for the rules that judge them one by one
    (:mod:`qlsd_flwr.robust.products`); ``combine(grads, θ)`` is ``grad_fn``'s sum of them, bit for bit."""

    def __init__(self, cfg: RunConfig, prior, gradients, kept, n_data):
        self.cfg, self.prior = cfg, prior
        self._gradients, self._kept = gradients, kept  # θ → the b clients' gradients (zeros for those left out)
        # the clients' N_i (claims on the Flower path); __call__'s scales, and its replies' bits where they are rows
        self.n_data, self.scales, self.uplink = n_data, None, None

    def clients(self, th) -> dict:
        grads = self._gradients(th)
        return {i: grads[i] for i in self._kept()}

    def kept(self) -> list[int]:
        """The clients the exchange still asks (those left out excluded)."""
        return list(self._kept())

    def combine(self, grads: dict, th) -> np.ndarray:
        return combine_grads(self.cfg, self.prior, [grads.get(i, np.zeros_like(th)) for i in range(self.cfg.b)], th)

    def __call__(self, th, precision: int = 64) -> np.ndarray:
        """``∇U(θ)``; at ``precision = 32`` θ goes out and the gradients come back as float32, at 16 or 12 θ as
        float32 and the gradients as fixed-point rows (the θ* descent where θ* is only the point where the curvature
        is taken), the prior's part taken at the θ the clients got. ``scales``: each client's row scale as received,
        for the next exchange's width (:class:`qlsd_flwr.protocol.descent.DescentWidth`)."""
        grads = self._gradients(th := as_sent(th, theta_width(precision)), precision)
        self.scales = [float(np.max(np.abs(g), initial=0.0)) for g in grads]  # (a row's code depends on its levels)
        self.uplink = sum(fixed.sent_bits(grads[i], precision) for i in self._kept()) if precision in ROWS else None
        return combine_grads(self.cfg, self.prior, grads, th)


def direct_exchanges(cfg: RunConfig, task: Task, specs, states=None):
    """``(grad_fn, curv_fn)`` for the engines that call their clients directly (local, vectorised): the very functions
    a ClientApp runs for the ``grad`` and ``curvature`` phases; ``states`` (local) keep what a client keeps."""
    from qlsd_flwr.core.kron_block import KRON_BLOCK, local_block
    from qlsd_flwr.core.lowrank import local_hvp
    from qlsd_flwr.core.curvature import local_curvature
    from qlsd_flwr.core.oracles import full_local_grad

    grads = lambda th, precision=64: [as_sent(full_local_grad(s, task.clients[s.index], th), precision) for s in specs]  # noqa: E731
    grad_fn = GradExchange(cfg, task.prior, grads, lambda: [s.index for s in specs],
                           [int(task.clients[s.index].n_data) for s in specs])

    def curv_fn(th, kind, vectors=None, bits=fixed.BITS):
        if kind == "hvp":  # metric-rank, the power iteration: the block of Hessian-vector products at width bits
            return {s.index: local_hvp(task.clients[s.index], th, vectors, bits) for s in specs}
        if kind == KRON_BLOCK:  # metric-block: the input directions as the clients read them, and keep
            V = fixed.rounded(vectors, bits)
            for st in states or ():  # as each client keeps them (protocol.client)
                st.block_dirs = V
            return {s.index: local_block(task.clients[s.index], th, V) for s in specs}
        return {s.index: local_curvature(task.clients[s.index], th, kind, cfg.seed, s.index) for s in specs}

    return grad_fn, curv_fn
