"""A user's own ServerApp (``QLSDStrategy`` with keyword parameters, the clients' potentials from
``make_client_app``), as the quickstart example writes it: held-out data give the verdict the
predictive and the evaluation files; without them the verdict says it read θ and what to pass;
the same app serves a run and its resume (issue 39).

In-process Flower grid (:class:`qlsd_flwr.flower.InProcessGrid`); ``flwr run`` of the quickstart,
stopped and resumed: ``tests/test_flwr_run.py``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from torch import nn

import qlsd_flwr
from qlsd_flwr.flower import InProcessGrid, QLSDStrategy, make_client_app
from qlsd_flwr.potentials import TorchPotential

B = 4


def _run(pots, out, name, **kw):
    app = make_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])])
    args = dict(num_clients=B, dim=pots[0].dim, variant="qlsd-pp", s=16, seed=0, output_dir=str(out),
                run_name=name, progress=False, loo="off", plot=False)
    initial = kw.pop("initial_arrays", None)  # a fresh model's: the clients' own models hold their last θ
    st = QLSDStrategy(**{**args, **kw})
    st.start(InProcessGrid(app, B), initial_arrays=initial)
    return st, json.loads((Path(st.run_dir) / "summary.json").read_text())["convergence"]


def test_held_out_data_give_the_predictive_verdict_and_the_evaluation_files(quickstart, tmp_path):
    """A softmax regression on two of wine's features (a near-Gaussian posterior, so that 800 rounds
    mix): the verdict reads the held-out predictive, says MIXED with the predictive's R-hat ≤ 1.05
    and ESS ≥ 100, and equals the verdict recomputed from the files; evaluation.json and
    reliability.png are written as for the CLI's tasks."""
    def model():
        torch.manual_seed(0)
        return nn.Linear(2, 3)

    pots = [TorchPotential(model(), X[:, :2], y) for X, y in (quickstart.load_partition(i, B) for i in range(B))]
    X, y = quickstart.held_out_data()
    st, rep = _run(pots, tmp_path, "logistic", gamma="auto", metric="dense", num_rounds=800, burn_in=200,
                   num_chains=4, init="dispersed", prior_var=1.0, initial_arrays=ArrayRecord(model().state_dict()),
                   heldout=(TorchPotential(model(), X[:, :2], y), X[:, :2], y))
    run_dir = Path(st.run_dir)
    assert rep["criterion"] == "predictive" and rep["verdict"] == "MIXED", rep["message"]
    pr = rep["predictive"]
    assert max(pr["rhat_pred_max"], pr["rhat_loglik"]) <= 1.05 and pr["ess_bulk_pred_min"] >= 100, pr
    assert qlsd_flwr.convergence_report(run_dir)["verdict"] == "MIXED" == st.summary_data["convergence"]["verdict"]
    ev = json.loads((run_dir / "evaluation.json").read_text())
    assert ev["n_samples"] > 0 and 0.0 <= ev["accuracy"] <= 1.0 and (run_dir / "reliability.png").stat().st_size > 0
    assert json.loads((run_dir / "config.json").read_text())["config"]["convergence-criterion"] == "predictive"


def test_a_network_reads_not_mixed_by_its_predictive_and_without_held_out_data_says_why(quickstart, tmp_path):
    """The quickstart's network after 150 rounds from dispersed starts has not mixed: with held-out
    data the verdict says so over the predictive; without, it reads θ, says that is for want of
    held-out data and names ``heldout``, and writes no evaluation."""
    pots = [quickstart.potential(i, B) for i in range(B)]
    X, y = quickstart.held_out_data()
    common = dict(gamma=1e-3, num_rounds=150, burn_in=50, num_chains=4, init="dispersed", prior_var=5.0,
                  initial_arrays=ArrayRecord(quickstart.make_model().state_dict()))
    _, rep = _run(pots, tmp_path, "with", heldout=(quickstart.potential(0, B), X, y), **dict(common))
    assert rep["criterion"] == "predictive" and rep["verdict"] == "NOT MIXED", rep["message"]
    assert "over the held-out predictive" in rep["message"]
    st, rep = _run(pots, tmp_path, "without", **dict(common))
    assert rep["criterion"] == "theta" and rep["verdict"] == "NOT MIXED"
    assert "for want of held-out data" in rep["message"] and "heldout=(predictor, X, y)" in rep["message"]
    assert not (Path(st.run_dir) / "evaluation.json").exists()


