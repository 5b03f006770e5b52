"""What travels between the ServerApp and a ClientApp, as plain Python values.

Server → client:
  ``phase`` (``"sample"`` or ``"grad"``), ``round`` k, ``client`` i, ``theta`` (θ_k),
  ``anchor_version``, ``eta_count`` (how many memory updates the server has applied
  for this client) and, only when the server believes the client lacks them, ``anchor``
  (ζ or θ*) and ``eta`` (the server's mirror of η_i). The vectors (:data:`VECTORS`) are float64
  arrays; on Flower's Message API they travel in ``ArrayRecord`` objects (see
  :mod:`qlsd_flwr.flower.records`), on the legacy API and the ``local`` engine as little-endian
  float64 bytes (:func:`vectors_to_bytes`). Beside them, the client's settings
  (:func:`qlsd_flwr.protocol.build.client_settings`): what it needs to compute its message, so a
  client needs no run config of its own.
Client → server:
  ``client`` i, ``status`` (``"ok"`` or ``"resync"``), ``payload`` (the *encoded* compressed
  message: QSGD-coded bytes, never a dense float vector) and ``anchor_version`` used. The
  server rejects (and counts) a reply that lacks any of these, has the wrong type, names
  another client, used another anchor than the current one, or whose payload does not decode
  to a finite vector of dimension ``d``; it never raises on a reply.

A client whose cached anchor or memory disagrees with the server's counters answers
``resync`` instead of a gradient; the server counts it as inactive that round and sends
the anchor and its η_i mirror next time. This is how a node that rejoins with empty state
is brought back in sync (η = Σ η_i holds again). After a resume from a checkpoint the server
sends the anchor and the mirror (with ``eta_count``) unasked in its first message to each
client: :func:`qlsd_flwr.protocol.client.handle` installs them before it checks its counters, so a
client that lost its state computes exactly the reply it would have, and no round is lost.
"""

from __future__ import annotations

import functools

import numpy as np

from qlsd_flwr.samplers.fields import CODE, FIELDS, FLAG, GRADIENT, METRIC, ROUND, VECTOR, undeclared


def arr_to_bytes(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, dtype="<f8").tobytes()


#: the fields holding a vector of R^d (:data:`qlsd_flwr.samplers.fields.FIELDS` of form ``vector``); all but θ
#: may come with some chains of a several-chain message
SENT_WITH = tuple(n for n, f in FIELDS.items() if f.form == VECTOR)
#: and θ before sampling on a client's own coordinates alone (``theta_on``: protocol.client.prep_point)
VECTORS = ("theta", "theta_on") + SENT_WITH
#: the reply fields holding ``∇U_i`` at a point (form ``gradient``)
UP_GRADIENTS = tuple(n for n, f in FIELDS.items() if f.form == GRADIENT)


def payload_bits(fields: dict) -> int:
    """A message's code length: 8 bits a byte of every array and byte string in ``fields`` (64 a float64
    number); its scalars (phase, round, client, versions, counts) are framing, as Flower's own."""
    return sum(8 * (v.nbytes if isinstance(v, np.ndarray) else len(v)) for v in fields.values()
               if isinstance(v, (np.ndarray, bytes, bytearray)))


def metric_to_bytes(metric) -> bytes:
    """The rivals' local-step metric as it travels (``metric``, sent with a client's first message and
    after a resync): its tagged encoding (:meth:`qlsd_flwr.core.metric.Metric.to_bytes`; the identity as
    empty bytes). One run's chains share it, so a several-chain message carries it once."""
    return b"" if metric.is_identity else metric.to_bytes()


def metric_of(x, d: int, refs: bool = False):
    """:func:`_parse_metric`, the last two metrics rebuilt kept (a Flower client rebuilds its state's
    metric at every message: a dense one's Cholesky factor, so, once a run instead). ``refs``: a client that quantises
    in the clients' block basis, which may come by reference (:class:`~qlsd_flwr.core.block_basis.BasisRef`)."""
    if not isinstance(x, (bytes, bytearray)):
        return _parse_metric(x, d)  # refused there, naming the field
    return _parsed_metric(bytes(x), int(d), bool(refs))


