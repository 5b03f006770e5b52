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
    assert set(idata.groups()) == {"posterior", "sample_stats"}
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