@pytest.mark.parametrize("bad, named", [((1, 2), "a tuple (predictor, X, y)"),
                                        ((object(), np.zeros((3, 2)), np.zeros(3, dtype=int)), "predict_proba"),
                                        (("p", np.zeros((3, 2)), np.zeros(2, dtype=int)), "predict_proba"),
                                        (None, None)])
def test_bad_held_out_data_are_refused_before_the_run(quickstart, bad, named):
    pot = quickstart.potential(0, B)
    if bad is None:  # a predictor, but labels that do not match the rows
        bad, named = (pot, np.zeros((3, 13), dtype=np.float32), np.zeros(2, dtype=int)), "one integer label per row"
    with pytest.raises(ValueError, match="heldout") as err:
        QLSDStrategy(num_clients=B, dim=pot.dim, write=False, heldout=bad)
    assert named in str(err.value)


def test_held_out_data_the_predictor_cannot_use_are_refused_before_the_first_exchange(quickstart, tmp_path):
    """Labels outside the predictor's classes, a predictor that fails on X, or no run folder to write
    the evaluation to: a ConfigError naming heldout when the run starts, not after it."""
    from qlsd_flwr.config import ConfigError

    pots = [quickstart.potential(i, B) for i in range(B)]
    X, y = quickstart.held_out_data()
    for bad, named in (((pots[0], X, y + 3), "labels must be in 0..2"),
                       ((pots[0], X[:, :5], y), "predict_proba(θ_0, X[:2]) failed")):
        with pytest.raises(ConfigError, match="heldout") as err:
            _run(pots, tmp_path, "bad", gamma=1e-3, num_rounds=5, burn_in=0, prior_var=5.0, heldout=bad)
        assert named in str(err.value)
        assert not (tmp_path / "bad" / "samples.nc").exists()
    with pytest.raises(ConfigError, match="set write = True"):
        st = QLSDStrategy(num_clients=B, dim=pots[0].dim, write=False, heldout=(pots[0], X, y), progress=False)
        st.start(InProcessGrid(make_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])]), B))


def test_the_same_app_resumes_bitwise_whatever_its_defaults(quickstart, tmp_path, caplog):
    """A run stopped at round 25 (with gamma = 2e-3 given for it) and resumed by the same app,
    which passes its own default gamma = 1e-3 and its initial arrays again, ends with the draws of a
    run never stopped; the log names the key kept from the run."""
    pots = [quickstart.potential(i, B) for i in range(B)]
    common = dict(num_rounds=40, burn_in=20, prior_var=5.0, checkpoint_every=10)
    fresh = ArrayRecord(quickstart.make_model().state_dict())

    def halt(st):
        if st.state.k == 25:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(pots, tmp_path, "stopped", gamma=2e-3, on_round=halt, initial_arrays=fresh, **common)
    X, y = quickstart.held_out_data()  # given at the resume only: the verdict reads it all the same
    with caplog.at_level(logging.WARNING, logger="qlsd_flwr"):
        st, rep = _run(pots, tmp_path, "stopped", gamma=1e-3, resume=str(tmp_path / "stopped"),
                       heldout=(pots[0], X, y), initial_arrays=fresh, **common)
    assert "resume: the run's own gamma=0.002 kept (this app gave gamma=0.001" in caplog.text
    assert "initial_arrays ignored" in caplog.text
    assert rep["criterion"] == "predictive" and (Path(st.run_dir) / "evaluation.json").exists()
    ref, _ = _run(pots, tmp_path, "never-stopped", gamma=2e-3, initial_arrays=fresh, **common)
    a, b = (qlsd_flwr.load_samples(s.run_dir) for s in (st, ref))
    assert a.shape == (1, 20, pots[0].dim) and np.array_equal(a, b)
