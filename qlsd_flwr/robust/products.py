"""``gamma = auto``'s products held to scale: one client cannot steer ``gamma = auto`` (issue 38).

``gamma = auto`` is ``c / λ_max(M^½ ∇²U(θ*) M^½)``, and the Lanczos iteration finds ``λ_max`` from
Hessian-vector products ``∇²U u``: each client's own ``∇²U_i u`` in one exchange where the engine can ask for it
(:func:`qlsd_flwr.protocol.curvature_exchange.power_products`, since issue 37), else the central difference of its
gradients at ``θ* ± εu``. Summed as they came, one client's difference scaled ×1e4 made γ 5,000× smaller (the chain frozen, 70 sd off
after 600 rounds), ×−1e4 aborted the run, and nothing was counted. Here each client's own product
``h_i = (∇U_i(θ*+εu) − ∇U_i(θ*−εu)) / 2ε`` is judged per datum, ``v_i = ‖h_i‖ / N_i`` (``N_i`` clamped), against
the lower median of the clients' ``v`` (at least :data:`~qlsd_flwr.robust.claims.POOL_MIN` clients), and one
over :data:`FACTOR_PRODUCT` times it is scaled down to that size before the sum (counted as
``products_clipped``; the clients named in the log). With no client over it, the product is the sum as
before, bit for bit.

**Its share of the Rayleigh quotient.** The clip above is a multiple of the median, and honest clients
spread 12× around it, so it cannot be tight. The quantity γ depends on is the Rayleigh quotient
``uᵀ ∇²U u = Σ_i q_i + q_0``, with ``q_i = uᵀ h_i`` client ``i``'s part and ``q_0`` the prior's (the server's
own). Each client's ``q_i`` is then held to ``max(SHARE, FACTOR_SHARE_DATUM · N_i / N_{−i})`` times the others'
and the prior's together, ``q_{−i} = Σ_{k≠i} q_k + q_0`` (``N_i`` clamped; only where ``q_{−i} > 0``, with at
least ``POOL_MIN`` clients): a client counts for at most as much as all the others together, unless its data
are a large enough share for its curvature per datum to be up to :data:`FACTOR_SHARE_DATUM` times theirs. A part
over it is scaled down to it (``products_clipped``, the log naming the rule).

**What one client can still do.** At every product the iteration reads, ``Σ q ≤ (1 + a_i) q_{−i}`` with
``a_i = max(SHARE, FACTOR_SHARE_DATUM · N_i / N_{−i})``, and ``q_{−i} = vᵀ B_{−i} v ≤ λ_max(B_{−i})`` (``v`` the
vector asked about, in ``M``'s whitened coordinates, ``B_{−i}`` the others' and the prior's part of ``M^½ ∇²U M^½``,
which is at most the honest federation's wherever the liar's own data have a convex potential). The value the
Lanczos iteration returns is such a quotient, that of one more product at its top Ritz vector
(:func:`qlsd_flwr.core.spectral.lambda_max`; the iteration's other entries only choose that vector). So the λ_max it
returns is at most ``1 + a_i`` times the honest one, and γ smaller by at most that factor: **3.2 for one client of ten equal
ones** (``1 + 20/9``), 2.05 for one of twenty, and never more than the per-datum clip's
``1 + FACTOR_PRODUCT · N_i / N_{−i}`` (6.6 for one of ten, the bound before this rule). A claimed ``N_i`` raises
``a_i`` up to ``N_CLAIM_CAP`` (10) times the median's. The 2× the issue asks for one client of ten
(``FACTOR_SHARE_DATUM ≤ 9``) would hold honest clients: those that count for more than the others together
had a curvature per datum up to 10.3× theirs (below).

**Enlarging γ** (since 2026-12-06). A negative part is held from below as well, ``q_i ≥ −a_i/(1 + a_i) · q_{−i}``
(the leave-one-out rule's other side, as for ``metric-rank``'s shares: :mod:`.krylov`), so that at every product
``Σ q ≥ q_{−i} / (1 + a_i)``: a convex client's own part is never negative, so no honest part of a log-concave model is
held. The iteration's value is at least the quotient at its start ``v₀`` (:func:`qlsd_flwr.core.spectral.lambda_max`
returns the larger of the two, both held), and ``v₀`` holds a random direction the clients do not choose (it is that
direction, or ``metric-rank``'s top uncorrected Ritz vector plus it where a block was corrected first). So the λ_max
it returns is at least ``q_{−i}(v₀) / (1 + a_i)`` and γ larger by at most ``(1 + a_i) · λ_max(B) / q_{−i}(v₀)``: the
share's factor times the spectrum's top over its value at the start, which for a random start is about the mean
eigenvalue: on the main job ``λ_max = 2.201`` and the start's quotient 1.237 (``benchmarks/RESULTS.md``), so one client
of its twenty equal ones can make γ about ``2.05 × 1.9 ≈ 3.8`` times larger at most. Before, ×−1e4 stopped the run
("not convex") and a smaller negative lie made γ larger without any bound.

**The constants, measured on honest clients** (``python benchmarks/bench_honest_claims.py --shares``, the same
37 log-concave cases, ``benchmarks/honest_products.json``; every product of the power iteration from a random
start at θ*, 5 random directions, and since 2026-12-04 every vector of the Lanczos iteration from a random start and
its top Ritz vectors): a client's ``q_i / q_{−i}`` reached 2.10 (breast_cancer over 5 clients, Dirichlet(0.5), at a
Lanczos vector; 2.05 before, digits over 5 clients, Dirichlet(0.1)), and
where it passed 1 its curvature per datum was at most 10.3× the others' (``q_i N_{−i} / (q_{−i} N_i)``), so
``FACTOR_SHARE_DATUM = 20`` leaves a factor of 1.9: no honest part was held in the 37 cases.

**Networks** (a model not declared log-concave: ``info['products_rule']``, from the task or, on Flower, the prior and
the majority of the clients' handshakes, so that one client cannot switch the rule either way; ``gamma-c = auto``
takes the smaller step if any client says it is not; since 2026-12-07). A network client's curvature at θ* follows
how badly θ* fits its labels, not its share of the data, so the constants above held honest parts there and γ came out
up to 2.2–2.7× larger than the honest sum's (a larger step than the user's ``gamma-c`` asks for: discretisation bias,
a cost a defence must not put on honest clients). Such models take :func:`factors`' other triple, and
:func:`hold_shares` judges a part from above against the others' and the prior's parts in absolute value (positive
where a network's parts cancel along the vector): a part is held to :data:`SHARE_NETWORK` times that, whatever the
``N_i`` its client claims, and from below to ``−¾`` of the others' signed sum (:data:`SHARE_NETWORK_BELOW`); the
per-datum clip is off (products per datum are heavy-tailed there). ``python benchmarks/bench_honest_claims.py
--networks`` gives the honest maxima. The argument above then gives, for any one client, **γ shrinks by at most
``(λ_max(B_{−i}) + 300 λ_max(|B|_{−i})) / λ_max(B)``** (``|B|_{−i}`` the prior's and the others' curvature with their
eigenvalues' absolute values: 301× where the others are convex) **and grows by at most ``4 λ_max(B)/q_{−i}(v₀)``**,
against 5,000× and a frozen chain with no rule. The first is weak, and has to be: a liar and a client whose labels θ*
misfits send the same products, and such an honest client's part reached 71× the others'. During the descent from a
network's initial point, where the potential is not convex, an honest part can be far below the others' and is then
held from below: that only shortens the descent's step (its λ reads larger).
"""

