"""Flower records ↔ the protocol's fields: the one place that knows where in a Flower message
the QLSD fields travel (a ``ConfigRecord`` named ``"qlsd"``)."""

from __future__ import annotations

from flwr.app import ConfigRecord

RECORD = "qlsd"


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
