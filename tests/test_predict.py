"""Predicting with a run's posterior on a user's own model (``qlsd_flwr.posterior_predictive``,
``load_draw``, ``load_samples``, ``predictive_metrics``): a draw loaded into the module predicts
what ``TorchPotential.predict_proba`` predicts for it, the posterior predictive is the mean of the
per-draw predictions, and bad arguments are named in one line."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord
from sklearn.datasets import load_wine

import qlsd_flwr
from qlsd_flwr import load_draw, load_samples, posterior_predictive, predictive_metrics
from qlsd_flwr.flower import InProcessGrid, QLSDStrategy, make_client_app
from qlsd_flwr.potentials import TorchPotential


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.fixture(scope="module")
def wine():
    X, y = load_wine(return_X_y=True)
    X = ((X - X.mean(0)) / X.std(0)).astype(np.float32)
    return X, y


@pytest.fixture(scope="module")
def pot(wine):
    X, y = wine
    return TorchPotential(_model(), X[:120], y[:120])


@pytest.fixture(scope="module")
def draws(pot):
    rng = np.random.default_rng(0)
    return pot.theta0() + 0.3 * rng.standard_normal((2, 3, pot.dim))  # (chain, draw, d)


def test_a_loaded_draw_predicts_what_the_potential_predicts(pot, draws, wine):
    X_new = wine[0][120:]
    for c, k in [(0, 0), (1, 2)]:
        net = load_draw(_model(), draws, chain=c, draw=k)
        with torch.no_grad():
            mine = torch.softmax(net.eval()(torch.as_tensor(X_new)).double(), dim=1).numpy()
        assert np.allclose(mine, pot.predict_proba(draws[c, k][None], X_new), rtol=0, atol=1e-12)
        assert not np.allclose(mine, pot.predict_proba(draws[1 - c, 2 - k][None], X_new))


def test_frozen_parameters_and_buffers_are_not_part_of_theta(wine):
    X, y = wine
    net = torch.nn.Sequential(torch.nn.Linear(13, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    net[0].weight.requires_grad_(False)
    p = TorchPotential(net, X, y)
    assert p.dim == 8 + 8 + 8 + 3 * 8 + 3  # bias 0, BN weight and bias, layer 2 (no BN running stats)
    theta = np.arange(p.dim, dtype=np.float64) / 100
    frozen = net[0].weight.detach().clone()
    load_draw(net, theta[None, None], 0, 0)
    assert np.array_equal(p.theta0(), theta.astype(np.float32).astype(np.float64))
    assert torch.equal(net[0].weight, frozen)


def test_the_posterior_predictive_is_the_mean_of_the_draws_predictions(pot, draws, wine):
    X_new = wine[0][120:]
    probs = posterior_predictive(draws, pot, X_new)
    each = [pot.predict_proba(t[None], X_new) for t in draws.reshape(-1, pot.dim)]
    assert probs.shape == (len(X_new), 3) and probs.dtype == np.float64
    assert np.allclose(probs, np.mean(each, axis=0), rtol=0, atol=1e-12)
    assert np.allclose(probs.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert np.array_equal(posterior_predictive(draws.reshape(-1, pot.dim), pot, X_new), probs)
    # max_draws: evenly spaced within each chain (draws 0 and 2 of each of the 2 chains)
    thinned = posterior_predictive(draws, pot, X_new, max_draws=4)
    assert np.allclose(thinned, pot.predict_proba(draws[:, [0, 2]], X_new), rtol=0, atol=1e-12)
    m = predictive_metrics(probs, wine[1][120:])
    assert set(m) >= {"accuracy", "nnll", "ece", "brier"} and m["n_test"] == len(X_new)


def test_bad_arguments_are_named_in_one_line(pot, draws, wine):
    def one_line(exc_info, *words):
        msg = str(exc_info.value)
        assert "\n" not in msg and all(w in msg for w in words), msg

    with pytest.raises(IndexError) as e:
        load_draw(_model(), draws, chain=2, draw=0)
    one_line(e, "chain", "[0, 1]")
    with pytest.raises(IndexError) as e:
        load_draw(_model(), draws, chain=0, draw=-1)
    one_line(e, "draw", "[0, 2]")
    with pytest.raises(TypeError) as e:
        load_draw(_model(), draws, chain=0.5, draw=0)
    one_line(e, "chain", "[0, 1]")
    with pytest.raises(ValueError) as e:
        load_draw(_model(), draws[..., :-1], chain=0, draw=0)
    one_line(e, "samples", f"d = {pot.dim - 1}", f"{pot.dim} trainable")
    with pytest.raises(ValueError) as e:
        posterior_predictive(draws[..., :-1], pot, wine[0][:3])
    one_line(e, "samples", str(pot.dim))
    with pytest.raises(ValueError) as e:
        posterior_predictive(draws, pot, wine[0][:3], max_draws=0)
    one_line(e, "max_draws")
    with pytest.raises(ValueError) as e:
        posterior_predictive(draws[0, 0], pot, wine[0][:3])
    one_line(e, "samples", "(chain, draw, d)")
    with pytest.raises(TypeError) as e:
        posterior_predictive(draws, object(), wine[0][:3])
    one_line(e, "predictor", "predict_proba")


def test_a_real_runs_folder_feeds_the_helpers(tmp_path, wine):
    X, y = wine
    parts = np.array_split(np.arange(120), 2)
    pots = [TorchPotential(_model(), X[p], y[p]) for p in parts]
    st = QLSDStrategy(num_clients=2, dim=pots[0].dim, variant="qlsd-pp", gamma=1e-3, num_rounds=12, burn_in=4,
                      s=16, prior_var=5.0, progress=False, loo="off", output_dir=str(tmp_path), run_name="tiny")
    st.start(InProcessGrid(make_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])]), 2),
             initial_arrays=ArrayRecord(pots[0].named_arrays()))
    s = load_samples(st.run_dir)
    assert s.shape == (1, 8, pots[0].dim)
    assert np.array_equal(load_samples(st.run_dir / "samples.nc"), s)
    probs = posterior_predictive(st.run_dir, pots[0], X[120:])
    assert np.array_equal(probs, posterior_predictive(s, pots[0], X[120:]))
    net = load_draw(_model(), st.run_dir, 0, 7).eval()
    with torch.no_grad():
        last = torch.softmax(net(torch.as_tensor(X[120:])).double(), dim=1).numpy()
    assert np.allclose(last, pots[0].predict_proba(s[0, 7], X[120:]), rtol=0, atol=1e-12)
    with pytest.raises(FileNotFoundError, match="samples.nc"):
        load_samples(tmp_path / "no-such-run")


def test_the_names_are_public_and_importing_the_package_imports_no_torch():
    for name in ("load_samples", "posterior_predictive", "load_draw", "predictive_metrics"):
        f = getattr(qlsd_flwr, name)
        assert f.__doc__ and "Parameters" in f.__doc__ and "Returns" in f.__doc__, name
    code = ("import sys, qlsd_flwr\n"
            "qlsd_flwr.posterior_predictive, qlsd_flwr.load_draw, qlsd_flwr.load_samples\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    with pytest.raises(AttributeError, match="no_such_name"):
        qlsd_flwr.no_such_name  # noqa: B018
