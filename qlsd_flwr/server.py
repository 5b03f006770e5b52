"""The server's round protocol, with no Flower in it: who is asked, what they are sent, what
is accepted, and the bookkeeping. Flower strategies (Message API and legacy) only translate
between this and their message types.

A round ``k``:  ``begin_round(k)`` → the active clients;  ``fields_for(i)`` → what client ``i``
is sent;  ``accept(i, reply_fields, error, message_bytes)`` per reply;  ``end_round()`` → the
server step and the records.
"""

from __future__ import annotations

import logging
import time

import numpy as np

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

    # ---- set-up -------------------------------------------------------------------------
    def begin(self, theta_star: np.ndarray | None, ts_info: dict | None = None) -> None:
        cfg = self.cfg
        self.ts_info = ts_info or {}
        self.spec = C.server_spec(cfg, self.task, theta_star, self.blocks)
        self.state = sampler.init_state(self.spec, C.theta0_of(self.task))
        if self.write:
            self.run_dir = self.run_dir or make_run_dir(cfg.get("output-dir"), cfg.get("run-name"), cfg.variant)
            self.recorder = Recorder(self.run_dir, cfg.to_dict(), self.d, 1, cfg.burn_in, cfg.thin)

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
        if i is None or i not in self._active or i in self._answered:
            self._reject("unexpected_sender")
            return
        self._answered.add(i)
        if error is not None:
            self._reject("client_error")
            log.debug("client %d: error reply: %s", i, error)
            return
        try:
            rep = parse_fields(fields, i)
            if rep["status"] == "resync":
                self.needs_resync[i] = True
                self._count("resync")
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
        self._g_hat[i] = g
        self.anchor_acked[i] = rep["anchor_version"]
        self.needs_resync[i] = False
        if self.cfg.memory:
            self.eta_count[i] += 1
        r = self._row
        r["bits_bound"] += comp.bound_bits(self.d)
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
        facts = sampler.server_step(self.spec, self.state, self.cfg.seed, self._g_hat)
        row = {"round": k + 1, "n_active": len(self._active), "n_replied": len(self._g_hat),
               "skipped": int(facts["skipped"]), **self._row, "seconds": time.perf_counter() - self._t0}
        if self.keep_trace:
            self.trace.append(self.state.theta.copy())
        if self.recorder is not None:
            self.recorder.record_round(row)
            self.recorder.record_sample(k + 1, self.state.theta)
        return row

    def finish(self) -> dict:
        extra = summary_extra(self.cfg, self.task, {
            "engine": self.engine_label, **self.ts_info, "rejected": dict(self.rejected),
            "missed_rounds": {str(i): r for i, r in sorted(self.missed_rounds.items())}})
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
