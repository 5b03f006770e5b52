"""A convergence verdict that cannot be fooled (issue 38), strict JSON, and the verdict recomputed from a
run's files (:func:`qlsd_flwr.convergence_report`).

* Chains stuck apart (a coordinate frozen at a different value in each chain: R-hat = inf) are NOT MIXED,
  named; a coordinate that is one value everywhere is a constant and does not count.
* No verdict from too few effective draws: bulk and tail ESS ≥ 100 (Vehtari et al. 2021). Four chains of an
  AR(0.999) process over 16 draws (which barely move) are never called MIXED; long independent chains are.
* ``convergence-criterion = predictive`` never reads θ in its place silently: without the held-out
  predictive the verdict is NOT CHECKED and says why.
* ``summary.json`` and the other files users read are strict JSON (no ``Infinity``/``NaN``).
* ``convergence_report`` gives the run's own report from its folder, from its ``samples.nc`` alone, and
  from chains merged by hand; a path that is not a run is one line naming it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import qlsd_flwr
from qlsd_flwr.evaluation.verdict import ReportError
from qlsd_flwr.outputs import convergence as cv
from qlsd_flwr.outputs.jsonio import dumps


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_chains_frozen_apart_are_not_mixed_and_a_true_constant_does_not_count():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 4, 3))
    x[:, :, 2] = np.arange(4.0)[None, :]  # each chain stuck at its own value
    rep = cv.verdict(cv.theta_report(x))
    assert rep["verdict"] == "NOT MIXED" and rep["rhat_undefined"] == 1 and rep["undefined_names"] == ["theta[2]"]
    assert "R-hat undefined on 1 quantity (theta[2])" in rep["message"]
    x[:, :, 2] = 7.0  # one value in every draw of every chain: a constant
    rep = cv.verdict(cv.theta_report(x))
    assert rep["verdict"] == "MIXED" and rep["rhat_undefined"] == 0


def _ar(rng, n: int, chains: int, phi: float) -> np.ndarray:
    z = np.empty((n, chains))
    z[0] = rng.normal(size=chains) / np.sqrt(1 - phi ** 2)  # each chain starts in the stationary law
    for t in range(1, n):
        z[t] = phi * z[t - 1] + rng.normal(size=chains)
    return z[:, :, None]


def test_short_slow_chains_are_never_called_mixed_and_long_independent_ones_are():
    rng = np.random.default_rng(1)
    verdicts = [cv.verdict(cv.theta_report(_ar(rng, 16, 4, 0.999)))["verdict"] for _ in range(200)]
    # without the ESS floor 4.5–10 % of these read MIXED (R-hat alone); 4 × 16 draws cannot reach ESS 100
    assert verdicts.count("MIXED") == 0
    rep = cv.verdict(cv.theta_report(_ar(rng, 16, 4, 0.999)))
    assert "too few effective draws to trust R-hat" in rep["message"] and rep["ess_min"] == cv.ESS_MIN
    # 4 × 400 independent draws: ESS about 1,600, R-hat about 1: MIXED in (nearly) every trial; R-hat's own
    # spread puts a few percent over 1.05 at most, none here with this seed
    ok = [cv.verdict(cv.theta_report(rng.normal(size=(400, 4, 2))))["verdict"] for _ in range(50)]
    assert ok.count("MIXED") >= 48


def test_the_predictive_criterion_never_falls_back_to_theta_silently():
    rng = np.random.default_rng(2)
    rep = cv.verdict(cv.theta_report(rng.normal(size=(400, 4, 3))), criterion="predictive")
    assert rep["verdict"] == "NOT CHECKED" and rep["pending"] == "predictive"
    assert "convergence-criterion = predictive" in rep["message"] and "NOT MIXED over θ" not in rep["message"]
    pred = {"rhat_pred_max": 1.01, "rhat_pred_p99": 1.0, "ess_bulk_pred_min": 300.0, "rhat_loglik": 1.0,
            "ess_bulk_loglik": 400.0}
    rep = cv.verdict(cv.theta_report(rng.normal(size=(400, 4, 3))), pred, criterion="predictive")
    assert rep["verdict"] == "MIXED" and rep["criterion"] == "predictive" and "pending" not in rep
    low = cv.verdict(cv.theta_report(rng.normal(size=(400, 4, 3))), {**pred, "ess_bulk_pred_min": 40.0},
                     criterion="predictive")
    assert low["verdict"] == "NOT MIXED" and "bulk ESS (worst test point) 40" in low["message"]
    inf = cv.verdict(cv.theta_report(rng.normal(size=(400, 4, 3))), {**pred, "rhat_pred_max": None},
                     criterion="predictive")
    assert inf["verdict"] == "NOT CHECKED"  # no predictive R-hat at all: nothing to read


def test_what_users_read_is_strict_json():
    text = dumps({"k_hat": float("inf"), "x": np.array([np.nan, 1.0]), "y": np.float64("-inf"), "n": 3})
    assert _strict(text) == {"k_hat": None, "x": [None, 1.0], "y": None, "n": 3}
    # a checkpoint's metadata (read back by this package only) keeps the very values
    assert json.loads(dumps({"a": float("inf")}, strict=False)) == {"a": float("inf")}


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A classification run of 4 chains, evaluated (the held-out predictive in its samples.nc)."""
    from qlsd_flwr.evaluation.evaluate import evaluate_run
    from qlsd_flwr.run.simulate import run

    out = tmp_path_factory.mktemp("verdict")
    o = run({"task": "logistic", "dataset": "breast_cancer", "num-clients": 3, "engine": "vectorised",
             "num-chains": 4, "num-rounds": 260, "burn-in": 60, "gamma": "auto", "metric": "diagonal",
             "init": "dispersed", "progress": False, "loo": "off", "plot": False, "output-dir": str(out),
             "run-name": "r"})
    evaluate_run(o.run_dir, write=True)
    return o.run_dir


