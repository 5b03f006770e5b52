"""QSGD and identity compressors: the operator's moments, the wire codes, their lengths, the bound.

Monte Carlo tolerances are derived, not tuned:
* The dequantised coordinate is ``C_j = (N/s) ℓ_j`` with ``N = float32(‖v_b‖) = (1+δ_b)‖v_b‖``
  (``δ_b`` known exactly per vector) and ``ℓ_j = sign(v_j)(⌊r_j⌋ + Bernoulli(p_j))``,
  ``p_j = r_j − ⌊r_j⌋``. So ``E C_j = (1+δ_b) v_j`` and ``Var C_j = (N/s)² p_j(1−p_j)``.
* ``‖C − v‖² = Σ_j ((N/s)(ℓ_j − r_j σ_j) + δ_b v_j)²`` has the exact mean
  ``Σ_b [(N_b/s)² Σ_{j∈b} p_j(1−p_j) + δ_b² ‖v_b‖²]`` (the cross term has mean 0) and, up to
  O(δ) ≈ 6e-8 relative, the per-draw variance ``Σ_j (N/s)⁴ p_j(1−p_j)(1−2p_j)²``.
* Floating-point slack: ``C_j`` is two float64 operations (≤ 2 ulp relative) and the mean of ``M``
  terms by numpy's pairwise sum adds ≤ ``(log2 M + 1)`` ulps of ``max |C_j|``.
"""

from __future__ import annotations

import math
import re
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qlsd_flwr.compression import codec
from qlsd_flwr.compression.bounds import elias_bound_bits, qsgd_theorem_bits
from qlsd_flwr.compression.elias import omega_len_int, omega_len_nb, omega_length
from qlsd_flwr.compression.format import (
    HEADER_BYTES,
    TAG_ELIAS,
    TAG_PACKED,
    DecodeError,
)
from qlsd_flwr.compression.identity import Identity
from qlsd_flwr.compression.factory import make_compressor
from qlsd_flwr.compression.qsgd import QSGD, Quantised, dequantise

EPS = 2.0**-52
Z = 5.0  # standard errors for every Monte Carlo assertion (two-sided p ≈ 6e-7 per check)
HSET = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ independent references
def omega_ref(n: int) -> str:
    """Elias omega code, straight from its definition."""
    code = "0"
    while n > 1:
        b = bin(n)[2:]
        code = b + code
        n = len(b) - 1
    return code


def body_ref(q: Quantised, encoding: str) -> str:
    """The code (norms + body) as a '0'/'1' string, built independently of the module."""
    out = []
    start = 0
    lb = q.s.bit_length()
    for b, n in enumerate(q.blocks):
        out.append(format(int(q.norms[b:b + 1].view(np.uint32)[0]), "032b"))
        lev = [int(x) for x in q.levels[start:start + n]]
        if encoding == "packed":
            for x in lev:
                out.append(("1" if x < 0 else "0") + format(abs(x), f"0{lb}b"))
        else:
            nz = [(i + 1, x) for i, x in enumerate(lev) if x != 0]
            out.append(omega_ref(len(nz) + 1))
            prev = 0
            for pos, x in nz:
                out.append(omega_ref(pos - prev) + ("1" if x < 0 else "0") + omega_ref(abs(x)))
                prev = pos
        start += n
    return "".join(out)


def payload_bits(payload: bytes) -> str:
    return "".join(format(b, "08b") for b in payload[HEADER_BYTES:])


def random_blocks(d: int, rng: np.random.Generator) -> tuple[int, ...]:
    if d == 1:
        return (1,)
    k = int(rng.integers(1, min(d, 6) + 1))
    cuts = np.sort(rng.choice(np.arange(1, d), size=k - 1, replace=False)) if k > 1 else np.array([], int)
    edges = np.concatenate([[0], cuts, [d]])
    return tuple(int(x) for x in np.diff(edges))


def moments(c: QSGD, v: np.ndarray):
    """Per-coordinate r_j, p_j, transmitted norm N per coordinate and δ per coordinate."""
    blocks = c._blocks(v.size)
    ends = np.cumsum(blocks)
    n64 = np.array([np.sqrt(np.sum(v[e - n:e] ** 2)) for n, e in zip(blocks, ends)])
    n32 = n64.astype(np.float32).astype(np.float64)
    N64 = np.repeat(n64, blocks)
    N32 = np.repeat(n32, blocks)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(N64 > 0, c.s * np.abs(v) / N64, 0.0)
        delta = np.where(N64 > 0, N32 / N64 - 1.0, 0.0)
    p = r - np.floor(r)
    return r, p, N32, delta


def draw(c: QSGD, v: np.ndarray, m: int, seed: int):
    rng = np.random.default_rng(seed)
    U = rng.random((m, v.size))
    norms, levels = c.quantise_batch(np.broadcast_to(v, (m, v.size)), U)
    return norms, levels, c.dequantise_batch(norms, levels)


