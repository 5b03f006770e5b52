"""A positive semi-definite report as its square root in 16-bit rows (:mod:`qlsd_flwr.compression.root`, issue 37):
what it costs, how close it comes back, and that nothing a client sends decodes to an indefinite matrix."""

import numpy as np
import pytest

from qlsd_flwr.compression import fixed, root


def _psd(m, r, seed, spread=1.0):
    """A random ``m × m`` semi-definite matrix of rank ``r`` whose eigenvalues span ``spread``."""
    g = np.random.default_rng(seed)
    U = np.linalg.qr(g.normal(size=(m, r)))[0]
    w = np.geomspace(1.0, 1.0 / spread, r) * g.uniform(0.5, 2.0)
    return (U * w) @ U.T


@pytest.mark.parametrize("bits", [12, 16])
@pytest.mark.parametrize("m,r,spread", [(12, 12, 1e3), (40, 9, 1e2), (30, 30, 1e5), (1, 1, 1.0)])
def test_a_root_comes_back_within_its_rounding_and_costs_what_it_says(m, r, spread, bits):
    S = _psd(m, r, m + r, spread)
    buf = root.encode(S, bits)
    R, piv = root.factor(S)
    assert R.shape == (r, m)
    raw_tag = root.TAG12 if bits == 12 else root.TAG
    assert buf[0] in (raw_tag, raw_tag | fixed.CODED)
    cost = root.message_bits(r, m, bits)
    assert 8 * len(buf) == cost if buf[0] == raw_tag else 8 * len(buf) < cost
    back = root.decode(buf, m)
    assert np.array_equal(back, back.T) and np.array_equal(back, root.rounded(S) if bits == root.BITS else back)
    # each entry of R within R_ff / 2L (pivoting: |R_fj| ≤ R_ff), so each entry of RᵀR within Σ_f R_ff² / L (1 + 1/4L)
    # ≤ tr S / L, plus what the rank's cut left (each entry below m RANK_TOL max S_ii)
    L = fixed._top(bits)
    bound = np.trace(S) / L * (1 + 1 / (4 * L)) + root.RANK_TOL * m * np.max(np.diag(S))
    assert np.max(np.abs(back - S)) <= bound
    # and the root keeps the bottom of the spectrum to a square root's precision: along S's least eigenvector (of
    # a full-rank S), within 2 ‖E‖ / √λ_min + ‖E‖² / λ_min of itself, ‖E‖ ≤ √(m tr S) / 2L
    if r == m:
        w, U = np.linalg.eigh(S)
        u = U[:, 0]
        e = np.sqrt(m * np.trace(S)) / (2 * L) / np.sqrt(w[0])
        assert abs(u @ back @ u / w[0] - 1) <= 2 * e + e * e
    if r < m:  # a low-rank report costs its rank, below float32's triangle
        assert cost < 32 * m * (m + 1) // 2
    if bits == 12 and r > 1:  # 12-bit levels cost less than 16-bit ones, raw or coded
        assert cost < root.message_bits(r, m, 16) and len(buf) <= len(root.encode(S, 16))


def test_the_root_keeps_a_spread_that_a_16_bit_triangle_loses():
    # the why of the format: a triangle rounded to 16 bits a row errs by its rows' largest entry / 2L, which swamps
    # S's small eigenvalues and makes it indefinite (measured: the least eigenvalue read as −1.4 × itself, its
    # direction's curvature 131 % off); the root keeps it within 1.1e-4 (bound: 2 ‖E‖/√λ_min, 0.3 here)
    S = _psd(100, 100, 3, 1e6)
    w, U = np.linalg.eigh(S)
    u = U[:, 0]
    tri = fixed.rounded(S)
    tri = 0.5 * tri + 0.5 * tri.T
    assert abs(u @ tri @ u / w[0] - 1) > 1.0 and np.linalg.eigvalsh(tri)[0] < 0
    assert abs(u @ root.decode(root.encode(S, 16), 100) @ u / w[0] - 1) < 1e-3
    # at 12 bits (root.BITS, what the clients write) 2.0 % there, within its bound 2e + e² (e = ‖E‖/√λ_min, 16 times
    # 16 bits'), and still 65 times closer than the 16-bit triangle
    e = np.sqrt(100 * np.trace(S)) / (2 * fixed._top(12)) / np.sqrt(w[0])
    assert abs(u @ root.rounded(S) @ u / w[0] - 1) <= min(2 * e + e * e, 0.05)


