"""``QLSDStrategy``: the QLSD family as a Flower Message-API strategy.

The strategy only translates between Flower messages and the framework-free round protocol
(:class:`~qlsd_flwr.protocol.server.QLSDServer`), and it keeps Flower's ``Strategy`` contract:
Flower's own :meth:`Strategy.start` drives the rounds; :meth:`QLSDStrategy.configure_train`
builds one ``Message`` per active client from the protocol's fields; :meth:`aggregate_train`
hands every reply back to the protocol (validated, decoded or rejected and counted) and takes
the server step, returning the new sample ``θ_{k+1}`` as the round's ``ArrayRecord``.

In your own ``ServerApp``, build it with keyword parameters (see :class:`QLSDStrategy`); the
clients run :func:`qlsd_flwr.flower.make_client_app` with your potential. The project's own
app builds it from a run config (:meth:`QLSDStrategy.from_config`).

What :meth:`start` adds around Flower's loop, and why:

* before it: the node handshake (:class:`~qlsd_flwr.flower.nodes.NodeRegistry`: client index
  ``i`` ↔ node id), the θ* phase for QLSD* (:mod:`qlsd_flwr.protocol.theta_star`), and the start of
  the chain (or its restart from a checkpoint);
* after it: the memory audit (every client's own η_i against the server's mirror) and the run's
  summary;
* one documented override of one step: on Flower's grids the grid passed to Flower's loop hands
  replies to :meth:`aggregate_train` *as they arrive* (:mod:`qlsd_flwr.flower.grid_stream`), so
  decoding overlaps the clients still at work. The chain does not depend on the order replies
  are taken in.

Participation is drawn per client from the counter stream ``(seed, PARTICIPATION, k, i)``,
never with Flower's ``sample_nodes``. A diverging chain raises
:class:`~qlsd_flwr.protocol.divergence.DivergenceError` (also handed to
``failure_sink["error"]``, so that the Ray engine, which runs the ServerApp inside Flower, can
re-raise it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from qlsd_flwr.config import ConfigError, RunConfig, resolve
from qlsd_flwr.core.potential import Task
from qlsd_flwr.flower import stopping
from qlsd_flwr.flower.grid_stream import RepliesAsTheyArrive
from qlsd_flwr.flower.finish import check_heldout, finish_run
from qlsd_flwr.flower.nodes import NodeRegistry, load_bound_keys
from qlsd_flwr.flower.phases import PhaseExchanges
from qlsd_flwr.flower.records import labels_from_arrays, record_fields, theta_from_arrays, to_content
from qlsd_flwr.flower.sizing import message_nbytes
from qlsd_flwr.outputs.checkpoint import resume_dir
from qlsd_flwr.outputs.resume import app_resume
from qlsd_flwr.outputs.warmup import warmup_store
from qlsd_flwr.outputs.observer import RunOutputs
from qlsd_flwr.outputs.progress import announce, progress_bar
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.chains import make_server
from qlsd_flwr.protocol.divergence import DivergenceError

log = logging.getLogger("qlsd_flwr")


class QLSDStrategy(Strategy):
    """QLSD, QLSD#, QLSD*, QLSD++ and the uncompressed LSD*/LSD++/SGLD as a Flower strategy.

    The server needs only what a server has: the number of clients, the dimension, the prior
    and, for QLSD*/LSD*, θ* when it is known. Each client's potential ``U_i`` stays on its
    node (:func:`qlsd_flwr.flower.make_client_app`). Run it with ``strategy.start(grid,
    initial_arrays=...)`` in a ``ServerApp``; the samples go to ``<output_dir>/<run_name>/``
    (``samples.nc`` for ArviZ, ``metrics.csv``, ``summary.json``).

    Parameters
    ----------
    num_clients : int
        ``b``, the number of clients; each node's ``partition-id`` is its index ``i`` in ``0..b-1``.
    dim : int
        ``d``, the length of θ (all trainable parameters, flattened in the order of your model's
        ``named_parameters()``).
    variant : str, default "qlsd-pp"
        ``qlsd`` (full local gradients), ``qlsd-sharp`` (QLSD#, minibatches), ``qlsd-star``
        (QLSD*, control variate at θ*), ``qlsd-pp`` (QLSD++: SVRG anchor ζ and memory η_i),
        ``lsd-star``, ``lsd-pp`` (uncompressed), ``sgld`` (one pooled client).
    gamma : float or "auto", default 4.9e-4
        γ, the Langevin step size: ``θ_{k+1} = θ_k − γ M G_k + sqrt(2γT) M^{1/2} Z_{k+1}``.
        ``"auto"``: ``c / λ_max(M^{1/2} ∇²U(θ*) M^{1/2})``, ``λ_max`` by the Lanczos method on the clients'
        Hessian-vector products before sampling (``c``: ``gamma_c``, default ``"auto"``: 0.25 if the clients'
        handshakes and the prior declare the posterior log-concave, else 0.125; ``summary.json``).
    metric : str, default "identity"
        ``M``, a constant preconditioner: ``identity`` (the paper's chain), ``diagonal``, ``dense``
        (d ≤ 2000), or the path of a ``.npy`` with d positive numbers or an SPD d × d matrix.
    metric_from : str, default "curvature"
        How a ``diagonal``/``dense`` M is built: ``(prior curvature + Σ_i H_i)^{-1}`` from each
        client's curvature report at θ* (its potential's ``curvature_diag``/``hessian``, else an
        estimate from ``grad_sum``), exchanges before sampling, each report validated and bounded.
    metric_rank : int, default 0
        ``k``: M corrected along the ``k`` directions where ``M^{1/2}ᵀ ∇²U(θ*) M^{1/2}`` is farthest
        from 1, by a block Krylov method on the clients' Hessian-vector products (``metric_rank_exchanges``,
        default 32, exchanges of 16; :mod:`qlsd_flwr.core.lowrank`, docs/METRIC.md). 0: none. With ``metric_block``
        (K-FAC exact on its top input directions) found off them: the main job's ``metric_block=100,
        metric_rank=150, metric_rank_exchanges=4`` (``**config``: any run-config key, ``_`` for ``-``).
    temperature : float, default 1.0
        ``T``: the chain targets ``π^{1/T}`` (the noise is scaled by ``√T``).
    init : str, default "theta0"
        ``theta0``: every chain starts at ``initial_arrays`` (or θ_0); ``dispersed``: chain ``c``
        at ``θ* + 2 M^{1/2} z_c``, so that R-hat can tell chains that have not met.
    prior : object, optional
        The server's prior ``U_0``, any object with ``value(θ)``, ``grad(θ)`` and optionally
        ``curvature_diag(θ)`` (:mod:`qlsd_flwr.core.priors`: Student-t, log half-normal, a user's
        function, blocks); default the Gaussian of ``prior_var``. Give one or the other.
    num_rounds : int, default 2000
        ``K``, the number of rounds (one sample each).
    burn_in : int, default 500
        Rounds dropped before samples are kept.
    thin : int, default 1
        Keep every ``thin``-th sample after burn-in.
    p : float or sequence of float, default 1.0
        ``p_i``, each client's probability to take part in a round (one value for all, or one
        per client).
    s : int or sequence of int, default 16
        ``s_i``, QSGD's number of levels (``s = 2^k`` is "k bits").
    aggregation : str, default "unbiased"
        ``unbiased`` (weights ``1/p_i``) or ``active-fraction`` (``b/|A_k|``, Algorithm 1).
    l : int, default 100
        The SVRG anchor period (QLSD++).
    alpha : float or "auto", default "auto"
        α, the memory rate of QLSD++; ``auto`` is ``1/(ω_i + 1)``.
    batch_fraction : float, default 0.1
        Minibatch size ``n_i = max(1, ⌊N_i · batch_fraction⌋)``.
    prior_var : float or "flat", default "flat"
        σ², the variance of the Gaussian prior ``U_0(θ) = ‖θ‖²/(2σ²)`` (``flat``: none).
    prior_on : str, default "server"
        Keep ``∇U_0`` on the ``server``, or share it over the ``clients`` (weights ``1/b``).
    blocks : sequence of int, optional
        Sizes of θ's tensors, for one QSGD norm per tensor (``block_norm = "tensor"``).
    block_norm : str, default "vector"
        One QSGD norm for the whole ``vector``, or one per ``tensor`` (needs ``blocks``).
    encoding : str, default "auto"
        ``elias`` (QSGD's sparse code), ``packed`` (dense), ``auto`` (the shorter), ``arith`` (arithmetic-coded levels).
    theta_star : array_like, optional
        θ*, the mode of the posterior, for QLSD*/LSD*; without it they first find θ* by a
        federated gradient descent through the same clients (``opt_rounds``, ``opt_tol``).
    seed : int, default 0
        The run's seed: participation, minibatches, quantisation and noise are functions of it.
    output_dir, run_name : str, default "outputs", "" (a timestamped name)
        The run folder is ``<output_dir>/<run_name>``.
    write, keep_trace : bool, default True, False
        Write the run folder; keep every ``θ_k`` in memory (``strategy.trace``).
    on_round : callable, optional
        ``on_round(strategy)``, called after each round (monitoring).
    heldout : tuple (predictor, X, y), optional
        Held-out data for the server: a ``predictor`` with ``predict_proba(thetas, X)`` (your model's
        ``TorchPotential``), inputs and labels. The run ends with ``evaluation.json``, ``reliability.png``
        and samples.nc's held-out groups, and the verdict reads the predictive's R-hat (``auto``); else
        θ's, which a network's symmetric weights keep high after its predictive has mixed.
    **config
        Any other run-config key (``num_chains``: C chains in one run, chain ``c`` with seed
        ``seed + c``, one message per client and round for all its chains, see
        :mod:`qlsd_flwr.protocol.chains`; ``checkpoint_every``, ``reply_timeout``, ``progress``,
        ``verbose``, ``opt_rounds``, ``opt_tol``, ``compressor``, …; see ``qlsd-flwr config``),
        with ``_`` or ``-``. A bad value raises :class:`qlsd_flwr.config.ConfigError` naming it.

    Examples
    --------
    >>> strategy = QLSDStrategy(num_clients=10, dim=291, gamma=1e-3, prior_var=5.0)  # doctest: +SKIP
    >>> strategy.start(grid, initial_arrays=ArrayRecord(potential.named_arrays()))  # doctest: +SKIP
    """

    def __init__(self, *, num_clients: int, dim: int, variant: str = "qlsd-pp", gamma: float | str = 4.9e-4,
                 num_rounds: int = 2000, burn_in: int = 500, thin: int = 1, p=1.0, s=16,
                 aggregation: str = "unbiased", l: int = 100, alpha="auto", batch_fraction: float = 0.1,
                 prior_var="flat", prior_on: str = "server", blocks=None, block_norm: str = "vector",
                 encoding: str = "auto", theta_star=None, seed: int = 0, output_dir: str = "outputs",
                 run_name: str = "", write: bool = True, keep_trace: bool = False, on_round=None,
                 metric: str = "identity", metric_from: str = "curvature", metric_rank: int = 0,
                 temperature: float = 1.0, init: str = "theta0", prior=None, heldout=None, **config):
        def joined(v):
            return ",".join(str(x) for x in v) if isinstance(v, (list, tuple, np.ndarray)) else v

        keys = {"task": "external", "num-clients": num_clients, "dim": dim, "variant": variant,
                "gamma": gamma, "num-rounds": num_rounds, "burn-in": burn_in, "thin": thin, "p": joined(p),
                "s": joined(s), "aggregation": aggregation, "l": l, "alpha": alpha,
                "batch-fraction": batch_fraction, "prior-var": prior_var, "prior-on": prior_on,
                "block-norm": block_norm, "encoding": encoding, "seed": seed, "output-dir": output_dir,
                "run-name": run_name, "theta-star": "optimise" if theta_star is None else "closed-form",
                "metric": metric, "metric-from": metric_from, "metric-rank": metric_rank, "temperature": temperature,
                "init": init, **{k.replace("_", "-"): v for k, v in config.items()}}
        if heldout is not None and str(keys.get("convergence-criterion", "auto")).strip().lower() == "auto":
            keys["convergence-criterion"] = "predictive"  # written to config.json: what the verdict read
        cfg = resolve(app_resume(keys))  # a resume: the app's values of the chain's keys give way to the run's
        task = build.external_task(cfg, blocks, theta_star, prior, prior_var, heldout)
        self._setup(cfg, task, write=write, keep_trace=keep_trace, on_round=on_round)

    @classmethod
    def from_config(cls, cfg: RunConfig, task: Task, run_dir=None, write: bool = True,
                    keep_trace: bool = False, on_round=None, engine_label: str = "flower",
                    failure_sink: dict | None = None) -> "QLSDStrategy":
        """The strategy of a validated run config (:func:`qlsd_flwr.config.resolve`) and its task
        (``d``, the prior, θ* when known; the clients' potentials are not used). ``run_dir``: the
        run folder (default ``<output-dir>/<run-name>``); ``write``: write it; ``keep_trace``: keep
        every ``θ_k`` in ``self.trace``; ``on_round(strategy)``: called after each round;
        ``engine_label``: recorded in the summary; ``failure_sink``: receives a
        ``DivergenceError`` under ``"error"``."""
        self = cls.__new__(cls)
        self._setup(cfg, task, run_dir, write, keep_trace, on_round, engine_label, failure_sink)
        return self

    def _setup(self, cfg: RunConfig, task: Task, run_dir=None, write: bool = True,
               keep_trace: bool = False, on_round=None, engine_label: str = "flower",
               failure_sink: dict | None = None) -> None:
        self.cfg, self.task, self.d = cfg, task, task.dim
        # one chain: QLSDServer; num-chains > 1: a ChainSet, one message per client for all its chains
        self.server = make_server(cfg, task, keep_trace, engine_label,
                                  observer=RunOutputs(cfg, task.dim, run_dir) if write else None)
        keys_dir = str(cfg.get("node-keys") or "")
        try:
            bound = load_bound_keys(keys_dir, cfg.b) if keys_dir else None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.nodes = NodeRegistry(cfg.b, task.dim, bound)
        self.failure_sink = failure_sink
        self.on_round = on_round  # called with the strategy after each round (tests, monitoring)
        self._warm = warmup_store(cfg) if write else None  # metric-from = adapt's warm-up state
        self._sent: dict[int, int] = {}  # node id -> client, this round
        self._settings_sent: set[int] = set()  # clients sent their settings (see configure_train)
        self._sent_ids: dict[str, int] = {}  # message id -> client (replies the SuperLink made)
        self._grid: Grid | None = None  # the real grid (node management talks to it directly)
        self._timeout = cfg.reply_timeout
        self._bar = None

    # the chain's facts, for callers and tests
    state = property(lambda self: self.server.state)
    trace = property(lambda self: self.server.trace)
    run_dir = property(lambda self: self.server.run_dir)
    summary_data = property(lambda self: self.server.summary_data)
    rejected = property(lambda self: self.server.rejected)
    missed_rounds = property(lambda self: self.server.missed_rounds)
    node_of = property(lambda self: self.nodes.node_of)
    rejoined = property(lambda self: self.nodes.rejoined)

    def summary(self) -> None:
        c = self.cfg
        log.info("QLSDStrategy variant=%s b=%d d=%d gamma=%g K=%d s=%s p=%s rule=%s", c.variant,
                 c.b, self.d, c.gamma, c.num_rounds, c.s.tolist(), c.p.tolist(), c.aggregation)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per active client ``i ∈ A_{k+1}``; a non-empty ``config`` (Flower's
        ``train_config``) travels beside the protocol's fields as the ``"config"`` record."""
        k = self.state.k
        self.nodes.rediscover(self._grid or grid, k + 1, self._timeout)
        self._sent = {}
        msgs = []
        theta = None if build.downlink_on(self.cfg) else Array(np.asarray(self.state.theta, dtype=np.float64))
        C = self.cfg.num_chains
        active = self.server.begin_round()
        resync = self.server.needs_resync  # once a round (a ChainSet combines its chains' flags)
        for i in active:
            node = self.nodes.node_of[i]
            # the client's settings go with the first message to each client and after a resync
            # (a node that lost its state answers resync): a record less per message otherwise
            first = i not in self._settings_sent or bool(resync[i])
            fields = self.server.fields_for(i)
            # the round's θ array when client i is active in every chain (downlink = qsgd: none, protocol.broadcast)
            shared = theta if len(fields.get("chains", ())) in (0, C) else None
            content = to_content(fields, self.server.settings[i] if first else None, shared)
            self._settings_sent.add(i)
            if config:
                content["config"] = config
            msgs.append(Message(content, node, MessageType.TRAIN, group_id=str(k + 1)))
            self.server.note_sent(i, message_nbytes(msgs[-1]))  # the downlink's Flower bytes (metrics.csv)
            self._sent[node] = i
        return msgs

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Hand each reply to the protocol, then take the server step. Returns ``θ_{k+1}``; the
        round's metrics go to ``metrics.csv`` (not into Flower's ``Result``, which would keep
        one record per round in memory for the whole run)."""
        for msg in replies:
            self.take_reply(msg)
        stopping.check()  # a stop from Flower ends the run between rounds
        self.server.end_round()
        if self._bar is not None:
            self._bar.update(1)
        if self.on_round is not None:
            self.on_round(self)
        return ArrayRecord({"theta": Array(np.asarray(self.state.theta))}), None

    def take_reply(self, msg: Message) -> None:
        """Hand one reply of this round to the protocol (validated, decoded or rejected)."""
        i = self._sent.get(msg.metadata.src_node_id)
        if i is None and msg.has_error():  # e.g. NODE_UNAVAILABLE, made by the SuperLink itself
            i = self._sent_ids.get(msg.metadata.reply_to_message_id)
        if msg.has_error():
            self.server.accept(i, None, error=str(msg.error.reason))
            return
        try:  # a record Flower cannot serialise (an integer beyond 2^64) is a malformed reply
            fields, nbytes = record_fields(msg.content), message_nbytes(msg)
        except Exception:  # noqa: BLE001 — a reply must never stop the server
            fields, nbytes = None, 0
        self.server.accept(i, fields, message_bytes=nbytes)

    def _note_sent(self, msgs: list[Message]) -> None:
        self._sent_ids = {m.metadata.message_id: self._sent[m.metadata.dst_node_id] for m in msgs
                          if m.metadata.message_id and m.metadata.dst_node_id in self._sent}

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []  # a posterior sampler has no client-side evaluation round

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    # ---- the run ------------------------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int | None = None,
              timeout: float | None = None, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None, evaluate_fn=None) -> Result:
        """Handshake, θ* phase, then Flower's round loop over the sampling rounds.

        ``initial_arrays``: ``θ_0`` (default: the task's); ``num_rounds``: ``K`` (default:
        ``num-rounds``); ``timeout``: seconds to wait for replies (default: ``reply-timeout``);
        ``train_config``: sent to the clients with every round's message; ``evaluate_fn(round,
        arrays)``: called by Flower before the first round and after each with the current
        ``θ`` (Flower counts the rounds of this start from 1: after a resume at round ``k_0``,
        its round ``r`` is the chain's ``θ_{k_0 + r}``).
        ``evaluate_config`` has no use here (there is no client-side evaluation round) and is
        refused. Returns Flower's ``Result`` with ``arrays`` = the last sample ``θ_K``.
        """
        try:
            return self._start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                               evaluate_fn)
        except (DivergenceError, KeyboardInterrupt) as exc:  # the outputs are closed (_start)
            stopping.hand_over(exc, self.failure_sink)

    def _start(self, grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
               evaluate_fn) -> Result:
        cfg = self.cfg
        if evaluate_config is not None and len(evaluate_config):
            raise ValueError("evaluate_config: QLSDStrategy has no client-side evaluation round; "
                             "evaluate θ_k on the server with evaluate_fn(round, arrays)")
        resuming = resume_dir(cfg) is not None
        if resuming and initial_arrays is not None:  # so that one ServerApp serves a run and its resume
            log.warning("initial_arrays ignored: a resumed run continues from its checkpoint's θ")
            initial_arrays = None
        theta0 = None if initial_arrays is None else theta_from_arrays(initial_arrays, self.d)
        if initial_arrays is not None and "param_labels" not in self.task.meta:  # samples.nc's names
            self.task.meta["param_labels"] = labels_from_arrays(initial_arrays)
        check_heldout(self, build.theta0_of(self.task) if theta0 is None else theta0)  # before any exchange
        self._timeout = cfg.reply_timeout if timeout is None else float(timeout)
        K = cfg.num_rounds if num_rounds is None else int(num_rounds)
        self._grid = grid
        with stopping.Stopper():  # flwr stop, SIGTERM or Ctrl-C in the handshake or the preparation: stop there
            self.nodes.handshake(grid, self._timeout)
            self.server.set_counts([self.nodes.n_data.get(i, 1) for i in range(cfg.b)], self.nodes.supports(cfg.b))
            ph = PhaseExchanges(cfg, self.task, self.nodes, self.server.settings)  # a bad reply: counted, asked again
            prep = claims = None
            if not resuming:  # resume: θ*, M and γ are in the checkpoint
                prep, claims = ph.prepare(grid, build.theta0_of(self.task) if theta0 is None else theta0,
                                          self._timeout, self._warm, self.server.wants_claims())
            if prep is None:
                self.server.begin(None, {}, theta0)
            else:
                self.server.begin(prep.theta_star, prep.info, theta0, prep)
                self.server.set_claims(claims)
                self.server.leave_out(ph.left_out, ph.rejected)
            self.cfg = cfg = self.server.cfg  # with the step the preparation chose (gamma = auto) or the checkpoint's
            saved = self.server.persist.get("rejoined", {})
            self.nodes.rejoined.update({int(i): list(r) for i, r in saved.items()})
            self.server.persist["rejoined"] = self.nodes.rejoined  # kept in the checkpoints
        if self.run_dir is not None:
            announce(f"{cfg.variant}: writing {Path(self.run_dir).resolve()}", cfg.progress)
        self._bar = progress_bar(K, cfg.progress, f"{cfg.variant} {self.server.engine_label}")
        self._bar.update(self.state.k)
        level = (flwr_log := logging.getLogger("flwr")).level
        if not cfg.verbose:  # Flower logs every round at INFO: the progress line replaces that
            flwr_log.setLevel(max(level, logging.WARNING))
        with stopping.Stopper():  # flwr stop / SIGTERM of Flower's process: stop here, close the outputs
            try:
                result = super().start(RepliesAsTheyArrive(grid, self._note_sent),
                                       ArrayRecord({"theta": Array(np.asarray(self.state.theta))}),
                                       num_rounds=max(K - self.state.k, 0), timeout=self._timeout,
                                       train_config=train_config, evaluate_fn=evaluate_fn)
            except BaseException as exc:  # Ctrl-C, SIGTERM, a failed grid: close the outputs so far
                self.server.stop(exc)
                raise
            finally:
                self._bar.close()
                flwr_log.setLevel(level)
        self.nodes.finish_run(self.server, grid, self._timeout)  # the memory audit, then the summary
        finish_run(self, grid)  # the LOO, the overview plot, the held-out evaluation (heldout)
        result.arrays = ArrayRecord({"theta": Array(np.asarray(self.state.theta))})
        return result
