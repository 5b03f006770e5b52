"""User plug-ins: your own dataset and torch model, named in the run config as ``module:attr``.

* ``dataset = "my_pkg.my_data:load"`` — ``load(seed: int) -> qlsd_flwr.data.datasets.ArrayDataset``
  (``seed`` is ``data-seed``, for your train/test split). ``X_train``/``X_test`` are
  ``(n, features)`` arrays (flattened images are reshaped to ``input_shape`` by the model
  wrapper), ``y`` integer labels in ``0..n_classes-1``. Give ``natural_partition`` (a list of
  index arrays into the training split, one per client) if your data come with their clients,
  and use ``partition = natural``; otherwise any ``partition`` of :mod:`qlsd_flwr.data.partition`.
* ``model = "my_pkg.my_models:make"`` — ``make(n_classes: int, input_shape: tuple) ->
  torch.nn.Module`` mapping a batch of ``input_shape`` inputs to ``n_classes`` logits. It is
  called under ``torch.manual_seed(data-seed)``, so the initial θ is reproducible. Use it with
  ``task = mnist`` (the torch-classifier task; any dataset). The potential is
  cross-entropy + the Gaussian prior (``prior-var``); θ is the flattened trainable parameters.

The module must be importable in every process that runs a client: installed in the
environment, or on ``PYTHONPATH`` (Ray's workers and Flower's SuperNodes start their own
interpreters). Both names are checked at start-up: a missing module or attribute is a
:class:`~qlsd_flwr.config.ConfigError` naming the key.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def is_plugin(name: Any) -> bool:
    """``module:attr`` (a colon, no spaces) names a plug-in; built-in names have no colon."""
    s = str(name).strip()
    return ":" in s and " " not in s and not s.startswith(":") and not s.endswith(":")


def load_object(path: str, key: str) -> Callable:
    """Import ``module:attr`` (``attr`` may be dotted); ``ValueError`` naming ``key`` if it
    cannot be imported or is not callable."""
    mod_name, _, attr = str(path).strip().partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"{key}: cannot import module {mod_name!r} of {path!r} ({exc}); it must be "
                         "installed or on PYTHONPATH in every process") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}: {path!r} is not callable")
    return obj
