"""What every loader returns: an :class:`ArrayDataset`, and the split/standardise helpers they share.

Its own module so that the offline loaders (:mod:`.datasets`) and the hub's (:mod:`.hub`) both build on it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
def split(X: np.ndarray, y: np.ndarray, test_frac: float, seed: int):
    """Stratified, seeded train/test split."""
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_frac < 1.0:
        raise ValueError(f"test_frac must be in (0, 1), got {test_frac}")
    return train_test_split(X, y, test_size=test_frac, random_state=seed, stratify=y)


def standardise(X_train: np.ndarray, X_test: np.ndarray):
    mu = X_train.mean(axis=0)
    sd = X_train.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)  # constant pixels (digits' borders) stay 0
    return (X_train - mu) / sd, (X_test - mu) / sd


def finish(name, X_tr, y_tr, X_te, y_te, n_classes, input_shape, dtype, **meta) -> ArrayDataset:
    return ArrayDataset(
        name=name,
        X_train=np.ascontiguousarray(X_tr, dtype=dtype), y_train=np.asarray(y_tr, dtype=np.int64),
        X_test=np.ascontiguousarray(X_te, dtype=dtype), y_test=np.asarray(y_te, dtype=np.int64),
        n_classes=int(n_classes), input_shape=tuple(input_shape), meta=dict(meta),
    )

