"""The model and each client's data: the part a user writes for any Flower app."""

import numpy as np
import torch
from sklearn.datasets import load_wine
from torch import nn

from qlsd_flwr.potentials import GaussianPrior, Task, TorchPotential

PRIOR_VAR = 5.0


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial θ on the server and in every check
    return nn.Sequential(nn.Linear(13, 16), nn.Tanh(), nn.Linear(16, 3))


HELD_OUT = 0.3  # the share of the points no client sees: the server's held-out set


def _wine():
    X, y = load_wine(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(y))  # fixed: the same split on every node
    return ((X - X.mean(0)) / X.std(0)).astype(np.float32), y, perm


def load_partition(i: int, n: int, held_out: float = HELD_OUT):
    """Client i of n: a fixed random share of the standardised wine samples that are not held out."""
    X, y, perm = _wine()
    part = np.array_split(perm[int(held_out * len(y)):], n)[i]
    return X[part], y[part]


def held_out_data(held_out: float = HELD_OUT):
    """The held-out points (no client has them): the server judges the posterior predictive on them."""
    X, y, perm = _wine()
    test = perm[: int(held_out * len(y))]
    return X[test], y[test]


def load_partition_dirichlet(i: int, n: int, alpha: float = 0.5, seed: int = 0):
    """Client i of n split by Flower Datasets' ``DirichletPartitioner`` (label skew ``alpha``) on an
    in-memory ``datasets.Dataset`` (offline). With a network, ``FederatedDataset(dataset="<hub
    name>", partitioners={"train": DirichletPartitioner(...)})`` gives the same partitions of a
    Hugging Face dataset; the rest is unchanged."""
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    X, y = load_wine(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    partitioner = DirichletPartitioner(num_partitions=n, partition_by="label", alpha=alpha, seed=seed,
                                       min_partition_size=5)
    partitioner.dataset = Dataset.from_dict({"x": X.astype(np.float32).tolist(), "label": y.tolist()})
    part = partitioner.load_partition(i)
    return np.asarray(part["x"], dtype=np.float32), np.asarray(part["label"], dtype=np.int64)


def potential(i: int, n: int) -> TorchPotential:
    """U_i(θ): the summed cross-entropy of client i's examples under the model with weights θ."""
    return TorchPotential(make_model(), *load_partition(i, n))


def make_task(num_clients: int, data_seed: int) -> Task:
    """The same posterior as a task plug-in (task = "qlsd_quickstart.task:make_task"), to sample it
    on qlsd-flwr's own engines too."""
    clients = [potential(i, num_clients) for i in range(num_clients)]
    return Task(name="wine-bnn", dim=clients[0].dim, clients=clients, prior=GaussianPrior(var=PRIOR_VAR),
                theta0=clients[0].theta0())
