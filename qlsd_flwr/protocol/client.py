"""The client's round protocol, with no Flower in it (the ClientApp only translates records).

:func:`handle` takes the fields the server sent (see :mod:`qlsd_flwr.protocol.wire`) and the client's
state, and returns the reply fields: for ``phase = "grad"`` the full local gradient, for
``phase = "curvature"`` its curvature report (:func:`qlsd_flwr.core.curvature.local_curvature`), for
``phase = "sample"`` the encoded compressed message of :func:`qlsd_flwr.core.oracles.client_round`,
or ``status = "resync"`` when the client's cached anchor or memory counter disagrees with the
server's. An ``anchor`` or ``eta`` (with ``eta_count``) in the fields is installed *before* that
check, so a client whose state was lost (a restarted node, a resumed run: the server then
sends both unasked) computes exactly the reply it would have computed with its old state.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qlsd_flwr.core.oracles import (
    ClientSpec,
    ClientState,
    client_round,
    client_rounds,
    full_local_grad,
    set_anchor,
)
from qlsd_flwr.compression import fixed
from qlsd_flwr.core.lowrank import local_hvp
from qlsd_flwr.robust.reports import MAX_BLOCK
from qlsd_flwr.core.curvature import KRON_OUTPUTS, local_curvature
from qlsd_flwr.core.block_basis import BasisRef
from qlsd_flwr.core.kron_block import KRON_BLOCK, local_block
from qlsd_flwr.core.metric import MetricError
from qlsd_flwr.core.downlink import own_positions, support_from_bytes
from qlsd_flwr.core.potential import LocalPotential, declared_support
from qlsd_flwr.protocol.gradients import gradient_to_bytes, precision_of
from qlsd_flwr.protocol.wire import (
    arr_to_bytes,
    bundle_reply,
    metric_of,
    refuse_undeclared,
    report_bytes,
    unbundle_request,
    vector,
)


def _prepare(spec: ClientSpec, pot: LocalPotential, st: ClientState, fields: dict, d: int, seed: int = 0,
             chain_seed: int | None = None):
    """``(θ, None)`` for a sampling round this state can answer, ``(θ, reply)`` otherwise (the
    full gradient of ``phase = "grad"``, or ``status = "resync"``); ``chain_seed`` (``seed`` where not given) keys the
    broadcast's subtractive dither."""
    i = spec.index
    if fields["phase"] in ("grad", "curvature"):
        theta = prep_point(st, fields, d, None if spec.prior_weight > 0 else declared_support(pot, d))
        if theta is None:  # a point it does not hold (a restarted node): the server sends θ again
            return None, {"client": i, "status": "resync"}
    else:
        st.point, st.point_id = None, -1  # sampling: the preparation's point is not asked for again
        support = _support(spec, pot, fields, d)
        theta = _point(spec, st, fields, d, seed if chain_seed is None else chain_seed, support, pot)
    if fields["phase"] == "grad":
        precision = precision_of(fields)
        return theta, {"client": i, "status": "ok",
                       "payload": gradient_to_bytes(full_local_grad(spec, pot, theta), precision)}
    if fields["phase"] == "curvature":  # metric-from = curvature: this client's ∇²U_i(θ*), data part
        kind = str(fields["kind"])
        if kind not in ("diagonal", "dense", "kronecker", KRON_OUTPUTS, KRON_BLOCK, "hvp"):
            raise ValueError(f"curvature: unknown kind {kind!r}; allowed: diagonal, dense, kronecker, {KRON_OUTPUTS}, "
                             f"{KRON_BLOCK}, hvp")
        if kind == KRON_BLOCK:  # metric-block: the exact curvature on the input directions sent
            V, _ = block_of(fields.get("vectors"), d)
            reply = {"client": i, "status": "ok", "payload": report_bytes(local_block(pot, theta, V))}
            st.block_dirs = V  # compression-basis = block: its basis may then come by reference (BasisRef)
            return theta, reply
        if kind == "hvp":  # the products at the width the block came in (compression.fixed), the block on this
            own = None if spec.prior_weight > 0 else declared_support(pot, d)  # client's own support where sent so
            V, bits = block_of(fields.get("vectors"), d, None if own is None else np.flatnonzero(own))
            return theta, {"client": i, "status": "ok", "payload": fixed.encode(local_hvp(pot, theta, V, bits), bits)}
        h = local_curvature(pot, theta, kind, seed, i)
        return theta, {"client": i, "status": "ok", "payload": report_bytes(h)}
    # every field is read and checked before any of the client's state changes (but the preparation's point,
    # dropped above: the state of a message that fails is not kept)
    refuse_undeclared(fields, spec.kind.down, "down")
    if spec.kind.local:
        local_of(fields, spec.kind.coupled)  # the round's numbers
        refresh_of(fields)
    version, count = int(fields["anchor_version"]), int(fields["eta_count"])
    eta = vector(fields["eta"], d) if "eta" in fields else None
    anchor = vector(fields["anchor"], d) if "anchor" in fields else None
    total = vector(fields.get("anchor_total"), d) if anchor is not None and spec.kind.at_theta_star else None
    surrogate = _surrogate(fields, d) if anchor is not None and spec.kind.surrogate else None
    metric = _metric(fields, d, spec.kind.coupled, spec.whitened) if "metric" in fields and spec.metric != "identity" \
        else None
    unresolved = False
    if isinstance(metric, BasisRef):  # the clients' basis by reference: Q̂ from this client's block directions
        try:  # a basis another of this node's chains built from them already (its directions then dropped)
            metric = st.metric if metric.matches(st.metric) else metric.resolve(st.block_dirs, d)
        except MetricError as exc:
            raise ValueError(f"sample: 'metric' is not a usable basis with this client's block directions: {exc}") \
                from None
        unresolved = metric is None  # directions lost (a restarted node) or other ones: resync, and it comes whole
    if flag_of(fields, "anchor_is_theta") and (spec.downlink is None or not spec.kind.cv_zeta):
        raise ValueError("sample: 'anchor_is_theta' is for QLSD++'s anchor with downlink = qsgd")
    if flag_of(fields, "anchor_is_theta") and anchor is None and theta is not None:
        anchor = theta  # downlink = qsgd: the anchor refreshed this round is the w_k just built
    if theta is not None and spec.downlink is not None:
        st.w, st.w_round = theta, int(fields["round"])
    if support is not None:
        st.w_support = support
    if metric is not None:
        st.metric = metric
    if st.metric is not None or not spec.whitened:
        st.block_dirs = None  # the basis built, or never to come: the directions are not needed again
    if eta is not None:
        st.eta, st.eta_count = eta, count
    if total is not None:
        st.anchor_total = total
    if surrogate is not None:
        st.surrogate, st.surrogate_total = surrogate
    if anchor is not None:
        set_anchor(spec, pot, st, anchor, version)
    stale_anchor = spec.kind.anchored and st.anchor_version != version
    stale_eta = spec.memory and st.eta_count != count
    lost_metric = spec.metric != "identity" and st.metric is None  # a restarted node: the server sends it again
    lost_metric |= spec.downlink is not None and spec.downlink.on_support and st.w_support is None  # and the support
    if stale_anchor or stale_eta or lost_metric or unresolved or theta is None:  # θ None: a code it cannot apply
        return theta, {"client": i, "status": "resync"}
    return theta, None