def test_convergence_report_recomputes_the_run_s_own_verdict_from_its_files(evaluated_run):
    summary = _strict((evaluated_run / "summary.json").read_text())  # strict JSON, as written
    _strict((evaluated_run / "evaluation.json").read_text())
    mine = summary["convergence"]
    for path in (evaluated_run, evaluated_run / "samples.nc"):
        got = qlsd_flwr.convergence_report(path)
        for key in ("verdict", "criterion", "rhat_max", "ess_bulk_min", "ess_tail_min", "rhat_undefined",
                    "stationary", "norm_trend_z", "loglik_trend_z", "chains", "draws", "starts"):
            assert got[key] == pytest.approx(mine[key], rel=1e-12) if isinstance(mine[key], float) else \
                got[key] == mine[key], key
        assert got["predictive"] == pytest.approx(mine["predictive"], rel=1e-12)
    both = qlsd_flwr.convergence_report(evaluated_run, criterion="predictive")
    assert both["criterion"] == "predictive" and both["verdict"] in ("MIXED", "NOT MIXED")


def test_convergence_report_judges_chains_merged_by_hand(evaluated_run, tmp_path):
    """Two chains of the run, and the same two chains with one shifted by 10 posterior sd, each written as a
    new samples.nc by hand: the report reads them as the arrays they hold, and the pair set apart is NOT MIXED."""
    import h5netcdf

    with h5netcdf.File(evaluated_run / "samples.nc", "r") as f:
        theta = np.asarray(f["posterior"]["theta"][...])
    same = None  # the pair's own worst R-hat
    for name, chains in (("same", theta[:2]), ("apart", np.stack([theta[0], theta[1] + 10 * theta.std(axis=(0, 1))]))):
        path = tmp_path / f"{name}.nc"
        with h5netcdf.File(path, "w") as f:
            g = f.create_group("posterior")
            g.dimensions = {"chain": chains.shape[0], "draw": chains.shape[1], "theta_dim_0": chains.shape[2]}
            g.create_variable("theta", ("chain", "draw", "theta_dim_0"), data=chains)
        rep = qlsd_flwr.convergence_report(path)
        assert rep["criterion"] == "theta" and rep["chains"] == 2
        assert rep["rhat_max"] == cv.theta_report(np.transpose(chains, (1, 0, 2)))["rhat_max"]
        if name == "apart":  # 10 sd apart: R-hat far above the pair's own
            assert rep["verdict"] == "NOT MIXED" and rep["rhat_max"] > same + 0.5
        same = rep["rhat_max"] if same is None else same


def test_convergence_report_names_a_path_that_is_not_a_run(tmp_path):
    with pytest.raises(ReportError, match="no such file"):
        qlsd_flwr.convergence_report(tmp_path / "missing")
    bad = tmp_path / "samples.nc"
    bad.write_text("not netCDF")
    with pytest.raises(ReportError, match=r"samples.nc: not a samples.nc this package can read"):
        qlsd_flwr.convergence_report(bad)
    with pytest.raises(ReportError, match="criterion: 'both'; allowed: theta, predictive, auto"):
        qlsd_flwr.convergence_report(bad, criterion="both")


def test_a_test_point_stuck_apart_in_the_predictive_is_not_mixed():
    """The predictive's rule is θ's: a test point whose probability is constant within each chain but differs
    between chains (a network's chains stuck in different modes that agree on nothing there) is undefined,
    not a constant; one value everywhere is a constant."""
    rng = np.random.default_rng(3)
    ll = np.log(rng.uniform(0.2, 0.9, size=(4, 400, 6)))
    ll[:, :, 5] = np.log(np.array([0.1, 0.3, 0.6, 0.9]))[:, None]  # each chain its own probability
    pred = cv.predictive(ll)
    # ArviZ's R-hat of chains frozen apart is inf, or (the rank-normalised within-chain variance rounding
    # to ~1e-32 instead of 0) a finite 1e16: either way not mixed, and named
    assert pred["pred_undefined"] == 1 or pred["rhat_pred_max"] > 1e10, pred
    rep = cv.verdict(cv.theta_report(rng.normal(size=(400, 4, 3))), pred, criterion="predictive")
    assert rep["verdict"] == "NOT MIXED"
    assert "1 test point(s)' predictive" in rep["message"] or rep["predictive"]["rhat_pred_max"] > 1e10, rep["message"]
    ll[:, :, 5] = np.log(0.5)
    pred = cv.predictive(ll)
    assert pred["pred_undefined"] == 0
    assert cv.verdict(cv.theta_report(rng.normal(size=(400, 4, 3))), pred, criterion="predictive")["verdict"] == "MIXED"
