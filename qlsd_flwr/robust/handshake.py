"""The facts a node states at the handshake: which client it is, θ's size, how many data points.

A node's claim is refused (counted in ``refused_claims``, the node is not one of the run's) when it
names no client of ``0..b-1``, another ``d``, no data, or more data than float64 counts exactly
(:data:`N_DATA_MAX`: every per-datum scale divides by ``N_i``, and numpy's ``int64`` overflows at
2^63, which Flower's ``uint64`` can carry). How much a claimed ``N_i`` may weigh is the reports'
rule (:func:`qlsd_flwr.robust.reports.clamped_counts`).
"""

from __future__ import annotations

#: the most data points one node may claim: 2^53, the largest count float64 holds exactly
N_DATA_MAX = 2 ** 53


def refusal(d: int, n_data: int, dim: int, client: int) -> str | None:
    """Why a node's handshake facts (``d``, ``N_i``) are refused for ``client`` of a run of ``dim``
    parameters, or ``None``."""
    if d != dim:
        return f"has dim {d}, the server expects {dim}"
    if n_data < 1:
        return f"holds no data points (client {client}: every client needs at least one; check its partition)"
    if n_data > N_DATA_MAX:
        return f"claims {n_data} data points, more than {N_DATA_MAX} (2^53), the most a count may be"
    return None
