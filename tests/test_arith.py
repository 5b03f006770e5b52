"""The compressed broadcast's arithmetic code (:mod:`qlsd_flwr.compression.arith`; issue 37): the code its docstring
states, written bit for bit by an independent reference here, read back exactly (and refused by an uplink
compressor), within a small margin of the levels' order-0 entropy and shorter than the Rice code before it, any
bytes either refused by name or the writer's own code of what they decode to, and the same chain as with the Rice
code in fewer bits on the local engine and on in-process Flower."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from qlsd_flwr.compression import arith, rice
from qlsd_flwr.compression.format import DecodeError
from qlsd_flwr.compression.qsgd import QSGD, Quantised

LAYOUTS = [(128, 7850, None), (16, 50, None), (3, 10, (4, 6)), (1, 5, None), (2 ** 20, 30, None),
           (64, 200, None), (100, 40, (25, 15))]


class Model:
    """The docstring's adaptive model: the starting frequencies given, ``+ INCREMENT`` for a coded symbol, all
    halved (rounded up) when the total passes ``MAX_TOTAL``."""

    def __init__(self, f):
        self.f = list(f)

    def interval(self, x):
        lo = sum(self.f[:x])
        return lo, lo + self.f[x], sum(self.f)

    def update(self, x):
        self.f[x] += arith.INCREMENT
        if sum(self.f) > arith.MAX_TOTAL:
            self.f = [(v + 1) // 2 for v in self.f]


def reference(q) -> bytes:
    """Witten, Neal & Cleary's coder on Python integers, with the docstring's symbols, as a bit string."""
    out = "".join(format(int(q.norms[b:b + 1].view(np.uint32)[0]), "032b") for b in range(len(q.blocks)))
    j = min(max((int(np.abs(q.levels).sum()) // q.d + 1).bit_length(), 1), 2 ** arith.SHAPE_BITS - 1)
    out += format(j, f"0{arith.SHAPE_BITS}b")
    prior, f = [], arith.PRIOR_WEIGHT  # the magnitudes' geometric start: PRIOR_WEIGHT, then f − ⌊f/2^j⌋, at least 1
    low, high, pending = 0, 2 ** 32 - 1, 0
    half, quarter = 2 ** 31, 2 ** 30

    def code(lo, hi, total):
        nonlocal low, high, pending, out
        r = high - low + 1
        low, high = low + r * lo // total, low + r * hi // total - 1
        while True:
            if high < half or low >= half:
                bit = "1" if low >= half else "0"
                out += bit + ("0" if bit == "1" else "1") * pending
                pending = 0
                low, high = (low - half, high - half) if bit == "1" else (low, high)
            elif low >= quarter and high < half + quarter:
                pending += 1
                low, high = low - quarter, high - quarter
            else:
                break
            low, high = 2 * low, 2 * high + 1

    nsym, escape = arith.alphabet(q.s), q.s > arith.MAX_SYMBOL
    for _ in range(nsym):
        prior.append(max(f, 1))
        f -= f >> j
    mags, lens = Model(prior), Model([1] * arith.LENGTHS)
    for lv in q.levels:
        a = abs(int(lv))
        x = min(a, nsym - 1) if escape else a
        code(*mags.interval(x))
        mags.update(x)
        if escape and x == nsym - 1:
            e = a - (nsym - 2)
            n = e.bit_length() - 1
            code(*lens.interval(n))
            lens.update(n)
            below = format(e, "b")[1:]  # the bits below the leading one, as uniform symbols of up to CHUNK bits
            for i in range(0, len(below), arith.CHUNK):
                v, k = int(below[i:i + arith.CHUNK], 2), len(below[i:i + arith.CHUNK])
                code(v, v + 1, 2 ** k)
        if a:
            code(int(lv < 0), int(lv < 0) + 1, 2)
    pending += 1
    bit = "0" if low < quarter else "1"
    out += bit + ("1" if bit == "0" else "0") * pending
    out += "0" * (-len(out) % 8)
    return struct.pack("<BI", 0x04, q.d) + int(out, 2).to_bytes(len(out) // 8, "big")


def _messages(seed=0):
    rng = np.random.default_rng(seed)
    for s, d, blocks in LAYOUTS:
        c = QSGD(s, blocks=blocks, encoding="arith")
        for scale in (1.0, 1e-3):
            v = rng.normal(size=d) * scale
            v[rng.integers(d)] *= 40  # a large level, the escape's where s is above MAX_SYMBOL
            if blocks:
                v[: blocks[0]] = 0.0  # a block of zero norm
            yield c, c.quantise(v, rng.uniform(size=d))


def test_the_writer_makes_the_reference_code_and_reads_it_back():
    for c, q in _messages():
        code = c.encode(q)
        if q.d <= 200:  # the Python reference is slow on the main job's d
            assert code == reference(q), (q.s, q.d)
        back = c.decode(code, q.d)
        assert np.array_equal(back.levels, q.levels) and np.array_equal(back.norms, q.norms)
        assert back.code_bits == c.code_length_bits(q) and len(code) == 5 + (c.code_length_bits(q) + 7) // 8
        with pytest.raises(DecodeError, match="tag"):  # an uplink compressor reads no broadcast code
            QSGD(q.s, blocks=c.blocks).decode(code, q.d)


def test_within_a_small_margin_of_the_levels_entropy_and_shorter_than_rice():
    """On dense messages like the broadcast's (θ_k − w_{k−1} at 128 and 64 levels, d = 7,850), the code is at most
    the levels' empirical order-0 entropy (magnitudes, plus a sign bit for each nonzero level) plus the model's
    learning cost, which the bound takes as ``(A/2 + 2) log2 d`` bits a message over the ``A = 64`` symbols (about
    0.5 % here), plus the norm's 32; and it is shorter than the Rice code (which spends 9 % over the entropy)."""
    rng = np.random.default_rng(3)
    d = 7850
    for s in (128, 64):
        c = QSGD(s, encoding="arith")
        for _ in range(5):
            q = c.quantise(rng.standard_t(5, size=d), rng.uniform(size=d))
            a = np.abs(q.levels)
            p = np.bincount(a) / d
            p = p[p > 0]
            entropy = -d * float(np.sum(p * np.log2(p))) + int(np.count_nonzero(a))
            bits = c.code_length_bits(q)
            assert bits <= entropy + (arith.alphabet(s) / 2 + 2) * np.log2(d) + 32, (s, bits, entropy)
            assert bits < 0.95 * int(rice.code_bits(q.levels, (d,), s)), s


