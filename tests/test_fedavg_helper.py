"""FedAvg next to QLSD on a user's own model (:mod:`qlsd_flwr.flower.fedavg`): the client's
local step is the MAP objective's gradient step, Flower's own FedAvg averages it, and the
quickstart's comparison script runs both on the same clients and prints one table."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord

from qlsd_flwr.flower import InProcessGrid, fedavg_strategy, make_fedavg_client_app, plug_in_probs
from qlsd_flwr.potentials import TorchPotential

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart-torch"


def _pots(b: int):
    from sklearn.datasets import load_wine

    X, y = load_wine(return_X_y=True)
    X = ((X - X.mean(0)) / X.std(0))
    torch.manual_seed(0)
    model = lambda: torch.nn.Sequential(torch.nn.Linear(13, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)).double()  # noqa: E731
    parts = np.array_split(np.arange(len(y)), b)
    pots = []
    for p in parts:
        torch.manual_seed(0)
        pots.append(TorchPotential(model(), X[p], y[p], dtype=torch.float64))
    return pots


def test_one_full_batch_round_is_one_gradient_step_on_the_map_objective():
    """One client, one epoch, one batch of all its points: FedAvg's new weights are
    θ_0 − lr (∇U_data(θ_0)/n + θ_0/(σ² N)), U_data from the same potential QLSD samples."""
    (pot,) = _pots(1)
    theta0 = pot.theta0()
    grad = pot.grad_sum(theta0) / pot.n_data
    sigma2, N, lr = 5.0, 1000, 0.05
    app = make_fedavg_client_app(lambda ctx: pot, prior_var=sigma2, n_total=N, local_epochs=1, lr=lr,
                                 batch_size=pot.n_data)
    result = fedavg_strategy(1).start(InProcessGrid(app, 1), initial_arrays=ArrayRecord(pot.named_arrays()),
                                      num_rounds=1)
    got = np.concatenate([a.numpy().ravel() for a in result.arrays.values()])
    want = theta0 - lr * (grad + theta0 / (sigma2 * N))
    assert np.allclose(got, want, rtol=0, atol=1e-12)


def test_fedavg_averages_the_clients_by_their_examples():
    pots = _pots(2)
    theta0 = pots[0].theta0()
    sigma2, N, lr = 5.0, 178, 0.05
    app = make_fedavg_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])], prior_var=sigma2,
                                 n_total=N, local_epochs=1, lr=lr, batch_size=10_000)
    result = fedavg_strategy(2).start(InProcessGrid(app, 2), initial_arrays=ArrayRecord(pots[0].named_arrays()),
                                      num_rounds=1)
    got = np.concatenate([a.numpy().ravel() for a in result.arrays.values()])
    steps = [theta0 - lr * (p.grad_sum(theta0) / p.n_data + theta0 / (sigma2 * N)) for p in pots]
    n = np.array([p.n_data for p in pots], dtype=float)
    assert np.allclose(got, (n[0] * steps[0] + n[1] * steps[1]) / n.sum(), rtol=0, atol=1e-12)
    probs = plug_in_probs(pots[0], result.arrays, pots[0].X.numpy())
    assert probs.shape == (pots[0].n_data, 3) and np.allclose(probs.sum(1), 1.0)


def test_the_quickstart_comparison_prints_both_rows(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    sys.path.insert(0, str(EXAMPLE))
    import compare

    rows = compare.main(rounds=200, fedavg_rounds=5, out=str(tmp_path))
    text = capsys.readouterr().out
    assert "QLSD++ (posterior predictive)" in text and "FedAvg (plug-in)" in text
    for m in rows.values():  # wine is nearly separable: both far above chance (1/3)
        assert m["accuracy"] > 0.8 and m["n_test"] == 53
    sys.modules.pop("compare", None)
    sys.modules.pop("qlsd_quickstart", None)
    sys.modules.pop("qlsd_quickstart.task", None)


def test_flower_datasets_partitions_feed_the_potentials(monkeypatch, tmp_path):
    """The quickstart's ``load_partition_dirichlet``: Flower Datasets' DirichletPartitioner on an
    in-memory dataset (offline) splits all 178 points, disjointly, into TorchPotentials that
    sample through the public API."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from qlsd_quickstart.task import PRIOR_VAR, load_partition_dirichlet, make_model

    from qlsd_flwr.flower import QLSDStrategy, make_client_app

    parts = [load_partition_dirichlet(i, 4) for i in range(4)]
    rows = np.concatenate([X for X, _ in parts])
    assert len(rows) == 178 and len(np.unique(rows, axis=0)) == 178 and min(len(y) for _, y in parts) >= 5
    shares = np.array([np.bincount(y, minlength=3) / len(y) for _, y in parts])
    assert shares.max() - shares.min() > 0.3  # label skew, as alpha = 0.5 gives
    pots = [TorchPotential(make_model(), X, y) for X, y in parts]
    st = QLSDStrategy(num_clients=4, dim=pots[0].dim, variant="qlsd-pp", gamma=1e-3, num_rounds=20, burn_in=5,
                      s=16, prior_var=PRIOR_VAR, progress=False, loo="off", output_dir=str(tmp_path))
    st.start(InProcessGrid(make_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])]), 4),
             initial_arrays=ArrayRecord(pots[0].named_arrays()))
    assert st.state.k == 20 and st.summary_data["rejected"] == {}
    sys.modules.pop("qlsd_quickstart", None)
    sys.modules.pop("qlsd_quickstart.task", None)
