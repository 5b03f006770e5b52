"""The server's side of the rivals whose clients run local chains (FALD, VR-FALD*, DG-LMC, FSGLD): what
a round's messages carry besides θ, and what the bounded-influence rule measures of a reply.
:class:`~qlsd_flwr.protocol.server.QLSDServer` calls these; the numerics are in
:mod:`qlsd_flwr.core.fald`, :mod:`qlsd_flwr.core.dglmc` and :mod:`qlsd_flwr.core.fsgld`.

* **FALD, VR-FALD\\***: each round the server computes the data shares ``w_i = N_i / Σ_{j kept} N_j``
  (``N_i`` the clients' counts as the guard holds them: the task's, or the handshake's claims,
  clamped) and the active set's ``S_A = Σ_{i∈A} w_i/p_i``, and sends client ``i`` ``(γ, w_i, S_A, p_i)``;
  the step averages with ``w_i/p_i``. VR-FALD\\*'s first message to a client carries ``θ*`` and
  ``∇U(θ*)`` of the clients kept (their claims at θ*, :mod:`qlsd_flwr.protocol.claims`).
  A reply is judged as ``w_i ‖Δ̂_i‖``, the client's part of the step (a sum over its data, as a
  gradient is).
* **DG-LMC**: client ``i`` is sent ``(γ_i, ρ, 1, 1)`` with ``γ_i = (1/γ + 1/(c ρ))⁻¹`` and ``ρ`` the key
  ``rho`` (``auto``: ``γ/10``); the exact draw of θ couples the kept clients only. A reply is judged as
  ``‖z_i' − θ_k‖ / ρ``, the pull of the client's ``z_i`` on θ, which at equilibrium is its local gradient.
* **FSGLD**: each round one kept client ``s`` is drawn with probability ``f_s = N_s / Σ_{j kept} N_j``
  (:func:`qlsd_flwr.core.fsgld.choose`; the participation draw does not apply) and sent ``(γ, f_s, 1, 1)``;
  its first message (and the first after a client leaves: a new version) carries ``θ*``, ``∇U(θ*)``,
  its surrogate's precision ``λ_s`` and ``Λ = Σ_{j kept} λ_j`` (the curvature reports gathered before
  sampling, :func:`qlsd_flwr.protocol.precondition.prepare`). The step is ``θ − γ Δ̂_s``; a reply is judged
  as ``f_s ‖Δ̂_s‖``, the client's expected part of the step (a sum over the federation's data scaled
  by its share, so honest clients of any size have the same per-datum scale).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from qlsd_flwr.config import ConfigError
from qlsd_flwr.core import curvature as cv, dglmc, fald, fsgld
from qlsd_flwr.protocol import metric_sent
from qlsd_flwr.protocol import build
from qlsd_flwr.protocol.claims import ThetaStarClaims
from qlsd_flwr.protocol.gradients import gradient_of
from qlsd_flwr.protocol.wire import ReplyError
from qlsd_flwr.robust.claims import out_of_scale, over_bound
from qlsd_flwr.robust.norm_guard import fixed_bound

log = logging.getLogger("qlsd_flwr")

#: ``rho = auto``: ``ρ = RHO_AUTO · γ``
RHO_AUTO = 0.1


def rho_of(server) -> float:
    """DG-LMC's ``ρ``: the key's number, or ``RHO_AUTO · γ``."""
    r = server.cfg.get("rho")
    return RHO_AUTO * float(server.spec.gamma) if str(r).strip().lower() == "auto" else float(r)


def _kept(server) -> list[int]:
    return [i for i in range(server.cfg.b) if i not in server.norm_guard.excluded]


def _couple(server) -> None:
    """DG-LMC's couplings ``1/ρ`` of the clients kept now."""
    coupling = np.zeros(server.cfg.b)
    coupling[_kept(server)] = 1.0 / rho_of(server)
    server.spec = dataclasses.replace(server.spec, coupling=coupling)


def start(server, prep=None) -> None:
    """DG-LMC's ``z_i`` start at the chain's ``θ_0`` (as :func:`qlsd_flwr.core.dglmc.run`'s do), so that
    dispersed starts stay dispersed: the mirrors are set to it, and every client's first message
    carries its mirror (a resync), which it installs as its ``z_i``. FSGLD keeps the surrogates the
    preparation gathered (``prep.surrogate``). FALD's, VR-FALD*'s and FSGLD's local steps take any metric
    (identity, diagonal, dense, Kronecker, with or without ``metric-rank``'s correction); DG-LMC's
    coupling any but a low-rank corrected one."""
    metric_sent.setup(server, ConfigError)
    kind = server.cfg.kind
    if kind.surrogate:
        if prep is None or prep.surrogate is None:
            raise ConfigError("fsgld: the clients' surrogates were not gathered before sampling "
                              "(protocol.precondition.prepare); this path started a chain without them")
        server.surrogate = np.array(prep.surrogate, dtype=np.float64)
        return
    if not kind.coupled:
        return
    st = server.state
    st.eta_i[...] = st.theta
    st.eta = st.eta_i.sum(axis=-2)
    server.needs_resync[:] = True


