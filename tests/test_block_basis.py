"""``compression-basis = block`` (issue 37): the clients quantise in K-FAC's root on ``metric-block``'s directions
(:mod:`qlsd_flwr.core.block_basis`), and the server undoes it exactly.

* ``B⁻¹ B = I`` to rounding, ``B`` symmetric positive-definite with K-FAC's root on the block's directions and the widest
  scale elsewhere; its bytes read back bit for bit, and hostile bytes are refused by name.
* With QSGD's levels so fine that its noise is below 1e-9 of a message, the chain in the block basis is the chain in θ's
  basis: the basis changes only where the quantisation's noise falls (a wrong inverse would move the drift itself).
* ``auto`` picks it for K-FAC with ``metric-block``; asked for without a block it is refused naming the keys; the
  engines' agreement bit for bit is ``tests/test_metric_block.py``'s (its runs take it by default).
"""

from __future__ import annotations

import numpy as np
import pytest

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.core.block_basis import BlockBasis
from qlsd_flwr.core.kron import Kron
from qlsd_flwr.core.kron_block import Blocked
from qlsd_flwr.core.metric import MetricError
from qlsd_flwr.core.metric_codec import from_bytes
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.bases import compression_basis
from qlsd_flwr.run.simulate import run


def _blocked(F=9, K=3, k=4, seed=0) -> Blocked:
    rng = np.random.default_rng(seed)
    qg = np.linalg.qr(rng.normal(size=(F, F)))[0]
    qa = np.linalg.qr(rng.normal(size=(K, K)))[0]
    den = 5.0 + rng.gamma(1.0, 40.0, size=(F, K))
    kron = Kron(rng.permutation(F * K), qg, qa, den)
    m = k * K
    v = np.linalg.qr(rng.normal(size=(m, m)))[0]
    return Blocked(kron, qg[:, F - k:], v, rng.uniform(0.5, 3.0, m))


def _dense(f, d):
    return np.stack([f(e) for e in np.eye(d)], axis=1)


def test_the_basis_is_k_fac_s_root_on_the_block_its_inverse_exact_and_its_bytes_checked():
    blk = _blocked()
    F, K = blk.kron.den.shape
    d = F * K
    B = BlockBasis.of(blk)
    Bm, Bi = _dense(B.apply_root, d), _dense(B.apply_inv, d)
    assert np.abs(Bi @ Bm - np.eye(d)).max() < 1e-12 and np.abs(Bm - Bm.T).max() < 1e-14
    assert np.linalg.eigvalsh(Bm).min() > 0
    # on the block's directions P = Q̂ ⊗ Q_A, K-FAC's root exactly (Q̂ are K-FAC's top input eigenvectors here);
    # orthogonal to them, the widest scale K-FAC gives
    R = _dense(lambda x: blk.kron.apply(x, -0.5), d)
    P = _dense(lambda x: Blocked(blk.kron, blk.qh, np.eye(blk.v.shape[0]), np.full(blk.t.size, 4.0))
               .apply_root(x) - blk.kron.apply(x, -0.5), d)  # R P C Pᵀ with C = −½ I: its range is R's image of S
    S = np.linalg.svd(P)[0][:, :blk.t.size]  # an orthonormal basis of the block's directions in θ's order
    assert np.abs(Bm @ S - R @ S).max() < 1e-12
    out = np.linalg.qr(np.eye(d) - S @ S.T)[0][:, : d - S.shape[1]]
    out = out - S @ (S.T @ out)
    assert np.abs(Bm @ out - (blk.kron.den.min() ** -0.5) * out).max() < 1e-12
    # the bytes: the same numbers back, bit for bit; the wrong ones refused by name
    back = from_bytes(B.to_bytes(), d)
    z = np.random.default_rng(1).normal(size=(2, d))
    assert isinstance(back, BlockBasis) and np.array_equal(back.apply_root_t(z), B.apply_root_t(z))
    arrays = B.arrays()
    for name, bad in (("s", -arrays["s"]), ("a", np.array([0.0])), ("qh", 2 * arrays["qh"]),
                      ("s", arrays["s"] * np.r_[1e13, np.ones(arrays["s"].size - 1)].reshape(arrays["s"].shape)),
                      ("perm", np.zeros(d))):
        hostile = type("H", (BlockBasis,), {"arrays": lambda self, a={**arrays, name: bad}: a})(
            B.perm, B.qh, B.qa, B.s, B.a)
        with pytest.raises(MetricError, match="not a block basis"):
            from_bytes(hostile.to_bytes(), d)
    with pytest.raises(MetricError, match="unknown kind code 6"):  # never a correction's base
        from_bytes(b"QM" + _corrected_head(d) + B.to_bytes(), d)