from __future__ import annotations

import logging
import math

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
#: a client's part of the Rayleigh quotient is at most this many times the others' and the prior's together
#: (so one client at most doubles the λ_max γ is taken from) ...
SHARE = 1.0
#: ... or, where its data are a larger share, up to this factor per datum over theirs: honest clients whose part
#: passed the others' reached 10.3× them per datum (module docstring), so 20 leaves 1.9
FACTOR_SHARE_DATUM = 20.0


#: **Models not declared log-concave** (networks; ``info['products_rule']``, module docstring): an honest
#: client's curvature there follows how badly θ* fits its labels, not its share of the data, and the constants above
#: held honest parts (γ up to 2.2–2.7× larger than the honest sum's on an MLP over MNIST clients). There a client's part
#: is held to SHARE_NETWORK times the others' and the prior's together in absolute value, whatever its ``N_i``, and the
#: per-datum clip is off (FACTOR_PRODUCT_NETWORK): ``python benchmarks/bench_honest_claims.py --networks``
#: (``benchmarks/honest_networks.json``, 14 cases, two runs whose θ* differed) measured honest parts up to 71.4× the
#: others' (so 300 leaves 4.2×) and products per datum up to 491× the median (a heavy tail no per-datum constant
#: clears with a bound worth having)
SHARE_NETWORK = 300.0
FACTOR_PRODUCT_NETWORK = float("inf")
#: ... and from below to ``−a/(1 + a)`` of them with this ``a`` (−¾): at the same cases' θ* the lowest honest part was
#: −0.275× the others' in the committed run, −0.551× in another and −1.35× in the first (one vector, where the sum along
#: it was negative and no hold of this form can pass it); γ's own iteration asked at none of them. So γ grows by at most
#: ``4 λ_max/q_{−i}(v₀)``, where ``a = 300`` would allow 301×
SHARE_NETWORK_BELOW = 3.0


def factors(log_concave: bool) -> tuple[float, float, float]:
    """``(per-datum clip, per-datum share factor, share floor)``: ``(FACTOR_PRODUCT, FACTOR_SHARE_DATUM, SHARE)`` for a
    model declared log-concave, ``(FACTOR_PRODUCT_NETWORK, 0, SHARE_NETWORK)`` for one that is not."""
    return (FACTOR_PRODUCT, FACTOR_SHARE_DATUM, SHARE) if log_concave else (FACTOR_PRODUCT_NETWORK, 0.0, SHARE_NETWORK)


