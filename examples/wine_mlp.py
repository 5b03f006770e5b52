"""A user plug-in: your own dataset and torch model (see :mod:`qlsd_flwr.plugins`).

Run QLSD++ on it over 5 virtual clients on Flower's Ray engine::

    PYTHONPATH=examples ./dev run run --set task=mnist --set dataset=wine_mlp:load \
        --set model=wine_mlp:make --set num-clients=5 --set partition=dirichlet \
        --set gamma=1e-3 --set num-rounds=300 --set burn-in=100

``task = mnist`` is the torch-classifier task (the name is historical: any dataset works).
"""

from __future__ import annotations

import numpy as np
from torch import nn

from qlsd_flwr.data import ArrayDataset


def load(seed: int) -> ArrayDataset:
    """scikit-learn's wine (178 × 13, 3 classes), standardised, 80/20 stratified split."""
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    X, y = load_wine(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.2, random_state=seed, stratify=y)
    mu, sd = X_tr.mean(0), X_tr.std(0)
    return ArrayDataset(name="wine", X_train=((X_tr - mu) / sd).astype(np.float32),
                        y_train=y_tr.astype(np.int64), X_test=((X_te - mu) / sd).astype(np.float32),
                        y_test=y_te.astype(np.int64), n_classes=3, input_shape=(13,))


def make(n_classes: int, input_shape: tuple) -> nn.Module:
    """A 13-16-3 MLP (291 parameters)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16), nn.Tanh(),
                         nn.Linear(16, n_classes))