def _parse_metric(x, d: int, refs: bool = False):
    """A metric sent as :func:`metric_to_bytes` made (:func:`qlsd_flwr.core.metric_codec.from_bytes`: the tag, the
    kind, each array's name and shape, every number finite, a dense matrix symmetric positive-definite,
    Kronecker factors orthogonal with positive eigenvalues, the length held to what the largest metric
    of ``d`` takes before anything is allocated); else ``ValueError`` naming ``metric``."""
    from qlsd_flwr.core.metric import MetricError
    from qlsd_flwr.core.metric_codec import from_bytes

    if not isinstance(x, (bytes, bytearray)):
        raise ValueError(f"sample: 'metric' must be the bytes of a metric of d = {d}, not {type(x).__name__}")
    try:
        return from_bytes(x, d, refs=refs)
    except MetricError as exc:
        raise ValueError(f"sample: 'metric' is not a usable metric: {exc}") from None


_parsed_metric = functools.lru_cache(maxsize=2)(_parse_metric)


def vectors_to_bytes(fields: dict) -> dict:
    """``fields`` with its vectors as float64 bytes (the legacy API and the ``local`` engine)."""
    return {k: (arr_to_bytes(v) if k in VECTORS else v) for k, v in fields.items()}


def vector(x, d: int) -> np.ndarray:
    """A vector field as a float64 ``(d,)`` array, from an array or from float64 bytes;
    ``ValueError`` naming the shape or length otherwise."""
    if isinstance(x, np.ndarray):
        if x.shape != (d,):
            raise ValueError(f"expected a vector of shape ({d},), got shape {x.shape}")
        return np.array(x, dtype=np.float64)  # a copy: the caller may keep it as its state
    return bytes_to_arr(x, d)


def bytes_to_arr(b: bytes, d: int) -> np.ndarray:
    if not isinstance(b, (bytes, bytearray)) or len(b) != 8 * d:
        raise ValueError(f"expected {8 * d} bytes of float64, got {type(b).__name__} of length "
                         f"{len(b) if isinstance(b, (bytes, bytearray)) else '?'}")
    return np.frombuffer(b, dtype="<f8").astype(np.float64)


def report_bytes(h) -> bytes:
    """A curvature report's payload: bytes as they are (K-FAC's first report and ``metric-block``'s, which carry a
    square root in 12-bit rows: :mod:`qlsd_flwr.compression.root`), the other reports' numbers as float64."""
    return bytes(h) if isinstance(h, (bytes, bytearray)) else arr_to_bytes(np.asarray(h).ravel())


def report_of(buf, kind: str):
    """A curvature report as received: the bytes themselves for K-FAC's first (``kind = "kronecker"``) and
    ``metric-block``'s, which their checks read; float64 numbers for the others, or the bytes as they came when
    they are not whole numbers (the preparation's check refuses those)."""
    if kind in ("kronecker", "kronecker-block") or not isinstance(buf, (bytes, bytearray)) or len(buf) % 8:
        return buf
    return np.frombuffer(buf, dtype="<f8")


class PhaseError(RuntimeError):
    """A phase before sampling cannot go on: every client's reply is needed and one is unusable."""


class ReplyError(ValueError):
    """A client reply that is malformed; the server rejects and counts it."""


def parse_fields(rec: dict | None, expected_client: int, up=None) -> dict:
    """Validate a reply's fields; raises :class:`ReplyError` on anything off, and on a sampler's field that
    ``up`` (the run's estimator's; ``None``: any) does not declare."""
    if not isinstance(rec, dict):
        raise ReplyError("reply has no 'qlsd' record")
    refuse_undeclared(rec, up, "up", ReplyError)
    try:
        client = int(rec["client"])
        status = str(rec["status"])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ReplyError(f"reply lacks client/status: {exc}") from exc
    if client != expected_client:
        raise ReplyError(f"reply from client {client}, expected {expected_client}")
    if status == "resync":
        return {"status": status}
    if status != "ok":
        raise ReplyError(f"unknown status {status!r}")
    payload = rec.get("payload")
    if not isinstance(payload, (bytes, bytearray)):
        raise ReplyError("reply payload is not bytes")
    try:
        version = int(rec["anchor_version"])
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ReplyError(f"missing or bad anchor_version: {exc!r}") from exc
    out = {"status": status, "payload": bytes(payload), "anchor_version": version}
    for name in UP_GRADIENTS:  # ∇U_i(θ*) repeated; VR-FALD*'s ∇U_i(θ_k) (8d bytes, checked later)
        if name in rec:
            if not isinstance(rec[name], (bytes, bytearray)):
                raise ReplyError(f"{name} is not bytes")
            out[name] = bytes(rec[name])
    return out