def clip_products(parts: dict, n_data: dict, factor: float = FACTOR_PRODUCT) -> tuple[dict, dict[int, str]]:
    """``parts`` (``{i: h_i}``) with each client's product over ``factor`` (:func:`factors`) times the lower median per
    datum scaled down to it, and ``{i: why}`` for those scaled (nothing with fewer than ``POOL_MIN`` clients)."""
    if not np.isfinite(factor):  # off (a network's: FACTOR_PRODUCT_NETWORK)
        return parts, {}
    v = {i: float(np.linalg.norm(h)) / max(int(n_data.get(i, 1)), 1) for i, h in parts.items()}
    if len(v) < POOL_MIN:
        return parts, {}
    ref = lower_median(v.values())
    limit = factor * ref
    over = {i: x for i, x in v.items() if not x <= limit}
    if not over or not ref > 0:
        return parts, {}
    out = {i: (h * (limit / v[i]) if i in over else h) for i, h in parts.items()}
    return out, {i: f"its Hessian-vector product per datum was {x / ref:.3g}× the clients' median (over "
                    f"{factor:g}×): scaled down to it" for i, x in over.items()}


def hold_shares(parts: dict, n_data: dict, u: np.ndarray, q0: float, per_datum: float = FACTOR_SHARE_DATUM,
                share: float = SHARE, absolute: bool = False, below: float | None = None) -> tuple[dict, dict[int, str]]:
    """``parts`` with each client's part of the Rayleigh quotient, ``q_i = uᵀ h_i``, held to
    ``a_i = max(share, per_datum · N_i / N_{−i})`` (the model's: :func:`factors`) times the others' and the prior's
    (``q0``) together, ``q_{−i}``, and from below to ``−a_i/(1 + a_i)`` times them (module docstring), and ``{i: why}``
    for those scaled (nothing with fewer than ``POOL_MIN`` clients). ``absolute`` (a network): the hold from above is
    against ``|q0| + Σ_{j≠i} |q_j|`` instead, which is positive where a network's honest parts cancel along ``u``;
    ``below``: the ``a`` of the hold from below, if not ``a_i`` (a network's: :data:`SHARE_NETWORK_BELOW`).
    ``q_{−i}`` is summed without ``q_i`` (``math.fsum``): from ``Σ q − q_i`` a part ×1e17 rounded the others away and
    went unjudged."""
    if len(parts) < POOL_MIN:
        return parts, {}
    q = {i: float(u @ h) for i, h in parts.items()}
    n_all = sum(int(n_data.get(i, 1)) for i in parts)
    out, why, keys = dict(parts), {}, sorted(parts)
    for i in keys:
        rest = [q[j] for j in keys if j != i]
        others, n_i = math.fsum(rest + [float(q0)]), max(int(n_data.get(i, 1)), 1)
        above = math.fsum([abs(x) for x in rest] + [abs(float(q0))]) if absolute else others
        a = max(share, per_datum * n_i / max(n_all - n_i, 1))
        low = a if below is None else below
        if above > 0 and np.isfinite(above) and q[i] > a * above:
            out[i] = parts[i] * (a * above / q[i])
            why[i] = (f"its part of the curvature along the power iteration's vector was {q[i] / above:.3g}× the "
                      f"others' and the prior's together (over {a:.3g}×): scaled down to it")
        elif others > 0 and np.isfinite(others) and q[i] < -low / (1.0 + low) * others:
            # Σ q stays at least q_{−i}/(1 + a): γ grows by at most that factor
            out[i] = parts[i] * (low / (1.0 + low) * others / -q[i])
            why[i] = (f"its part of the curvature along the power iteration's vector was {q[i] / others:.3g}× the "
                      f"others' and the prior's together (below {-low / (1.0 + low):.3g}×): scaled to it")
    return out, why


def held_parts(parts: dict, n_data, info: dict, u: np.ndarray | None = None,
               q0: float = 0.0) -> tuple[dict, bool]:
    """:func:`clip_products` on the power iteration's parts (``n_data``: the clients' claimed ``N_i``, clamped
    here), then, given the vector ``u`` they are products with and the prior's part ``q0 = uᵀ ∇²U_0 u``,
    :func:`hold_shares`, with the constants for the model (:func:`factors`: ``info['products_rule']``, which the
    preparation sets, ``network`` or ``log-concave``, the latter where it is not set); those scaled named in the log and
    counted in ``info`` (``products_clipped``, ``products_clipped_clients``); ``(held parts, whether any was scaled)``."""
    counts = clamped_counts(n_data, list(parts))
    network = info.get("products_rule") == "network"
    per_product, per_datum, share = factors(not network)
    held, why = clip_products(parts, counts, per_product)
    if u is not None:
        held, shared = hold_shares(held, counts, np.asarray(u, dtype=np.float64), q0, per_datum, share, network,
                                   SHARE_NETWORK_BELOW if network else None)
        why = {**why, **{i: (why[i] + "; then " + w if i in why else w) for i, w in shared.items()}}
    for i, w in sorted(why.items()):
        log.warning("client %d: %s (products_clipped)", i, w)
    if why:
        info["products_clipped"] = int(info.get("products_clipped", 0)) + len(why)
        info["products_clipped_clients"] = sorted(set(info.get("products_clipped_clients", [])) | set(why))
    return held, bool(why)
