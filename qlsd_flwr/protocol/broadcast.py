"""The server's side of ``downlink = qsgd`` (:mod:`qlsd_flwr.core.downlink`): one chain's ``w_k``, the round's
code, and which client holds which ``w``.

Each round, before the anchor's refresh, the server codes ``θ_k − w_{k−1}`` (``ef21-p``) or ``θ_k`` (``none``)
once, and sends that code in θ's place to every active client that holds ``w_{k−1}``: a client holds the ``w``
of the last round whose message it answered ``ok``. Any other client (its first message, one that missed a
round, answered resync, failed, or a run just resumed) is sent ``w_k`` in full, so a client never computes at
another point than the others. Under ``ef21-p`` every client holds ``w_{−1} = 0`` (:mod:`qlsd_flwr.core.downlink`), so
round 0 sends every client the code. QLSD++'s anchor refreshed
at round ``k`` is ``w_k`` (where the clients evaluate), so a client that builds ``w_k`` this round is told so
(``anchor_is_theta``) instead of being sent ``ζ``. The server's ``w`` goes into the checkpoint (``downlink_w``),
so a resumed chain codes the same ``w``s, bit for bit.

Under ``downlink-support = data`` the code carries only the coordinates some client's gradient reads (the union
of their declared supports, from the handshakes; :class:`~qlsd_flwr.core.downlink.Downlink`), and each client is
told which, ``theta_support``, with its first message and after a resync: the same rule as the metric's
(:mod:`qlsd_flwr.protocol.metric_sent`). The union is not in the checkpoint: a resumed run takes it from the
handshakes again.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qlsd_flwr.config import ConfigError
from qlsd_flwr.core.downlink import Downlink, broadcast_code, own_positions, support_to_bytes, union_support
from qlsd_flwr.core.potential import declared_support
from qlsd_flwr.protocol import build


def setup(server) -> None:
    """The chain's broadcast (``server.downlink``: ``None`` with ``downlink = off``), on the clients' support: the
    handshakes' (:func:`set_support`, kept through a restore), else that of the clients the task holds."""
    cfg = server.cfg
    if not hasattr(server, "client_support"):
        server.client_masks = task_supports(server.task) if build.support_on(cfg) else None
        server.client_support = None if server.client_masks is None else union_support(server.client_masks, server.d)
    server.downlink = downlink_of(cfg, server.client_support)
    server.w, server.w_q, server.w_codes = None, None, {}
    server.w_held = np.full(cfg.b, -1, dtype=np.int64)  # the round of the w each client holds (−1: none)
    server.support_sent = set()  # the clients sent theta_support since the server started


def task_support(task) -> np.ndarray | None:
    """The union of ``task``'s clients' declared supports (:func:`~qlsd_flwr.core.downlink.union_support`), on an
    engine that holds the clients; ``None``: every coordinate (or no clients: a Flower server takes the union from
    the handshakes)."""
    return union_support(task_supports(task), task.dim)


def task_supports(task) -> list:
    """Each of ``task``'s clients' declared support (a boolean mask, ``None``: every coordinate)."""
    return [declared_support(c, task.dim) for c in task.clients]


def set_support(server, masks) -> None:
    """The broadcast's support from the clients' handshakes (each a boolean mask, or ``None``: every coordinate):
    their union (:func:`~qlsd_flwr.core.downlink.union_support`) under ``downlink-support = data``. ``masks``
    ``None``: no handshake (nothing changes)."""
    if masks is None or not build.support_on(server.cfg):
        return
    server.client_masks = list(masks)
    server.client_support = union_support(masks, server.d)
    if getattr(server, "downlink", None) is not None:  # else setup, when the chain begins, takes it
        server.downlink = dataclasses.replace(server.downlink, support=server.client_support)


def downlink_of(cfg, support: np.ndarray | None = None) -> Downlink | None:
    """The run's broadcast rule (``None``: ``downlink = off``), coding ``support`` (sorted indices; ``None``: every
    coordinate) under ``downlink-support = data``."""
    if not build.downlink_on(cfg):
        return None
    on = build.support_on(cfg)
    return Downlink(broadcast_code(int(cfg.get("downlink-s"))), str(cfg.get("downlink-feedback")),
                    str(cfg.get("downlink-dither") or "stochastic"), on, support if on else None)