def prep_point(st: ClientState, fields: dict, d: int, own: np.ndarray | None = None) -> np.ndarray | None:
    """The point θ of a request before sampling: ``theta`` as sent, or ``theta_on``, its numbers on the client's
    own support ``own`` (a boolean mask; 0 elsewhere, which nothing it computes before sampling reads), kept with
    its number ``point`` where the request gives one; or the point kept when the request gives only its number (the
    server sends θ once for the exchanges at one point: λ_max's and the products' at θ*); ``None`` when this client
    does not hold that point (a restarted node, whose ``context.state`` is gone). ``ValueError`` naming the field
    otherwise."""
    if "theta_on" in fields:
        if own is None or "theta" in fields:
            raise ValueError(f"{fields['phase']}: 'theta_on' with 'theta', or to a client that reads every coordinate")
        theta = np.zeros(d)
        theta[own] = vector(fields["theta_on"], int(np.count_nonzero(own)))
    elif "theta" in fields:
        theta = vector(fields["theta"], d)
    else:
        theta = None
    if theta is not None:
        if "point" in fields:
            st.point, st.point_id = theta, _point_id(fields)
        return theta
    if "point" not in fields:
        raise ValueError(f"{fields['phase']}: neither 'theta' nor 'point' in the request")
    return st.point if st.point is not None and st.point_id == _point_id(fields) else None


