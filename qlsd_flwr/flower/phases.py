"""The exchanges before sampling on the Flower path: the θ* descent's gradients, the curvature
reports and the claims at θ*, each reply attributed to the node it came from and checked before
it is used.

One unusable reply (a wrong length, a non-finite value, an error, no reply in time) must neither
stop the run nor enter ``∇U``. It is counted (``rejected['phase_reply']`` in ``summary.json``) and
the client is asked again at once. Still unusable, the client is **left out of the run** (not asked
again, ``excluded`` at round 0 in ``summary.json``) and :class:`LeftOut` is raised: the strategy
starts the preparation again without it, so that θ*, the metric, γ and the warm-up are each a
function of one set of clients (a descent, a power iteration or a finite difference that lost a
term halfway would be neither). The chain then samples the posterior of the other clients' data,
as after the norm guard excludes one (``docs/DEPLOYMENT.md`` §9b). The run stops only when no
client is left.

**The claims at θ*** (QLSD*, :mod:`qlsd_flwr.protocol.claims`). Every gradient a client gives is
remembered as a sketch (its projection on :data:`SKETCH` fixed random directions), for the points
where ``‖∇U‖`` was smallest (the descent's last points, θ* among them). When the claims are asked
at θ*, a client whose claim differs from what it said at θ* during the descent changed its answer:
it is left out, and the preparation starts again. Its reply to θ* in sampling is then held to its
claim (the server's check). A client that lies at θ* in the descent *and* in the claims *and* in
sampling is one with other data: only a fixed ``norm-bound = B`` bounds it, and a claim over ``B``
leaves its client out here too.
"""

from __future__ import annotations

import hashlib
import heapq
import logging

import numpy as np
from flwr.app import Message, MessageType

from qlsd_flwr.core.potential import declares_log_concave
from qlsd_flwr.flower import stopping
from qlsd_flwr.flower.records import record_fields, to_content
from qlsd_flwr.protocol import build, precondition
from qlsd_flwr.protocol.traffic import Traffic, as_point, count_claims, own_cols
from qlsd_flwr.protocol.claims import claims_over_bound
from qlsd_flwr.robust.claims import out_of_scale, relative_gap
from qlsd_flwr.robust.reports import MAX_BLOCK, clamped_counts
from qlsd_flwr.compression import fixed
from qlsd_flwr.protocol.gradients import gradient_of
from qlsd_flwr.protocol.wire import PhaseError, report_of
from qlsd_flwr.tasks.threads import pin_blas

log = logging.getLogger("qlsd_flwr")

#: random directions of a gradient's sketch, and how many points' sketches are kept
SKETCH, KEPT = 8, 64


class LeftOut(Exception):
    """A client was left out: the preparation starts again without it."""