def _gamma_c(server) -> float:
    """DG-LMC's ``c``: the preparation's (``gamma-c``, auto resolved by log-concavity), kept in the
    checkpoint with it; a checkpoint from before ``auto`` existed holds a number in its config."""
    c = server.ts_info.get("gamma_c")
    return float(c) if c is not None else cv.gamma_c(server.cfg.get("gamma-c"), log_concave=True)


def begin_round(server) -> None:
    """Set the round's numbers on ``server`` (its spec's weights or couplings, and ``server._local``,
    each active client's 32 bytes). VR-FALD*'s anchor version and ``∇U(θ*)`` are fixed here for the
    round: a client excluded during the round changes them from the next (every reply of a round is
    judged against the same version, whatever order the replies arrive in)."""
    b, kept = server.cfg.b, _kept(server)
    server._fresh = False  # VR-FALD*'s refresh round (below)
    kind = server.cfg.kind
    if kind.coupled:
        _couple(server)
        rho = rho_of(server)
        step = dglmc.local_step(float(server.spec.gamma), rho, _gamma_c(server))
        row = np.array([step, rho, 1.0, 1.0], dtype="<f8").tobytes()
        server._local = {i: row for i in server._active}
        return
    if kind.at_theta_star:
        server._star_version = len(server.norm_guard.excluded) + _installed(server)
        off = None if server.claims is None else server.claims.offset(server.norm_guard.excluded)
        server._star_total = off if off is not None or server.claims is None else server.claims.total
    n = [server.norm_guard.n.get(i, 1) for i in range(b)]
    if kind.surrogate:  # one kept client, by its data share; the step weighs it 1
        f, _ = fald.round_shares(n, kept, [], server.cfg.p)
        if not kept:  # every client excluded: nobody is asked, the round is skipped (as FALD's)
            server._active, server._f, server._local = [], f, {}
            server.spec = dataclasses.replace(server.spec, local_weights=np.zeros(b))
            return
        s = fsgld.choose(f, server.cfg.seed, server.state.k)
        server._active, server._f = [s], f
        server._lam_total = server.surrogate[kept].sum(axis=0)  # Λ over the clients kept, for add_fields and the guard
        one = np.zeros(b)
        one[s] = 1.0
        server.spec = dataclasses.replace(server.spec, local_weights=one)
        server._local = {s: np.array([server.spec.gamma, f[s], 1.0, 1.0], dtype="<f8").tobytes()}
        return
    # VR-FALD*'s refresh round (probability q, its own stream): every kept client, p_i = 1 for the round
    server._fresh = kind.refreshable and fald.refreshes(float(server.cfg.get("q") or 0.0),
                                                                        server.cfg.seed, server.state.k)
    server._ref_grads = {}
    if server._fresh:
        server._active = list(kept)
    p = np.ones(b) if server._fresh else server.cfg.p
    w, share = fald.round_shares(n, kept, server._active, p)
    server.spec = dataclasses.replace(server.spec, local_weights=w, p=p)
    server._local = {i: np.array([server.spec.gamma, w[i], share, p[i]], dtype="<f8").tobytes()
                     for i in server._active}


def add_fields(server, i: int, fields: dict) -> None:
    """Client ``i``'s round numbers, VR-FALD*'s and FSGLD's ``∇U(θ*)`` beside ``θ*`` (FSGLD's surrogate
    too), and the metric (as :func:`~qlsd_flwr.protocol.wire.metric_to_bytes` makes it) with the client's
    first message and after a resync."""
    fields["local"] = server._local[i]
    if server._fresh:
        fields["refresh"] = 1
    metric_sent.add(server, i, fields)
    if "anchor" in fields and server.cfg.kind.at_theta_star:
        if server.claims is None:
            raise ConfigError(f"{server.cfg.variant}: the clients' ∇U_i(θ*) were not gathered before sampling "
                              "(QLSDServer.set_claims); its clients need ∇U(θ*)")
        fields["anchor_total"] = server._star_total
    if "anchor" in fields and server.cfg.kind.surrogate:  # λ_i and Λ over the clients kept
        fields["surrogate"] = server.surrogate[i]
        fields["surrogate_total"] = server._lam_total


