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

import numpy as np


def arr_to_bytes(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x, dtype="<f8").tobytes()


VECTORS = ("theta", "anchor", "eta")  # the fields holding a vector of R^d


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


class ReplyError(ValueError):
    """A client reply that is malformed; the server rejects and counts it."""


def parse_fields(rec: dict | None, expected_client: int) -> dict:
    """Validate a reply's fields; raises :class:`ReplyError` on anything off."""
    if not isinstance(rec, dict):
        raise ReplyError("reply has no 'qlsd' record")
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
    return {"status": status, "payload": bytes(payload), "anchor_version": version}