def _corrected_head(d: int) -> bytes:
    import struct

    out = [struct.pack("<BB", 4, 2)]  # a correction (kind 4) of two arrays, its base to follow
    for name, a in (("u", np.eye(d)[:, :1]), ("t", np.ones(1))):
        a = np.asarray(a, dtype="<f8")
        out += [struct.pack("<BB", 1, a.ndim), name.encode(), struct.pack(f"<{a.ndim}I", *a.shape), a.tobytes()]
    return b"".join(out)


def test_the_block_basis_moves_only_the_quantisation_noise_and_auto_picks_it(tmp_path):
    base = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "num-chains": 1, "num-rounds": 15,
            "burn-in": 0, "thin": 1, "progress": False, "output-dir": str(tmp_path), "metric": "kronecker",
            "metric-block": 8, "gamma": "auto", "variant": "qlsd-pp", "s": str(2 ** 30), "l": 5, "loo": "off",
            "engine": "local"}
    cfg = resolve(base)
    assert compression_basis(cfg, 62) == "block"
    assert compression_basis(resolve({**base, "metric-block": 0}), 62) == "theta"
    with pytest.raises(ConfigError, match="compression-basis: block .* metric-block > 0"):
        compression_basis(resolve({**base, "metric": "diagonal", "metric-block": 0, "compression-basis": "block"}), 62)
    block = load_samples(run({**base, "run-name": "block"}).run_dir)
    theta = load_samples(run({**base, "compression-basis": "theta", "run-name": "theta"}).run_dir)
    # 2^30 levels: QSGD's noise is below 1e-9 of each message, so the two chains differ by rounding and that noise;
    # the drift's M B⁻¹ (B g) is M g to rounding (an inverse off by 1 % would put them 1e-2 γ |M g| apart)
    scale = np.abs(theta).max()
    assert np.abs(block - theta).max() < 1e-6 * scale
    assert not np.array_equal(block, theta)  # the basis did change the quantisation


def test_a_basis_off_orthonormal_by_its_scales_spread_a_missing_block_and_an_older_checkpoint_are_refused(tmp_path):
    """The review's cases: factors 1e-8 off orthonormal pass a fixed 1e-8, but with scales 1e11 apart ``B`` is then
    indefinite, so the tolerance shrinks with the spread; ``block`` on a metric without a block (a checkpoint of the
    former dense form) is refused by name rather than sending the whole metric; a checkpoint written before the block
    basis, whose chain quantised in θ's coordinates, is not resumed in the block basis."""
    from qlsd_flwr.bases import basis_of
    from qlsd_flwr.core.metric import Kronecker
    from qlsd_flwr.errors import CheckpointError
    from qlsd_flwr.outputs.checkpoint_checks import check_step_and_metric

    B = BlockBasis.of(_blocked())
    d = B.perm.size
    arrays = {**B.arrays(), "qh": B.qh * np.sqrt(1 + 0.9e-8), "s": np.full_like(B.s, 1e-11), "a": np.array([1.0])}
    with pytest.raises(MetricError, match="not a block basis"):
        BlockBasis.checked(arrays, d)
    assert BlockBasis.checked({**arrays, "qh": B.qh}, d).a == 1.0  # exactly orthonormal: the same spread is allowed
    cfg = resolve({"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "metric": "kronecker",
                   "metric-block": 8, "gamma": "auto", "variant": "qlsd-pp", "s": "8"})
    with pytest.raises(ConfigError, match="compression-basis: block needs metric-block's metric"):
        basis_of(cfg, d, Kronecker(_blocked().kron))
    theta = {"theta": np.zeros(62)}
    old = {"ts_info": {"metric_kind": "kronecker", "gamma_used": 0.1}}
    with pytest.raises(CheckpointError, match="compression-basis: its clients quantised in the theta basis"):
        check_step_and_metric(cfg, old, theta, tmp_path)
    check_step_and_metric(cfg, {"ts_info": {**old["ts_info"], "compression_basis": "block"}}, theta, tmp_path)