def _point_id(fields: dict) -> int:
    p = fields["point"]
    if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 0:
        raise ValueError(f"{fields['phase']}: 'point' must be an integer ≥ 0, not {p!r}")
    return int(p)


def _support(spec: ClientSpec, pot: LocalPotential, fields: dict, d: int) -> np.ndarray | None:
    """``theta_support`` (``downlink-support = data``) as the client keeps it, 1 on the coordinates the codes carry
    (``None``: not sent); ``ValueError`` naming the field when the run does not send one, when it is malformed, or
    when it leaves out a coordinate this client's gradient reads (its codes would leave that coordinate stale)."""
    x = fields.get("theta_support")
    if x is None:
        return None
    if spec.downlink is None or not spec.downlink.on_support:
        raise ValueError("sample: 'theta_support' without downlink-support = data in the client's settings")
    live = support_from_bytes(x, d)
    own = None if spec.prior_weight > 0 else declared_support(pot, d)  # a share of the prior reads every coordinate
    if (~live).any() and (own is None or (own & ~live).any()):
        raise ValueError("sample: 'theta_support' leaves out coordinates this client's gradient reads")
    return live.astype(np.float64)


def _point(spec: ClientSpec, st: ClientState, fields: dict, d: int, seed: int = 0,
           support: np.ndarray | None = None, pot: LocalPotential | None = None) -> np.ndarray | None:
    """A sampling round's point: θ_k, or with ``downlink = qsgd`` the ``w_k`` that ``theta_code`` builds from the
    client's ``w_{k−1}`` (``theta``: ``w_k`` in full), under ``downlink-support = data`` on the coordinates of the
    potential ``pot``'s own support, which its code carries (:meth:`~qlsd_flwr.core.downlink.Downlink.code_for`);
    ``None`` when the client cannot apply the code (it missed round ``k − 1`` of a chain past its round 0: it answers
    resync and is sent ``w_k`` in full next). ``ValueError`` naming the field when a message carries neither, or a code the client was not
    told to expect, or one that does not decode."""
    code = fields.get("theta_code")
    if code is not None and spec.downlink is None:
        raise ValueError("sample: 'theta_code' without downlink settings (downlink = off sends theta)")
    if "theta" in fields or code is None:
        if "theta" not in fields:
            raise ValueError("sample: the message carries neither 'theta' nor 'theta_code'")
        return vector(fields["theta"], d)
    dl, k, own = spec.downlink, int(fields["round"]), None
    if dl.on_support:  # the coordinates the code carries: this message's theta_support, else the one held
        live = support if support is not None else st.w_support
        if live is None:  # a restarted node: it answers resync and is sent the support
            return None
        dl = dataclasses.replace(dl, support=None if live.all() else np.flatnonzero(live))
        # of them, those of its own support (a share of the prior reads every coordinate: the server's rule too)
        own = own_positions(dl.support, None if spec.prior_weight > 0 or pot is None else declared_support(pot, d))
    if dl.feedback == "none":
        return dl.receive(None, code, d, seed, k, own)
    # the w_{k−1} it holds; round 0's code is from w_{−1} = 0, which every client holds (core.downlink)
    held = st.w if st.w is not None and st.w_round == k - 1 else np.zeros(d) if k == 0 else None
    if held is None:
        dl.receive(np.zeros(d), code, d, seed, k, own)  # refused if malformed, even when it cannot be applied
        return None
    return dl.receive(held, code, d, seed, k, own)