# ---------------------------------------------------------------------- Elias omega codes
def test_omega_reference_matches_known_codes_and_lengths():
    known = {1: "0", 2: "100", 3: "110", 4: "101000", 7: "101110", 8: "1110000",
             16: "10100100000", 17: "10100100010", 100: "1011011001000"}
    for n, code in known.items():
        assert omega_ref(n) == code
    xs = np.concatenate([np.arange(1, 5000), 2 ** np.arange(13, 40), 2 ** np.arange(13, 40) - 1])
    assert np.array_equal(omega_length(xs), [len(omega_ref(int(x))) for x in xs])


def test_compiled_omega_length_equals_the_rule():
    # the compiled twin (bit writer, reader, vectorised engine) on every bit length up to 2^64 - 1
    xs = sorted({1, 2, 3} | {v for m in range(1, 64) for v in (2**m - 1, 2**m, 2**m + 1)} | {2**64 - 1})
    assert [int(omega_len_nb(np.uint64(x))) for x in xs] == [len(omega_ref(x)) for x in xs]
    assert [omega_len_int(x) for x in xs] == [len(omega_ref(x)) for x in xs]
    lev = np.array([0, 3, -1, 0, 0, 7, -2**32, 1], dtype=np.int64)
    blocks = np.array([5, 3], dtype=np.int64)
    ref = QSGD(2**32, blocks=(5, 3), encoding="elias").code_length_bits(
        Quantised(norms=np.ones(2, np.float32), levels=lev, s=2**32, blocks=(5, 3)))
    assert codec.elias_bits(lev, blocks) == ref  # int levels (the writer)
    assert codec.elias_bits(lev.astype(np.float64), blocks) == ref  # float-held levels (the engine)


# ------------------------------------------------------------------------- the operator
UNBIASED_CASES = [(2, None), (16, None), (256, None), (2, (5, 1, 14)), (16, (10, 10)), (256, (1, 19))]


@pytest.mark.parametrize("s,blocks", UNBIASED_CASES)
def test_unbiased_within_derived_standard_errors(s, blocks):
    rng = np.random.default_rng(100 + s)
    v = rng.standard_normal(20) * np.exp(rng.standard_normal(20))
    v[3] = 0.0
    v[7] = 4.0 * np.max(np.abs(v))  # a dominant coordinate (r close to s)
    c = QSGD(s, blocks=blocks)
    m = 20000
    _, _, C = draw(c, v, m, seed=s)
    r, p, N32, delta = moments(c, v)
    se = (N32 / s) * np.sqrt(p * (1 - p) / m)
    fp = (3 + math.log2(m)) * EPS * N32 * (np.floor(r) + 1) / s
    mean = C.mean(axis=0)
    err = np.abs(mean - v)
    assert np.all(err <= Z * se + np.abs(delta * v) + fp), np.max(err / (Z * se + np.abs(delta * v) + fp))
    # pooled along sign(v): a systematic under/over-rounding shows up √d times more sharply
    pooled = np.sum(np.sign(v) * (mean - (1 + delta) * v))
    assert abs(pooled) <= Z * np.sqrt(np.sum(se**2)) + np.sum(fp + 2 * EPS * np.abs(v))


def test_exactly_quantised_coordinates_carry_only_the_float32_norm_error():
    # one-hot and r_j integer: no randomness, C(v) = (1+δ) v exactly as documented
    v = np.zeros(9)
    v[4] = -1.3
    c = QSGD(4)
    q = c.quantise(v, np.full(9, 0.999))
    assert np.array_equal(q.levels, np.where(np.arange(9) == 4, -4, 0))
    x = dequantise(q)
    assert x[4] == float(np.float32(1.3)) * -4 / 4
    assert abs(x[4] - v[4]) <= 2.0**-24 * 1.3


VARIANCE_CASES = [
    ("gauss", 2, None, 50), ("gauss", 16, (20, 30), 50), ("onehot", 2, None, 50),
    ("constant", 2, None, 10000), ("constant", 16, None, 50), ("constant", 1, (25, 25), 50),
]


