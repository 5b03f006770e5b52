"""A chain's whole server state as plain arrays and JSON (a checkpoint), and back: what
:meth:`qlsd_flwr.protocol.server.QLSDServer.snapshot` and ``restore`` do."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core import server_step as sampler
from qlsd_flwr.core.metric import Identity
from qlsd_flwr.core.metric_codec import from_array, to_array
from qlsd_flwr.outputs.checkpoint import CheckpointError
from qlsd_flwr.protocol import broadcast, build, local_chains, metric_sent
from qlsd_flwr.protocol.claims import ThetaStarClaims
from qlsd_flwr.robust.norm_guard import GuardStateError
from qlsd_flwr.samplers.fields import CHECKPOINT

log = logging.getLogger("qlsd_flwr")


def snapshot(server) -> tuple[dict, dict]:
    """``(arrays, meta)``: the chain's whole state after round ``k``, for a checkpoint."""
    st = server.state
    arrays = {"theta": st.theta, "zeta": st.zeta, "eta_i": st.eta_i, "eta": st.eta,
              "theta_star": server.spec.theta_star, "anchor_acked": server.anchor_acked,
              "eta_count": server.eta_count, "needs_resync": server.needs_resync,
              "metric": to_array(server.spec.metric), **(server.claims.arrays() if server.claims else {}),
              **local_chains.arrays(server), **broadcast.arrays(server)}
    meta = {"kind": "server", "k": int(st.k), "zeta_version": int(st.zeta_version), "gamma": float(server.spec.gamma),
            "config": server.cfg.raw, "rejected": server.rejected,
            "missed_rounds": {str(i): r for i, r in server.missed_rounds.items()},
            "ts_info": server.ts_info, "persist": server.persist, "guard": server.norm_guard.state(),
            "runaway_scale": server._scale}
    return arrays, meta

def restore(server, meta: dict, a: dict) -> None:
    """The state of a :func:`snapshot` back into ``server``; every client is marked as needing a resync."""
    cfg = server.cfg
    other = next((n for n in CHECKPOINT if n in a and n not in cfg.kind.kept), None)
    if other is not None:  # another sampler's state: this checkpoint is not this run's
        raise CheckpointError(f"checkpoint: {other!r} ({CHECKPOINT[other]}) is not part of {cfg.variant}'s state; "
                              "resume with the variant that wrote it")
    server.ts_info = dict(meta["ts_info"])
    theta_star = a.get("theta_star")
    if "gamma" in meta:  # the step the run was started with (gamma = auto chose it then)
        server.cfg = cfg = dataclasses.replace(cfg, gamma=float(meta["gamma"]))
    metric = from_array(a["metric"], server.d) if "metric" in a else Identity()
    server.spec = build.server_spec(cfg, server.task, None if theta_star is None else theta_star.copy(), server.blocks,
                                  metric)
    st = sampler.init_state(server.spec, a["theta"])
    st.k = int(meta["k"])
    st.zeta_version = int(meta["zeta_version"])
    if "zeta" in a:
        st.zeta = a["zeta"].copy()
    if server.spec.memory:
        st.eta_i, st.eta = a["eta_i"].copy(), a["eta"].copy()
    server.state = st
    # the run-away scale the chain started with (its start is not in the checkpoint); an older
    # checkpoint, or a value that is not a positive finite number, takes it from θ_k
    saved = meta.get("runaway_scale")
    ok = isinstance(saved, (int, float)) and not isinstance(saved, bool) and 0 < saved < float("inf")
    server._set_scale(float(saved) if ok else None)
    server.anchor_acked = a["anchor_acked"].astype(np.int64)
    server.eta_count = a["eta_count"].astype(np.int64)
    # the clients may have lost their state with the restart: the first message to each
    # carries the anchor and its η_i mirror (fields_for), so no round is lost to a resync
    server.needs_resync = np.ones(cfg.b, dtype=bool)
    try:
        server.norm_guard.restore(meta.get("guard"))
    except GuardStateError as exc:
        raise CheckpointError(f"checkpoint: {exc}") from None
    server.claims = ThetaStarClaims.restored(a, cfg.b, server.d)
    if server.local:  # the rivals: the metric as it travels, FSGLD's surrogates
        local_chains.restore(server, a)
    elif metric_sent.wanted(server):  # compression-basis = metric or block (the basis rebuilt from the metric)
        metric_sent.setup(server, CheckpointError)
    broadcast.restore(server, a, CheckpointError)  # downlink = qsgd: w, every client sent it in full next
    server._set_offset()
    server.rejected = dict(meta["rejected"])
    server.missed_rounds = {int(i): list(r) for i, r in meta["missed_rounds"].items()}
    server.persist = dict(meta.get("persist", {}))
    server.resumed_from = st.k
    log.info("resumed at round %d from a checkpoint", st.k)


def resume_snapshot(cfg: RunConfig, observer) -> tuple[dict, dict] | None:
    """With ``resume`` set, the observer's checkpoint ``(meta, arrays)`` to restore (a run that
    writes nothing cannot resume: ``ConfigError``); ``None`` for a new run."""
    if observer is None and str(cfg.get("resume") or ""):
        raise ConfigError("resume: continuing a run needs its run folder (the checkpoint is read "
                          "and the outputs appended to); run with write=True")
    return observer.resume_snapshot() if observer is not None else None
