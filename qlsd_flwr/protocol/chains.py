"""Several chains in one run of the round protocol (``num-chains = C > 1`` on the Flower engines).

Chain ``c`` is a :class:`~qlsd_flwr.protocol.server.QLSDServer` of its own whose every random
draw (participation, minibatches, dither, noise) comes from seed ``seed + c``: it is the chain a
one-chain run with seed ``seed + c`` gives, and chain ``c`` of the vectorised engine, bit for
bit. :class:`ChainSet` serves the ``C`` chains through one message per client and round:

* **participation is drawn per chain** (``(seed + c, PARTICIPATION, k, i)``): client ``i`` is
  sent a message when it is active in at least one chain, carrying ``θ`` of those chains only,
  and answers each with its own compressed message. Shared participation (one draw a client and
  round for every chain) would save messages when ``p < 1``, but it ties the chains together:
  they would miss the same clients' data in the same rounds, so their errors are correlated and
  R-hat and ESS, which assume independent chains, would read too well; and chain ``c`` would no
  longer be the chain a one-chain run (or the vectorised engine) gives. At ``p = 1`` the two
  are the same.
* every chain's reply is validated, decoded, norm-checked and counted on its own (its
  ``rejected`` counts, its ``needs_resync``, its memory mirrors); a reply that does not answer
  the chains asked is rejected for each of them;
* the run folder holds all chains (``samples.nc`` with ``chain = 0..C-1``; a ``metrics.csv``
  row is the round's totals over the chains, as on the vectorised engine); a checkpoint holds
  every chain's :meth:`QLSDServer.snapshot` (keys ``c<c>.<name>``) and resumes bit for bit.

The Flower strategy talks to a :class:`ChainSet` exactly as to a :class:`QLSDServer`
(:func:`make_server` picks one).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from qlsd_flwr.config import RunConfig, check_memory
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.divergence import DivergenceError, divergence_message, saved_where
from qlsd_flwr.protocol.facts import summary_extra
from qlsd_flwr.protocol.server import QLSDServer
from qlsd_flwr.protocol.snapshot import resume_snapshot
from qlsd_flwr.protocol import precondition
from qlsd_flwr.protocol.wire import bundle_request, unbundle_reply

log = logging.getLogger("qlsd_flwr")

# the fields of a round's row that add up over the chains
_SUMMED = ("n_active", "n_replied", "skipped", "n_rejected", "bits_exact", "bytes_payload", "bytes_message",
           "bits_down", "bytes_message_down")


def make_server(cfg: RunConfig, task: Task, keep_trace: bool = False, engine_label: str = "flower",
                observer=None):
    """A :class:`QLSDServer` for one chain, a :class:`ChainSet` for ``num-chains > 1``."""
    if cfg.num_chains > 1:
        return ChainSet(cfg, task, keep_trace, engine_label, observer)
    return QLSDServer(cfg, task, keep_trace, engine_label, observer)


def chain_config(cfg: RunConfig, c: int) -> RunConfig:
    """Chain ``c``'s configuration: seed ``seed + c``, one chain (``raw`` keeps the run's keys)."""
    return dataclasses.replace(cfg, seed=int(cfg.seed) + int(c), num_chains=1)


@dataclasses.dataclass
class _Stacked:
    """The chains' state as the observer and the strategy read it: ``k`` and ``θ`` ``(C, d)``."""

    chains: list

    @property
    def k(self) -> int:
        return int(self.chains[0].state.k)

    @property
    def theta(self) -> np.ndarray:
        return np.stack([ch.state.theta for ch in self.chains])


