"""What the preparation sends and receives, counted by kind of exchange as it is made.

Every engine hands :func:`qlsd_flwr.protocol.precondition.prepare` the same two ways to reach the clients
(``grad_fn``, ``curv_fn``); :func:`counted` wraps them so that each exchange adds its code lengths to a
:class:`Traffic`: a gradient exchange sends θ to each of the ``b`` clients (``64 d`` bits each, 32 in a
float32 descent; under ``downlink-support = data`` each client its own coordinates alone, :meth:`Traffic.theta_bits`) and gets ``∇U_i(θ)`` back (the same; at 12 or 16, :mod:`qlsd_flwr.protocol.gradients`, θ goes as
float32 and the gradient comes back as one fixed-point row, at most ``16 d + 40`` or ``24 ⌈d/2⌉ + 40`` bits (coded where
shorter, :mod:`qlsd_flwr.compression.fixed`: counted as the bytes the row takes, :func:`~qlsd_flwr.compression.fixed.sent_bits`), the width chosen
before each exchange by the descent's rule, :func:`precision`); a curvature exchange sends θ (``32 d`` where it is the
float32 descent's result, :func:`point_bits`, else ``64 d``; and, for Hessian-vector
products, the block's ``k`` vectors as rows of :mod:`qlsd_flwr.compression.fixed`, at most ``8 + k (16 d + 32)`` bits at
16 bits, ``8 + 32 k d`` at 32) and gets each client's report as sent (products: the same as the block). The kinds (``PREP_KINDS`` of
:mod:`qlsd_flwr.outputs.bits`) follow what the exchange is for: a gradient in the θ* descent is
``descent``, in the warm-up of ``metric-from = adapt`` ``warmup``; a product or a gradient difference for a
``λ_max`` (γ's Lanczos iteration, and the descent's power iteration for its step) ``power_iteration`` (the key's
name from before γ's Lanczos iteration, 2026-12-04); a curvature report ``curvature``, a block of the correction's
products ``products``; the claims at θ*
``claims`` (:func:`count_claims`); θ sent again to a node that lost the point it held ``resync`` (Flower only:
:meth:`qlsd_flwr.flower.phases.PhaseExchanges.ask`). The counts go into the preparation's facts (``prep_bits``, and the
totals ``prep_exchanges``, ``prep_uplink_bits``, ``prep_downlink_bits``).

θ goes to a client once a point (since 2026-12-05 afternoon): each client keeps the last point it was sent, and a
request at that point names it by its number instead, so an exchange at the last exchange's point counts no θ
(:meth:`Traffic.theta_bits`; ``prep_points_held``: the bits one client was not sent so, by kind).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from qlsd_flwr.compression import fixed
from qlsd_flwr.protocol.gradients import theta_width


#: how the progress lines name each kind of exchange
LABELS = {"descent": "θ* descent", "curvature": "curvature reports", "products": "Hessian-vector products",
          "power_iteration": "λ_max products", "warmup": "warm-up", "claims": "claims at θ*",
          "resync": "θ sent again to a restarted node"}


class Traffic:
    """The preparation's exchanges so far, by kind; ``phase`` names what a gradient exchange is for.

    ``say(line)``, when given, is told one line each time the kind of exchange changes (the run of
    exchanges of one kind just ended, with its bits and its wall-clock seconds) and, from :meth:`summary`, what
    the whole preparation cost (``prep_seconds`` in the facts: the time from the first exchange to the summary,
    the server's own work included): the progress of a preparation that may take minutes."""

    def __init__(self, b: int, d: int, info: dict, say=None, supports=None):
        self.b, self.d, self.info, self.say = int(b), int(d), info, say
        self.cols = own_cols(supports)  # each client's own coordinates, which its blocks of vectors carry (or None)
        # the numbers of a point sent to every client: each its own coordinates where they are known (theta_on)
        self.point_numbers = self.d * self.b if self.cols is None else \
            sum(self.d if c is None else c.size for c in self.cols)
        self.phase = "descent"
        self.precision = 64  # bits a number of a gradient exchange, both ways (:func:`precision`)
        info.setdefault("prep_bits", {})
        self.point = None  # the values of the last point θ sent: the clients hold it (:meth:`theta_bits`)
        self._run = None  # [kind, exchanges, uplink, downlink, start] of the exchanges since the kind last changed
        self._start = None  # when the first exchange was asked
        self._totals()

    def rows_bits(self, vectors, bits: int) -> int:
        """The bits of a block of vectors sent to every client at width ``bits``: each on its own coordinates where
        the clients' supports are known (:func:`own_cols`)."""
        if self.cols is None:
            return fixed.sent_bits(vectors, bits) * self.b
        return sum(fixed.sent_bits(vectors, bits, c) for c in self.cols)

    def theta_bits(self, theta, width: int, kind: str) -> int:
        """The bits of the point ``theta`` (the values the clients read) sent at ``width`` bits a number to every
        client in an exchange of ``kind``, each its own coordinates where the clients' supports are known
        (:func:`own_cols`, ``theta_on``: :meth:`qlsd_flwr.flower.phases.PhaseExchanges._at_point`): 0 where it is the
        last point sent, which each client holds and the request names by its number instead (issue 37: λ_max's
        products and the correction's ask at θ* a dozen times and more); the bits that one client reading every
        coordinate would not have been sent so, by kind, go into ``prep_points_held``."""
        key = np.asarray(theta, dtype=np.float64).tobytes()
        if key == self.point:
            held = self.info.setdefault("prep_points_held", {})
            held[kind] = held.get(kind, 0) + int(width) * self.d
            return 0
        self.point = key
        return int(width) * self.point_numbers

    def add(self, kind: str, uplink: int, downlink: int) -> None:
        """One exchange of ``kind`` with these code lengths (bits, all clients together)."""
        row = self.info["prep_bits"].setdefault(kind, {"uplink": 0, "downlink": 0, "exchanges": 0})
        row["uplink"] += int(uplink)
        row["downlink"] += int(downlink)
        row["exchanges"] += 1
        self._totals()
        if self._run is not None and self._run[0] != kind:
            self._flush()
        if self._run is None:
            now = time.monotonic()
            self._start = now if self._start is None else self._start
            self._run = [kind, 0, 0, 0, now]
        self._run[1] += 1
        self._run[2] += int(uplink)
        self._run[3] += int(downlink)

    def _flush(self) -> None:
        if self._run is not None and self.say is not None:
            kind, n, up, down, start = self._run
            self.say(f"  preparation · {LABELS.get(kind, kind)}: {n} exchange{'s' if n != 1 else ''}, "
                     f"{up:.3g} bits up, {down:.3g} down, {time.monotonic() - start:.1f} s")
        self._run = None

    def summary(self) -> None:
        """The last run's line, then one line with what the preparation cost (nothing when it made no exchange)."""
        self._flush()
        rows = self.info["prep_bits"]
        if self._start is not None:
            self.info["prep_seconds"] = round(time.monotonic() - self._start, 1)
        if self.say is None or not rows:
            return
        up, down = self.info["prep_uplink_bits"], self.info["prep_downlink_bits"]
        parts = ", ".join(f"{LABELS[k]} {rows[k]['uplink'] + rows[k]['downlink']:.3g}" for k in LABELS if k in rows)
        self.say(f"preparation: {self.info['prep_exchanges']} exchanges, {up:.3g} bits up + {down:.3g} down "
                 f"= {up + down:.3g} ({parts}), {self.info.get('prep_seconds', 0.0):.0f} s; summary.json 'bits'")

    def _totals(self) -> None:
        rows = self.info["prep_bits"].values()
        self.info["prep_exchanges"] = sum(r["exchanges"] for r in rows)
        self.info["prep_uplink_bits"] = sum(r["uplink"] for r in rows)
        self.info["prep_downlink_bits"] = sum(r["downlink"] for r in rows)


def point_bits(theta) -> int:
    """Bits a number of a point a curvature exchange sends: 32 where ``θ`` is exactly a float32 vector (the θ*
    descent's result where θ* is only the point where the curvature is taken: :mod:`qlsd_flwr.protocol.precondition`
    rounds it to what its exchanges carried), else 64. Exact either way: nothing is lost in the narrower form."""
    t = np.asarray(theta, dtype=np.float64)
    with np.errstate(over="ignore"):  # beyond float32's range: not exact, 64
        return 32 if np.array_equal(t.astype(np.float32).astype(np.float64), t) else 64


def as_point(theta) -> np.ndarray:
    """``θ`` as a curvature exchange sends it: float32 where :func:`point_bits` says so, else as it is."""
    return np.asarray(theta, dtype=np.float32) if point_bits(theta) == 32 else theta


@contextlib.contextmanager
def phase(fn, name: str):
    """Within the block, gradient exchanges through ``fn`` (a :func:`counted` ``grad_fn``) count as ``name``
    (one of ``PREP_KINDS``)."""
    traffic = getattr(fn, "traffic", None)
    if traffic is None:
        yield
        return
    before, traffic.phase = traffic.phase, name
    try:
        yield
    finally:
        traffic.phase = before


@contextlib.contextmanager
def precision(fn, bits):
    """Within the block, gradient exchanges through ``fn`` (a :func:`counted` ``grad_fn`` over a
    :class:`~qlsd_flwr.protocol.build.GradExchange`) send θ and the gradients with ``bits`` a number, or at the width
    ``bits(scales, norm)`` gives before each exchange from the one before (the clients' row scales and the summed
    gradient's norm: :class:`qlsd_flwr.protocol.descent.DescentWidth`, whose ``recheck`` may ask the same θ again
    wider). Without a count, nothing changes."""
    traffic = getattr(fn, "traffic", None)
    if traffic is None or not hasattr(fn, "clients"):  # only a GradExchange (it has clients) takes a precision
        yield
        return
    before, traffic.precision = traffic.precision, (bits if callable(bits) else int(bits))
    try:
        yield
    finally:
        traffic.precision = before


def counted(grad_fn, curv_fn, traffic: Traffic):
    """``grad_fn`` and ``curv_fn`` adding each exchange to ``traffic`` (module docstring); ``None`` stays ``None``."""
    b, d = traffic.b, traffic.d

    def exchange(th, bits, ruled):  # counted when asked: a request that fails still went out
        if ruled:  # the widths a rule chose go into the summary
            widths = traffic.info.setdefault("opt_widths", {})
            widths[str(bits)] = widths.get(str(bits), 0) + 1
        # 12, 16: one fixed-point row a client, counted as its bytes (the exchange's ``uplink``); a request that fails
        # is counted at the raw layout's length, the most its replies could have cost
        up = (fixed.message_bits(1, d, bits) if bits < 32 else bits * d) * b
        width = theta_width(bits)  # θ as the request carries it: float32 below 64
        down = traffic.theta_bits(th if width == 64 else np.asarray(th, dtype=np.float32), width, traffic.phase)
        try:
            g = grad_fn(th) if bits == 64 else grad_fn(th, bits)
            up = getattr(grad_fn, "uplink", None) or up
        finally:
            traffic.add(traffic.phase, up, down)
        return g, float(np.linalg.norm(g))

    def grad(th):
        rule = traffic.precision
        if not callable(rule):
            g, grad.norm = exchange(th, rule, False)
            return g
        # a rule (precision): the width from the exchange before, and the same θ again where this reading may end
        # the descent with too coarse a rounding (protocol.descent.DescentWidth)
        g, norm = exchange(th, bits := rule(getattr(grad_fn, "scales", None), grad.norm), True)
        if (again := rule.recheck(getattr(grad_fn, "scales", None), norm, bits)) is not None:
            g, norm = exchange(th, again, True)
        rule.saw(norm)
        grad.norm = norm
        return g

    def curv(th, kind, vectors=None, bits=fixed.BITS):
        reports = curv_fn(th, kind, vectors, bits) if vectors is not None else curv_fn(th, kind)
        if vectors is None or kind == "kronecker-block":  # reports as each travels (metric-block's: float32, after
            # the input directions went down as rows)
            up = sum(8 * len(h) if isinstance(h, (bytes, bytearray)) else 8 * int(np.asarray(h).nbytes)
                     for h in reports.values())
            rows = 0 if vectors is None else fixed.sent_bits(vectors, bits)
            traffic.add("curvature", up, traffic.theta_bits(th, point_bits(th), "curvature") + rows * b)
            return reports
        # products and vectors as rows of width bits (compression.fixed); a reply that did not decode, as received
        up = sum(8 * len(h) if isinstance(h, (bytes, bytearray)) else fixed.sent_bits(np.reshape(h, (-1, d)), bits)
                 for h in reports.values())
        kind = "power_iteration" if traffic.phase == "power_iteration" else "products"
        traffic.add(kind, up, traffic.theta_bits(th, point_bits(th), kind) + traffic.rows_bits(vectors, bits))
        return reports

    if grad_fn is not None:
        grad.traffic, grad.norm = traffic, None
    if hasattr(grad_fn, "clients"):  # a build.GradExchange: its clients' gradients one by one, counted alike

        def clients(th):
            traffic.add(traffic.phase, 64 * d * b, traffic.theta_bits(th, 64, traffic.phase))
            return grad_fn.clients(th)

        grad.clients, grad.combine, grad.n_data, grad.kept = clients, grad_fn.combine, grad_fn.n_data, grad_fn.kept
    return (None if grad_fn is None else grad), (None if curv_fn is None else curv)


def own_cols(supports) -> list | None:
    """Each client's own coordinates (sorted indices; ``None``: every one) from their declared supports (boolean masks,
    ``None`` each: every coordinate), where the Hessian-vector exchanges send each client its block on them
    (``downlink-support = data``; :func:`qlsd_flwr.compression.fixed.encode`'s ``cols``); ``None`` where none is
    known."""
    if supports is None or all(m is None for m in supports):
        return None
    return [None if m is None else np.flatnonzero(m) for m in supports]


def count_claims(info: dict, b: int, d: int) -> None:
    """The claims at θ* (QLSD*, VR-FALD*, FSGLD): θ* to each client, its ``∇U_i(θ*)`` back."""
    Traffic(b, d, info).add("claims", 64 * d * b, 64 * d * b)