def test_whatever_bytes_a_client_sends_decode_to_a_semi_definite_matrix_or_are_refused():
    g = np.random.default_rng(7)
    m = 9
    for trial in range(200):
        r = int(g.integers(0, m + 1))
        n = r * m - r * (r - 1) // 2
        buf = (root._HEAD.pack(root.TAG, m, r) + g.permutation(m).astype("<u4").tobytes()
               + g.uniform(0, 10.0 ** g.integers(-3, 30), r).astype("<f4").tobytes()
               + g.integers(-32768, 32768, n).astype("<i2").tobytes())
        buf12 = (root._HEAD.pack(root.TAG12, m, r) + g.permutation(m).astype("<u4").tobytes()
                 + g.uniform(0, 10.0 ** g.integers(-3, 30), r).astype("<f4").tobytes()
                 + fixed._pack12(g.integers(-2047, 2048, (1, n))).tobytes())
        for b in (buf, buf12):
            try:
                S = root.decode(b, m)
            except ValueError as exc:  # random levels whose code is shorter than their raw layout: refused
                assert "code is shorter" in str(exc)
                continue
            assert np.array_equal(S, S.T) and np.linalg.eigvalsh(S)[0] >= -1e-12 * max(np.max(np.abs(S)), 1e-300)
    good = root.encode(_psd(m, 4, 1), 16)
    bad = {
        "not a square-root report": [b"", b"\x52", np.zeros(3), bytes([0x51]) + good[1:]],
        "of a 9 × 9 matrix": [root.encode(np.eye(8)), root._HEAD.pack(root.TAG, m, m + 1) + good[9:]],
        "12-bit level is out of range": [root._HEAD.pack(root.TAG12, m, 1) + np.arange(m, dtype="<u4").tobytes()
                                          + np.float32(1).tobytes() + bytes(3 * ((m + 1) // 2))],
        "expected": [good[:-1], good + b"\x00"],
        "not an ordering": [good[:9] + np.zeros(m, "<u4").tobytes() + good[9 + 4 * m:]],
        "scale is negative or not finite": [root.encode(np.full((m, m), np.nan)), root.encode(np.diag([np.inf] + [1.0] * 8)),
                                            good[:9 + 4 * m] + np.float32(-1).tobytes() + good[13 + 4 * m:]],
    }
    # float32's largest scales square to a finite matrix (the caller holds it to REPORT_MAX)
    assert np.all(np.isfinite(root.decode(good[:9 + 4 * m] + np.full(4, 3e38, "<f4").tobytes() + good[9 + 4 * m + 16:], m)))
    for why, bufs in bad.items():
        for b in bufs:
            with pytest.raises(ValueError, match=why):
                root.decode(b, m)


def test_a_zero_report_is_rank_zero_and_a_non_finite_one_cannot_be_factored():
    assert root.factor(np.zeros((4, 4)))[0].shape == (0, 4)
    assert np.array_equal(root.decode(root.encode(np.zeros((4, 4))), 4), np.zeros((4, 4)))
    assert 8 * len(root.encode(np.zeros((4, 4)))) <= root.message_bits(0, 4)
    with pytest.raises(ValueError, match="not finite"):
        root.factor(np.full((2, 2), np.nan))


def test_the_rank_cut_leaves_at_most_m_minus_r_times_its_tolerance():
    # the review's case: pivots just below the cut along a direction spread over m − 1 coordinates; what the cut leaves
    # is semi-definite with each diagonal entry below m RANK_TOL max S_ii, so its spectral norm is below (m − r) times that
    m = 400
    cut = m * root.RANK_TOL
    S = np.zeros((m, m))
    S[0, 0] = 1.0
    S[1:, 1:] = 0.99 * cut
    R, piv = root.factor(S)
    back = np.empty_like(S)
    back[np.ix_(piv, piv)] = R.T @ R
    left = np.linalg.eigvalsh(S - back)
    assert R.shape[0] == 1 and left[0] >= -1e-15 and 0.9 * (m - 1) * cut < left[-1] <= (m - 1) * cut
    S[1:, 1:] = 1.01 * cut  # just above the cut: kept
    assert root.factor(S)[0].shape[0] == 2


def test_a_report_with_structure_travels_coded_and_one_report_has_one_code():
    # issue 37: K-FAC's G_i on images has rows and columns of 0 (pixels that are always 0) and entries over many
    # scales, so its root's levels code in fewer bits (compression.arith; the main job's: 0.51 of raw). The same
    # levels read back, the raw layout of those levels is refused, and so is a code of a report whose raw layout
    # is the shorter; what a forger's coded bytes decode to is semi-definite or refused
    g = np.random.default_rng(11)
    m = 60
    X = g.normal(size=(200, m)) * np.exp(1.5 * g.normal(size=m))
    X[:, :20] = 0.0
    S = X.T @ X
    buf = root.encode(S, 16)
    R, piv = root.factor(S)
    r = R.shape[0]
    assert root.encode(S)[0] == root.CODED12 and buf[0] == root.CODED and 8 * len(buf) < 0.8 * root.message_bits(r, m, 16)
    s32 = fixed._scales(R)
    levels = fixed._levels(R, s32)[root._mask(r, m)]
    raw = root._HEAD.pack(root.TAG, m, r) + piv.astype("<u4").tobytes() + s32.tobytes() + levels.tobytes()
    assert len(raw) == root.message_bits(r, m, 16) // 8
    back = root.decode(buf, m)
    assert np.array_equal(back, root.decode(root.encode(S, 16), m))
    with pytest.raises(ValueError, match="whose code is shorter"):
        root.decode(raw, m)
    low = bytearray(raw)
    low[-2:] = np.array([-32768], "<i2").tobytes()  # a level no writer makes
    with pytest.raises(ValueError, match="out of range"):
        root.decode(bytes(low), m)
    A = g.normal(size=(20, 20))  # a small dense report: its raw layout is the shorter
    assert root.encode(A @ A.T, 16)[0] == root.TAG
    Rf, pf = root.factor(A @ A.T)
    sf = fixed._scales(Rf)
    coded = root._coded(fixed._levels(Rf, sf)[root._mask(20, 20)], sf, pf, 20)
    with pytest.raises(ValueError, match="fewer coded"):
        root.decode(coded, 20)
    for trial in range(200):
        b = bytearray(buf)
        b[9 + 4 * m + trial % (len(b) - 9 - 4 * m)] ^= 1 << (trial % 8)
        try:
            T = root.decode(bytes(b), m)
        except ValueError:
            continue
        assert np.array_equal(T, T.T) and np.linalg.eigvalsh(T)[0] >= -1e-9 * np.max(np.abs(T))
