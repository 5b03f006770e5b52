"""The server's round protocol, with no Flower in it: who is asked, what they are sent, what
is accepted, and the bookkeeping. Flower strategies (Message API and legacy) only translate
between this and their message types.

A round ``k``:  ``begin_round(k)`` → the active clients;  ``fields_for(i)`` → what client ``i``
is sent;  ``accept(i, reply_fields, error, message_bytes)`` per reply;  ``end_round()`` → the
server step and the records.

Reliability (:mod:`qlsd_flwr.checkpoint`): with ``checkpoint-every = N`` the server saves
``checkpoint.npz`` after every ``N``-th round; with ``resume = <run folder>`` :meth:`QLSDServer.begin`
restores the chain from it and marks every client as needing a resync, so that the first
message to each client after the restart carries the anchor and its ``η_i`` mirror (a client
whose state was lost computes the very reply it would have). A non-finite ``θ`` after a step
closes the outputs cleanly and raises :class:`~qlsd_flwr.checkpoint.DivergenceError` naming
the round and suggesting a smaller ``gamma``.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from . import checkpoint as ckpt
from . import components as C
from . import participation, sampler
from .compression import DecodeError
from .config import RunConfig
from .outputs import Recorder, make_run_dir
from .tasks.base import Task
from .wire import ReplyError, arr_to_bytes, parse_fields

log = logging.getLogger("qlsd_flwr")


class QLSDServer:
    """State and bookkeeping of one chain on the server side."""

    def __init__(self, cfg: RunConfig, task: Task, run_dir=None, write: bool = True,
                 keep_trace: bool = False, engine_label: str = "flower"):
        self.cfg, self.task, self.d = cfg, task, task.dim
        C.warn_if_unstable(cfg, task)
        self.blocks = C.blocks_for(cfg, task)
        self.compressors = [C.compressor_for(cfg, i, self.blocks) for i in range(cfg.b)]
        self.write, self.run_dir, self.keep_trace = write, run_dir, keep_trace
        self.engine_label = engine_label
        self.trace: list[np.ndarray] = []
        self.spec: sampler.ServerSpec | None = None
        self.state: sampler.ServerState | None = None
        self.recorder: Recorder | None = None
        self.anchor_acked = np.full(cfg.b, -2, dtype=np.int64)  # anchor version each client holds
        self.eta_count = np.zeros(cfg.b, dtype=np.int64)  # memory updates applied per client
        self.needs_resync = np.zeros(cfg.b, dtype=bool)
        self.rejected: dict[str, int] = {}
        self.missed_rounds: dict[int, list[int]] = {}
        self.ts_info: dict = {}
        self.summary_data: dict = {}
        self.persist: dict = {}  # JSON facts a front end keeps in the checkpoint (e.g. rejoined nodes)
        self.last_checkpoint: int | None = None  # round of the last checkpoint written or resumed
        self.resumed_from: int | None = None

    # ---- set-up -------------------------------------------------------------------------
    def begin(self, theta_star: np.ndarray | None, ts_info: dict | None = None) -> None:
        """Start the chain at ``θ_0``, or, with ``resume`` set, where its checkpoint left it
        (``theta_star`` and ``ts_info`` are then taken from the checkpoint)."""
        cfg = self.cfg
        if ckpt.resume_dir(cfg) is not None:
            self._resume()
            return
        self.ts_info = ts_info or {}
        self.spec = C.server_spec(cfg, self.task, theta_star, self.blocks)
        self.state = sampler.init_state(self.spec, C.theta0_of(self.task))
        if self.write:
            self.run_dir = self.run_dir or make_run_dir(cfg.get("output-dir"), cfg.get("run-name"), cfg.variant)
            self.recorder = Recorder(self.run_dir, cfg.to_dict(), self.d, 1, cfg.burn_in, cfg.thin,
                                     raw_draws=ckpt.enabled(cfg))

    # ---- checkpoints --------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Write ``checkpoint.npz`` (atomically) with the chain's whole state after round ``k``."""
        st = self.state
        rec_meta, rec_arrays = self.recorder.checkpoint_state()
        arrays = {"theta": st.theta, "zeta": st.zeta, "eta_i": st.eta_i, "eta": st.eta,
                  "theta_star": self.spec.theta_star, "anchor_acked": self.anchor_acked,
                  "eta_count": self.eta_count, "needs_resync": self.needs_resync,
                  **{f"rec_{k}": v for k, v in rec_arrays.items()}}
        meta = {"kind": "server", "k": int(st.k), "zeta_version": int(st.zeta_version),
                "config": self.cfg.raw, "rejected": self.rejected,
                "missed_rounds": {str(i): r for i, r in self.missed_rounds.items()},
                "ts_info": self.ts_info, "persist": self.persist, "recorder": rec_meta}
        ckpt.save(ckpt.path_in(self.run_dir), arrays, meta)
        self.last_checkpoint = int(st.k)

    def _resume(self) -> None:
        cfg = self.cfg
        run_dir, meta, a = ckpt.load_for_resume(cfg, "server")
        self.ts_info = dict(meta["ts_info"])
        theta_star = a.get("theta_star")
        self.spec = C.server_spec(cfg, self.task, None if theta_star is None else theta_star.copy(), self.blocks)
        st = sampler.init_state(self.spec, a["theta"])
        st.k = int(meta["k"])
        st.zeta_version = int(meta["zeta_version"])
        if "zeta" in a:
            st.zeta = a["zeta"].copy()
        if self.spec.memory:
            st.eta_i, st.eta = a["eta_i"].copy(), a["eta"].copy()
        self.state = st
        self.anchor_acked = a["anchor_acked"].astype(np.int64)
        self.eta_count = a["eta_count"].astype(np.int64)
        # the clients may have lost their state with the restart: the first message to each
        # carries the anchor and its η_i mirror (fields_for), so no round is lost to a resync
        self.needs_resync = np.ones(cfg.b, dtype=bool)
        self.rejected = dict(meta["rejected"])
        self.missed_rounds = {int(i): list(r) for i, r in meta["missed_rounds"].items()}
        self.persist = dict(meta.get("persist", {}))
        self.run_dir = run_dir
        self.last_checkpoint = self.resumed_from = st.k
        if self.write:
            self.recorder = Recorder(run_dir, cfg.to_dict(), self.d, 1, cfg.burn_in, cfg.thin,
                                     resume=ckpt.recorder_part(meta, a))
        log.info("resumed %s at round %d from its checkpoint", run_dir, st.k)

    def anchor(self):
        if self.cfg.oracle == "svrg":
            return self.state.zeta, self.state.zeta_version
        if self.cfg.oracle == "star":
            return self.spec.theta_star, 0
        return None, -1

    # ---- one round ----------------------------------------------------------------------
    def begin_round(self) -> list[int]:
        """Refresh the anchor and draw ``A_{k+1}``; returns the active client indices."""
        self._t0 = time.perf_counter()
        sampler.refresh_anchor(self.spec, self.state)
        self._active = [int(i) for i in np.flatnonzero(participation.active_mask(self.cfg.seed, self.state.k, self.cfg.p))]
        self._g_hat: dict[int, np.ndarray] = {}
        self._answered: set[int] = set()
        self._overflow: dict[int, str] = {}  # clients whose codec overflowed (θ running away)
        self._bounds: list[float] = []
        self._row = {"bits_bound": 0.0, "bits_exact": 0, "bytes_payload": 0, "bytes_message": 0, "n_rejected": 0}
        return list(self._active)

    def fields_for(self, i: int) -> dict:
        """What client ``i`` is sent this round (see :mod:`qlsd_flwr.wire`)."""
        st = self.state
        anchor, version = self.anchor()
        fields = {"phase": "sample", "round": st.k, "client": i, "theta": arr_to_bytes(st.theta),
                  "anchor_version": int(version), "eta_count": int(self.eta_count[i])}
        if anchor is not None and (self.anchor_acked[i] != version or self.needs_resync[i]):
            fields["anchor"] = arr_to_bytes(anchor)
        if self.cfg.memory and self.needs_resync[i]:
            fields["eta"] = arr_to_bytes(st.eta_i[i])
        return fields

    def accept(self, i: int | None, fields: dict | None, error: str | None = None, message_bytes: int = 0) -> None:
        """Take one reply: validate, decode, or reject and count it."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or int(i) not in self._active \
                or int(i) in self._answered:
            self._reject("unexpected_sender")
            return
        i = int(i)
        self._answered.add(i)
        if error is not None:
            if ckpt.is_overflow(error):
                self._overflow[i] = str(error)
            self._reject("client_error")
            log.debug("client %d: error reply: %s", i, error)
            return
        try:
            rep = parse_fields(fields, i)
            if rep["status"] == "resync":
                self.needs_resync[i] = True
                self._count("resync")
                return
            if self.cfg.oracle in ("svrg", "star") and rep["anchor_version"] != self.anchor()[1]:
                self._reject("stale_anchor")  # computed with another ζ/θ*: not this round's H_i
                return
            comp = self.compressors[i]
            q = comp.decode(rep["payload"], self.d)
            g = comp.dequantise(q)
            if not np.all(np.isfinite(g)):
                raise ReplyError("non-finite values")
        except (ReplyError, DecodeError) as exc:
            self._reject("malformed" if isinstance(exc, ReplyError) else "decode_error")
            log.debug("client %d: rejected reply: %s", i, exc)
            return
        except Exception as exc:  # noqa: BLE001 — a reply must never stop the server
            self._reject("malformed")
            log.warning("client %d: rejected a reply the validators missed: %s: %s", i, type(exc).__name__, exc)
            return
        self._g_hat[i] = g
        self.anchor_acked[i] = rep["anchor_version"]
        self.needs_resync[i] = False
        if self.cfg.memory:
            self.eta_count[i] += 1
        r = self._row
        self._bounds.append(comp.bound_bits(self.d))  # summed exactly (fsum) in end_round
        # the exact length of the code this client sent (the decoder counts what it read)
        r["bits_exact"] += q.code_bits if getattr(q, "code_bits", None) is not None else comp.code_length_bits(q)
        r["bytes_payload"] += len(rep["payload"])
        r["bytes_message"] += message_bytes

    def end_round(self) -> dict:
        """The server step for this round, and its records; returns the round's row."""
        k = self.state.k
        for i in set(self._active) - self._answered:
            self._reject("no_reply")
        for i in set(self._active) - set(self._g_hat):
            self.missed_rounds.setdefault(i, []).append(k + 1)
        if self._active and set(self._overflow) == set(self._active):
            # every active client's gradient overflowed its codec at θ_k: the chain has run away
            self._diverged(k + 1, "every active client's message overflows the codec "
                                  f"[{self._overflow[min(self._overflow)]}]")
        # replies arrive in any order: an exactly rounded sum keeps the row a function of the seed
        self._row["bits_bound"] = math.fsum(self._bounds)
        facts = sampler.server_step(self.spec, self.state, self.cfg.seed, self._g_hat)
        if not np.all(np.isfinite(self.state.theta)):
            self._diverged(k + 1)
        row = {"round": k + 1, "n_active": len(self._active), "n_replied": len(self._g_hat),
               "skipped": int(facts["skipped"]), **self._row, "seconds": time.perf_counter() - self._t0}
        if self.keep_trace:
            self.trace.append(self.state.theta.copy())
        if self.recorder is not None:
            self.recorder.record_round(row)
            self.recorder.record_sample(k + 1, self.state.theta)
            if ckpt.due(self.cfg, k + 1):
                self.save_checkpoint()
        return row

    def _diverged(self, round_: int, why: str = "θ is not finite") -> None:
        """Close the outputs (samples up to the last finite θ) and raise DivergenceError."""
        msg = ckpt.divergence_message(round_, self.cfg.gamma, self.run_dir if self.recorder else None,
                                      self.last_checkpoint, why=why)
        log.error(msg)
        if self.recorder is not None:
            self.ts_info = {**self.ts_info, "diverged_at_round": round_, "error": msg}
            self.finish()
            self.recorder = None
        raise ckpt.DivergenceError(msg)

    def finish(self) -> dict:
        extra = summary_extra(self.cfg, self.task, {
            "engine": self.engine_label, **self.ts_info, "rejected": dict(self.rejected),
            "missed_rounds": {str(i): r for i, r in sorted(self.missed_rounds.items())}})
        if self.resumed_from is not None:
            extra["resumed_from_round"] = self.resumed_from
        self.summary_data = self.recorder.close(extra) if self.recorder is not None else extra
        return self.summary_data

    # ---- helpers ------------------------------------------------------------------------
    def _reject(self, why: str) -> None:
        self._row["n_rejected"] += 1
        self._count(why)

    def _count(self, why: str) -> None:
        self.rejected[why] = self.rejected.get(why, 0) + 1


def summary_extra(cfg: RunConfig, task: Task, extra: dict) -> dict:
    """Facts every engine adds to its summary."""
    out = dict(extra)
    out.update({"variant": cfg.variant, "task": task.name, "b": cfg.b, "d": task.dim,
                "gamma": cfg.gamma, "num_rounds": cfg.num_rounds, "seed": cfg.seed})
    out.update(task.meta.get("summary_extra", {}))  # e.g. dataset, partition counts, prior used
    if task.posterior_mean is not None:
        out["posterior_mean_exact"] = np.asarray(task.posterior_mean).tolist()
        out["posterior_var_exact"] = np.asarray(task.posterior_var).tolist()
        # ULA with exact gradients on this Gaussian target has variance 1/(τ(1 − γτ/2)), τ = 1/var:
        # the discretisation bias every variant carries at this γ, before any gradient noise.
        v = np.asarray(task.posterior_var)
        out["ula_var_exact"] = (v / (1.0 - cfg.gamma / (2.0 * v))).tolist()
    return out