def _body(code):
    return code[5:]


def test_hostile_bytes_are_refused_by_name_or_are_the_writers_own_code():
    """Any bit string decodes to some levels, so a payload is accepted only as the writer's code of them: random
    bytes, flipped bits, a byte short or long and nonzero padding are refused, never a crash; what is accepted
    re-encodes to the very bytes received."""
    rng = np.random.default_rng(5)
    accepted = 0
    for _ in range(2000):
        s = int(rng.choice([2, 16, 128, 2 ** 20]))
        d = int(rng.integers(1, 40))
        body = rng.integers(0, 256, size=int(rng.integers(0, 60)), dtype=np.uint8).tobytes()
        c = QSGD(s, encoding="arith")
        try:
            q = c.decode(struct.pack("<BI", 0x04, d) + body, d)
        except DecodeError:
            continue
        accepted += 1
        assert c.encode(q) == struct.pack("<BI", 0x04, d) + body
    assert accepted < 40
    c = QSGD(128, encoding="arith")
    q = c.quantise(rng.normal(size=300), rng.uniform(size=300))
    code = c.encode(q)
    for bad, why in ((code[:-1], "arithmetic code"), (code + b"\x00", "arithmetic code"),
                     (code[:5] + b"\xff" * (arith.max_bits(128, (300,)) // 8 + 2), "longer than any")):
        with pytest.raises(DecodeError, match=why):
            c.decode(bad, 300)
    pad = (8 - c.code_length_bits(q) % 8) % 8
    if pad:
        with pytest.raises(DecodeError, match="arithmetic code"):
            c.decode(code[:-1] + bytes([code[-1] | 1]), 300)
    for i in range(40, 8 * (len(code) - 5)):  # every flipped bit after the norm: refused, or a canonical other code
        b = bytearray(code)
        b[5 + i // 8] ^= 0x80 >> (i % 8)
        try:
            other = c.decode(bytes(b), 300)
        except DecodeError:
            continue
        assert c.encode(other) == bytes(b)


def test_a_level_above_s_is_refused():
    """Above ``MAX_SYMBOL`` a magnitude's size comes from the escape's bit length, which can say more than ``s``:
    the reader refuses it by name (the writer's code for ``s = 1000`` with one level of 1,000, read as ``s = 999``);
    and the writer refuses a level above ``s`` (its model has no symbol for it) rather than write past its buffer."""
    q = QSGD(1000, encoding="arith").quantise(np.array([1.0, 0.0, 0.0]), np.zeros(3))
    assert q.levels[0] == 1000
    code = QSGD(1000, encoding="arith").encode(q)
    with pytest.raises(DecodeError, match="above s = 999"):
        QSGD(999, encoding="arith").decode(code, 3)
    for s, big in ((3, 100), (2 ** 32, 2 ** 40)):  # the writer refuses what its model cannot code (never a crash)
        bad = Quantised(norms=np.ones(1, np.float32), levels=np.full(5, big), s=s, blocks=(5,))
        with pytest.raises(ValueError, match="level above s"):
            arith.encode(bad)


def test_dense_takes_the_shorter_code_and_reads_both():
    """``dense`` (the broadcast's): each message in the shorter of the two codes (the arithmetic one on a tie), read
    back by a ``dense`` reader whichever it is, which refuses the longer code of the same levels (so every message
    has one code); a reader of one code refuses the other's tag, and no broadcast reader reads an uplink code."""
    rng = np.random.default_rng(9)
    seen = set()
    for d, s in ((7850, 128), (200, 64), (650, 256), (30, 4)):
        for _ in range(3):
            q = QSGD(s, encoding="dense").quantise(rng.standard_t(5, size=d), rng.uniform(size=d))
            a, r = int(arith.code_bits(q.levels, (d,), s)), int(rice.code_bits(q.levels, (d,), s))
            c = QSGD(s, encoding="dense")
            code = c.encode(q)
            seen.add(code[0])
            assert code[0] == (0x04 if a <= r else 0x03) and c.code_length_bits(q) == min(a, r)
            assert np.array_equal(c.decode(code, d).levels, q.levels)
            other = "rice" if code[0] == 0x04 else "arith"
            with pytest.raises(DecodeError, match="tag"):
                QSGD(s, encoding=other).decode(code, d)
            longer = QSGD(s, encoding=other).encode(q)  # the other code of the same levels: never sent, refused
            with pytest.raises(DecodeError, match="longer of the broadcast's two codes"):
                c.decode(longer, d)
            for enc in ("dense", "arith", "rice"):  # a broadcast reader reads no uplink code
                with pytest.raises(DecodeError, match="tag"):
                    QSGD(s, encoding=enc).decode(QSGD(s).encode(q), d)
    assert seen == {0x03, 0x04}  # both codes are taken somewhere among these messages


def test_the_chain_is_the_rice_broadcasts_in_no_more_bits(tmp_path, monkeypatch):
    """``downlink = qsgd`` with the broadcast's code (``dense``) against the Rice code alone, as before (QLSD++ on
    digits, 256 levels): the chain is the same bit for bit on the local engine and on in-process Flower, two chains,
    and no round's broadcast costs more bits (the broadcast's levels do not depend on the code)."""
    import csv

    from qlsd_flwr.config import resolve
    from qlsd_flwr.core import downlink
    from qlsd_flwr.engines.local import run_local
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.run.simulate import run_inprocess

    o = {"task": "logistic", "dataset": "digits", "num-clients": 4, "prior-var": 0.2, "variant": "qlsd-pp",
         "s": "16", "l": 5, "downlink": "qsgd", "downlink-s": 256, "num-rounds": 30, "burn-in": 10, "gamma": 1e-3,
         "progress": False, "plot": False, "loo": "off", "output-dir": str(tmp_path)}

    def down(run_dir):
        with open(run_dir / "metrics.csv", newline="") as f:
            return [int(float(r["bits_down"])) for r in csv.DictReader(f)]

    from qlsd_flwr.flower import client_app

    runs = {}
    for enc in ("dense", "rice"):
        monkeypatch.setattr(downlink, "ENCODING", enc)
        # a client's spec (its reader of the broadcast among it) is cached per settings, which do not name the
        # broadcast's code (a constant of the package): changing the constant here needs a fresh one
        client_app._spec.cache_clear()
        loc = run_local(resolve({**o, "engine": "local", "run-name": f"local-{enc}"}))
        fl_o = {**o, "engine": "inprocess", "num-chains": 2, "run-name": f"flwr-{enc}"}
        fl = run_inprocess(resolve(fl_o), fl_o)
        runs[enc] = (loc.run_dir, fl.run_dir)
    for i in range(2):
        assert np.array_equal(load_samples(runs["dense"][i]), load_samples(runs["rice"][i]))
        a, r = down(runs["dense"][i]), down(runs["rice"][i])
        assert len(a) == len(r) == 30 and all(x <= y for x, y in zip(a, r)), (a, r)
