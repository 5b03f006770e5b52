"""Bounds on the clients' curvature reports and on the data counts that scale them.

One client's report (a curvature, a block of Hessian-vector products, a surrogate's precision) is
compared per datum with the lower median of the clients' (an honest client's value while at least
half the clients are honest), and a report above :data:`REPORT_CAP` times it is scaled down to it; a
client's claimed ``N_i`` counts for at most :data:`REPORT_CAP` times the lower median of the claims.
"""

from __future__ import annotations

import numpy as np

#: one client's curvature report may weigh at most this many times its share ``N_i`` of the
#: (lower-median) honest clients' per-datum curvature before it is scaled down
#: (:func:`qlsd_flwr.core.curvature.metric_from_curvature`).
REPORT_CAP = 10.0
#: a curvature report with a value above this is refused: sums of a few such reports stay finite
REPORT_MAX = 1e150
#: the most Hessian-vector products a client computes for one message (a server message asking more
#: is refused by the client): one block then costs it at most 256 gradient pairs
MAX_BLOCK = 256


class ReportError(ValueError):
    """A curvature report the server refuses (counted as ``curvature_rejected``)."""


def clamped_counts(n_data, clients) -> dict[int, int]:
    """Each client's ``N_i`` as used to scale its report: at least 1 and at most :data:`REPORT_CAP`
    times the lower median of the claims (``N_i`` is the client's own claim at the handshake; a
    claim of 10^12 must not make its report look small per datum)."""
    n_data = np.asarray(n_data)
    n = {i: max(int(n_data[i]) if i < n_data.size else 1, 1) for i in clients}
    if not n:
        return n
    ref = lower_median(n.values())
    return {i: int(min(v, REPORT_CAP * ref)) for i, v in n.items()}


def lower_median(values) -> float:
    """The lower median: an honest client's value when at least half the clients are honest."""
    s = np.sort(np.fromiter(values, dtype=np.float64))
    return float(s[(len(s) - 1) // 2])


def per_datum_scale(h: np.ndarray, n: int) -> float:
    """A curvature report's largest diagonal entry per datum (its scale against the other clients')."""
    return float(np.max(np.diag(h) if h.ndim == 2 else h)) / max(int(n), 1)


def cap_reports(reports: dict[int, np.ndarray], n_data) -> list[int]:
    """Scale down, in place, each report whose per-datum scale ``max_j (H_i)_jj / N_i`` passes
    :data:`REPORT_CAP` times the lower median of the reports' scales; returns the clients scaled."""
    n = clamped_counts(n_data, reports)
    scales = {i: per_datum_scale(h, n[i]) for i, h in reports.items()}
    scaled = []
    if scales:
        ref = lower_median(scales.values())
        cap = REPORT_CAP * ref
        for i in sorted(reports):
            if ref > 0 and scales[i] > cap:
                reports[i] = reports[i] * (cap / scales[i])
                scaled.append(i)
    return scaled


def cap_total(lam: np.ndarray, h: float) -> int:
    """FSGLD's surrogate precisions: scale the precisions ``λ`` ``(b, d)`` down, in place, in each coordinate where ``Λ = Σ_i λ_i``
    exceeds ``1/h``; returns how many coordinates. Every client's local step holds ``h Λ``, which must
    stay below 2 for its steps to be stable whatever its own data (honest surrogates give
    ``Λ ≤ λ_max(∇²U)``, and ``h λ_max`` is ``c = 0.25`` under ``gamma = auto``); any ``λ`` keeps
    the conducive gradient unbiased, so a smaller one costs variance, never bias."""
    total = lam.sum(axis=0)
    over = total * h > 1.0
    lam[:, over] *= (1.0 / h) / total[over]
    return int(np.count_nonzero(over))
