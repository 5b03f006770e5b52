"""The size of a Flower message as it travels: the third of the three byte counts per round.

Flower 1.41 serialises a message as a tree of "inflatable" objects, each deflated to bytes; the
sum of their lengths is what crosses the wire. Flower's public API has ``deflate`` and
``get_object_id`` but no per-message total, and deflating a tree naively deflates each child
twice (once alone, once inside its parent's id). Flower keeps a per-context set of object ids it
will not recompute; reaching it needs its private ``_get_computed_object_ids``. That single
private name is imported here, in one place, with a tested fallback: where it is missing, every
object is deflated as Flower would (the same bytes, about twice the time;
``tests/test_flower.py`` checks both against :func:`message_nbytes_reference`).
"""

from __future__ import annotations

from flwr.app import Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import (
    get_object_id,
    no_object_id_recompute,
)

try:  # the per-context set of object ids Flower will not recompute (see message_nbytes)
    from flwr.supercore.inflatable.inflatable_object import (
        _get_computed_object_ids as _computed_ids,
    )
except ImportError:  # pragma: no cover - another Flower layout: deflate as Flower does
    _computed_ids = None


def message_nbytes(obj) -> int:
    """Bytes of a Flower message as it is serialised for transport (every object in its tree).

    Each object is deflated once, children first, and its object id is set from that very
    content, inside Flower's ``no_object_id_recompute`` (what Flower itself uses when it ships
    a message), so that the parent's deflation reuses it: the same bytes as deflating the
    whole tree naively (:func:`message_nbytes_reference`, checked equal in the tests) in about
    half the time. Where Flower's id cache is not where this expects, every object is
    deflated as Flower would."""
    with no_object_id_recompute():
        return _tree_nbytes(obj)


def _tree_nbytes(obj) -> int:
    if isinstance(obj, Message):
        kids = [obj.content] if obj.has_content() else []
    elif isinstance(obj, RecordDict):
        kids = list(obj.values())
    else:
        kids = list((obj.children or {}).values())
    total = sum(_tree_nbytes(k) for k in kids)
    content = obj.deflate()
    if _computed_ids is not None:
        oid = get_object_id(content)
        obj.__dict__["_object_id"] = oid
        _computed_ids().add(oid)
    return total + len(content)


def message_nbytes_reference(obj) -> int:
    """``message_nbytes`` by deflating every object of the tree as it comes (the reference)."""
    with no_object_id_recompute():
        return _naive_nbytes(obj)


def _naive_nbytes(obj) -> int:
    return len(obj.deflate()) + sum(_naive_nbytes(c) for c in (obj.children or {}).values())