# ---- several chains in one message ------------------------------------------------------------
# A run of C > 1 chains (num-chains; chain c draws every random number from seed + c) asks client
# i once a round for every chain in which i is active, in one message. Server → client:
#   ``chains`` (the chain indices, increasing), ``theta`` (an (m, d) array, row j = chain
#   chains[j]), ``anchor_version`` and ``eta_count`` (lists, one entry a chain), and when some
#   chains send them, ``anchor`` / ``eta`` ((n, d) arrays) with ``anchor_chains`` / ``eta_chains``
#   naming their rows; ``phase``, ``round`` and ``client`` as for one chain.
# Client → server: ``client``, ``chains`` (as asked), and one entry a chain in ``status``,
# ``payload`` (b"" for a resync) and ``anchor_version``. Each chain's message is compressed,
# counted and validated on its own, exactly as a one-chain reply. A one-chain run keeps the
# one-chain fields above (no ``chains``), so its messages are unchanged.
MAX_CHAIN = 2 ** 31  # a chain index is a non-negative int below this


def bundle_request(per_chain: dict[int, dict], theta: np.ndarray | None = None) -> dict:
    """One message's fields from the per-chain fields of one client (see above); ``theta``: the
    chains' θ already stacked in chain order (the server stacks them once a round)."""
    chains = sorted(per_chain)
    first = per_chain[chains[0]]
    out = {"phase": first["phase"], "round": first["round"], "client": first["client"], "chains": chains}
    # θ in full for every chain, or (downlink = qsgd) for the chains ``theta_chains`` names, the others' coded
    with_theta = [c for c in chains if "theta" in per_chain[c]]
    if theta is None and with_theta:
        theta = np.stack([np.asarray(per_chain[c]["theta"], dtype=np.float64) for c in with_theta])
    if with_theta:
        out["theta"] = theta
    if with_theta and with_theta != chains:  # none: every chain's θ is coded (no empty list: Flower refuses one)
        out["theta_chains"] = with_theta
    out.update({"anchor_version": [int(per_chain[c]["anchor_version"]) for c in chains],
                "eta_count": [int(per_chain[c]["eta_count"]) for c in chains]})
    for name, f in FIELDS.items():  # the samplers' own fields, each by its form
        if f.direction != "down":
            continue
        if f.form == ROUND:  # FALD: each chain's (h, w_i, S_A, p_i), 32 bytes a chain
            if name in first:
                out[name] = b"".join(bytes(per_chain[c][name]) for c in chains)
            continue
        rows = [c for c in chains if name in per_chain[c] and (f.form != FLAG or per_chain[c][name])]
        if not rows:
            continue
        out[f"{name}_chains"] = rows
        if f.form == METRIC:  # the run's, the same for every chain: once
            out[name] = bytes(per_chain[rows[0]][name])
        elif f.form == CODE:  # one a chain (a list of bytes)
            out[name] = [bytes(per_chain[c][name]) for c in rows]
        elif f.form == VECTOR:
            out[name] = np.stack([np.asarray(per_chain[c][name], dtype=np.float64) for c in rows])
    return out


def _chain_list(x, name: str) -> list[int]:
    if not isinstance(x, (list, tuple)) or not x:
        raise ValueError(f"{name}: expected a non-empty list of chain indices")
    out = []
    for c in x:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= int(c) < MAX_CHAIN:
            raise ValueError(f"{name}: bad chain index {c!r}")
        out.append(int(c))
    if any(b <= a for a, b in zip(out, out[1:])):
        raise ValueError(f"{name}: chain indices must increase")
    return out


def matrix(x, m: int, d: int) -> np.ndarray:
    """An ``(m, d)`` float64 array from an array or from float64 bytes; ``ValueError`` otherwise."""
    if isinstance(x, np.ndarray):
        if x.shape != (m, d):
            raise ValueError(f"expected an array of shape ({m}, {d}), got shape {x.shape}")
        return np.array(x, dtype=np.float64)
    return bytes_to_arr(x, m * d).reshape(m, d)


def _int_list(x, m: int, name: str) -> list[int]:
    if not isinstance(x, (list, tuple)) or len(x) != m:
        raise ValueError(f"{name}: expected a list of {m} integers")
    if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in x):
        raise ValueError(f"{name}: expected integers")
    return [int(v) for v in x]