class ChainSet:
    """``C`` chains of one run, served together (see the module docstring)."""

    def __init__(self, cfg: RunConfig, task: Task, keep_trace: bool = False, engine_label: str = "flower",
                 observer=None, warn: bool = True):
        self.cfg, self.task, self.d = cfg, task, task.dim
        self.C = int(cfg.num_chains)
        self.chains = [QLSDServer(chain_config(cfg, c), task, False, engine_label, None, warn=warn and c == 0)
                       for c in range(self.C)]
        self.settings = self.chains[0].settings  # seed = the run's; the client adds c for chain c
        self.keep_trace, self.engine_label, self.observer = keep_trace, engine_label, observer
        if keep_trace:  # the trace is the run's largest allocation: sized before the first round
            check_memory(cfg, task.dim, keep_trace=True)
        self.trace: list[np.ndarray] = []
        self.unattributed: dict[str, int] = {}  # rejections no chain can be charged with
        self.ts_info: dict = {}
        self.summary_data: dict = {}
        self.persist: dict = {}
        self.resumed_from: int | None = None
        self._asked: dict[int, list[int]] = {}

    def wants_claims(self) -> bool:
        return self.chains[0].wants_claims()

    def set_claims(self, grads) -> None:
        """:meth:`QLSDServer.set_claims` for every chain (θ* is the run's)."""
        for ch in self.chains:
            ch.set_claims(grads)

    def leave_out(self, clients, rejected: int = 0) -> None:
        """:meth:`QLSDServer.leave_out` for every chain; the refused replies counted once."""
        for ch in self.chains:
            ch.leave_out(clients)
        if rejected:
            self.unattributed["phase_reply"] = self.unattributed.get("phase_reply", 0) + int(rejected)

    # ---- what the strategy and the observer read ---------------------------------------------
    @property
    def state(self) -> _Stacked | None:
        return None if self.chains[0].state is None else _Stacked(self.chains)

    @property
    def run_dir(self):
        return None if self.observer is None else self.observer.run_dir

    @property
    def needs_resync(self) -> np.ndarray:
        """Per client: whether any chain holds it out of step (its settings then go again)."""
        return np.any([ch.needs_resync for ch in self.chains], axis=0)

    @property
    def rejected(self) -> dict[str, int]:
        out = dict(self.unattributed)
        for ch in self.chains:
            for why, n in ch.rejected.items():
                out[why] = out.get(why, 0) + n
        return out

    @property
    def missed_rounds(self) -> dict[int, dict[int, list[int]]]:
        """``{chain: {client: rounds}}``: the rounds each client's reply was missing from a chain."""
        return {c: dict(ch.missed_rounds) for c, ch in enumerate(self.chains) if ch.missed_rounds}

    # ---- set-up and checkpoints ----------------------------------------------------------
    def begin(self, theta_star: np.ndarray | None, ts_info: dict | None = None,
              theta0: np.ndarray | None = None, prep=None) -> None:
        """Every chain at ``θ_0`` (chain ``c`` at ``prep.theta0[c]`` with ``init = dispersed``), or
        where the observer's checkpoint left them."""
        snap = resume_snapshot(self.cfg, self.observer)
        if snap is not None:
            self.restore(*snap)
        else:
            self.ts_info = ts_info or {}
            for c, ch in enumerate(self.chains):
                ch.start_chain(theta_star, ts_info, theta0, None if prep is None else prep.for_chain(c))
            if prep is not None:
                self.cfg = precondition.apply(self.cfg, prep)
        if self.observer is not None:
            self.observer.on_begin(self)

    def snapshot(self) -> tuple[dict, dict]:
        """Every chain's :meth:`QLSDServer.snapshot`, its arrays under ``c<c>.<name>``."""
        arrays, metas = {}, []
        for c, ch in enumerate(self.chains):
            chain_arrays, chain_meta = ch.snapshot()
            arrays.update({f"c{c}.{k}": v for k, v in chain_arrays.items()})
            metas.append({k: chain_meta[k] for k in ("k", "zeta_version", "gamma", "rejected", "missed_rounds", "guard",
                                                   "runaway_scale")})
        meta = {"kind": "server", "k": self.state.k, "chains": self.C, "chain_meta": metas,
                "zeta_version": metas[0]["zeta_version"], "config": self.cfg.raw,
                "rejected": dict(self.unattributed), "missed_rounds": {}, "ts_info": self.ts_info,
                "persist": self.persist}
        return arrays, meta

    def restore(self, meta: dict, arrays: dict) -> None:
        for c, ch in enumerate(self.chains):
            sub = {k[len(f"c{c}."):]: v for k, v in arrays.items() if k.startswith(f"c{c}.")}
            ch.restore({**meta["chain_meta"][c], "ts_info": meta["ts_info"], "persist": {}}, sub)
        self.ts_info = dict(meta["ts_info"])
        self.cfg = dataclasses.replace(self.cfg, gamma=self.chains[0].cfg.gamma)  # the checkpoint's γ
        self.unattributed = dict(meta["rejected"])
        self.persist = dict(meta.get("persist", {}))
        self.resumed_from = self.state.k

    # ---- one round ----------------------------------------------------------------------
    def begin_round(self) -> list[int]:
        """Each chain draws its own active set; returns the clients active in any chain."""
        self._t0 = time.perf_counter()
        self._asked = {}
        for c, ch in enumerate(self.chains):
            for i in ch.begin_round():
                self._asked.setdefault(i, []).append(c)
        self._answered: set[int] = set()
        self._n_unattributed = 0
        self._shared_down = 0  # bits the chains counted twice in one message (the run's metric: fields_for)
        self._theta = self.state.theta  # (C, d), once a round: every message's θ rows come from it
        return sorted(self._asked)

    def fields_for(self, i: int) -> dict:
        """Client ``i``'s message: its active chains' fields in one (``wire.bundle_request``)."""
        asked = self._asked[i]
        # downlink = qsgd: each chain's fields carry its w_k or its code, not θ_k (protocol.broadcast)
        theta = None if self.chains[0].downlink is not None else self._theta if len(asked) == self.C \
            else self._theta[asked]
        per = {c: self.chains[c].fields_for(i) for c in asked}
        # the run's metric and the broadcast's support go once a message whatever the chains that carry them
        # (wire.bundle_request): each chain counted them, so the round's downlink takes the others' copies off (end_round)
        for name in ("metric", "theta_support"):
            carried = [c for c in asked if name in per[c]]
            if not carried:
                continue
            # chains that differ (the basis by reference to one, whole to another after its resync: metric_sent)
            # are all sent the whole one
            sent = max((per[c][name] for c in carried), key=len)
            self._shared_down += sum(8 * len(per[c][name]) for c in carried) - 8 * len(sent)
            for c in carried:
                per[c][name] = sent
        return bundle_request(per, theta)

    def note_sent(self, i: int, message_bytes: int) -> None:
        """The Flower message to client ``i``, its bytes shared out over the chains it carried (as a reply's)."""
        asked = self._asked[i]
        share, rest = divmod(int(message_bytes), len(asked))
        for j, c in enumerate(asked):
            self.chains[c].note_sent(i, share + (rest if j == 0 else 0))

    def accept(self, i: int | None, fields: dict | None, error: str | None = None, message_bytes: int = 0) -> None:
        """One client's reply: each chain it answers takes its part (validated on its own)."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool) or int(i) not in self._asked \
                or int(i) in self._answered:
            self.unattributed["unexpected_sender"] = self.unattributed.get("unexpected_sender", 0) + 1
            self._n_unattributed += 1
            return
        i = int(i)
        self._answered.add(i)
        asked = self._asked[i]
        if error is not None:
            for c in asked:
                self.chains[c].accept(i, None, error=error)
            return
        try:
            parts = unbundle_reply(fields, asked, self.cfg.kind.up)
        except Exception as exc:  # noqa: BLE001 — ReplyError, or a record no validator foresaw
            log.debug("client %d: rejected reply: %s", i, exc)
            parts = {c: None for c in asked}  # each chain counts it malformed
        # the message's bytes shared out over its chains (the remainder to the first), so the
        # totals over the chains are the bytes that travelled
        share, rest = divmod(int(message_bytes), len(asked))
        for j, c in enumerate(asked):
            self.chains[c].accept(i, parts[c], message_bytes=share + (rest if j == 0 else 0))

    def end_round(self) -> dict:
        """Every chain's server step; the round's row is the totals over the chains."""
        k = self.state.k
        rows = []
        for c, ch in enumerate(self.chains):
            try:
                rows.append(ch.end_round())
            except DivergenceError as exc:
                self._diverged(k + 1, c, exc)
        row = {"round": k + 1, **{f: sum(r[f] for r in rows) for f in _SUMMED},
               "bits_bound": float(np.sum([r["bits_bound"] for r in rows])),
               "seconds": time.perf_counter() - self._t0}
        row["n_rejected"] += self._n_unattributed
        row["bits_down"] -= self._shared_down
        if self.keep_trace:
            self.trace.append(self.state.theta)
        if self.observer is not None:
            self.observer.on_round(self, row)
        return row

    def _diverged(self, round_: int, c: int, exc: DivergenceError) -> None:
        obs = self.observer
        run_dir, last = (obs.run_dir, obs.last_checkpoint) if obs is not None else (None, None)
        why = getattr(exc, "why", "θ is not finite")
        if getattr(exc, "stalled", False):  # not run away: most replies refused, the chain stands still
            msg = (f"the run stopped at round {round_} in chain {c} (seed {int(self.cfg.seed) + c}): {why}."
                   + saved_where(round_, run_dir, last))
        else:
            msg = divergence_message(round_, self.cfg.gamma, run_dir, last,
                                     where=f" in chain {c} (seed {int(self.cfg.seed) + c})",
                                     why=why, stable=build.stable_gamma(self.task, self.ts_info))
        log.error(msg)
        if obs is not None:
            self.ts_info = {**self.ts_info, "diverged_at_round": round_, "diverged_chain": c, "error": msg}
            self.finish()
        raise DivergenceError(msg) from None

    def stop(self, why: BaseException | str) -> None:
        """As :meth:`QLSDServer.stop`: close the outputs of a run stopped before its end."""
        if self.observer is None or getattr(self.observer, "recorder", None) is None:
            return
        reason = f"{type(why).__name__}: {why}".rstrip(": ") if isinstance(why, BaseException) else str(why)
        k = self.state.k if self.state is not None else 0
        self.ts_info = {**self.ts_info, "stopped": reason, "stopped_at_round": k}
        self.finish()

    def facts(self) -> dict:
        """What the chains' servers counted, for the summary: rejections (all, and per chain), missed
        rounds and, when any, the excluded clients (per chain: client → round)."""
        out = {"rejected": self.rejected, "rejected_per_chain": [dict(ch.rejected) for ch in self.chains],
               "missed_rounds": {str(c): {str(i): r for i, r in sorted(m.items())}
                                 for c, m in self.missed_rounds.items()}}
        excluded = {str(c): {str(i): k for i, k in sorted(ch.norm_guard.excluded.items())}
                    for c, ch in enumerate(self.chains) if ch.norm_guard.excluded}
        refresh = [ch.ts_info["reference_refresh"] for ch in self.chains if "reference_refresh" in ch.ts_info]
        if refresh:  # VR-FALD*'s refresh counts, each chain its own (protocol.local_chains)
            out["reference_refresh_per_chain"] = refresh
        return {**out, "excluded": excluded} if excluded else out

    def finish(self) -> dict:
        extra = summary_extra(self.cfg, self.task, {
            "engine": self.engine_label, **self.ts_info, "num_chains": self.C,
            "chain_seeds": f"seed + c for chain c (seeds {int(self.cfg.seed)}..{int(self.cfg.seed) + self.C - 1})",
            **self.facts()})
        if self.resumed_from is not None:
            extra["resumed_from_round"] = self.resumed_from
        self.summary_data = self.observer.on_stop(self, extra) if self.observer is not None else extra
        return self.summary_data

    def set_counts(self, n_data, support=None) -> None:
        """The clients' ``N_i`` claims and supports (:meth:`QLSDServer.set_counts`), for every chain."""
        for ch in self.chains:
            ch.set_counts(n_data, support)

    def memory_check(self, reports: dict[int, dict[int, tuple[np.ndarray, int]]]) -> dict:
        """:meth:`QLSDServer.memory_check` for each chain, from each client's per-chain report."""
        return {f"chain{c}": ch.memory_check({i: r[c] for i, r in reports.items() if c in r})
                for c, ch in enumerate(self.chains)}