def support_bits(cfg, d: int) -> int:
    """The bits of ``theta_support`` (d bits, packed), sent with each client's first message under
    ``downlink-support = data``; 0 otherwise."""
    return 8 * -(-int(d) // 8) if build.support_on(cfg) else 0


def begin_round(server) -> None:
    """Round ``k``'s ``w_k`` and its code, from ``θ_k``."""
    dl, st = server.downlink, server.state
    if dl is None:
        return
    try:
        server.w, server.w_q = dl.step(st.theta, server.w, server.cfg.seed, st.k)
        server.w_codes = {}  # each client's code of this round's levels, made when its message is (code_of)
        st.w = server.w  # downlink-correction: the step's lag term (core.server_step)
    except ValueError as exc:  # θ_k − w_{k−1} not finite or beyond float32's range: the chain ran away
        server._diverged(st.k, f"the broadcast cannot code θ_k ({exc})")


def refreshed(server) -> None:
    """QLSD++'s anchor refreshed at this round is ``w_k``."""
    if server.downlink is not None:
        server.state.zeta = server.w.copy()


def add(server, i: int, fields: dict) -> None:
    """Client ``i``'s point: the code when it holds ``w_{k−1}``, else ``w_k`` in full; the anchor refreshed this
    round not sent when it is that point."""
    dl = server.downlink
    if dl is None:
        return
    k = server.state.k
    if server.w_q is not None and (dl.feedback == "none" or server.w_held[i] == k - 1):
        del fields["theta"]
        fields["theta_code"] = code_of(server, i)
    else:
        fields["theta"] = server.w
    if dl.on_support and (i not in server.support_sent or server.needs_resync[i]):
        S = dl.support if dl.support is not None else np.arange(server.d)
        fields["theta_support"] = support_to_bytes(S, server.d)
        server.support_sent.add(i)
    kind = server.cfg.kind
    if "anchor" in fields and kind.cv_zeta and k % max(int(server.cfg.l), 1) == 0:
        del fields["anchor"]
        fields["anchor_is_theta"] = 1


def code_of(server, i: int) -> bytes:
    """Client ``i``'s code of this round's levels: those on its own support alone under ``downlink-support = data``
    (:meth:`~qlsd_flwr.core.downlink.Downlink.code_for`), the whole code otherwise; made once a round and client."""
    own = own_positions(server.downlink.support, None if server.client_masks is None else server.client_masks[i])
    key = None if own is None else i
    if key not in server.w_codes:
        server.w_codes[key] = server.downlink.code_for(server.w_q, own)
    return server.w_codes[key]


def answered(server, i: int, ok: bool) -> None:
    """Client ``i`` answered round ``k`` (``ok``: it built ``w_k``; otherwise it is sent ``w`` in full next)."""
    if server.downlink is not None:
        server.w_held[i] = server.state.k if ok else -1


def arrays(server) -> dict:
    """The checkpoint's ``downlink_w`` (the last round's ``w``), when there is one."""
    return {} if server.downlink is None or server.w is None else {"downlink_w": server.w}


def restore(server, a: dict, error=ConfigError) -> None:
    """The chain's ``w`` from a checkpoint; every client is sent ``w`` in full next."""
    setup(server)
    w = checked_w(server.downlink, a.get("downlink_w"), (server.d,), server.state.k > 0, error)
    if w is not None:
        server.w = w


def checked_w(rule: Downlink | None, w, shape: tuple, after_round0: bool, error=ConfigError) -> np.ndarray | None:
    """A checkpoint's ``downlink_w`` (``None``: absent) held to the run's broadcast ``rule`` (``None``: off): the
    ``shape`` of finite float64 numbers, and present under ``ef21-p`` once round 0 was run (``after_round0``);
    a copy, or ``None`` when there is none, else ``error`` naming the field."""
    if rule is None:
        if w is not None:
            raise error("checkpoint: 'downlink_w' is the state of a run with downlink = qsgd; resume with it")
        return None
    if w is None:
        if rule.feedback == "ef21-p" and after_round0:
            raise error("checkpoint: downlink = qsgd (ef21-p) needs 'downlink_w', which this checkpoint lacks; "
                        "resume with downlink = off, as it was written")
        return None
    w = np.asarray(w)
    if w.shape != tuple(shape) or w.dtype != np.float64 or not np.all(np.isfinite(w)):
        raise error(f"checkpoint: 'downlink_w' must be {' × '.join(map(str, shape))} finite float64 numbers")
    return w.copy()
