"""The package's one JSON encoder for what a run writes (``config.json``, ``summary.json``, a
checkpoint's metadata, the provenance hash; :func:`write` writes a file whole): numpy arrays and scalars as lists and numbers,
anything else as its string."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


def jsonable(x):
    """``json.dumps``'s ``default``: numpy arrays as lists, numpy integers and floats as numbers."""
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return str(x)


def finite(obj):
    """``obj`` with every non-finite number (``inf``, ``nan``; numpy's too, and inside arrays) as ``None``:
    strict JSON has no ``Infinity`` or ``NaN`` (Python's ``json`` writes them, other readers refuse them)."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return finite(obj.tolist())
    if isinstance(obj, (float, np.floating)):
        return float(obj) if np.isfinite(obj) else None
    return obj


def dumps(obj, strict: bool = True, **kwargs) -> str:
    """``json.dumps`` with :func:`jsonable` for numpy values; ``strict`` (what a user's tools read:
    ``summary.json``, ``config.json``, ``evaluation.json``, ``comparison.json``): non-finite numbers as
    ``null`` (:func:`finite`), so the file is strict JSON. A checkpoint's metadata, which only this
    package reads back, keeps them (``strict = False``) so that a resume sees the very values."""
    kwargs.setdefault("default", jsonable)
    if strict:
        return json.dumps(finite(obj), allow_nan=False, **kwargs)
    return json.dumps(obj, **kwargs)


def write(path, obj, **kwargs) -> None:
    """``path`` as :func:`dumps`'s text (``indent = 2``), written whole or not at all: to a temporary name in the same
    folder, then renamed over it, so that a reader polling the file (``flwr``'s tests, a user's monitor, a resume)
    never reads it half-written (measured: a test that waits for ``summary.json`` to appear read it empty once)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(dumps(obj, **{"indent": 2, **kwargs}))
    os.replace(tmp, path)