def check_reply(server, i: int, rep: dict) -> None:
    """VR-FALD*'s reply in a refresh round must carry ``ref_grad``, ``∇U_i(θ_k)`` as ``8d`` bytes of
    finite numbers (:class:`ReplyError` otherwise: the whole reply is refused, counted, and the refresh
    waits for another round); it is held until the round's judgement."""
    if not server._fresh:
        return
    try:
        server._ref_grads[i] = gradient_of(rep.get("ref_grad"), server.d)
    except ValueError as exc:
        raise ReplyError(f"ref_grad: {exc}") from None


def before_step(server) -> None:
    """Before the server's step: DG-LMC's draw couples only the clients still kept (one excluded in
    this round's judgement leaves θ | z at once; its mirror was zeroed). VR-FALD*'s refresh round
    installs its new reference θ_r = θ_k, with ``∇U(θ_r)`` the sum of the kept clients' ``ref_grad``
    and the prior's, when every kept client's reply was accepted; otherwise the reference stays (counted
    as ``incomplete``: the control variate is unbiased for any reference fixed before its rounds)."""
    if server.cfg.kind.coupled:
        _couple(server)
    if not server._fresh:
        return
    got = {i: g for i, g in server._ref_grads.items() if i in server._g_hat}  # the accepted replies only
    _refuse_out_of_scale(server, got)
    kept = _kept(server)
    got = {i: g for i, g in got.items() if i in kept}
    complete = bool(kept) and set(got) == set(kept)
    _count(server, rounds=1, uplink_bits=64 * server.d * len(server._ref_grads), incomplete=int(not complete),
           installed=int(complete))
    if not complete:
        return
    theta = server.state.theta.copy()
    claims = np.zeros((server.cfg.b, server.d))
    for i in kept:
        claims[i] = got[i]
    total = build.combine_grads(server.cfg, server.task.prior, [claims[i] for i in kept], theta)
    server.claims = ThetaStarClaims(claims, total)  # what each client's reply to θ_r must repeat
    server.spec = dataclasses.replace(server.spec, theta_star=theta)  # from the next round's begin_round on


def _refuse_out_of_scale(server, got: dict) -> None:
    """VR-FALD*'s ``ref_grad`` held as its θ* claims are (:mod:`qlsd_flwr.robust.claims`): over a fixed
    ``norm-bound = B``, or out of scale per datum against the other clients', its client is excluded from the
    next round on (counted ``ref_grad_refused``, named in the log), so the reference is installed without it
    and no honest reply is refused for its lie."""
    clients = list(got)
    why = {clients[j]: w for j, w in over_bound(list(got.values()),
                                                fixed_bound(server.cfg.raw.get("norm-bound", "auto"))).items()}
    why.update({i: w for i, w in out_of_scale(got, server.norm_guard.n).items() if i not in why})
    for i, w in sorted(why.items()):
        log.warning("client %d: its ref_grad at round %d: %s; excluded from round %d on, and the reference is "
                    "installed without it (summary.json 'excluded')", i, server.state.k, w, server.state.k + 1)
        server.norm_guard.excluded[i] = int(server.state.k) + 1
        server._count("ref_grad_refused")
    if why:
        server._set_offset()


#: VR-FALD*'s refresh counts: refresh rounds, new references installed, rounds that installed none (a
#: kept client's ref_grad missing or refused: the reference stayed), and the ref_grad bits received
#: (those of replies the guard then refused too: they were sent)
REFRESH_COUNTS = ("rounds", "installed", "incomplete", "uplink_bits")


def _refreshing(server) -> bool:
    return server.cfg.kind.refreshable and float(server.cfg.get("q") or 0.0) > 0


def _installed(server) -> int:
    """How many references VR-FALD*'s refresh has installed (each a new anchor version)."""
    return int(server.ts_info.get("reference_refresh", {}).get("installed", 0)) if _refreshing(server) else 0


def _count(server, **inc) -> None:
    """Add to this chain's refresh counts, kept in its ``ts_info`` (``summary.json``): a new dict each
    time, since the chains of a several-chain run start from one shared ``ts_info``."""
    old = server.ts_info.get("reference_refresh") or {k: 0 for k in REFRESH_COUNTS}
    new = {"q": float(server.cfg.get("q")), **{k: int(old[k]) + int(inc.get(k, 0)) for k in REFRESH_COUNTS}}
    server.ts_info = {**server.ts_info, "reference_refresh": new}