def _surrogate(fields: dict, d: int) -> tuple[np.ndarray, np.ndarray]:
    """FSGLD's ``(λ_i, Λ)``, sent with θ*: finite, ``0 ≤ λ_i ≤ Λ``; else ``ValueError`` naming the field."""
    lam, total = vector(fields.get("surrogate"), d), vector(fields.get("surrogate_total"), d)
    if not (np.all(np.isfinite(lam)) and np.all(np.isfinite(total)) and np.all(lam >= 0)
            and np.all(lam <= total * (1 + 1e-12))):
        raise ValueError("sample: 'surrogate' and 'surrogate_total' must be finite with 0 ≤ λ_i ≤ Λ")
    return lam, total


def _metric(fields: dict, d: int, coupled: bool, refs: bool = False):
    """The local steps' metric ``M`` (:func:`qlsd_flwr.protocol.wire.metric_of`; ``refs``: the clients' basis, which
    may come by reference); DG-LMC's without a low-rank correction (its server draws θ | z in ``M``'s eigenbasis);
    else ``ValueError`` naming it."""
    metric = metric_of(fields["metric"], d, refs)
    if coupled and metric.has_correction:
        raise ValueError("sample: 'metric' for dg-lmc may not carry a low-rank correction")
    return metric


def local_of(fields: dict, coupled: bool = False) -> tuple[float, float, float, float]:
    r"""The round's four numbers ``local`` of a local-chain oracle, 32 bytes of float64 (a legacy config
    holds no lists): FALD and VR-FALD\* ``(h, w_i, S_A, p_i)`` (:func:`qlsd_flwr.samplers.fald.message`)
    with ``h > 0``, ``0 < w_i ≤ 1``, ``S_A > 0``, ``0 < p_i ≤ 1`` (FSGLD's ``(h, f_s, 1, 1)`` the same); DG-LMC ``(γ_i, ρ_i, 1, 1)``
    (:func:`qlsd_flwr.samplers.dglmc.message`, ``coupled``) with ``γ_i, ρ_i > 0``, all finite; else ``ValueError``."""
    x = fields.get("local")
    if not isinstance(x, (bytes, bytearray)) or len(x) != 32:
        raise ValueError("sample: 'local' must be four numbers as 32 bytes of float64")
    h, w, share, p = (float(v) for v in np.frombuffer(bytes(x), dtype="<f8"))
    if coupled:
        if not (0 < h < np.inf and 0 < w < np.inf):
            raise ValueError(f"sample: 'local' out of range (γ_i > 0, ρ_i > 0): {[h, w]}")
    elif not (0 < h < np.inf and 0 < w <= 1 and 0 < share < np.inf and 0 < p <= 1):
        raise ValueError(f"sample: 'local' out of range (h > 0, 0 < w_i ≤ 1, S_A > 0, 0 < p_i ≤ 1): "
                         f"{[h, w, share, p]}")
    return h, w, share, p


def refresh_of(fields: dict) -> bool:
    """VR-FALD*'s ``refresh`` (absent, 0 or 1): whether the reply also carries ``∇U_i(θ_k)`` for the next
    reference; else ``ValueError`` naming it."""
    return flag_of(fields, "refresh")


def flag_of(fields: dict, name: str) -> bool:
    """A flag field (absent, 0 or 1); else ``ValueError`` naming it."""
    x = fields.get(name, 0)
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or int(x) not in (0, 1):
        raise ValueError(f"sample: {name!r} must be 0 or 1")
    return bool(x)


def _refreshed(spec: ClientSpec, pot: LocalPotential, fields: dict, theta: np.ndarray, out: dict) -> dict:
    """A VR-FALD* reply in a refresh round also carries ``ref_grad = ∇U_i(θ_k)`` (the message's θ), the
    client's part of the next reference's ``∇U(θ_r)`` (:mod:`qlsd_flwr.protocol.local_chains`)."""
    if spec.kind.refreshable and refresh_of(fields):
        out["ref_grad"] = arr_to_bytes(full_local_grad(spec, pot, theta))
    return out