def unbundle_request(fields: dict, d: int, down=None) -> dict[int, dict]:
    """The per-chain fields of a several-chain message (:func:`bundle_request`); ``ValueError``
    naming the field when it is malformed, or when it is a sampler's field (:mod:`qlsd_flwr.samplers.fields`)
    that ``down`` (the run's estimator's) does not declare."""
    refuse_undeclared(fields, down, "down")
    chains = _chain_list(fields.get("chains"), "chains")
    n_chains = len(chains)
    if "theta_chains" in fields:  # downlink = qsgd: θ in full for these chains only
        with_theta = _chain_list(fields["theta_chains"], "theta_chains")
        if not set(with_theta) <= set(chains):
            raise ValueError("theta_chains: names a chain the message does not carry")
    else:
        with_theta = chains if "theta" in fields else []
    if with_theta and "theta" not in fields:
        raise ValueError("theta: theta_chains names chains but the message carries no theta")
    theta = matrix(fields["theta"], len(with_theta), d) if with_theta else None
    versions = _int_list(fields.get("anchor_version"), n_chains, "anchor_version")
    counts = _int_list(fields.get("eta_count"), n_chains, "eta_count")
    per = {c: {"phase": fields["phase"], "round": fields["round"], "client": fields["client"],
               "anchor_version": versions[j], "eta_count": counts[j]}
           for j, c in enumerate(chains)}
    for j, c in enumerate(with_theta):
        per[c]["theta"] = theta[j]
    for name, f in FIELDS.items():  # the samplers' own fields, each by its form
        if f.direction != "down":
            continue
        if f.form == ROUND:
            if name in fields:
                loc = fields[name]
                if not isinstance(loc, (bytes, bytearray)) or len(loc) != 32 * n_chains:
                    raise ValueError(f"{name}: expected {32 * n_chains} bytes (four float64 a chain)")
                for j, c in enumerate(chains):
                    per[c][name] = bytes(loc[32 * j: 32 * j + 32])
            continue
        if f"{name}_chains" not in fields:
            continue
        rows = _chain_list(fields[f"{name}_chains"], f"{name}_chains")
        if not set(rows) <= set(chains):
            raise ValueError(f"{name}_chains: names a chain the message does not carry")
        # the metric and a code are checked by the client's handle; a flag's rows are the chains it holds for
        vals = matrix(fields[name], len(rows), d) if f.form == VECTOR else None
        if f.form == CODE:
            vals = fields.get(name)
            if not isinstance(vals, (list, tuple)) or len(vals) != len(rows):
                raise ValueError(f"{name}: expected one entry for each of {len(rows)} chains")
        for j, c in enumerate(rows):
            per[c][name] = vals[j] if vals is not None else fields.get(name) if f.form == METRIC else 1
    return per


def refuse_undeclared(fields: dict, declared, direction: str, error=ValueError) -> None:
    """``error`` naming a sampler's field in ``fields`` that ``declared`` (its estimator's ``down`` or ``up``;
    ``None``: any) does not hold: a message or reply that carries another sampler's field."""
    if declared is None:
        return
    name = undeclared(fields, declared, direction)
    if name is not None:
        where, side = ("sample", "messages") if direction == "down" else ("reply", "replies")
        raise error(f"{where}: {name!r} is not a field of this sampler's {side}; its fields: "
                    f"{', '.join(declared) or 'none beyond the protocol’s'}")


def bundle_reply(client: int, per_chain: dict[int, dict]) -> dict:
    """One reply's fields from the per-chain replies of :func:`qlsd_flwr.protocol.client.handle`."""
    chains = sorted(per_chain)
    out = {"client": int(client), "chains": chains,
           "status": [str(per_chain[c]["status"]) for c in chains],
           "payload": [bytes(per_chain[c].get("payload", b"")) for c in chains],
           "anchor_version": [int(per_chain[c].get("anchor_version", -1)) for c in chains]}
    grads = [per_chain[c].get("anchor_grad") for c in chains]
    given = [g for g in grads if g is not None]
    if given:  # ∇U_i(θ*): one θ* for every chain, sent once; VR-FALD*'s refreshed θ_r, one a chain
        same = all(g == given[0] for g in given)
        out["anchor_grad"] = given[0] if same else [b"" if g is None else bytes(g) for g in grads]
    if any("ref_grad" in per_chain[c] for c in chains):  # VR-FALD*'s refresh: each chain's own θ_k
        out["ref_grad"] = [bytes(per_chain[c].get("ref_grad", b"")) for c in chains]
    return out


