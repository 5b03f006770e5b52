"""The server's round protocol, with no Flower in it: who is asked, what they are sent, what
is accepted, and the bookkeeping. Flower strategies (Message API and legacy) only translate.

A round ``k``:  ``begin_round(k)`` → the active clients;  ``fields_for(i)`` → what client ``i``
is sent;  ``accept(i, reply_fields, error, message_bytes)`` per reply;  ``end_round()`` → the
server step and the records.

It does no I/O. An optional *observer* (:class:`~qlsd_flwr.outputs.observer.RunOutputs`: the run
folder, the checkpoints) is told of each round and of the end, and on :meth:`QLSDServer.begin`
may hand back a checkpoint's :meth:`~QLSDServer.snapshot`: every client then needs a resync, so
the first message to each after the restart carries the anchor and its ``η_i`` mirror. A
non-finite ``θ`` after a step stops the observer cleanly and raises
:class:`~qlsd_flwr.protocol.divergence.DivergenceError`, naming the round."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque

import numpy as np

from qlsd_flwr.compression.format import DecodeError
from qlsd_flwr.config import ConfigError, RunConfig, check_memory
from qlsd_flwr.core import participation
from qlsd_flwr.core import server_step as sampler
from qlsd_flwr.core.metric import Identity
from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.protocol import broadcast, build, local_chains, memory_audit, metric_sent, precondition, snapshot
from qlsd_flwr.protocol.divergence import RUNAWAY_FACTOR, RUNAWAY_WINDOW, is_overflow, runaway_scale, runaway_why, stop_server
from qlsd_flwr.protocol.precondition import Prepared
from qlsd_flwr.robust.norm_guard import NormGuard
from qlsd_flwr.protocol.claims import ThetaStarClaims
from qlsd_flwr.protocol.wire import ReplyError, parse_fields, payload_bits
from qlsd_flwr.protocol.facts import summary_extra

log = logging.getLogger("qlsd_flwr")
#: a round's counts before its first message: uplink bits and bytes, rejections, downlink bits and bytes
_ROW = {"bits_bound": 0.0, "bits_exact": 0, "bytes_payload": 0, "bytes_message": 0, "n_rejected": 0, "bits_down": 0,
        "bytes_message_down": 0}


class QLSDServer:
    """State and bookkeeping of one chain on the server side.

    ``observer``: ``None`` (nothing is written), or an object with ``resume_snapshot()``,
    ``on_begin(server)``, ``on_round(server, row)``, ``on_stop(server, extra) -> summary`` and
    the attributes ``run_dir`` and ``last_checkpoint`` (see :mod:`qlsd_flwr.outputs.observer`).
    """

    def __init__(self, cfg: RunConfig, task: Task, keep_trace: bool = False,
                 engine_label: str = "flower", observer=None, warn: bool = True):
        self.cfg, self.task, self.d = cfg, task, task.dim
        if warn:  # a chain of a several-chain run (protocol.chains) leaves it to the first chain
            build.warn_if_unstable(cfg, task)
        self.blocks = build.blocks_for(cfg, task)
        self.compressors = [build.compressor_for(cfg, i, self.blocks) for i in range(cfg.b)]
        self.settings = [build.client_settings(cfg, i, self.d, task.prior, self.blocks) for i in range(cfg.b)]
        self.local = cfg.kind.local  # FALD, VR-FALD*, DG-LMC: local chains (protocol.local_chains)
        if self.local and not isinstance(task.prior, GaussianPrior):
            raise ConfigError(f"prior: {cfg.variant}'s clients share the prior in their local steps, and only a "
                              f"Gaussian prior's two numbers travel to them (got {type(task.prior).__name__})")
        self.norm_guard = NormGuard(cfg.raw.get("norm-bound", "auto"), cfg.b, task.n_data if task.clients else None,
                                    cfg.kind.measure)  # see _commit
        self._norm_warned: set[int] = set()
        self.keep_trace, self.engine_label, self.observer = keep_trace, engine_label, observer
        if keep_trace:  # the trace is the run's largest allocation: sized before the first round
            check_memory(cfg, task.dim, keep_trace=True)
        self.trace: list[np.ndarray] = []
        self.spec: sampler.ServerSpec | None = None
        self.state: sampler.ServerState | None = None
        self.anchor_acked = np.full(cfg.b, -2, dtype=np.int64)  # anchor version each client holds
        self.eta_count = np.zeros(cfg.b, dtype=np.int64)  # memory updates applied per client
        self.needs_resync = np.zeros(cfg.b, dtype=bool)
        self.rejected: dict[str, int] = {}
        self.missed_rounds: dict[int, list[int]] = {}
        self.ts_info: dict = {}
        self.summary_data: dict = {}
        self.persist: dict = {}  # JSON facts a front end keeps in the checkpoint (e.g. rejoined nodes)
        self.resumed_from: int | None = None
        self.claims: ThetaStarClaims | None = None  # QLSD*: the θ* phase's ∇U_i(θ*), held to the replies

    run_dir = property(lambda self: None if self.observer is None else self.observer.run_dir)

    # ---- set-up -------------------------------------------------------------------------
    def begin(self, theta_star: np.ndarray | None, ts_info: dict | None = None,
              theta0: np.ndarray | None = None, prep: Prepared | None = None) -> None:
        """Start the chain at ``θ_0`` (the task's unless given), or where the observer's checkpoint
        left it (``theta_star``, ``ts_info``, the metric and ``γ`` are then the checkpoint's).
        ``prep``: what :func:`qlsd_flwr.protocol.precondition.prepare` settled (metric, ``γ``)."""
        snap = snapshot.resume_snapshot(self.cfg, self.observer)
        if snap is not None:
            self.restore(*snap)
        else:
            self.start_chain(theta_star, ts_info, theta0, prep)
        if self.observer is not None:
            self.observer.on_begin(self)

    def start_chain(self, theta_star: np.ndarray | None, ts_info: dict | None = None,
                    theta0: np.ndarray | None = None, prep: Prepared | None = None) -> None:
        """The chain at ``θ_0`` (the task's unless given), round 0."""
        self.ts_info = ts_info or {}
        metric = Identity()
        if prep is not None:
            self.cfg = precondition.apply(self.cfg, prep)
            metric = prep.metric
            if prep.theta0 is not None:  # init = dispersed: this chain's own start
                theta0 = prep.theta0[0]
        self.spec = build.server_spec(self.cfg, self.task, theta_star, self.blocks, metric)
        self.state = sampler.init_state(self.spec, build.theta0_of(self.task) if theta0 is None else theta0)
        if self.local:  # DG-LMC's z_i start at the chain's θ_0; FSGLD's surrogates (protocol.local_chains)
            local_chains.start(self, prep)
        elif metric_sent.wanted(self):  # compression-basis = metric, block: the clients quantise Sᵀ H_i, B H_i
            metric_sent.setup(self, holders=prep.info.get("block_clients", ()) if prep is not None else ())
        broadcast.setup(self)  # downlink = qsgd (protocol.broadcast)
        self._set_scale()

    def wants_claims(self) -> bool:
        """QLSD*/LSD*, unless norm-bound = off (no defence at all): every client's ∇U_i(θ*) is asked."""
        return (self.cfg.kind.cv_theta_star and self.norm_guard.mode != "off") or self.cfg.kind.at_theta_star

    def set_claims(self, grads) -> None:
        """Every client's ``∇U_i(θ*)`` (``None``: not asked), what its reply to θ* must repeat and what
        the step adds back once a client is excluded (:mod:`qlsd_flwr.protocol.claims`)."""
        if grads is not None:
            ts = self.spec.theta_star
            self.claims = ThetaStarClaims(np.stack(grads), build.combine_grads(self.cfg, self.task.prior, grads, ts))

    def leave_out(self, clients, rejected: int = 0) -> None:
        """Clients left out before sampling (:mod:`qlsd_flwr.flower.phases`), and its refused replies."""
        self.norm_guard.excluded.update({int(i): 0 for i in clients})
        self.rejected.update({"phase_reply": self.rejected.get("phase_reply", 0) + rejected} if rejected else {})
        self._set_offset()

    def _set_offset(self) -> None:
        if self.claims is not None:  # QLSD* without the excluded clients' terms (protocol.claims)
            self.spec = dataclasses.replace(self.spec, offset=self.claims.offset(self.norm_guard.excluded))

    # ---- checkpoints: the state as plain arrays and JSON ------------------------------------
    def snapshot(self) -> tuple[dict, dict]:
        """``(arrays, meta)``: the state after round ``k`` (:func:`qlsd_flwr.protocol.snapshot.snapshot`)."""
        return snapshot.snapshot(self)

    def restore(self, meta: dict, a: dict) -> None:
        """A :meth:`snapshot`'s state; every client then needs a resync (:func:`.snapshot.restore`)."""
        snapshot.restore(self, meta, a)

    def anchor(self):
        kind = self.cfg.kind
        if kind.cv_zeta:
            return self.state.zeta, self.state.zeta_version
        if kind.cv_theta_star:
            return self.spec.theta_star, 0
        if kind.at_theta_star:  # ∇U(θ*) changes when a client leaves: a new version
            return self.spec.theta_star, getattr(self, "_star_version", len(self.norm_guard.excluded))
        return None, -1

    # ---- one round ----------------------------------------------------------------------
    def begin_round(self) -> list[int]:
        """Refresh the anchor and draw ``A_{k+1}``; returns the active client indices."""
        self._t0 = time.perf_counter()
        broadcast.begin_round(self)  # downlink = qsgd: w_k and its code, from θ_k
        if sampler.refresh_anchor(self.spec, self.state):
            broadcast.refreshed(self)  # the anchor is w_k, where the clients evaluate
        # the participation draw is the same with or without exclusions (a function of seed and k)
        self._active = [int(i) for i in np.flatnonzero(participation.active_mask(self.cfg.seed, self.state.k, self.cfg.p))
                        if int(i) not in self.norm_guard.excluded]
        self._g_hat: dict[int, np.ndarray] = {}
        self._pending: dict[int, tuple] = {}  # valid replies, committed at end_round after the norm check
        self._answered: set[int] = set()
        self._overflow: dict[int, str] = {}  # clients whose codec overflowed (θ running away)
        self._bounds: list[float] = []
        self._anchor_sent: set[int] = set()  # clients sent θ* this round (their reply repeats ∇U_i(θ*))
        if self.local:  # FALD's shares, DG-LMC's couplings (protocol.local_chains)
            local_chains.begin_round(self)
        self._row = dict(_ROW)
        return list(self._active)

    def fields_for(self, i: int) -> dict:
        """What client ``i`` is sent this round (:mod:`.wire`); its settings go beside (``self.settings[i]``)."""
        st = self.state
        anchor, version = self.anchor()
        fields = {"phase": "sample", "round": st.k, "client": i, "theta": st.theta,
                  "anchor_version": int(version), "eta_count": int(self.eta_count[i])}
        if anchor is not None and (self.anchor_acked[i] != version or self.needs_resync[i]):
            fields["anchor"] = anchor
            self._anchor_sent.add(i)
        if self.cfg.memory and self.needs_resync[i]:
            fields["eta"] = st.eta_i[i]
        if self.local:
            local_chains.add_fields(self, i, fields)
        else:
            metric_sent.add(self, i, fields)
        broadcast.add(self, i, fields)  # downlink = qsgd: the code in θ's place
        self._row["bits_down"] += payload_bits(fields)  # the downlink's code length (metrics.csv)
        return fields

    def note_sent(self, i: int, message_bytes: int) -> None:
        """The size of the Flower message that carried client ``i``'s fields this round."""
        self._row["bytes_message_down"] += int(message_bytes)

    def accept(self, i: int | None, fields: dict | None, error: str | None = None, message_bytes: int = 0) -> None:
        """Take one reply: validate, decode, or reject and count it."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or int(i) not in self._active \
                or int(i) in self._answered:
            self._reject("unexpected_sender")
            return
        i = int(i)
        self._answered.add(i)
        if error is not None:
            broadcast.answered(self, i, False)
            if is_overflow(error):
                self._overflow[i] = str(error)
            self._reject("client_error")
            log.debug("client %d: error reply: %s", i, error)
            return
        try:
            rep = parse_fields(fields, i, self.cfg.kind.up)
            broadcast.answered(self, i, rep["status"] == "ok")  # it built w_k, or is sent it in full next
            if rep["status"] == "resync":
                self.needs_resync[i] = True
                self._count("resync")
                return
            # a version other than the round's (−1 without an anchor): a reply computed with another
            # ζ/θ* (not this round's H_i) or a forged value (2^63 would not fit anchor_acked)
            if rep["anchor_version"] != self.anchor()[1]:
                self._reject("stale_anchor")
                return
            if self.claims is not None and i in self._anchor_sent and self.claims.broken(i, rep, self.state.k + 1):
                self._reject("theta_star_mismatch")  # it lied in the θ* phase or lies now: it leaves
                self.norm_guard.excluded[i] = int(self.state.k) + 1
                self._set_offset()
                return
            comp = self.compressors[i]
            q = comp.decode(rep["payload"], self.d)
            g = comp.dequantise(q)
            if not np.all(np.isfinite(g)):
                raise ReplyError("non-finite values")
            # everything the reply adds to the round, computed before any state changes
            bound = comp.bound_bits(self.d)
            bits = q.code_bits if getattr(q, "code_bits", None) is not None else comp.code_length_bits(q)
            if self.local:  # VR-FALD*'s refresh round: its ∇U_i(θ_k) too (protocol.local_chains)
                local_chains.check_reply(self, i, rep)
        except (ReplyError, DecodeError) as exc:
            self._reject("malformed" if isinstance(exc, ReplyError) else "decode_error")
            log.debug("client %d: rejected reply: %s", i, exc)
            return
        except Exception as exc:  # noqa: BLE001 — a reply must never stop the server
            self._reject("malformed")
            log.warning("client %d: rejected a reply the validators missed: %s: %s", i, type(exc).__name__, exc)
            return
        self._pending[i] = (g, rep["anchor_version"], bound, bits, len(rep["payload"]), message_bytes)

    def _commit(self) -> None:
        """This round's valid replies judged by the bounded-influence rule
        (:mod:`qlsd_flwr.robust.norm_guard`) become the round's ``ĝ_i``, in client order; those
        it refuses are rejected (``norm_bound``, or ``excluded`` for a client whose replies are
        steadily out of scale: it is not asked again and its ``η_i`` mirror leaves ``η``) and leave
        no other trace. The clients' own η_i then differ from the mirrors for the rejected ones,
        which the counters catch (a ``resync`` next time)."""
        # what a reply makes of client i's gradient estimate: ĝ_i itself, η_i + ĝ_i with memory, c_i + ĝ_i
        # for QLSD* (differences, whose norms span orders of magnitude; with c_i a lie told everywhere is seen)
        base = self.state.eta_i if self.spec.memory else self.claims.base(self.spec) if self.claims is not None else None
        given = None  # FSGLD: the server's prediction of an honest reply's scale (protocol.local_chains)
        if self.local:  # FALD's w_i Δ_i, DG-LMC's pull on θ, FSGLD's f_s Δ_s
            norms, given = local_chains.reply_norms(self, self._pending)
        else:
            norms = {i: float(np.linalg.norm(p[0] if base is None else base[i] + p[0])) for i, p in self._pending.items()}
        refused, newly = self.norm_guard.judge(norms, self.state.k + 1, given)
        for i in newly:
            self._exclude(i, norms)
        self._round_norms = {}
        for i in sorted(self._pending):
            g, version, bound, bits, nbytes, mbytes = self._pending[i]
            if i in refused:
                self._reject(refused[i])
                # the client applied its own memory update: mark it as out of step now, as a
                # restored server would, so that a resumed run takes the very same path
                self.needs_resync[i] = True
                # the first time a client is held off is news; every round after, a count
                level = logging.DEBUG if i in self._norm_warned else logging.WARNING
                self._norm_warned.add(i)
                if refused[i] == "norm_bound":
                    log.log(level, "client %d: reply norm %.3g over the limit %.3g (norm-bound): rejected "
                            "(counted in summary.json 'rejected')", i, norms[i], self.norm_guard.limit_of(i, norms, given))
                continue
            self._g_hat[i] = g
            self._round_norms[i] = norms[i]
            self.anchor_acked[i] = version
            self.needs_resync[i] = False
            if self.cfg.memory:
                self.eta_count[i] += 1
            r = self._row
            self._bounds.append(bound)  # summed exactly (fsum) in end_round
            r["bits_exact"] += bits  # the exact length of the code this client sent (the decoder counts what it read)
            r["bytes_payload"] += nbytes
            r["bytes_message"] += mbytes
        self._pending = {}

    def _exclude(self, i: int, norms: dict) -> None:
        """Client ``i``'s replies are steadily out of scale: it leaves the federation for the rest of
        the run (its memory mirror with it), and the log and ``summary.json`` say so."""
        st = self.state
        if self.spec.memory:
            st.eta_i[i] = 0.0
            st.eta = st.eta_i.sum(axis=-2)
        log.warning("client %d: excluded from round %d on: its replies are steadily out of the federation's scale "
                    "per datum (norm-bound = auto, docs/DEPLOYMENT.md; last %.3g); the chain now samples the "
                    "posterior of the other clients' data (summary.json 'excluded')", i, st.k + 1, norms[i])
        self._set_offset()

    def end_round(self) -> dict:
        """The server step for this round, and its records; returns the round's row."""
        k = self.state.k
        self._commit()
        for i in set(self._active) - self._answered:
            self._reject("no_reply")
        for i in set(self._active) - set(self._g_hat):
            self.missed_rounds.setdefault(i, []).append(k + 1)
        if (stalled := self.norm_guard.storm()) is not None:  # most replies refused: the chain stands still
            stop_server(self, k + 1, stalled, stalled=True)
        if self._active and set(self._overflow) == set(self._active):
            # every active client's gradient overflowed its codec at θ_k: the chain has run away
            self._diverged(k + 1, "every active client's message overflows the codec "
                                  f"[{self._overflow[min(self._overflow)]}]")
        # replies arrive in any order: an exactly rounded sum keeps the row a function of the seed
        self._row["bits_bound"] = math.fsum(self._bounds)
        g_hat, replied = sampler.stack_replies(self._g_hat, self.cfg.b, self.d)
        if self.local:  # DG-LMC: a client excluded this round leaves θ | z now (protocol.local_chains)
            local_chains.before_step(self)
        skipped = bool(sampler.server_step(self.spec, self.state, self.cfg.seed, g_hat, replied))
        if not np.all(np.isfinite(self.state.theta)):
            self._diverged(k + 1)
        self._recent.append(self._round_norms)
        self._check_runaway(k + 1)
        row = {"round": k + 1, "n_active": len(self._active), "n_replied": len(self._g_hat),
               "skipped": int(skipped), **self._row, "seconds": time.perf_counter() - self._t0}
        if self.keep_trace:
            self.trace.append(self.state.theta.copy())
        if self.observer is not None:
            self.observer.on_round(self, row)
        return row

    def _set_scale(self, scale: float | None = None) -> None:
        """The scale θ may reach (:func:`runaway_scale` of the start, unless given); the recent reply norms."""
        start = (self.task, self.state.theta, self.spec.theta_star, self.spec.metric)
        self._scale = scale if scale is not None else runaway_scale(*start)
        self._recent: deque = deque(maxlen=RUNAWAY_WINDOW)

    def _check_runaway(self, round_: int) -> None:
        """A finite θ far beyond every scale the run knows stops the run, naming the clients whose replies
        dominated the last rounds (an attacker inside the norm bound, or a p so small one reply throws θ)."""
        size = float(np.linalg.norm(self.state.theta))
        if size <= RUNAWAY_FACTOR * self._scale or self.norm_guard.mode == "off":
            return
        self._diverged(round_, runaway_why(size, self._scale, self._recent))

    def _diverged(self, round_: int, why: str = "θ is not finite") -> None:
        stop_server(self, round_, why, build.stable_gamma(self.task, self.ts_info))  # raises DivergenceError

    def stop(self, why: BaseException | str) -> None:
        """Close the outputs of a run stopped before its end (Ctrl-C, SIGTERM, an error): the folder holds every
        draw and round so far (``summary.json`` with ``stopped``). Does nothing once the outputs are closed."""
        if self.observer is None or getattr(self.observer, "recorder", None) is None:
            return
        reason = f"{type(why).__name__}: {why}".rstrip(": ") if isinstance(why, BaseException) else str(why)
        k = int(self.state.k) if self.state is not None else 0
        self.ts_info = {**self.ts_info, "stopped": reason, "stopped_at_round": k}
        self.finish()

    def finish(self) -> dict:
        """The run's summary facts; the observer closes its outputs with them."""
        extra = summary_extra(self.cfg, self.task, {
            "engine": self.engine_label, **self.ts_info, "rejected": dict(self.rejected),
            "missed_rounds": {str(i): r for i, r in sorted(self.missed_rounds.items())}})
        if self.norm_guard.excluded:
            extra["excluded"] = {str(i): k for i, k in sorted(self.norm_guard.excluded.items())}
        if self.resumed_from is not None:
            extra["resumed_from_round"] = self.resumed_from
        self.summary_data = self.observer.on_stop(self, extra) if self.observer is not None else extra
        return self.summary_data

    def set_counts(self, n_data, support=None) -> None:
        """The clients' handshake facts: ``N_i`` (their claims), the scale of the bounded-influence rule
        (:mod:`qlsd_flwr.robust.norm_guard`), and their supports, the broadcast's (:func:`.broadcast.set_support`)."""
        self.norm_guard.set_counts(n_data)
        broadcast.set_support(self, support)

    def memory_check(self, reports: dict[int, tuple[np.ndarray, int]]) -> dict:
        """The clients' own ``(η_i, update count)`` against the mirrors (:func:`.memory_audit.memory_check`)."""
        return memory_audit.memory_check(self.state, self.needs_resync, self.eta_count, reports)

    def _reject(self, why: str) -> None:
        self._row["n_rejected"] += 1
        self._count(why)

    def _count(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1
