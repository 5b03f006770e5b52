"""The rules a client's θ* claims are held to (QLSD*, LSD*, VR-FALD*, FSGLD; the claims' state and their
use in the step are :mod:`qlsd_flwr.protocol.claims`): the same answer twice, and a fixed
``norm-bound = B``."""

from __future__ import annotations

import numpy as np

#: ``‖a_i − c_i‖ ≤ RTOL (‖a_i‖ + ‖c_i‖)`` is the same answer
RTOL = 1e-6


def relative_gap(a: np.ndarray, c: np.ndarray) -> float | None:
    """``‖a − c‖ / (‖a‖ + ‖c‖)`` when over :data:`RTOL` (two different answers); ``None`` when they agree."""
    gap = float(np.linalg.norm(a - c))
    scale = float(np.linalg.norm(a) + np.linalg.norm(c))
    return None if gap <= RTOL * scale else gap / max(scale, np.finfo(float).tiny)


def over_bound(claims, bound: float | None) -> dict[int, str]:
    """The clients whose claim ``c_i`` alone passes a fixed ``norm-bound = B`` (``None``: no fixed
    bound), with why: each later estimate ``c_i + ĝ_i`` would carry it, so they are left out
    before sampling and θ* is found again without them (:mod:`qlsd_flwr.flower.phases`)."""
    norms = {i: float(np.linalg.norm(c)) for i, c in enumerate(claims)}
    return {} if bound is None else {i: f"its ∇U_i(θ*) has norm {n:.3g}, over norm-bound = {bound:.3g}"
                                     for i, n in norms.items() if not n <= bound}
