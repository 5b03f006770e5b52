"""Every metric against values worked out by hand on tiny inputs (the arithmetic is in the
comments), plus R-hat/ESS against closed-form ESS of i.i.d. and AR(1) chains."""

import math

import numpy as np
import pytest

from qlsd_flwr.evaluation import metrics as M
from qlsd_flwr.evaluation.reference import diagnostics_of

# Four points, three classes. Top-1 predictions: [0, 1, 2, 0]; confidences [.7, .4, .8, .5].
P = np.array([[0.7, 0.2, 0.1],
              [0.3, 0.4, 0.3],
              [0.1, 0.1, 0.8],
              [0.5, 0.25, 0.25]])
Y = np.array([0, 2, 0, 1])  # correct: [yes, no, no, no]
# A reference predictive; its top-1 predictions are [1, 1, 0, 0].
Q = np.array([[0.2, 0.7, 0.1],
              [0.3, 0.4, 0.3],
              [0.6, 0.3, 0.1],
              [0.4, 0.3, 0.3]])


def test_accuracy():
    # predictions [0,1,2,0] vs labels [0,2,0,1]: only point 1 is right -> 1/4
    assert M.accuracy(P, Y) == pytest.approx(0.25, abs=1e-15)


def test_ece_right_closed_bins():
    # M = 5 bins ]0,.2] ]0.2,.4] ].4,.6] ].6,.8] ].8,1]; confidences .7,.4,.8,.5
    #   .4 -> bin 2 and .8 -> bin 4 (right-closed, as in the supplement).
    # bin 2: {pt2}: acc 0, conf .4   -> 1/4 * |0 - .4|  = .100
    # bin 3: {pt4}: acc 0, conf .5   -> 1/4 * |0 - .5|  = .125
    # bin 4: {pt1 (right), pt3 (wrong)}: acc .5, conf (.7+.8)/2 = .75 -> 2/4 * .25 = .125
    # ECE = .35.  (Left-closed bins would give .225 + .075 + .2 = .5.)
    cb = M.calibration_bins(P, Y, 5)
    assert cb["counts"].tolist() == [0, 1, 1, 2, 0]
    assert M.ece(P, Y, 5) == pytest.approx(0.35, abs=1e-12)
    # M = 1: |accuracy - mean confidence| = |.25 - (.7+.4+.8+.5)/4| = |.25 - .6| = .35
    assert M.ece(P, Y, 1) == pytest.approx(0.35, abs=1e-12)
    # M = 2 (]0,.5] ].5,1]): {pt2 (.4), pt4 (.5, right-closed)}: acc 0, conf .45 -> 2/4·.45
    #   = .225; {pt1, pt3}: acc .5, conf .75 -> 2/4·.25 = .125; total .35
    assert M.calibration_bins(P, Y, 2)["counts"].tolist() == [2, 2]
    assert M.ece(P, Y, 2) == pytest.approx(0.35, abs=1e-12)
    # one-hot correct predictions: conf 1 = acc 1 -> ECE 0
    assert M.ece(np.eye(3)[[0, 1, 2]], np.array([0, 1, 2]), 10) == 0.0


def test_brier_supplement_normalisation():
    # Σ_c (p_c - 1{y=c})^2 per point, NOT divided by K (supplement's BS):
    #   pt1 y=0: .3² + .2² + .1²            = .09 + .04 + .01     = .14
    #   pt2 y=2: .3² + .4² + .7²            = .09 + .16 + .49     = .74
    #   pt3 y=0: .9² + .1² + .8²            = .81 + .01 + .64     = 1.46
    #   pt4 y=1: .5² + .75² + .25²          = .25 + .5625 + .0625 = .875
    #   mean = 3.215 / 4 = .80375
    assert M.brier(P, Y) == pytest.approx(0.80375, abs=1e-12)


def test_nnll():
    # p(y|x) = .7, .3, .1, .25 -> -(1/4) log(.7 * .3 * .1 * .25) = -log(.00525)/4 ≈ 1.312382
    assert M.nnll(P, Y) == pytest.approx(-math.log(0.00525) / 4, rel=1e-12)
    assert M.nnll(P, Y) == pytest.approx(1.312382, abs=1e-6)