def unbundle_reply(rec: dict | None, asked: list[int], up=None) -> dict[int, dict]:
    """The per-chain reply fields (each then checked by :func:`parse_fields`) of a reply to a
    message that asked for the chains ``asked``. A reply without ``chains`` may only be a
    ``resync`` (a client that lost its settings), which then holds for every chain asked.
    :class:`ReplyError` when the reply does not answer exactly the chains asked."""
    if not isinstance(rec, dict):
        raise ReplyError("reply has no 'qlsd' record")
    refuse_undeclared(rec, up, "up", ReplyError)
    if "chains" not in rec:
        if rec.get("status") == "resync":
            return {c: {"client": rec.get("client"), "status": "resync"} for c in asked}
        raise ReplyError("reply to a several-chain message lacks 'chains'")
    try:
        chains = _chain_list(rec["chains"], "chains")
    except ValueError as exc:
        raise ReplyError(str(exc)) from None
    if chains != list(asked):
        raise ReplyError(f"reply answers chains {chains[:8]}, the message asked {list(asked)[:8]}")
    cols = {}
    for name in ("status", "payload", "anchor_version"):
        v = rec.get(name)
        if not isinstance(v, (list, tuple)) or len(v) != len(chains):
            raise ReplyError(f"{name}: expected one entry per chain ({len(chains)})")
        cols[name] = v
    per = {c: {"client": rec.get("client"), "status": cols["status"][j], "payload": cols["payload"][j],
               "anchor_version": cols["anchor_version"][j]} for j, c in enumerate(chains)}
    for name in UP_GRADIENTS:  # one for every chain (bytes), or one a chain (b"": none)
        x = rec.get(name)
        if x is None:
            continue
        if isinstance(x, (bytes, bytearray)) and name == "anchor_grad":
            x = [x] * len(chains)
        if not isinstance(x, (list, tuple)) or len(x) != len(chains) or \
                not all(isinstance(v, (bytes, bytearray)) for v in x):
            raise ReplyError(f"{name}: expected bytes, or one bytes entry per chain ({len(chains)})")
        for j, c in enumerate(chains):
            if len(x[j]):
                per[c][name] = x[j]
    return per


def memory_digests(rec: dict) -> dict[int, tuple[bytes, int]]:
    """A client's ``report = "memory-digest"`` reply (:func:`qlsd_flwr.protocol.memory_audit.digest`): ``{c: (8-byte
    digest or b"", update count)}`` (chain 0 for a one-chain client); ``ValueError`` when malformed."""
    chains = _chain_list(rec["chains"], "chains") if "chains" in rec else [0]
    dgs = rec.get("eta_digest") if "chains" in rec else [rec.get("eta_digest", b"")]
    counts = _int_list(rec.get("eta_count"), len(chains), "eta_count") if "chains" in rec \
        else [int(rec.get("eta_count", 0))]
    if not isinstance(dgs, (list, tuple)) or len(dgs) != len(chains) or \
            any(not isinstance(g, (bytes, bytearray)) or len(g) not in (0, 8) for g in dgs):
        raise ValueError("eta_digest: expected one 8-byte digest (or none) per chain")
    return {c: (bytes(g), n) for c, g, n in zip(chains, dgs, counts)}


def memory_report(rec: dict, d: int) -> dict[int, tuple[np.ndarray, int]]:
    """A client's memory report (the end-of-run audit) per chain: ``{c: (η_i, update count)}``
    (chain 0 for a one-chain client); ``ValueError`` when malformed."""
    if "chains" not in rec:
        eta = bytes_to_arr(rec["eta"], d) if "eta" in rec else np.zeros(d)
        return {0: (eta, int(rec.get("eta_count", 0)))}
    chains = _chain_list(rec["chains"], "chains")
    etas, counts = rec.get("eta"), _int_list(rec.get("eta_count"), len(chains), "eta_count")
    if not isinstance(etas, (list, tuple)) or len(etas) != len(chains):
        raise ValueError("eta: expected one entry per chain")
    return {c: (bytes_to_arr(e, d) if len(e) else np.zeros(d), counts[j])
            for j, (c, e) in enumerate(zip(chains, etas))}
