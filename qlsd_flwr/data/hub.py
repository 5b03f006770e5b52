"""Datasets from the Hugging Face hub (MNIST, Fashion-MNIST, FEMNIST, CIFAR-10, SVHN), with fast,
explained failure offline (:class:`~qlsd_flwr.data.arrays.DatasetUnavailableError`)."""

from __future__ import annotations

import contextlib
import os
import socket
from urllib.parse import urlparse

import numpy as np

from qlsd_flwr.data.arrays import OFFLINE_DATASETS, ArrayDataset, DatasetUnavailableError
from qlsd_flwr.data.arrays import finish as _finish

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