def reply_norms(server, pending: dict) -> tuple[dict[int, float], float | None]:
    """What the bounded-influence rule judges of each valid reply (module docstring), and FSGLD's
    reference while its pool is thin (:func:`predicted_scale`)."""
    if server.cfg.kind.coupled:  # M⁻¹ (z_i' − θ)/ρ with a metric (core.dglmc)
        rho, st, sp = rho_of(server), server.state, server.spec.spectrum
        inv = (lambda x: x) if sp is None else (lambda x: sp.map(x, lambda s: 1.0 / s))  # M⁻¹
        return {i: float(np.linalg.norm(inv(st.eta_i[i] + p[0] - st.theta))) / rho for i, p in pending.items()}, None
    if server.cfg.kind.surrogate:
        return ({i: float(server._f[i] * np.linalg.norm(p[0])) for i, p in pending.items()},
                predicted_scale(server) if pending else None)
    return {i: float(server.spec.local_weights[i] * np.linalg.norm(p[0])) for i, p in pending.items()}, None


def predicted_scale(server) -> float:
    """FSGLD: the per-datum measure ``f_s ‖Δ‖ / N_s`` of the reply an honest client ``s`` would send if
    its surrogate were exact, computed by the server itself (the surrogates' sum
    ``Λ (x − θ*) + Σ_j ∇U_j(θ*) + ∇U_0(x)`` in the round's local steps, with the round's noise, which the
    server draws too). It is the guard's reference for FSGLD in place of the pooled median: one
    client answers a round, drawn by its data share, so the pool holds too few clients in the first
    rounds and a large client can be most of it later. An honest reply differs from it by the
    surrogate's error only. With QSGD the prediction is scaled by ``√(1 + ω)``, the root of the
    code's bound on ``E‖C(x)‖² / ‖x‖²``: an honest coded reply is that much longer, on average at most."""
    s, st, cfg = server._active[0], server.state, server.cfg
    ts = server.spec.theta_star
    total = server._star_total - server.task.prior.grad(ts)
    g = fsgld.conducive_grad(lambda x: 0.0, server.task.prior.grad, 1.0, 0.0, server._lam_total, ts, 0.0, total)
    metric = None if server.spec.metric.is_identity else server.spec.metric
    delta = fsgld.message(g, st.theta, float(server.spec.gamma), int(cfg.get("local-steps")), cfg.seed, st.k, s,
                          float(cfg.temperature), metric)
    coded = np.sqrt(1.0 + float(server.compressors[s].omega(server.d)))
    return coded * float(server._f[s] * np.linalg.norm(delta)) / server.norm_guard.n.get(s, 1)


def arrays(server) -> dict:
    """FSGLD's surrogates and VR-FALD*'s refresh counts (this chain's), for checkpoints."""
    s = getattr(server, "surrogate", None)
    out = {} if s is None else {"surrogate": s}
    if _refreshing(server):
        facts = server.ts_info.get("reference_refresh") or {}
        out["reference_refresh"] = np.array([int(facts.get(k, 0)) for k in REFRESH_COUNTS], dtype=np.int64)
    return out


def restore(server, a: dict) -> None:
    """A checkpoint's part of the rivals' state: the metric as it travels (sent to no client yet), this
    chain's VR-FALD* refresh counts and FSGLD's surrogates; :class:`CheckpointError` naming the field."""
    from qlsd_flwr.outputs.checkpoint import CheckpointError

    metric_sent.setup(server, CheckpointError)
    server.ts_info = {k: v for k, v in server.ts_info.items() if k != "reference_refresh"}  # this chain's, below
    if _refreshing(server):
        c = a.get("reference_refresh")
        if c is None or c.shape != (len(REFRESH_COUNTS),) or c.dtype.kind not in "iu" or np.any(c < 0) \
                or np.any(c >= 2**62):
            raise CheckpointError(f"checkpoint: 'reference_refresh' must be the {len(REFRESH_COUNTS)} counts "
                                  f"{', '.join(REFRESH_COUNTS)} as integers ≥ 0 (vr-fald-star, q > 0)")
        _count(server, **{k: int(v) for k, v in zip(REFRESH_COUNTS, c)})
    if not server.cfg.kind.surrogate:
        return

    s = a.get("surrogate")
    shape = (server.cfg.b, server.d)
    if s is None or s.shape != shape or s.dtype.kind != "f" or not np.all(np.isfinite(s)) or np.any(s < 0):
        raise CheckpointError(f"checkpoint: 'surrogate' must be {shape[0]} × {shape[1]} finite numbers ≥ 0 (fsgld)")
    server.surrogate = s.copy()
