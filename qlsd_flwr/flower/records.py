"""Flower records ↔ the protocol's fields: the one place that knows where in a Flower message
the QLSD fields travel.

A server → client message holds:

* ``"arrays"`` — an ``ArrayRecord`` with ``θ_k`` under ``"theta"`` (Flower's own name for a
  strategy's arrays, so Flower's array mods see it) and, when sent, the anchor ``"anchor"`` and the
  memory mirror ``"eta"`` (float64 vectors of length ``d``);
* ``"qlsd"`` — a ``ConfigRecord`` with the protocol's scalar fields (:mod:`qlsd_flwr.protocol.wire`);
* ``"qlsd-settings"`` — a ``ConfigRecord`` with the client's settings
  (:func:`qlsd_flwr.protocol.build.client_settings`), in the first message to each client and
  after a resync only (the client keeps them in ``context.state``; a record costs Flower about
  80 µs a message to build and serialise).

A reply holds one ``ConfigRecord`` ``"qlsd"``, whose ``payload`` is the encoded compressed message
(bytes: a QSGD code is not an array).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from qlsd_flwr.protocol.wire import VECTORS

RECORD = "qlsd"
ARRAYS = "arrays"
SETTINGS = "qlsd-settings"


def to_content(fields: dict, settings: dict | None = None, theta: Array | None = None) -> RecordDict:
    """A server → client message's content from the protocol's fields (vectors as arrays).
    ``theta``: ``θ_k`` already made an :class:`Array` (one per round, shared by its messages:
    making an ``Array`` serialises the vector)."""
    # float32 vectors stay float32 (the θ* descent's θ, descent.DescentWidth); the rest travel as float64
    arrays = {k: (theta if k == "theta" and theta is not None else
                  Array(v if isinstance(v, np.ndarray) and v.dtype == np.float32 else np.asarray(v, dtype=np.float64)))
              for k, v in fields.items() if k in VECTORS}
    content = RecordDict({RECORD: ConfigRecord({k: v for k, v in fields.items() if k not in VECTORS})})
    if arrays:
        content[ARRAYS] = ArrayRecord(arrays)
    if settings is not None:
        content[SETTINGS] = ConfigRecord(settings)
    return content


def from_content(content) -> tuple[dict, dict | None]:
    """``(fields, settings)`` of a server → client message (vectors as float64 arrays; a legacy
    sender's bytes are left as they are). ``KeyError`` if there is no ``"qlsd"`` record."""
    fields = dict(config_record(content))
    arrays = content[ARRAYS] if ARRAYS in content else None
    if isinstance(arrays, ArrayRecord):
        for k in VECTORS:
            if k in arrays:
                fields[k] = arrays[k].numpy()
    try:
        settings = dict(config_record(content, SETTINGS))
    except KeyError:
        settings = None
    return fields, settings


def config_record(content, name: str = RECORD):
    """The ``ConfigRecord`` called ``name`` in a Flower ``RecordDict``; ``KeyError`` if there is
    none. (A direct look-up: Flower's ``content.config_records`` builds and type-checks a new
    view of every record on each access; three such accesses a message were about 7 % of a client's
    round at d = 50.)"""
    rec = content[name] if name in content else None
    if not isinstance(rec, ConfigRecord):
        raise KeyError(name)
    return rec


def record_fields(content) -> dict | None:
    """The ``"qlsd"`` ConfigRecord of a Flower reply as a dict, or ``None`` if absent."""
    try:
        return dict(config_record(content))
    except (KeyError, AttributeError, TypeError):
        return None


def theta_from_arrays(arrays: ArrayRecord, d: int) -> np.ndarray:
    """``θ`` as one float64 vector: the record's arrays flattened and joined in their order
    (``ArrayRecord(model.state_dict())`` gives a torch model's parameters in its own order)."""
    parts = [np.asarray(a.numpy(), dtype=np.float64).ravel() for a in arrays.values()]
    theta = np.concatenate(parts) if parts else np.zeros(0)
    if theta.shape[0] != d:
        raise ValueError(f"initial_arrays: {theta.shape[0]} values in {len(parts)} array(s), the model "
                         f"has d = {d} parameters")
    if not np.all(np.isfinite(theta)):
        raise ValueError("initial_arrays: θ_0 has non-finite values")
    return theta


def labels_from_arrays(arrays: ArrayRecord) -> list[str]:
    """θ's coordinate names from the record's arrays, ``<name>[i,j,…]`` per entry, as the built-in
    torch tasks name theirs (``ArrayRecord(pot.named_arrays())`` gives ``named_parameters()``)."""
    from qlsd_flwr.tasks.registry import tensor_labels

    return tensor_labels([(name, tuple(int(n) for n in a.shape)) for name, a in arrays.items()])
