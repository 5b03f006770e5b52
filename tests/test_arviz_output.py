"""``samples.nc`` is what ArviZ takes as it is (the front-door issue): named groups and dims,
all chains of a run, ``sample_stats`` per draw, provenance; ``az.summary``, ``az.ess``,
``az.rhat`` and ``az.plot_trace`` on it, on the vectorised engine (many chains) and on a Flower
engine (one chain per run), streamed and through a checkpointed run."""

from __future__ import annotations

import json

import arviz as az
import matplotlib
import numpy as np
import pytest

from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.run.simulate import run

matplotlib.use("Agg")
BASE = {"dim": 3, "num-clients": 4, "num-rounds": 60, "burn-in": 10, "thin": 2, "p": "0.5",
        "progress": False}


@pytest.mark.parametrize("engine,chains,ck", [("vectorised", 3, 0), ("inprocess", 1, 0), ("local", 1, 20)])
def test_samples_nc_is_arviz_ready(tmp_path, engine, chains, ck):
    out = run({**BASE, "engine": engine, "num-chains": chains, "checkpoint-every": ck,
               "output-dir": str(tmp_path), "run-name": "r"})
    idata = az.from_netcdf(out.run_dir / "samples.nc")
    assert set(idata.groups()) == {"posterior", "sample_stats", "loo"}  # loo: the federated LOO (test_loo.py)
    post, ss = idata.posterior, idata.sample_stats
    n = len(range(11, 61, 2))
    assert dict(post.sizes) == {"chain": chains, "draw": n, "theta_dim_0": 3}
    assert post["draw"].values.tolist() == list(range(n))  # ArviZ's convention; the round is a stat
    assert np.array_equal(post["theta"].values, load_samples(out.run_dir))
    assert ss["round"].values[0].tolist() == list(range(11, 61, 2))
    with open(out.run_dir / "metrics.csv") as f:
        rows = {int(r.split(",")[0]): r.split(",") for r in f.read().splitlines()[1:]}
    assert ss["n_active"].values[-1, -1] == float(rows[59][1])  # the kept round's own row
    assert np.all(ss["bits_exact"].values >= 0) and not np.isnan(ss["n_replied"].values).any()
    cfg = json.loads((out.run_dir / "config.json").read_text())
    for attrs in (post.attrs, ss.attrs):
        assert attrs["inference_library"] == "qlsd_flwr" and attrs["seed"] == str(cfg["config"]["seed"])
        assert attrs["flwr_version"] and len(attrs["config_sha256"]) == 64
    summary = az.summary(idata, var_names=["theta"])
    assert list(summary.index) == ["theta[0]", "theta[1]", "theta[2]"]
    assert np.allclose(summary["mean"].values, post["theta"].values.mean(axis=(0, 1)), atol=1e-3)
    if chains > 1:
        assert np.all(np.isfinite(az.rhat(idata)["theta"].values))
    assert np.all(az.ess(idata)["theta"].values > 0)
    axes = az.plot_trace(idata, var_names=["theta"])
    assert axes.shape == (1, 2)
    matplotlib.pyplot.close("all")


def test_classification_runs_get_loo_ready_groups_and_named_coordinates(tmp_path, capsys):
    # the CLI's run on a classification task evaluates the held-out set and adds ArviZ's groups
    from qlsd_flwr.cli import main
    from qlsd_flwr.config import resolve
    from qlsd_flwr.tasks import registry
    from qlsd_flwr.tasks.logistic import predict_proba

    sets = {"task": "logistic", "engine": "vectorised", "num-chains": 2, "num-rounds": 60, "burn-in": 20,
            "gamma": 1e-3, "num-clients": 4, "output-dir": str(tmp_path), "run-name": "lg", "progress": False}
    assert main(["run", *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])]) == 0
    said = capsys.readouterr().out
    assert "held-out: accuracy" in said  # plot = false (this suite's default): no overview.png
    assert "plot:" not in said and not (tmp_path / "lg" / "overview.png").exists()
    idata = az.from_netcdf(tmp_path / "lg" / "samples.nc")
    assert {"posterior", "sample_stats", "heldout_log_likelihood", "predictions", "observed_data",
            "loo"} <= set(idata.groups())
    assert "log_likelihood" not in idata.groups()  # the test points are never az.loo's input
    X, y, K, _ = registry.test_set(resolve(sets))
    th = idata.posterior["theta"].values
    ll = idata["heldout_log_likelihood"]["y"].values
    assert ll.shape == (2, 40, len(y)) and np.array_equal(idata.observed_data["y"].values, y)
    prob = predict_proba(th[1, 7][None], X, K)
    assert np.allclose(ll[1, 7], np.log(prob[np.arange(len(y)), y]), rtol=0, atol=1e-12)
    pred = idata.predictions["y"].values
    assert pred.min() >= 0 and pred.max() < K
    # the draws' labels follow the predictive: per test point, the fraction of draws labelled 1 is
    # a mean of S independent Bernoulli(p_θs) with mean the posterior predictive p̄ and sd at most
    # 1/(2√S); 5 sd (a union bound over the test points keeps a false alarm below 1e-4)
    S = pred.shape[0] * pred.shape[1]
    gap = np.abs((pred == 1).mean(axis=(0, 1)) - predict_proba(th.reshape(-1, th.shape[-1]), X, K)[:, 1])
    assert gap.max() < 5 * 0.5 / np.sqrt(S)
    import qlsd_flwr

    loo = qlsd_flwr.loo(tmp_path / "lg")  # over the training points, from the clients
    from qlsd_flwr.tasks import loading

    assert np.isfinite(loo.elpd_loo) and loo.n_data_points == loading.load_task(resolve(sets)).n_data.sum()
    p = X.shape[1]
    labels = idata.posterior["theta_dim_0"].values.tolist()
    assert labels[:2] == ["W[0,0]", "W[0,1]"] and labels[-K:] == [f"b[{k}]" for k in range(K)]
    assert len(labels) == (p + 1) * K
    # the same run with loo = pointwise and plot = true: az.loo, az.compare and az.plot_trace take
    # the CLI's file as it is, and the CLI drew overview.png
    sets.update({"run-name": "lg-pw", "loo": "pointwise", "plot": "true"})
    assert main(["run", *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])]) == 0
    assert f"plot: {tmp_path / 'lg-pw' / 'overview.png'}" in capsys.readouterr().out
    pw = az.from_netcdf(tmp_path / "lg-pw" / "samples.nc")
    assert np.isclose(az.loo(pw).elpd_loo, loo.elpd_loo, rtol=1e-9)  # the same draws: the same LOO
    cmp = az.compare({"psis": loo, "pointwise": pw})
    assert np.allclose(cmp["elpd_diff"], 0.0, atol=1e-6)
    assert az.plot_trace(pw, var_names=["theta"], coords={"theta_dim_0": labels[:2]}).shape == (1, 2)
    assert (tmp_path / "lg-pw" / "overview.png").stat().st_size > 10_000


