"""The compressed broadcast's dense codes, by ``encoding``: ``arith`` (:mod:`.arith`), ``rice`` (:mod:`.rice`), and
``dense``, the shorter of the two for each message (``arith`` on a tie): the broadcast's code (issue 37).

The arithmetic code reaches the levels' order-0 entropy to within its model's learning cost, a few hundred bits a
message: on the main job (``d = 7,850``, 128 levels) it is 8 % shorter than the Rice code, but on a message of a
few hundred coordinates with wide levels the Rice code can be a little shorter (by about 2 % at ``d = 200``, 64
levels). Taking the shorter of the two costs the writer one more length and never sends more bits than the Rice
code before it. A ``dense`` reader takes either tag, checks each code in full with its own reader, and refuses the
longer of the two (the writer never sends it), so every message has one code; a reader of a dense code refuses
QSGD's uplink codes (Elias, packed).
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.compression import arith, rice
from qlsd_flwr.compression.format import TAG_ARITH, TAG_RICE, DecodeError

#: ``encoding`` → the tags its reader takes
TAGS = {"arith": (TAG_ARITH,), "rice": (TAG_RICE,), "dense": (TAG_ARITH, TAG_RICE)}
_CODE = {TAG_ARITH: arith, TAG_RICE: rice}


def code_bits(encoding: str, levels: np.ndarray, blocks, s: int) -> np.ndarray:
    """The exact length (norms and body, no header) of each row's code (``levels`` ``(..., d)``)."""
    if encoding == "dense":
        return np.minimum(arith.code_bits(levels, blocks, s), rice.code_bits(levels, blocks, s))
    return _CODE[TAGS[encoding][0]].code_bits(levels, blocks, s)


def max_bits(encoding: str, s: int, blocks) -> int:
    """The longest code the writer makes (a bound): under ``dense``, the shorter code is at most Rice's longest."""
    if encoding == "dense":
        return min(arith.max_bits(s, blocks), rice.max_bits(s, blocks))
    return _CODE[TAGS[encoding][0]].max_bits(s, blocks)


def encode(encoding: str, q) -> bytes:
    """``header ‖ code ‖ padding`` of a :class:`~.qsgd.Quantised` message."""
    if encoding == "dense":  # the arithmetic code is measured by writing it: written once
        code, bits = arith.written(q)
        return code if bits <= int(rice.code_bits(q.levels, q.blocks, q.s)) else rice.encode(q)
    return _CODE[TAGS[encoding][0]].encode(q)


def reads(encoding: str, tag: int) -> bool:
    """Whether a reader of ``encoding`` takes a payload with this tag."""
    return tag in TAGS.get(encoding, ())


def decode(encoding: str, tag: int, body: bytes, d: int, blocks, s: int):
    """``(norms, levels, bits)`` of a code body of this tag (:func:`reads` said yes), or ``DecodeError``; under
    ``dense`` the code must also be the one the writer takes, the shorter (so every message has one code)."""
    norms, levels, bits = _CODE[tag].decode(body, d, blocks, s)
    if encoding == "dense":
        other = (rice if tag == TAG_ARITH else arith).code_bits(levels, blocks, s)
        if (tag == TAG_ARITH and bits > other) or (tag == TAG_RICE and bits >= other):
            raise DecodeError("the longer of the broadcast's two codes for these levels (the writer sends the shorter)")
    return norms, levels, bits