def test_the_basis_by_reference_is_the_basis_from_the_clients_own_directions_and_what_cannot_resolve_resyncs():
    """A client whose block report the server took holds ``Q̂``'s rows already: it is sent the basis without them
    (:class:`BasisRef`) and builds the server's basis bit for bit from the same QR of the same numbers. Directions from
    another exchange, or none (a restarted node), do not resolve: the client answers resync with its state
    unchanged, and the server then sends the whole basis. The reference is read only where a client reads its
    ``metric``, and hostile arrays are refused by name."""
    from qlsd_flwr.compression import fixed
    from qlsd_flwr.core.block_basis import BasisRef
    from qlsd_flwr.core.kron_block import orthonormal, pack, unpack
    from qlsd_flwr.protocol import metric_sent

    blk = _blocked(F=9, K=3, k=4)
    F, K = blk.kron.den.shape
    d = F * K
    rows = fixed.rounded(pack(blk.qh + 1e-3, d), 32)  # the directions as the clients read them (float32 rows)
    # the server's Q̂: the orthonormal basis of the rows as the clients read them (kron_block.correction)
    server_side = BlockBasis.of(Blocked(blk.kron, orthonormal(unpack(rows, F))[0], blk.v, blk.t))
    server_side = BlockBasis.checked(server_side.arrays(), d)
    ref = BasisRef.of(server_side)
    back = from_bytes(ref.to_bytes(), d, refs=True)
    assert isinstance(back, BasisRef)
    built = back.resolve(rows, d)
    for name, a in server_side.arrays().items():
        assert np.array_equal(built.arrays()[name], a), name
    k = ref.qsum.size  # the reference is the basis less Q̂'s F k numbers (and its name and shape), plus k sums
    assert len(server_side.to_bytes()) - len(ref.to_bytes()) == 8 * k * (F - 1) + (2 + 8) - (4 + 4)
    # other directions, or none: not resolved
    assert back.resolve(fixed.rounded(pack(blk.qh, d), 32), d) is None and back.resolve(None, d) is None
    with pytest.raises(MetricError, match="unknown kind code 7"):  # a checkpoint's metric is never a reference
        from_bytes(ref.to_bytes(), d)
    for name, bad in (("s", -ref.s), ("qsum", np.ones(ref.qsum.size + 1)), ("qa", 2 * ref.qa), ("perm", np.zeros(d))):
        hostile = type("H", (BasisRef,), {"arrays": lambda self, a={**ref.arrays(), name: bad}: a})(
            ref.perm, ref.qa, ref.s, ref.a, ref.qsum)
        with pytest.raises(MetricError, match="not a block basis"):
            from_bytes(hostile.to_bytes(), d, refs=True)
    # the server: the reference to a holder, the whole basis to the others and to a holder after its resync
    server = type("S", (), {})()
    server._metric_bytes, server._metric_sent, server.needs_resync = server_side.to_bytes(), set(), {0: False, 1: False}
    server._ref_bytes, server._ref_holders = metric_sent.ref_of(server_side, [0]), {0}
    sent = []
    for i, resync in ((0, False), (1, False), (0, True)):
        server.needs_resync[i] = resync
        fields: dict = {}
        metric_sent.add(server, i, fields)
        sent.append(fields["metric"])
    assert sent == [ref.to_bytes(), server_side.to_bytes(), server_side.to_bytes()]
    assert list(metric_sent.bits_by_client(server_side, [0], 2)) == [8 * len(sent[0]), 8 * len(sent[1])]


def test_a_client_without_the_directions_answers_resync_with_its_state_unchanged():
    from qlsd_flwr.core.block_basis import BasisRef
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol.client import _prepare

    blk = _blocked(F=9, K=3, k=4)
    d = blk.kron.den.size
    ref = BasisRef.of(BlockBasis.of(blk))
    spec = type("Spec", (), {"index": 0, "metric": "sent", "whitened": True, "downlink": None, "memory": False,
                             "kind": type("K", (), {"local": False, "coupled": False, "anchored": False,
                                                    "down": ("metric",), "cv_zeta": False,
                                                    "at_theta_star": False, "surrogate": False})()})()
    st = ClientState()
    fields = {"phase": "sample", "round": 3, "anchor_version": 0, "eta_count": 0, "theta": np.zeros(d),
              "metric": ref.to_bytes()}
    theta, reply = _prepare(spec, None, st, fields, d)
    assert reply == {"client": 0, "status": "resync"} and st.metric is None


def test_an_identity_layout_travels_as_no_permutation_and_any_other_whole():
    # issue 37: a softmax regression's layout is the identity (θ is its (F̃, K) matrix): the basis and its reference
    # leave it out, 8 d bytes fewer a client, and read back as the identity; another permutation travels whole
    from qlsd_flwr.core.block_basis import BasisRef

    blk = _blocked()
    d = blk.kron.perm.size
    ident = Blocked(Kron(np.arange(d), blk.kron.qg, blk.kron.qa, blk.kron.den), blk.qh, blk.v, blk.t)
    for b in (BlockBasis.of(blk), BlockBasis.of(ident)):
        for x in (b, BasisRef.of(b)):
            back = from_bytes(x.to_bytes(), d, refs=True)
            assert np.array_equal(back.perm, b.perm) and back.perm.dtype == np.int64
    shown, hidden = BlockBasis.of(blk), BlockBasis.of(ident)
    assert len(shown.to_bytes()) - len(hidden.to_bytes()) == 8 * d
    assert len(BasisRef.of(shown).to_bytes()) - len(BasisRef.of(hidden).to_bytes()) == 8 * d
    from qlsd_flwr.core.metric import encode

    for bad in (np.arange(d - 1.0), np.zeros(d)):  # neither none nor a permutation of 0..d−1: refused by name
        with pytest.raises(MetricError, match="permutation"):
            from_bytes(encode(BlockBasis.code, {**hidden.arrays(), "perm": bad}), d)