@pytest.mark.parametrize("kind,s,blocks,d", VARIANCE_CASES)
def test_variance_matches_formula_and_respects_omega(kind, s, blocks, d):
    rng = np.random.default_rng(7)
    v = {"gauss": rng.standard_normal(d), "onehot": np.eye(d)[d // 3] * 2.5,
         "constant": np.full(d, -0.7)}[kind]
    c = QSGD(s, blocks=blocks)
    m = 1000 if d > 1000 else 20000
    sq = []
    for k in range(0, m, 200):
        _, _, C = draw(c, v, 200, seed=1000 + k)
        sq.append(np.sum((C - v) ** 2, axis=1))
    sq = np.concatenate(sq)
    r, p, N32, delta = moments(c, v)
    exact = np.sum((N32 / s) ** 2 * p * (1 - p) + (delta * v) ** 2)
    se = math.sqrt(np.sum((N32 / s) ** 4 * p * (1 - p) * (1 - 2 * p) ** 2) / m)
    fp = 8 * EPS * np.sum(v**2) * (1 + c.omega(d))  # rounding of C − v and of the sum, generous
    bound = c.omega(d) * np.sum(v**2)
    assert abs(sq.mean() - exact) <= Z * se + fp
    assert exact <= bound * (1 + 2.0**-23)  # ω grows by (1+δ)² at most
    assert sq.mean() <= bound * (1 + 2.0**-23) + Z * se + fp
    if kind == "constant" and d == 10000:
        # near-tight case: E‖C−v‖² = (1 − s/√d) ω‖v‖², so the check above has teeth
        assert sq.mean() > 0.95 * bound


def test_omega_values():
    assert QSGD(2).omega(50) == min(50 / 4, math.sqrt(50) / 2)
    assert QSGD(16).omega(50) == 50 / 256
    assert QSGD(4, blocks=(10, 40)).omega(50) == max(min(10 / 16, math.sqrt(10) / 4), min(40 / 16, math.sqrt(40) / 4))
    assert Identity().omega(50) == 0.0
    with pytest.raises(ValueError, match="sum"):
        QSGD(4, blocks=(10, 40)).omega(51)


@pytest.mark.parametrize("blocks", [None, (3, 4)])
@pytest.mark.parametrize("encoding", ["elias", "packed", "auto"])
def test_zero_vector(blocks, encoding):
    c = QSGD(16, blocks=blocks, encoding=encoding)
    q = c.quantise(np.zeros(7), np.random.default_rng(0).random(7))
    assert np.all(q.levels == 0) and np.all(q.norms == 0) and not np.any(np.signbit(q.norms))
    x = dequantise(q)
    assert np.all(x == 0) and not np.any(np.signbit(x))
    payload = c.encode(q)
    assert c.decode(payload, 7) == q
    nb = 1 if blocks is None else 2
    expect = {"elias": 33 * nb, "packed": 32 * nb + 7 * 6, "auto": 33 * nb}[encoding]
    assert c.code_length_bits(q) == expect


def test_float32_range_edges():
    c = QSGD(4)
    u = np.full(3, 0.5)
    # ‖v‖ > 0 but float32(‖v‖) = 0: sent as the zero vector, a valid message
    q = c.quantise(np.array([1e-46, 0.0, 0.0]), u)
    assert np.all(q.levels == 0) and q.norms[0] == 0
    assert c.decode(c.encode(q), 3) == q
    # squares underflow in float64: also zero
    assert np.all(c.quantise(np.full(3, 1e-300), u).levels == 0)
    # subnormal float32 norm survives
    q = c.quantise(np.array([1e-40, 0.0, 0.0]), u)
    assert q.levels[0] == 4 and 0 < q.norms[0] < np.finfo(np.float32).tiny
    assert c.decode(c.encode(q), 3) == q
    for bad in ([1e39, 0, 0], [np.nan, 0, 0], [np.inf, 0, 0]):
        with pytest.raises(ValueError):
            c.quantise(np.array(bad), u)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        c.quantise(np.ones(3), np.array([0.0, 1.0, 0.5]))


# ---------------------------------------------------------------- batch = row by row
@given(data=st.data())
@HSET
def test_quantise_batch_equals_rows_bitwise(data):
    d = data.draw(st.integers(1, 40))
    lead = data.draw(st.sampled_from([(1,), (5,), (2, 3)]))
    s = data.draw(st.sampled_from([1, 2, 3, 16, 2**16]))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    blocks = data.draw(st.sampled_from([None, random_blocks(d, rng)]))
    V = rng.standard_normal(lead + (d,)) * np.exp(3 * rng.standard_normal(lead + (d,)))
    V[rng.random(V.shape) < 0.3] = 0.0
    U = rng.random(V.shape)
    c = QSGD(s, blocks=blocks, encoding=data.draw(st.sampled_from(["elias", "packed", "auto"])))
    norms, levels = c.quantise_batch(V, U)
    X = c.dequantise_batch(norms, levels)
    L = c.code_length_bits_batch(levels)
    for i in np.ndindex(lead):
        q = c.quantise(V[i], U[i])
        assert np.array_equal(q.norms.view(np.uint32), norms[i].view(np.uint32))
        assert np.array_equal(q.levels, levels[i])
        assert np.array_equal(dequantise(q).view(np.uint64), X[i].view(np.uint64))
        assert L[i] == c.code_length_bits(q)


def test_compiled_quantise_equals_batch_across_the_float_range():
    # one-norm quantise runs the compiled twin (qsgd.quantise_block_nb); quantise_batch is numpy: the
    # norms, levels and errors must agree bit for bit, down to float32 underflow and up to overflow
    rng = np.random.default_rng(11)
    for d in (1, 8, 9, 129, 5000):
        for s in (1, 16, 2**32):
            c = QSGD(s)
            for scale in (1e-50, 1e-45, 1e-40, 1.0, 1e37, 1e38):
                v = rng.standard_normal(d) * scale * np.exp(2 * rng.standard_normal(d))
                v[rng.random(d) < 0.2] = 0.0
                u = rng.random(d)
                try:
                    norms, levels = c.quantise_batch(v[None], u[None])
                except ValueError as exc:
                    with pytest.raises(ValueError, match=re.escape(str(exc))):
                        c.quantise(v, u)
                    continue
                q = c.quantise(v, u)
                assert np.array_equal(q.norms.view(np.uint32), norms[0].view(np.uint32))
                assert np.array_equal(q.levels, levels[0])


def test_quantise_batch_large_rows_bitwise():
    rng = np.random.default_rng(3)
    V = rng.standard_normal((64, 3001))
    U = rng.random(V.shape)
    for c in (QSGD(16), QSGD(16, blocks=(1000, 2001))):
        norms, levels = c.quantise_batch(V, U)
        for i in range(V.shape[0]):
            q = c.quantise(V[i], U[i])
            assert np.array_equal(q.norms.view(np.uint32), norms[i].view(np.uint32))
            assert np.array_equal(q.levels, levels[i])


# -------------------------------------------------------------------- codes: round trip
def check_code(c: QSGD, q: Quantised):
    """Round trip, exact length, byte-exact agreement with the reference encoder."""
    payload = c.encode(q)
    bits = c.code_length_bits(q)
    tag, d = struct.unpack_from("<BI", payload)
    assert d == q.d
    enc = {TAG_PACKED: "packed", TAG_ELIAS: "elias"}[tag]
    if c.encoding != "auto":
        assert enc == c.encoding
    ref = body_ref(q, enc)
    assert bits == len(ref)
    assert len(payload) == HEADER_BYTES + (bits + 7) // 8  # header + code + padding (< 8 bits)
    assert payload_bits(payload) == ref + "0" * (-len(ref) % 8)
    if c.encoding == "auto":  # the shorter code of the two
        assert bits == min(len(body_ref(q, "packed")), len(body_ref(q, "elias")))
    assert int(c.code_length_bits_batch(q.levels)) == bits
    assert c.encode_reference(q) == payload  # compiled writer (qlsd_flwr.compression.codec) = numpy fields
    back = c.decode(payload, q.d)
    assert back == q
    ref = c.decode_reference(payload, q.d)
    assert ref == q and ref.code_bits == back.code_bits == bits
    assert np.array_equal(dequantise(back).view(np.uint64), dequantise(q).view(np.uint64))
    return payload


@pytest.mark.parametrize("d", [1, 7, 50, 1000, 100000])
@pytest.mark.parametrize("s", [1, 2, 16, 2**16])
@pytest.mark.parametrize("blocked", [False, True])
def test_round_trip_and_exact_length(d, s, blocked):
    rng = np.random.default_rng(d * 7 + s)
    blocks = random_blocks(d, rng) if blocked else None
    v = rng.standard_normal(d)
    if d > 7:
        v[rng.random(d) < 0.5] = 0.0
    u = rng.random(d)
    for enc in ("elias", "packed", "auto"):
        c = QSGD(s, blocks=blocks, encoding=enc)
        q = c.quantise(v, u)
        if d <= 1000:
            check_code(c, q)
        else:  # the string reference is slow at 1e5: check the lengths and the round trip
            payload = c.encode(q)
            assert len(payload) == HEADER_BYTES + (c.code_length_bits(q) + 7) // 8
            assert c.decode(payload, d) == q
        # the decoder reports the length of the code it read: the server's exact bit count
        assert c.decode(c.encode(q), d).code_bits == c.code_length_bits(q)


@given(data=st.data())
@HSET
def test_round_trip_random_vectors(data):
    d = data.draw(st.integers(1, 60))
    v = data.draw(hnp.arrays(np.float64, d, elements=st.one_of(
        st.just(0.0), st.floats(-1e30, 1e30, allow_nan=False, allow_infinity=False))))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    s = data.draw(st.sampled_from([1, 2, 3, 5, 16, 255, 2**16, 2**31]))
    blocks = data.draw(st.sampled_from([None, random_blocks(d, rng)]))
    for enc in ("elias", "packed", "auto"):
        c = QSGD(s, blocks=blocks, encoding=enc)
        check_code(c, c.quantise(v, rng.random(d)))


def test_dense_elias_round_trip_at_large_d():
    # the decoder's speed lives in benchmarks/; here only that a dense d = 1e5 code reads back
    rng = np.random.default_rng(0)
    c = QSGD(2**16, encoding="elias")
    q = c.quantise(rng.standard_normal(100000), rng.random(100000))
    assert c.decode(c.encode(q), 100000) == q


# ------------------------------------------------------------------ decode rejects junk
def small_payloads():
    rng = np.random.default_rng(5)
    out = []
    for enc in ("elias", "packed"):
        for blocks in (None, (2, 4)):
            c = QSGD(3, blocks=blocks, encoding=enc)
            v = rng.standard_normal(6)
            v[1] = 0
            out.append((c, c.encode(c.quantise(v, rng.random(6)))))
    return out


def test_decode_rejects_truncation_extension_and_padding():
    for c, payload in small_payloads():
        c.decode(payload, 6)
        for k in range(len(payload)):
            with pytest.raises(DecodeError):
                c.decode(payload[:k], 6)
        for extra in (b"\x00", b"\x01", b"\xff\xff"):
            with pytest.raises(DecodeError):
                c.decode(payload + extra, 6)
        nbits = c.code_length_bits(c.decode(payload, 6))
        if nbits % 8:
            bad = bytearray(payload)
            bad[-1] |= 1  # a padding bit
            with pytest.raises(DecodeError, match="padding"):
                c.decode(bytes(bad), 6)
        for d in (5, 7, 1):
            with pytest.raises(DecodeError):
                c.decode(payload, d)
        with pytest.raises(DecodeError, match="tag"):
            c.decode(bytes([0x7F]) + payload[1:], 6)
        with pytest.raises(DecodeError):
            c.decode("not bytes", 6)


@pytest.mark.parametrize("enc", ["elias", "packed"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0, -0.0])
def test_decode_rejects_bad_norms(enc, bad):
    c = QSGD(4, encoding=enc)
    payload = bytearray(c.encode(c.quantise(np.array([1.0, -2.0, 0.5]), np.full(3, 0.5))))
    payload[HEADER_BYTES:HEADER_BYTES + 4] = struct.pack(">f", bad)  # first norm, MSB first
    with pytest.raises(DecodeError, match="norm"):
        c.decode(bytes(payload), 3)


def test_decode_rejects_levels_above_s_negative_zero_and_nonzero_levels_under_zero_norm():
    s = 2
    norm = format(struct.unpack(">I", struct.pack(">f", 1.0))[0], "032b")

    def pay(tag, bits, d):
        bits += "0" * (-len(bits) % 8)
        return struct.pack("<BI", tag, d) + int(bits, 2).to_bytes(len(bits) // 8, "big")

    c = QSGD(s)
    assert c.decode(pay(TAG_PACKED, norm + "010" + "000", 2), 2).levels.tolist() == [2, 0]
    with pytest.raises(DecodeError, match="above s"):
        c.decode(pay(TAG_PACKED, norm + "011" + "000", 2), 2)  # level 3 > s
    with pytest.raises(DecodeError, match="negative zero"):
        c.decode(pay(TAG_PACKED, norm + "100" + "001", 2), 2)
    assert c.decode(pay(TAG_ELIAS, norm + omega_ref(2) + omega_ref(2) + "1" + omega_ref(2), 2), 2).levels.tolist() == [0, -2]
    with pytest.raises(DecodeError, match="maximum"):
        c.decode(pay(TAG_ELIAS, norm + omega_ref(2) + "1" + "0" + omega_ref(3), 2), 2)  # level 3
    with pytest.raises(DecodeError, match="maximum"):
        c.decode(pay(TAG_ELIAS, norm + omega_ref(2) + omega_ref(3) + "0" + "0", 2), 2)  # position 3 > d
    with pytest.raises(DecodeError, match="maximum"):
        c.decode(pay(TAG_ELIAS, norm + omega_ref(4) + "0000000", 2), 2)  # 3 nonzeros in d = 2
    zero = "0" * 32
    with pytest.raises(DecodeError, match="zero norm"):
        c.decode(pay(TAG_ELIAS, zero + omega_ref(2) + "0" + "0" + "0", 2), 2)
    with pytest.raises(DecodeError, match="zero norm"):
        c.decode(pay(TAG_PACKED, zero + "001" + "000", 2), 2)


def test_decode_work_is_bounded_on_hostile_input():
    # each is rejected up front by its length, before any bit is read (the messages say so)
    c = QSGD(2**16, encoding="elias")
    for junk in (b"\xff" * 10**6, b"\x00" * 10**6, bytes(np.random.default_rng(0).integers(0, 256, 10**6, dtype=np.uint8))):
        with pytest.raises(DecodeError, match="longer than any Elias code"):
            c.decode(struct.pack("<BI", TAG_ELIAS, 1000) + junk, 1000)
        with pytest.raises(DecodeError, match="packed code must be 2254 bytes"):
            c.decode(struct.pack("<BI", TAG_PACKED, 1000) + junk, 1000)


def decode_outcome(decode, payload: bytes, d: int):
    try:
        return decode(payload, d), None
    except DecodeError as exc:
        return None, str(exc)


def check_canonical_or_rejected(c: QSGD, payload: bytes, d: int):
    q, err = decode_outcome(c.decode, payload, d)
    # the compiled reader (qlsd_flwr.compression.codec) fails where the Python reference does, with its message
    q_ref, err_ref = decode_outcome(c.decode_reference, payload, d)
    assert err == err_ref
    if err is not None:
        return False
    assert q == q_ref and q.code_bits == q_ref.code_bits
    assert isinstance(q, Quantised) and q.d == d
    assert np.all(np.abs(q.levels) <= c.s) and np.all(np.isfinite(q.norms))
    enc = "packed" if payload[0] == TAG_PACKED else "elias"
    assert QSGD(c.s, blocks=c.blocks, encoding=enc).encode(q) == payload  # canonical
    return True


@given(d=st.integers(1, 6), s=st.sampled_from([1, 2, 3, 2**16]), tag=st.sampled_from([TAG_PACKED, TAG_ELIAS, 0, 3]),
       body=st.binary(max_size=40))
@settings(max_examples=300, deadline=None)
def test_fuzz_random_bytes(d, s, tag, body):
    check_canonical_or_rejected(QSGD(s), struct.pack("<BI", tag, d) + body, d)
    check_canonical_or_rejected(QSGD(s), body, d)


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_fuzz_mutated_valid_payloads(data):
    d = data.draw(st.integers(1, 12))
    s = data.draw(st.sampled_from([1, 2, 16, 2**16]))
    enc = data.draw(st.sampled_from(["elias", "packed"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    blocks = data.draw(st.sampled_from([None, random_blocks(d, rng)]))
    c = QSGD(s, blocks=blocks, encoding=enc)
    v = rng.standard_normal(d) * (rng.random(d) < 0.6)
    payload = bytearray(c.encode(c.quantise(v, rng.random(d))))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(HEADER_BYTES, len(payload) - 1))
        payload[i] ^= 1 << data.draw(st.integers(0, 7))
    cut = data.draw(st.integers(0, 2))
    mutated = bytes(payload[:len(payload) - cut] if data.draw(st.booleans()) else payload + bytes(cut))
    check_canonical_or_rejected(c, mutated, d)


# ------------------------------------------------------------------------ length bound
def mean_elias_bits(c: QSGD, d: int, m: int, seed: int, vec="gauss"):
    rng = np.random.default_rng(seed)
    V = {"gauss": lambda: rng.standard_normal((m, d)), "constant": lambda: np.ones((m, d))}[vec]()
    _, levels = c.quantise_batch(V, rng.random((m, d)))
    bits = c.code_length_bits_batch(levels).astype(np.float64)
    return bits.mean(), bits.std(ddof=1) / math.sqrt(m)


@pytest.mark.parametrize("d", [50, 10000])
@pytest.mark.parametrize("s", [2, 16])
@pytest.mark.parametrize("blocks", [None, "halves"])
def test_mean_elias_length_within_bound(d, s, blocks):
    blocks = None if blocks is None else (d // 2, d - d // 2)
    c = QSGD(s, blocks=blocks, encoding="elias")
    m = 2000 if d == 50 else 200
    for vec in ("gauss", "constant"):
        mean, se = mean_elias_bits(c, d, m, seed=d + s, vec=vec)
        # a one-sided test of E[bits] ≤ bound: reject only if the mean exceeds it by Z SE
        assert mean <= c.bound_bits(d) + Z * se
        assert mean <= c.proven_bound_bits(d) + Z * se
        assert mean <= c.theorem_bits(d) + Z * se


def exact_expected_elias_bits(v: np.ndarray, s: int) -> float:
    """E[length] of one block's Elias code in closed form (independent Bernoulli levels)."""
    n = v.size
    r = s * np.abs(v) / np.sqrt(np.sum(v * v))
    lo = np.floor(r).astype(int)
    p = r - lo
    pnz = np.where(lo >= 1, 1.0, p)
    lev = np.where(lo >= 1, (1 - p) * omega_length(np.maximum(lo, 1)) + p * omega_length(lo + 1), 1)
    total = 32 + float(np.sum(pnz * (1 + lev)))
    dist = np.zeros(n + 1)
    dist[0] = 1.0
    for q in pnz:  # Poisson-binomial law of the count K
        dist[1:] = dist[1:] * (1 - q) + dist[:-1] * q
        dist[0] *= 1 - q
    total += float(np.sum(dist * omega_length(np.arange(1, n + 2))))
    for j in range(n):  # gap into j: previous nonzero i (or the block start)
        surv = 1.0
        for i in range(j - 1, -2, -1):
            if i < 0:
                total += pnz[j] * surv * len(omega_ref(j + 1))
                break
            total += pnz[j] * surv * pnz[i] * len(omega_ref(j - i))
            surv *= 1 - pnz[i]
            if surv == 0.0:
                break
    return total


def test_exact_expected_length_matches_monte_carlo_and_bound_adversarial():
    rng = np.random.default_rng(11)
    c = QSGD(2, encoding="elias")
    v = np.ones(50)
    mc, se = mean_elias_bits(c, 50, 4000, seed=1, vec="constant")
    exact = exact_expected_elias_bits(v, 2)
    assert abs(mc - exact) <= Z * se  # the closed form is right, so the next checks mean something
    for n, s in [(50, 1), (50, 2), (50, 16), (200, 1), (200, 3), (120, 8)]:
        sparse = np.zeros(n)
        sparse[:: max(1, n // (s * s))] = 1.0  # s² coordinates at r = 1, evenly spaced: no randomness
        for w in (np.ones(n), sparse, rng.standard_normal(n) ** 3, np.eye(n)[-1]):
            e = exact_expected_elias_bits(w, s)
            assert e <= elias_bound_bits(n, s)
            assert e <= QSGD(s, encoding="elias").bound_bits(n)


def test_bound_formulas():
    # Theorem 3.2 with base-2 logs (natural logs would give a smaller number)
    n, s = 10000, 2
    m = s * (s + math.sqrt(n))
    assert qsgd_theorem_bits(n, s) == pytest.approx(32 + (3 + 1.5 * math.log2(2 * (s * s + n) / m)) * m, rel=1e-12)
    assert qsgd_theorem_bits(n, s) > 32 + (3 + 1.5 * math.log(2 * (s * s + n) / m)) * m
    # dense regime: the Jensen bound is finite where Theorem 3.2's s(s+√n) explodes
    c = QSGD(2**16, encoding="elias")
    assert c.bound_bits(1000) < 25 * 1000 < c.theorem_bits(1000)
    mean, se = mean_elias_bits(c, 1000, 200, seed=2)
    assert mean <= c.bound_bits(1000) + Z * se
    # packed: the fixed length; auto: the smaller; blocks: the sum
    assert QSGD(16, encoding="packed").bound_bits(50) == 32 + 50 * 6
    a = QSGD(16, encoding="auto").bound_bits(50)
    assert a == min(QSGD(16, encoding="elias").bound_bits(50), 32 + 50 * 6)
    assert QSGD(16, blocks=(20, 30), encoding="elias").bound_bits(50) == pytest.approx(
        QSGD(16, encoding="elias").bound_bits(20) + QSGD(16, encoding="elias").bound_bits(30))


# --------------------------------------------------------------- identity and factory
@pytest.mark.parametrize("dtype,bits", [("float64", 64), ("float32", 32)])
def test_identity(dtype, bits):
    c = Identity(dtype)
    v = np.random.default_rng(0).standard_normal(9)
    q = c.quantise(v)
    if dtype == "float64":
        assert np.array_equal(q, v)
    else:
        assert np.array_equal(q, v.astype(np.float32).astype(np.float64))
    payload = c.encode(q)
    assert len(payload) * 8 == c.code_length_bits(q) == c.bound_bits(9) == bits * 9
    assert np.array_equal(c.decode(payload, 9), q)
    assert np.array_equal(c.dequantise(q), q)
    assert c.code_length_bits_batch(np.zeros((3, 9))).tolist() == [bits * 9] * 3
    for bad in (payload[:-1], payload + b"\x00", b""):
        with pytest.raises(DecodeError):
            c.decode(bad, 9)
    nan = np.frombuffer(payload, dtype=c._wire).copy()
    nan[2] = np.nan
    with pytest.raises(DecodeError):
        c.decode(nan.tobytes(), 9)
    with pytest.raises(ValueError):
        c.quantise(np.array([np.inf]))


def test_factory_and_argument_errors():
    assert make_compressor("qsgd", 16) == QSGD(16)
    assert make_compressor("QSGD", 4, blocks=[2, 3], encoding="elias") == QSGD(4, (2, 3), "elias")
    assert make_compressor("identity", None) == Identity()
    with pytest.raises(ValueError, match=r"'topk'.*qsgd, identity"):
        make_compressor("topk", 4)
    with pytest.raises(ValueError, match="needs s"):
        make_compressor("qsgd", None)
    with pytest.raises(ValueError, match=r"'huffman'.*elias, packed, auto"):
        QSGD(4, encoding="huffman")
    for bad_s in (0, -1, 2.5, True, 2**33):
        with pytest.raises(ValueError):
            QSGD(bad_s)
    with pytest.raises(ValueError):
        QSGD(4, blocks=(3, 0))
    with pytest.raises(ValueError, match="float64, float32"):
        Identity("float16")
    q = QSGD(4).quantise(np.ones(3), np.zeros(3))
    with pytest.raises(ValueError):
        QSGD(8).encode(q)  # quantised with another s


def test_omega_tables_equal_the_rule():
    """The lookup tables (speed only) hold exactly what the reference rule computes."""
    from qlsd_flwr.compression import elias as Q

    x = np.arange(1, Q._SMALL, dtype=np.int64)
    assert np.array_equal(Q.omega_length(x), Q._omega_length(x))
    big = np.array([Q._SMALL, Q._SMALL + 1, 2**40 + 3, 2**62], dtype=np.int64)
    assert list(Q.omega_length(big)) == [len(omega_ref(int(v))) for v in big]
    y = np.arange(1, Q._FIELDS_SMALL, dtype=np.int64)
    for a, b in zip(Q._omega_fields(y), Q._omega_fields_ref(y)):
        assert np.array_equal(a, b)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 4), st.sampled_from([12, 16, 32]), st.integers(0, 2**32 - 1))
def test_fixed_point_rows_round_trip_at_every_width_with_their_exact_length(d, rows, bits, seed):
    # compression.fixed: a row as it travels (12 bits: two levels in three bytes, the last padded; or the same levels
    # coded where shorter) reads back as rounded() gives it, each entry within σ/2L of itself (σ the row's largest),
    # and its bytes are sent_bits, at most the raw layout's message_bits (exactly it where the raw layout is sent)
    from qlsd_flwr.compression import fixed

    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, d)) * 10.0 ** rng.uniform(-20, 20, size=(rows, 1))
    X[:, rng.random(d) < 0.5] = 0.0  # zeros, as a product's coordinates whose input pixel is always 0
    buf = fixed.encode(X, bits)
    raw = fixed.message_bits(rows, d, bits)
    assert 8 * len(buf) == fixed.sent_bits(X, bits) and fixed.width_of(buf) == bits
    assert 8 * len(buf) == raw if buf[0] == bits else 8 * len(buf) < raw
    Y = fixed.decode(buf, d)
    assert np.array_equal(Y, fixed.rounded(X, bits)) and fixed.sent_bits(Y, bits) == 8 * len(buf)
    sigma = np.max(np.abs(X), axis=1, keepdims=True)
    L = 2 ** (bits - 1) - 1 if bits < 32 else 2 ** 23  # float32: within 2⁻²⁴ of itself
    assert np.all(np.abs(Y - X) <= sigma / (2 * L) * (1 + 1e-6) + 1e-300)
    with pytest.raises(ValueError, match="not whole rows" if buf[0] == bits else "coded|rows"):
        fixed.decode(buf[:-1], d)


def test_fixed_point_rows_are_coded_where_shorter_and_read_only_as_the_writers_code():
    # issue 37: the preparation's rows are mostly levels far below L (a product's coordinates whose pixel is always 0
    # are 0; the rest spread over scales), so the writer codes the same levels (compression.arith) where that is
    # shorter; one message has one code, and any other bytes are refused by name or are that code
    from qlsd_flwr.compression import fixed

    rng = np.random.default_rng(3)
    d = 400
    X = rng.normal(size=(3, d)) * np.exp(2.0 * rng.normal(size=d))  # scales spread over orders of magnitude
    X[:, :100] = 0.0
    for bits in (fixed.NARROW, fixed.BITS):
        buf = fixed.encode(X, bits)
        assert buf[0] == fixed.CODED | bits and 8 * len(buf) < 0.75 * fixed.message_bits(3, d, bits)
        assert np.array_equal(fixed.decode(buf, d, max_rows=3), fixed.rounded(X, bits))
        s32 = fixed._scales(X)
        q = fixed._levels(X, s32, fixed._top(bits))
        with pytest.raises(ValueError, match="whose code is shorter"):  # the same levels, raw: not the writer's
            fixed.decode(fixed._raw(q, s32, bits), d)
        G = rng.normal(size=(2, d))  # Gaussian rows: their raw layout is the shorter, and their code is refused
        assert fixed.encode(G, bits)[0] == bits
        g32 = fixed._scales(G)
        with pytest.raises(ValueError, match="no shorter than its raw rows"):
            fixed.decode(fixed._coded(fixed._levels(G, g32, fixed._top(bits)), g32, bits), d)
        for bad, why in ((buf[:3], "shorter than its header"), (struct.pack("<BI", buf[0], 0) + buf[5:], "0 rows, none"),
                         (struct.pack("<BI", buf[0], 2 ** 32 - 1) + buf[5:], "above the 3 allowed")):
            with pytest.raises(ValueError, match=why):  # the row count is checked before a level is read
                fixed.decode(bad, d, max_rows=3)
        half = q.copy()
        half[0] //= 2  # the first row's levels below L: not the writer's scale for them, raw or coded
        for forged in (fixed._raw(half, s32, bits), fixed._coded(half, s32, bits)):
            with pytest.raises(ValueError, match="not the writer's message"):
                fixed.decode(forged, d)
        peaked = np.zeros((1, d), dtype=np.int64)
        peaked[0, :7] = fixed._top(bits)  # scale 0 with levels at L: would read as zeros, counted as a zero row's bytes
        for forged, why in ((fixed._raw(peaked, np.zeros(1, np.float32), bits), "not the writer's message"),
                            (fixed._raw(0 * peaked, np.full(1, -0.0, np.float32), bits), "negative or not finite")):
            with pytest.raises(ValueError, match=why):
                fixed.decode(forged, d)
        tiny = np.full((2, d), 1e-300)  # below float32's least scale: a zero row, sent with scale 0, read back
        assert np.array_equal(fixed.decode(fixed.encode(tiny, bits), d), fixed.rounded(tiny, bits))
        nan = fixed.encode(np.full((1, d), np.nan), bits)
        with pytest.raises(ValueError, match="non-finite row scale"):
            fixed.decode(nan, d)
        accepted = 0
        for trial in range(300):  # flipped bits and random bodies: refused, or exactly the writer's bytes of what they hold
            b = bytearray(buf)
            if trial < 200:
                b[5 + trial % (len(b) - 5)] ^= 1 << (trial % 8)
            else:
                b[5:] = rng.integers(0, 256, size=len(b) - 5, dtype=np.uint8).tobytes()
            try:
                Y = fixed.decode(bytes(b), d, max_rows=3)
            except ValueError:
                continue
            accepted += 1
            assert fixed.encode(Y, bits) == bytes(b)
        assert accepted < 300
