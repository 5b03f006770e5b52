"""A metric ``M`` from a ``.npy`` file (``metric = <path>``): the one file the preparation reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qlsd_flwr.core.metric import Metric, MetricError, from_user_array
from qlsd_flwr.core.curvature import DENSE_MAX_DIM


def metric_from_file(path: str, d: int) -> Metric:
    """A ``.npy`` holding ``d`` positive numbers or an SPD ``d × d`` matrix; ``MetricError`` naming
    the file otherwise."""
    p = Path(path).expanduser()
    try:
        a = np.load(p, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise MetricError(f"metric: cannot read {str(p)!r} as a .npy array ({type(exc).__name__}: {exc})") from None
    if a.shape == (d, d) and d > DENSE_MAX_DIM:
        raise MetricError(f"metric: {str(p)!r} is a dense {d} × {d} metric; dense metrics are allowed up to "
                          f"d = {DENSE_MAX_DIM}")
    try:
        return from_user_array(a, d)
    except MetricError as exc:
        raise MetricError(f"{exc} (in {str(p)!r})") from None