def test_agreement_and_tv():
    # top-1: P [0,1,2,0], Q [1,1,0,0] -> agree on pts 2 and 4 -> 1/2
    assert M.agreement(P, Q) == pytest.approx(0.5)
    # ½Σ|p-q|: pt1 ½(.5+.5+0) = .5; pt2 0; pt3 ½(.5+.2+.7) = .7; pt4 ½(.1+.05+.05) = .1
    # mean = 1.3/4 = .325
    assert M.total_variation(P, Q) == pytest.approx(0.325, abs=1e-12)
    assert M.total_variation(P, P) == 0.0 and M.agreement(P, P) == 1.0


def test_predictive_entropy():
    # [.5,.5] -> log 2; one-hot -> 0 (0 log 0 = 0); uniform over 4 -> log 4
    ent = M.predictive_entropy(np.array([[0.5, 0.5, 0, 0], [1, 0, 0, 0], [0.25] * 4]))
    np.testing.assert_allclose(ent, [math.log(2), 0.0, math.log(4)], atol=1e-15)


def test_auroc_with_ties():
    # pos {3,2,2}, neg {1,2}: pairs (3,1)=1 (3,2)=1 (2,1)=1 (2,2)=½ (2,1)=1 (2,2)=½ -> 5/6
    assert M.auroc([3, 2, 2], [1, 2]) == pytest.approx(5 / 6)
    assert M.auroc([1], [2]) == 0.0 and M.auroc([2], [2]) == 0.5
    # OOD by entropy: in-dist entropies {0, log2}, OOD {log2, log2}:
    #   (log2 > 0) twice = 2, (log2 = log2) twice = 2·½ = 1 -> 3/4
    p_in = np.array([[1.0, 0.0], [0.5, 0.5]])
    p_out = np.array([[0.5, 0.5], [0.5, 0.5]])
    assert M.ood_auroc(p_in, p_out) == pytest.approx(0.75)


def test_selective_accuracy():
    # conf [.7,.4,.8,.5], correct [T,F,F,F]
    # τ=0: 1/4; τ=.5: pts {1,3,4} -> 1/3; τ=.75: {3} -> 0; τ=.9: empty -> nan
    out = M.selective_accuracy(P, Y, [0.0, 0.5, 0.75, 0.9])
    np.testing.assert_allclose(out[:3], [0.25, 1 / 3, 0.0])
    assert math.isnan(out[3])


def test_hpd():
    # U = 1..5, α = .25: the .75 quantile (linear interpolation) sits at position
    # (5-1)·.75 = 3 -> 4.  Shifting U by +1 gives 5: relative error |5-4|/4 = .25
    u = np.arange(1.0, 6.0)
    assert M.hpd_threshold(u, 0.25) == pytest.approx(4.0)
    assert M.hpd_error(u + 1, u, alpha=0.25) == pytest.approx(0.25)
    assert M.hpd_error(u, u) == 0.0


def test_mean_and_var_errors():
    # samples [[0,0],[2,2]]: mean [1,1]; ref [1,4] -> ‖[0,-3]‖ = 3; relative 3/√17
    s = np.array([[0.0, 0.0], [2.0, 2.0]])
    assert M.mean_error(s, [1.0, 4.0]) == pytest.approx(3.0)
    assert M.mean_error(s, [1.0, 4.0], relative=True) == pytest.approx(3 / math.sqrt(17))
    # samples [[0,0],[2,4]]: unbiased variances [(1+1)/1, (4+4)/1] = [2, 8]; ref [2,5] -> 3
    s2 = np.array([[0.0, 0.0], [2.0, 4.0]])
    assert M.var_error(s2, [2.0, 5.0]) == pytest.approx(3.0)
    # (chain, draw, dim) input is pooled over chains: same numbers
    assert M.var_error(s2.reshape(2, 1, 2), [2.0, 5.0]) == pytest.approx(3.0)
    me = M.moment_errors(s2, s2)
    assert me["mean_error"] == 0.0 and me["var_error"] == 0.0


def test_rhat_ess_closed_forms():
    rng = np.random.default_rng(0)
    # i.i.d. N(0,1), 4 chains x 1000: R-hat → 1 (its sd here is O(1/√n) ≈ 0.003, bound 1.02)
    # and ESS ≈ n = 4000 (over seeds the estimator's relative sd is ≈ 8%: band ≈ ±3.5 sd).
    iid = rng.standard_normal((4, 1000, 2))
    d = diagnostics_of(iid)
    assert np.all(d["rhat"] < 1.02)
    assert np.all((d["ess_bulk"] > 2900) & (d["ess_bulk"] < 5100))
    # AR(1) with φ = .9: ESS = n(1-φ)/(1+φ) = 4000·.1/1.9 ≈ 210.5; over seeds the estimate's
    # relative sd is ≈ 12% (≈ 25), band 210 ± 4 sd = [110, 310].
    phi, x = 0.9, np.zeros((4, 1000, 1))
    x[:, 0] = rng.standard_normal((4, 1)) / math.sqrt(1 - phi**2)
    for t in range(1, 1000):
        x[:, t] = phi * x[:, t - 1] + rng.standard_normal((4, 1))
    ess = diagnostics_of(x)["ess_mean"][0]
    assert 110 < ess < 310, ess
    # chains stuck at different places: R-hat far above 1
    shifted = iid + np.array([0.0, 0.0, 3.0, 3.0])[:, None, None]
    assert np.all(diagnostics_of(shifted)["rhat"] > 1.5)


