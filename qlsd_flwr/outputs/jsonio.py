"""The package's one JSON encoder for what a run writes (``config.json``, ``summary.json``, a
checkpoint's metadata, the provenance hash): numpy arrays and scalars as lists and numbers,
anything else as its string."""

from __future__ import annotations

import json

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


def dumps(obj, **kwargs) -> str:
    """``json.dumps`` with :func:`jsonable` for numpy values."""
    return json.dumps(obj, default=jsonable, **kwargs)
