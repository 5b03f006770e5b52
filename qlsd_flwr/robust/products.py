"""The power iteration's products held to scale: one client cannot steer ``gamma = auto`` (issue 38).

``gamma = auto`` is ``c / λ_max(M^½ ∇²U(θ*) M^½)``, and the power iteration finds ``λ_max`` from
Hessian-vector products ``∇²U u``: each client's own ``∇²U_i u`` in one exchange where the engine can ask for it
(:func:`qlsd_flwr.protocol.curvature_exchange.power_products`, since issue 37), else the central difference of its
gradients at ``θ* ± εu``. Summed as they came, one client's difference scaled ×1e4 made γ 5,000× smaller (the chain frozen, 70 sd off
after 600 rounds), ×−1e4 aborted the run, and nothing was counted. Here each client's own product
``h_i = (∇U_i(θ*+εu) − ∇U_i(θ*−εu)) / 2ε`` is judged per datum, ``v_i = ‖h_i‖ / N_i`` (``N_i`` clamped), against
the lower median of the clients' ``v`` (at least :data:`~qlsd_flwr.robust.claims.POOL_MIN` clients), and one
over :data:`FACTOR_PRODUCT` times it is scaled down to that size before the sum (counted as
``products_clipped``; the clients named in the log). With no client over it, the product is the sum as
before, bit for bit.

**What one client can still do.** Its clipped product is at most ``FACTOR_PRODUCT · N_i · m`` in norm, with ``m``
the median per-datum product and ``N_i ≤ N_CLAIM_CAP ·`` the median ``N``: against the honest sum, about
``N_{−i} · m`` along the top direction, it moves the Rayleigh quotient up by at most a factor
``1 + FACTOR_PRODUCT · N_i / N_{−i}``, so γ down by at most that factor: for one client of ten equal ones,
``1 + 50/9 ≈ 6.6`` (against 5,000× before the rule). A negative lie can make the curvature read smaller (γ
larger) or not convex: the run then stops naming the cause (``gamma = auto``: not convex there; or, once
sampling runs away, the clients whose products were scaled down), never with a silent γ. The issue's target,
2× for one client of ten, needs a bound tighter than honest clients' own spread (12×, measured): a robust
aggregate of the per-datum Rayleigh quotients, not a clip; not built.
"""

from __future__ import annotations

import logging

import numpy as np

from qlsd_flwr.robust.claims import POOL_MIN
from qlsd_flwr.robust.reports import clamped_counts, lower_median

log = logging.getLogger("qlsd_flwr")

#: a client's Hessian-vector product per datum over this many times the lower median of the clients' is
#: scaled down to it: honest clients measured at most 12.2× over 37 cases (θ* of the toy Gaussian and of
#: logistic regression on breast_cancer and digits with Dirichlet(0.5) and (0.1) label splits of 5 to 20
#: clients, along the top eigenvector and 5 random directions: ``benchmarks/bench_honest_claims.py``; a label
#: split gives clients per-datum curvatures ``p(1 − p) ‖x‖²`` that differ that much), so 50 leaves a factor of 4
FACTOR_PRODUCT = 50.0


def clip_products(parts: dict, n_data: dict) -> tuple[dict, dict[int, str]]:
    """``parts`` (``{i: h_i}``) with each client's product over :data:`FACTOR_PRODUCT` times the lower median per
    datum scaled down to it, and ``{i: why}`` for those scaled (nothing with fewer than ``POOL_MIN`` clients)."""
    v = {i: float(np.linalg.norm(h)) / max(int(n_data.get(i, 1)), 1) for i, h in parts.items()}
    if len(v) < POOL_MIN:
        return parts, {}
    ref = lower_median(v.values())
    limit = FACTOR_PRODUCT * ref
    over = {i: x for i, x in v.items() if not x <= limit}
    if not over or not ref > 0:
        return parts, {}
    out = {i: (h * (limit / v[i]) if i in over else h) for i, h in parts.items()}
    return out, {i: f"its Hessian-vector product per datum was {x / ref:.3g}× the clients' median (over "
                    f"{FACTOR_PRODUCT:g}×): scaled down to it" for i, x in over.items()}


def held_parts(parts: dict, n_data, info: dict) -> tuple[dict, bool]:
    """:func:`clip_products` on the power iteration's parts (``n_data``: the clients' claimed ``N_i``, clamped
    here), those scaled named in the log and counted in ``info`` (``products_clipped``,
    ``products_clipped_clients``); ``(held parts, whether any was scaled)``."""
    held, why = clip_products(parts, clamped_counts(n_data, list(parts)))
    for i, w in sorted(why.items()):
        log.warning("client %d: %s (products_clipped)", i, w)
    if why:
        info["products_clipped"] = int(info.get("products_clipped", 0)) + len(why)
        info["products_clipped_clients"] = sorted(set(info.get("products_clipped_clients", [])) | set(why))
    return held, bool(why)
