"""The server's side of the rivals whose clients run local chains (FALD, VR-FALD*, DG-LMC): what a
round's messages carry besides θ, and what the bounded-influence rule measures of a reply.
:class:`~qlsd_flwr.protocol.server.QLSDServer` calls these; the numerics are in
:mod:`qlsd_flwr.core.fald` and :mod:`qlsd_flwr.core.dglmc`.

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
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qlsd_flwr.config import ConfigError
from qlsd_flwr.core import dglmc, fald

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


def start(server) -> None:
    """DG-LMC's ``z_i`` start at the chain's ``θ_0`` (as :func:`qlsd_flwr.core.dglmc.run`'s do), so that
    dispersed starts stay dispersed: the mirrors are set to it, and every client's first message
    carries its mirror (a resync), which it installs as its ``z_i``."""
    st = server.state
    st.eta_i[...] = st.theta
    st.eta = st.eta_i.sum(axis=-2)
    server.needs_resync[:] = True


def begin_round(server) -> None:
    """Set the round's numbers on ``server`` (its spec's weights or couplings, and ``server._local``,
    each active client's 32 bytes). VR-FALD*'s anchor version and ``∇U(θ*)`` are fixed here for the
    round: a client excluded during the round changes them from the next (every reply of a round is
    judged against the same version, whatever order the replies arrive in)."""
    b, kept = server.cfg.b, _kept(server)
    if server.cfg.oracle == "dglmc":
        _couple(server)
        rho = rho_of(server)
        step = dglmc.local_step(float(server.spec.gamma), rho, float(server.cfg.get("gamma-c")))
        row = np.array([step, rho, 1.0, 1.0], dtype="<f8").tobytes()
        server._local = {i: row for i in server._active}
        return
    if server.cfg.oracle == "fald-star":
        server._star_version = len(server.norm_guard.excluded)
        off = None if server.claims is None else server.claims.offset(server.norm_guard.excluded)
        server._star_total = off if off is not None or server.claims is None else server.claims.total
    n = [server.norm_guard.n.get(i, 1) for i in range(b)]
    w, share = fald.round_shares(n, kept, server._active, server.cfg.p)
    server.spec = dataclasses.replace(server.spec, local_weights=w)
    server._local = {i: np.array([server.spec.gamma, w[i], share, server.cfg.p[i]], dtype="<f8").tobytes()
                     for i in server._active}


def add_fields(server, i: int, fields: dict) -> None:
    """Client ``i``'s round numbers, and VR-FALD*'s ``∇U(θ*)`` beside ``θ*``."""
    fields["local"] = server._local[i]
    if "anchor" in fields and server.cfg.oracle == "fald-star":
        if server.claims is None:
            raise ConfigError("vr-fald-star: the clients' ∇U_i(θ*) were not gathered before sampling "
                              "(QLSDServer.set_claims); its clients need ∇U(θ*)")
        fields["anchor_total"] = server._star_total


def before_step(server) -> None:
    """Before the server's step: DG-LMC's draw couples only the clients still kept (one excluded in
    this round's judgement leaves θ | z at once; its mirror was zeroed)."""
    if server.cfg.oracle == "dglmc":
        _couple(server)


def reply_norms(server, pending: dict) -> dict[int, float]:
    """What the bounded-influence rule judges of each valid reply (module docstring)."""
    if server.cfg.oracle == "dglmc":
        rho, st = rho_of(server), server.state
        return {i: float(np.linalg.norm(st.eta_i[i] + p[0] - st.theta)) / rho for i, p in pending.items()}
    return {i: float(server.spec.local_weights[i] * np.linalg.norm(p[0])) for i, p in pending.items()}
