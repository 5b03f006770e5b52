"""The compressed broadcast's Rice code (:mod:`qlsd_flwr.compression.rice`; issue 37): the layout its docstring
states, written bit for bit by a reference here, read back exactly (and refused by an uplink compressor),
shorter than Elias on dense messages, and hostile bytes refused by name. (The broadcast now takes the shorter of this
code and the arithmetic one, message by message: ``tests/test_arith.py`` runs the chain with both.)"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from qlsd_flwr.compression import rice
from qlsd_flwr.compression.format import DecodeError
from qlsd_flwr.compression.qsgd import QSGD

LAYOUTS = [(256, 7850, None), (16, 50, None), (3, 10, (4, 6)), (1, 5, None), (2 ** 20, 30, None),
           (8, 12, (5, 5, 2))]


def reference(q) -> bytes:
    """The docstring's layout, written field by field as a bit string, each block's k tried in full."""
    bits, start = "", 0
    for b, n in enumerate(q.blocks):
        lv = q.levels[start:start + n]
        best = None
        for k in range(rice.kmax(q.s) + 1):
            body = "".join("1" * (abs(int(x)) >> k) + "0" + (format(abs(int(x)) & ((1 << k) - 1), f"0{k}b") if k else "")
                           + (("1" if x < 0 else "0") if x else "") for x in lv)
            if best is None or len(body) < len(best[1]):
                best = (k, body)
        norm = format(int(q.norms[b:b + 1].view(np.uint32)[0]), "032b")
        bits += norm + format(best[0], f"0{rice.K_BITS}b") + best[1]
        start += n
    bits += "0" * (-len(bits) % 8)
    return struct.pack("<BI", 0x03, q.d) + int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


def _messages(seed=0):
    rng = np.random.default_rng(seed)
    for s, d, blocks in LAYOUTS:
        c = QSGD(s, blocks=blocks, encoding="rice")
        for t in range(6):
            v = rng.normal(size=d) * rng.exponential(size=d)
            if t == 1:
                v[:] = 0.0  # a zero message: every level 0, a zero norm
            if t == 2:
                v[rng.random(d) < 0.9] = 0.0  # sparse
            yield c, c.quantise(v, rng.uniform(size=d))


def test_the_code_is_the_stated_layout_and_reads_back_exactly():
    for c, q in _messages():
        code = c.encode(q)
        assert code == reference(q), (c.s, q.d)
        got = c.decode(code, q.d)
        assert np.array_equal(got.levels, q.levels)
        assert np.array_equal(got.norms.view(np.uint32), q.norms.view(np.uint32))
        # the count is the code's exact length, by message and in a batch; any QSGD of these s and blocks reads it
        assert got.code_bits == c.code_length_bits(q) == int(c.code_length_bits_batch(q.levels[None])[0])
        assert len(code) == 5 + (got.code_bits + 7) // 8
        with pytest.raises(DecodeError, match="unknown encoding tag"):  # read only where it is expected
            QSGD(c.s, blocks=c.blocks, encoding="auto").decode(code, q.d)
        assert c.code_length_bits(q) <= rice.max_bits(c.s, q.blocks) <= c.bound_bits(q.d)


def test_on_dense_messages_it_is_shorter_than_elias():
    # a Gaussian vector at s = 256, d = 7,850: levels of mean size about 2, 80 % nonzero, as the main job's broadcast.
    # Rice (k = 1) costs about 1 + 1 + |ℓ|/2 + a sign, 3.78 bits a coordinate here; Elias a gap, a sign and ω(|ℓ|),
    # 4.77: the ratio is 0.79, and 0.85 fails a code that saves less than the main job's measured 20 %
    rng = np.random.default_rng(3)
    v = rng.normal(size=7850)
    q = QSGD(256).quantise(v, rng.uniform(size=v.size))
    r, e = QSGD(256, encoding="rice").code_length_bits(q), QSGD(256).code_length_bits(q)
    assert r < 0.85 * e, (r / v.size, e / v.size)


def _body(bits: str) -> bytes:
    bits += "0" * (-len(bits) % 8)
    return int(bits, 2).to_bytes(len(bits) // 8, "big") if bits else b""


@pytest.mark.parametrize("why,bits,match", [
    ("k above bitlen(s)", format(0x3F800000, "032b") + format(5, "05b") + "0" * 3, "Rice parameter k"),
    ("a quotient past s", format(0x3F800000, "032b") + "00000" + "1" * 9, "level above s = 4"),
    ("a remainder past s", format(0x3F800000, "032b") + "00010" + "1" + "0" + "01" + "0" + "0" * 4, "level above s = 4"),
    ("a truncated quotient", format(0x3F800000, "032b") + "00000" + "111", "truncated Rice code"),
    ("a truncated norm", "1" * 20, "truncated norm"),
    ("a nonzero level in a zero-norm block", "0" * 32 + "00000" + "10" + "0" + "0" * 6, "zero norm"),
    ("a negative norm", format(0xBF800000, "032b") + "00000" + "0" * 4, "negative norm"),
    ("a non-finite norm", format(0x7F800000, "032b") + "00000" + "0" * 4, "non-finite norm"),
])
def test_hostile_bytes_are_refused_by_name(why, bits, match):
    c = QSGD(4, encoding="rice")  # d = 4 below, one block; bitlen(4) = 3
    with pytest.raises(DecodeError, match=match):
        c.decode(struct.pack("<BI", 0x03, 4) + _body(bits), 4)


def test_trailing_bytes_padding_and_overlong_payloads_are_refused():
    c = QSGD(4, encoding="rice")
    q = c.quantise(np.array([1.0, -2.0, 0.5, 0.0]), np.full(4, 0.5))
    code = c.encode(q)
    with pytest.raises(DecodeError, match="trailing bytes"):
        c.decode(code + b"\x00", 4)
    last_bits = c.code_length_bits(q)
    if last_bits % 8:  # a 1 in the padding
        bad = bytearray(code)
        bad[-1] |= 1
        with pytest.raises(DecodeError, match="nonzero padding"):
            c.decode(bytes(bad), 4)
    with pytest.raises(DecodeError, match="longer than any Rice code"):
        c.decode(code[:5] + b"\xff" * 64, 4)
    # a valid layout the writer never makes (k = 0 and long unary runs at s = 16): longer than its guard, refused unread
    legal = format(0x3F800000, "032b") + "00000" + ("1" * 16 + "0" + "0") * 4
    assert len(legal) > rice.max_bits(16, (4,))
    with pytest.raises(DecodeError, match="longer than any Rice code"):
        QSGD(16, encoding="rice").decode(struct.pack("<BI", 0x03, 4) + _body(legal), 4)
    for cut in range(5, len(code)):  # every truncation is refused, never read past the end
        with pytest.raises(DecodeError):
            c.decode(code[:cut], 4)
