"""Who takes part in a round, and the weight of each message.

Client ``i`` is active at round ``k`` independently with probability ``p_i``:
``i ∈ A_{k+1}  ⇔  X_{k+1}^{(3,i)} ≤ p_i`` with ``X ~ U[0,1)`` drawn from the counter stream
``(seed, PARTICIPATION, k, i)`` (supplement S1.1). This replaces Flower's ``sample_nodes``,
which draws a fixed-size subset with Python's unseeded global ``random``.

Two aggregation rules (``g = Σ_{i∈A} w_i g_i``):

* ``unbiased`` (default, the supplement's theory): ``w_i = 1/p_i``. ``E[g] = Σ_i E[g_i]``.
* ``active-fraction`` (Algorithm 1): ``w_i = b/|A|``.

Empty rounds (``A = ∅``): under ``unbiased`` the data term is ``0``, which is what the
estimator prescribes, and the Langevin step is taken with the server's terms only (prior
gradient, and ``η`` for QLSD++). Under ``active-fraction`` the rule is undefined; we skip the
round: ``θ_{k+1} = θ_k``, no noise, memory unchanged, and the round is counted as empty.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from qlsd_flwr.core import rng


class Aggregation(IntEnum):
    """The aggregation rules (the run config's ``aggregation``; compiled code takes the value)."""

    UNBIASED = 0
    ACTIVE_FRACTION = 1

    @classmethod
    def of(cls, name: str) -> "Aggregation":
        return cls[str(name).upper().replace("-", "_")]


def active_mask(seed, round_, p: np.ndarray) -> np.ndarray:
    """Boolean mask of active clients at round ``k``; broadcasts over array ``seed``/``round_``."""
    b = p.shape[-1]
    u = rng.uniform(np.asarray(seed)[..., None], rng.Stream.PARTICIPATION,
                    np.asarray(round_)[..., None], np.arange(b), 1)[..., 0]
    return u < p


def weights(replied: np.ndarray, p: np.ndarray, rule: str) -> np.ndarray:
    """Aggregation weights ``w_i`` (``0`` for clients without a valid reply)."""
    replied = np.asarray(replied, dtype=bool)
    if _rule(rule) is Aggregation.UNBIASED:
        return np.where(replied, 1.0 / p, 0.0)
    n = replied.sum(axis=-1, keepdims=True)
    b = replied.shape[-1]
    return np.where(replied, b / np.maximum(n, 1), 0.0)


def skips_round(replied: np.ndarray, rule: str) -> np.ndarray:
    """Whether the round is skipped (active-fraction rule with no valid reply)."""
    return np.logical_and(_rule(rule) is Aggregation.ACTIVE_FRACTION, ~np.any(replied, axis=-1))


def _rule(rule) -> Aggregation:
    try:
        return Aggregation.of(rule) if isinstance(rule, str) else Aggregation(rule)
    except (KeyError, ValueError):
        raise ValueError(f"aggregation: unknown rule {rule!r}; allowed: unbiased, active-fraction") from None