def test_tensor_labels_name_each_parameter_entry():
    from qlsd_flwr.tasks.registry import tensor_labels

    assert tensor_labels([("fc.weight", (2, 3)), ("fc.bias", (2,))]) == [
        "fc.weight[0,0]", "fc.weight[0,1]", "fc.weight[0,2]", "fc.weight[1,0]", "fc.weight[1,1]", "fc.weight[1,2]",
        "fc.bias[0]", "fc.bias[1]"]


def test_the_overview_plot_shows_the_coordinates_the_data_moved_and_every_chain(tmp_path):
    from qlsd_flwr.evaluation.report import (
        informative_coordinates,
        plot_run,
        rolling_mean,
    )

    rng = np.random.default_rng(0)
    s = rng.normal(size=(2, 100, 6))  # centred noise, as an uninformed (prior-only) coordinate
    s[..., 4] += 10.0  # the data moved coordinates 4 and 1
    s[..., 1] -= 5.0
    assert informative_coordinates(s, 2) == [1, 4]
    assert np.allclose(rolling_mean([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
    out = run({**BASE, "engine": "vectorised", "num-chains": 2, "output-dir": str(tmp_path), "run-name": "p"})
    (path,) = plot_run(out.run_dir)
    assert path.stat().st_size > 10_000


def test_the_flwr_run_server_app_evaluates_classification_runs(tmp_path):
    # `flwr run` goes through the ServerApp, not the CLI: it adds the held-out groups itself
    from qlsd_flwr.config import resolve
    from qlsd_flwr.flower.server_app import evaluate_task_held_out

    sets = {"task": "logistic", "engine": "inprocess", "num-rounds": 30, "burn-in": 10, "gamma": 1e-3,
            "num-clients": 4, "output-dir": str(tmp_path), "run-name": "f", "progress": False}
    out = run(sets)
    evaluate_task_held_out(resolve(sets), out.run_dir)
    idata = az.from_netcdf(out.run_dir / "samples.nc")
    assert {"heldout_log_likelihood", "predictions", "observed_data", "loo"} <= set(idata.groups())
    assert (out.run_dir / "evaluation.json").exists()
    evaluate_task_held_out(resolve({**sets, "task": "gaussian"}), out.run_dir)  # other tasks: nothing


def test_a_run_folder_evaluated_twice_keeps_one_copy_of_each_heldout_group(tmp_path):
    """Re-evaluating a classification run (e.g. a table script reusing its run folders) rewrites
    the held-out groups in place: the same values, one group each, and the same summary."""
    import h5netcdf

    from qlsd_flwr.evaluation.evaluate import evaluate_run
    from qlsd_flwr.run.simulate import run

    o = run({"task": "logistic", "dataset": "breast_cancer", "num-clients": 3, "engine": "vectorised",
             "num-chains": 2, "num-rounds": 60, "burn-in": 20, "gamma": 1e-4, "progress": False,
             "output-dir": str(tmp_path), "run-name": "r"})
    first = evaluate_run(o.run_dir)
    with h5netcdf.File(o.run_dir / "samples.nc", "r") as f:
        ll = np.asarray(f["heldout_log_likelihood"]["y"][...])
    again = evaluate_run(o.run_dir)
    with h5netcdf.File(o.run_dir / "samples.nc", "r") as f:
        assert sorted(f.groups) == ["heldout_log_likelihood", "loo", "observed_data", "posterior", "predictions",
                                    "sample_stats"]
        assert np.array_equal(np.asarray(f["heldout_log_likelihood"]["y"][...]), ll) and ll.shape == (2, 40, 114)
    assert again == first