class PhaseExchanges:
    """The phases before sampling of one strategy (module docstring); ``left_out`` and
    ``rejected`` are what the server records once sampling begins."""

    def __init__(self, cfg, task, nodes, settings):
        self.cfg, self.task, self.nodes, self.settings = cfg, task, nodes, settings
        self.d = task.dim
        self.left_out: dict[int, str] = {}  # client -> why
        self.rejected = 0
        self._dirs = np.random.default_rng(0).normal(size=(SKETCH, self.d))
        self._sketches: list = []  # a heap of (−‖∇U‖, n, θ bytes, {i: sketch}): the KEPT smallest ‖∇U‖
        self._n = 0
        self._points: dict[int, tuple[int, bytes]] = {}  # client -> (number, values) of the last point θ it was sent
        self._resent: list[int] = []  # the bits of each request sent again with θ to a client that lost its point
        self._whole = False  # θ whole to every client (the claims), not on each client's own coordinates

    def prepare(self, grid, theta0: np.ndarray, timeout: float, warm, wants_claims: bool):
        """The preparation (θ*, the metric, γ: :func:`qlsd_flwr.protocol.precondition.prepare`) over
        ``grid``, then the claims at θ* when the sampler takes them. A client left out
        (:class:`LeftOut`) starts it again without that client, and clears the warm-up store
        ``warm``. Returns ``(prep, claims)``."""
        pin_blas()  # the server's linear algebra on one BLAS thread, as every engine's (a user's ServerApp too)
        while True:
            self._points.clear()  # every attempt counts θ from its first exchange (protocol.traffic.counted)
            self._resent.clear()
            try:
                n_data = [self.nodes.n_data.get(i, 1) for i in range(self.cfg.b)]
                said = [self.nodes.log_concave.get(i, False) for i in self.clients()]  # the handshakes' claims
                prior_concave = declares_log_concave(self.task.prior)
                prep = precondition.prepare(
                    self.cfg, self.task, theta0,
                    build.GradExchange(self.cfg, self.task.prior,
                                       lambda th, precision=64: self.gradients(grid, th, timeout, precision),
                                       self.clients, n_data),
                    lambda th, kind, vectors=None, bits=fixed.BITS: self.curvature(grid, th, kind, timeout, vectors,
                                                                                   bits),
                    n_data=n_data, warm=warm,
                    log_concave=prior_concave and all(said), supports=self._supports(),
                    # the products' rule by the majority: one client's claim cannot weaken it (robust.products)
                    products_log_concave=prior_concave and 2 * sum(said) > len(said))
                resync = Traffic(len(self.clients()), self.d, prep.info)
                for bits in self._resent:  # a restarted node's θ, sent again: counted beside the rest
                    resync.add("resync", 0, bits)
                if not wants_claims:
                    return prep, None
                claims = self.claims(grid, prep.theta_star, timeout, prep.metric)
                count_claims(prep.info, len(self.clients()), self.d)
                return prep, claims
            except LeftOut:
                if warm is not None:
                    warm.clear()

    def clients(self) -> list[int]:
        return [i for i in range(self.cfg.b) if i not in self.left_out]

    def _supports(self) -> list | None:
        """The clients' declared supports from their handshakes, under ``downlink-support = data`` (else ``None``)."""
        return self.nodes.supports(self.cfg.b) if build.support_on(self.cfg) else None

    def ask(self, grid, fields: dict, timeout: float, clients: list[int], per: dict | None = None) -> dict[int, bytes]:
        """Send ``fields`` (with ``client = i``) to ``clients``; ``{i: payload}`` of the replies,
        each attributed to the node it came from (never to the index it claims). ``fields``' θ goes to a client
        only where it is not the point that client holds (:meth:`_at_point`); a client that answers ``resync`` (it
        lost that point: a restarted node) is asked once more with θ."""
        out: dict[int, bytes] = {}
        point = _point_of(fields)
        cols = None if self._whole else self._own()
        for _ in range(2):
            stopping.check()  # a stop asked for meanwhile (flwr stop, SIGTERM, Ctrl-C) ends the preparation here
            msgs = [Message(to_content({**self._at_point(fields, point, i, cols), **(per or {}).get(i, {}),
                                        "client": i}, self.settings[i]), self.nodes.node_of[i], MessageType.TRAIN)
                    for i in clients]
            client_of = {self.nodes.node_of[i]: i for i in clients}
            lost = []
            for msg in grid.send_and_receive(msgs, timeout=timeout):
                i = client_of.get(msg.metadata.src_node_id)
                if i is None or msg.has_error():
                    continue
                rec = record_fields(msg.content) or {}
                if isinstance(rec.get("payload"), (bytes, bytearray)):
                    out[i] = bytes(rec["payload"])
                elif rec.get("status") == "resync":  # before sampling: it lost the point (a restarted node)
                    lost.append(i)
            if not lost or "theta" not in fields:
                break
            for i in lost:  # asked again with θ, and counted (the preparation's kind "resync")
                self._points.pop(i, None)
                vec = (per or {}).get(i, fields).get("vectors", b"")
                theta = np.asarray(fields["theta"])
                n = theta.size if cols is None or cols[i] is None else cols[i].size
                self._resent.append(8 * (theta.itemsize * n + len(vec)))
            clients = lost
        return out

    def _at_point(self, fields: dict, point: tuple[int, bytes] | None, i: int, cols: list | None = None) -> dict:
        """``fields`` for client ``i``: with θ and its number ``point`` (a 63-bit digest of its values) where ``i``
        does not hold that point (which it then keeps), with the number alone where it does (issue 37: λ_max's
        products and the correction's ask at θ* a dozen times and more); ``point`` is :func:`_point_of` the request,
        made once for all its clients. With ``cols`` (each client's own coordinates, :meth:`_own`), θ goes as
        ``theta_on``, its numbers there alone: nothing the client computes before sampling reads the others. Every
        engine counts the point's bits so (:func:`~qlsd_flwr.protocol.traffic.counted`)."""
        if point is None:
            return fields
        rest = {k: v for k, v in fields.items() if k != "theta"}
        if self._points.get(i) == point:
            return {**rest, "point": point[0]}
        self._points[i] = point
        if cols is not None and cols[i] is not None:
            return {**rest, "theta_on": np.asarray(fields["theta"])[cols[i]], "point": point[0]}
        return {**fields, "point": point[0]}

    def _own(self) -> list | None:
        """Each client's own coordinates (:func:`~qlsd_flwr.protocol.traffic.own_cols`), where the preparation sends
        it θ and its blocks of vectors there alone (``downlink-support = data``, :func:`~qlsd_flwr.protocol.build.
        support_on`; ``None``: every coordinate to every client)."""
        return own_cols(self._supports())

    def _leave_out(self, why: dict[int, str]) -> None:
        for i, w in sorted(why.items()):
            self.left_out[i] = w
            log.warning("client %d: %s before sampling: left out of the run, and the preparation starts again "
                        "without it; the chain samples the posterior of the other clients' data (summary.json "
                        "'excluded')", i, w)
        if not self.clients():
            raise PhaseError("optimisation phase: no usable gradient from any client ("
                             + ", ".join(f"{j}: {w}" for j, w in sorted(self.left_out.items())) + ")")
        raise LeftOut(sorted(why))

    def gradients(self, grid, theta: np.ndarray, timeout: float, precision: int = 64) -> list[np.ndarray]:
        """The kept clients' ``∇U_i(θ)`` in client order (zeros for those left out); an unusable reply
        is asked once more, then its client is left out (:class:`LeftOut`). ``precision = 32``: θ (already
        float32-valued) travels as float32 and the gradients come back so; 12, 16: as fixed-point rows of that width."""
        ask = {"phase": "grad", "round": -1, "theta": theta}
        if precision != 64:  # θ (already float32-valued) as float32; the gradients at the width asked
            ask = {**ask, "theta": np.asarray(theta, dtype=np.float32), "precision": precision}
        grads: dict[int, np.ndarray] = {}
        refused: dict[int, str] = {}
        for attempt in range(2):
            want = self.clients() if attempt == 0 else sorted(refused)
            if not want:
                break
            got = self.ask(grid, ask, timeout, want)
            for i in want:
                if i not in got:
                    refused[i] = "no reply"
                    continue
                try:
                    grads[i] = gradient_of(got[i], self.d, precision)
                    refused.pop(i, None)
                except ValueError as exc:
                    refused[i] = str(exc)
            self.rejected += len(refused)
        if refused:
            self._leave_out({i: f"no usable gradient ({w})" for i, w in refused.items()})
        out = [grads.get(i, np.zeros(self.d)) for i in range(self.cfg.b)]
        self._remember(theta, grads, out)
        return out

    def _remember(self, theta: np.ndarray, grads: dict, out: list) -> None:
        size = float(np.linalg.norm(build.combine_grads(self.cfg, self.task.prior, out, theta)))
        entry = (-size, self._n, np.asarray(theta, dtype=np.float64).tobytes(),
                 {i: self._dirs @ g for i, g in grads.items()})
        self._n += 1
        (heapq.heappush if len(self._sketches) < KEPT else heapq.heappushpop)(self._sketches, entry)

    def claims(self, grid, theta_star: np.ndarray, timeout: float, metric=None) -> list[np.ndarray]:
        """Every kept client's ``∇U_i(θ*)``, each held to what it said at θ* during the descent
        (module docstring) and to a fixed ``norm-bound`` as its sampling replies will be (in ``metric``'s coordinates
        where the run's messages are); :class:`LeftOut` for a client that changed its answer."""
        key = np.asarray(theta_star, dtype=np.float64).tobytes()
        before = next((e[3] for e in self._sketches if e[2] == key), {})
        self._points.clear()  # the claims send θ* whole, as count_claims counts them
        self._whole = True
        try:
            grads = self.gradients(grid, theta_star, timeout)
        finally:
            self._whole = False
        changed = {}
        for i, old in before.items():
            if i not in self.left_out and (gap := relative_gap(self._dirs @ grads[i], old)) is not None:
                changed[i] = f"its ∇U_i(θ*) changed between the descent and the claims (relative {gap:.3g})"
        if self.cfg.kind.needs_theta_star:  # QLSD*'s estimates carry c_i; VR-FALD*'s, FSGLD's local steps Σ_j c_j
            changed.update(claims_over_bound(self.cfg, self.d, metric, grads))
        if self.cfg.kind.at_theta_star:  # every client's local steps carry Σ_j c_j: one claim out of scale moves all
            kept = self.clients()
            n = clamped_counts([self.nodes.n_data.get(i, 1) for i in range(self.cfg.b)], kept)
            changed.update({i: w for i, w in out_of_scale({i: grads[i] for i in kept}, n).items() if i not in changed})
        if changed:
            self._leave_out(changed)
        return grads

    def curvature(self, grid, theta: np.ndarray, kind: str, timeout: float,
                  vectors: np.ndarray | None = None, bits: int = fixed.BITS) -> dict[int, np.ndarray]:
        """The kept clients' curvature reports at ``θ`` (``kind = "hvp"``: their Hessian-vector products
        with the rows of ``vectors``, sent at width ``bits``: :mod:`qlsd_flwr.compression.fixed`), as received:
        :func:`qlsd_flwr.protocol.precondition.prepare` validates each."""
        fields = {"phase": "curvature", "round": -1, "theta": as_point(theta), "kind": kind}
        own = self._own() if kind == "hvp" else None  # each client's block on its own coordinates
        if vectors is not None and own is None:
            fields["vectors"] = fixed.encode(vectors, bits)
        per = None if vectors is None or own is None else \
            {i: {"vectors": fixed.encode(vectors, bits, own[i])} for i in self.clients()}
        got = self.ask(grid, fields, timeout, self.clients(), per)
        rows = MAX_BLOCK if vectors is None else np.atleast_2d(vectors).shape[0]
        return {i: (_products(b, theta.size, bits, rows) if kind == "hvp" else report_of(b, kind))
                for i, b in got.items()}


def _products(buf: bytes, d: int, bits: int, rows: int = MAX_BLOCK):
    """A client's block of Hessian-vector products (fixed-point rows at the width asked, at most the ``rows`` asked)
    as ``(b, d)`` float64, or the bytes as received when they do not decode or come at another width: the
    preparation's check refuses those, and counts them (a client answers at its request's width, as the direct
    engines do)."""
    try:
        return fixed.decode(buf, d, rows) if fixed.width_of(buf) == bits else buf
    except ValueError:
        return buf


def _point_of(fields: dict) -> tuple[int, bytes] | None:
    """``(number, values)`` of the request's θ (``None`` without one): the values the client reads, and a 63-bit
    digest of them as the number, so that another strategy of the same run (whose numbers a client may still hold)
    or a lost message can never make a client take one point for another."""
    if "theta" not in fields:
        return None
    key = np.asarray(fields["theta"], dtype=np.float64).tobytes()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1, key