def block_of(x, d: int, cols=None) -> tuple[np.ndarray, int]:
    """The server's block of vectors (``metric-rank``, the power iteration) as ``(b, d)`` and its width: rows of
    :mod:`qlsd_flwr.compression.fixed`, at most :data:`~qlsd_flwr.robust.reports.MAX_BLOCK` of them, on this client's
    own coordinates ``cols`` where the server sent them so (0 elsewhere, which its products never read), else
    ``ValueError`` naming the field and saying why."""
    try:
        return fixed.decode(x, d, MAX_BLOCK, cols), fixed.width_of(x)
    except ValueError as exc:
        raise ValueError(f"curvature: 'vectors' is not a block the client can use: {exc}") from None


def _sampled(spec: ClientSpec, pot: LocalPotential, st: ClientState, q, fields: dict, done: dict | None = None) -> dict:
    out = {"client": spec.index, "status": "ok", "payload": spec.compressor.encode(q),
           "anchor_version": st.anchor_version}
    if spec.kind.needs_theta_star and "anchor" in fields:
        # QLSD*: the reply to θ* repeats ∇U_i(θ*), which the server holds against this client's θ* phase
        # reply (a client that lied there, honest now, is caught: protocol.server.QLSDServer.accept);
        # ``done``: the chains' anchors already answered (θ* is the run's; VR-FALD*'s refreshed θ_r a chain's)
        done = {} if done is None else done
        key = st.anchor.tobytes()
        if key not in done:
            done[key] = arr_to_bytes(full_local_grad(spec, pot, st.anchor))
        out["anchor_grad"] = done[key]
    return out


def handle(spec: ClientSpec, pot: LocalPotential, st: ClientState, seed: int, fields: dict, d: int) -> dict:
    theta, reply = _prepare(spec, pot, st, fields, d, seed)
    if reply is not None:
        return reply
    q, _ = client_round(spec, pot, st, seed, int(fields["round"]), theta,
                        local_of(fields, spec.kind.coupled) if spec.kind.local else None)
    return _refreshed(spec, pot, fields, theta, _sampled(spec, pot, st, q, fields))


def handle_chains(spec: ClientSpec, pot: LocalPotential, load_state, seed: int, fields: dict,
                  d: int) -> tuple[dict, dict[int, ClientState]]:
    """A several-chain message (:func:`qlsd_flwr.protocol.wire.bundle_request`): chain ``c`` is
    :func:`handle` with its own state ``load_state(c)`` and seed ``seed + c`` (so it is the chain
    a one-chain run with that seed computes). The oracles of the chains that sample this round
    are one :func:`qlsd_flwr.core.oracles.client_rounds` call (one batched gradient where the
    potential has ``grad_sum_batch``; bit for bit the per-chain result). Returns the reply fields
    and the chains' states (the caller keeps them)."""
    per = unbundle_request(fields, d, spec.kind.down)  # one round for every chain: the message's
    states = {c: load_state(c) for c in per}
    replies, ready = {}, []  # ready: (chain, θ) of the chains that sample
    for c, f in per.items():
        theta, replies[c] = _prepare(spec, pot, states[c], f, d, seed, seed + c)
        if replies[c] is None:
            ready.append((c, theta))
    if ready:
        chains = [c for c, _ in ready]
        outs = client_rounds(spec, pot, [states[c] for c in chains], [seed + c for c in chains],
                             int(fields["round"]), np.stack([theta for _, theta in ready]),
                             [local_of(per[c], spec.kind.coupled) if spec.kind.local else None for c in chains])
        done: dict = {}  # ∇U_i at each anchor sent, computed once (θ* is the run's, shared by the chains)
        for (c, theta), (q, _) in zip(ready, outs):
            replies[c] = _refreshed(spec, pot, per[c], theta, _sampled(spec, pot, states[c], q, per[c], done))
    return bundle_reply(spec.index, replies), states