def test_reliability_diagram(tmp_path):
    path = tmp_path / "rel.png"
    out = M.reliability_diagram(P, Y, 5, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["ece"] == pytest.approx(0.35) and out["counts"] == [0, 1, 1, 2, 0]


def test_shape_errors():
    with pytest.raises(ValueError):
        M.accuracy(P, Y[:3])
    with pytest.raises(ValueError):
        M.total_variation(P, Q[:2])


def test_the_vectorised_rhat_and_ess_are_arvizs_own_values():
    """``qlsd_flwr.outputs.diagnostics.rhat_ess`` (what every run's convergence report uses, all
    coordinates at once) against ``az.rhat`` and ``az.ess`` one coordinate at a time: the same
    estimator, so equal to float rounding (relative 1e-9), NaN where ArviZ gives NaN. Cases: i.i.d.,
    a constant, ties, a random walk, one chain shifted, binary values, a NaN, and short chains."""
    import logging
    import warnings

    import arviz as az

    from qlsd_flwr.outputs.diagnostics import rhat_ess

    rng = np.random.default_rng(0)
    logging.getLogger("arviz").setLevel(logging.ERROR)
    for c, n, k in [(4, 100, 8), (2, 7, 8), (4, 9, 8), (3, 250, 8), (2, 4, 8), (4, 1000, 8)]:
        x = rng.normal(size=(c, n, k))
        x[..., 0] = 1.5
        x[..., 1] = np.round(x[..., 1])
        x[..., 2] = np.cumsum(x[..., 2], axis=1)
        x[0, :, 3] += 5.0
        x[..., 4] = rng.integers(0, 2, size=(c, n))
        x[1, 2, 5] = np.nan
        ds = az.convert_to_dataset({"v": x})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = [np.asarray(az.rhat(ds)["v"].values).reshape(-1),
                   np.asarray(az.ess(ds, method="bulk")["v"].values).reshape(-1),
                   np.asarray(az.ess(ds, method="tail")["v"].values).reshape(-1)]
        for name, a, b in zip(("rhat", "bulk", "tail"), ref, rhat_ess(x)):
            assert np.array_equal(np.isnan(a), np.isnan(b)), (c, n, name, a, b)
            ok = ~np.isnan(a)
            assert np.allclose(b[ok], a[ok], rtol=1e-9, atol=0), (c, n, name, a, b)


def test_the_vectorised_ess_of_the_mean_and_loos_reff_are_arvizs():
    """``diagnostics.ess_mean`` against ``az.ess(method="mean")``, and ``loo.reff_of`` (the r_eff the
    federated LOO sends) against the mean of ArviZ's, to float rounding."""
    import logging
    import warnings

    import arviz as az

    from qlsd_flwr.outputs.diagnostics import ess_mean
    from qlsd_flwr.outputs.loo import reff_of

    rng = np.random.default_rng(1)
    logging.getLogger("arviz").setLevel(logging.ERROR)
    x = rng.normal(size=(4, 60, 6))
    x[..., 1] = np.cumsum(x[..., 1], axis=1)
    x[..., 2] = 0.5
    x[2, 3, 3] = np.nan
    ds = az.convert_to_dataset({"theta": x})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = np.asarray(az.ess(ds, method="mean")["theta"].values)
    mine = ess_mean(x)
    assert np.array_equal(np.isnan(ref), np.isnan(mine)) and np.allclose(mine[~np.isnan(ref)], ref[~np.isnan(ref)],
                                                                         rtol=1e-9, atol=0)
    ok = az.convert_to_dataset({"theta": x[..., [0, 1, 2, 4, 5]]})
    assert np.isclose(reff_of(ok), float(np.mean(az.ess(ok, method="mean")["theta"].values)) / 240, rtol=1e-9)
