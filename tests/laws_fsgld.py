"""FSGLD's exact stationary laws on the toy Gaussian: the tests' oracles (issue 36 keeps them beside the
tests, out of the production code). Moved unchanged from :mod:`qlsd_flwr.core.fsgld`, whose numerics they
describe.
"""

from __future__ import annotations

import numpy as np


def gaussian_stationary(n, ybar, mu, lam, f, h: float, steps: int, prior_var: float = np.inf):
    r"""The exact stationary law of FSGLD's θ on the toy Gaussian (the prior ``N(0, σ_0²)``):
    ``(mean (d,), variance (d,))``.

    Per coordinate, ``g_s(θ) = a_s θ − c_s`` with ``a_s = (N_s − λ_s)/f_s + Λ + 1/σ_0²`` and
    ``c_s = (N_s ȳ_s − λ_s μ_s)/f_s + Σ_j λ_j μ_j``; ``K`` steps on client ``s`` give
    ``θ' = R_s θ + C_s + ε_s`` with ``r_s = 1 − h a_s``, ``R_s = r_s^K``, ``C_s = h c_s Σ_{m<K} r_s^m``,
    ``Var ε_s = 2h Σ_{m<K} r_s^{2m}``. With ``s`` drawn afresh each round, independent of θ:
    ``m = E[C] / (1 − E[R])`` and ``E[θ²] = (2 E[RC] m + E[C²] + E[Var ε]) / (1 − E[R²])``."""
    n, f = np.asarray(n, dtype=np.float64), np.asarray(f, dtype=np.float64)
    ybar, mu, lam = (np.asarray(v, dtype=np.float64) for v in (ybar, mu, lam))
    prec0 = 0.0 if not np.isfinite(prior_var) else 1.0 / prior_var
    a = (n[:, None] - lam) / f[:, None] + lam.sum(axis=0) + prec0  # (b, d)
    c = (n[:, None] * ybar - lam * mu) / f[:, None] + (lam * mu).sum(axis=0)
    r = 1.0 - h * a
    m_pow = np.arange(steps)[None, None, :]
    R = r**steps
    C = h * c * (r[..., None] ** m_pow).sum(axis=-1)
    V = 2.0 * h * (r[..., None] ** (2 * m_pow)).sum(axis=-1)
    E = lambda x: (f[:, None] * x).sum(axis=0)  # noqa: E731 (the expectation over the chosen client)
    if np.any(E(R**2) >= 1.0):
        raise ValueError(f"FSGLD on this Gaussian has no stationary variance at h = {h}")
    m = E(C) / (1.0 - E(R))
    second = (2.0 * E(R * C) * m + E(C**2) + E(V)) / (1.0 - E(R**2))
    return m, second - m**2
