"""One dense layer's Kronecker-factored curvature (K-FAC), the form ``metric = kronecker`` keeps:
:class:`Kron` applies ``M^t`` for ``t = −1`` (the metric) and ``t = −1/2`` (its symmetric root)
without ever forming the ``d × d`` matrix. Built by :func:`qlsd_flwr.core.curvature.metric_from_kronecker`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Kron:
    """One dense layer's curvature in Kronecker form (K-FAC, Martens & Grosse 2015): θ's
    coordinates, reordered by ``perm``, are a ``(F̃, K)`` matrix ``V`` (``F̃`` inputs with the bias's
    constant 1, ``K`` outputs), and ``∇²U ≈ G ⊗ Ā + λ_0 I`` with ``G = Σ_j x̃_j x̃_jᵀ`` and
    ``Ā = (1/N) Σ_j (diag p_j − p_j p_jᵀ)`` (softmax outputs). With ``G = Q_G Λ_G Q_Gᵀ`` and
    ``Ā = Q_A Λ_A Q_Aᵀ``, ``M^t V = Q_G [(Q_Gᵀ V Q_A) ⊙ den^t] Q_Aᵀ`` with ``den = λ_G λ_Aᵀ + λ_0``:
    ``t = −1`` is ``M``, ``t = −1/2`` its symmetric root, each ``O(F̃² K)`` a row."""

    perm: np.ndarray  # (d,) int: V.ravel()[j] = θ[perm[j]]
    qg: np.ndarray  # (F̃, F̃)
    qa: np.ndarray  # (K, K)
    den: np.ndarray  # (F̃, K), positive

    def apply(self, r: np.ndarray, t: float) -> np.ndarray:
        return self.map(r, lambda den: den**t)

    def map(self, r: np.ndarray, f) -> np.ndarray:
        """``f(∇²U) r`` for a function ``f`` of the eigenvalues ``den`` (``den^t``: ``M^t``; DG-LMC's exact
        θ | z draw takes others, :class:`qlsd_flwr.core.dglmc.Spectrum`)."""
        F, K = self.den.shape
        V = r[self.perm].reshape(F, K)
        W = (self.qg.T @ V @ self.qa) * f(self.den)
        out = np.empty_like(r)
        out[self.perm] = (self.qg @ W @ self.qa.T).ravel()
        return out

    def describe(self) -> dict:
        F, K = self.den.shape
        return {"kind": "kronecker", "inputs": F, "outputs": K,
                "den_min": float(self.den.min()), "den_max": float(self.den.max())}

    @staticmethod
    def checked(perm, qg, qa, den, d: int) -> "Kron":
        """A :class:`Kron` of dimension ``d`` from its arrays (as received: a permutation of ``0..d−1``,
        orthogonal factors, positive eigenvalues of the right shapes), else ``ValueError`` saying so."""
        try:
            perm, qg, qa, den = (np.asarray(x, dtype=np.float64) for x in (perm, qg, qa, den))
            F, K = den.shape
            ok = (perm.shape == (d,) and F * K == d and qg.shape == (F, F) and qa.shape == (K, K)
                  and np.array_equal(np.sort(perm), np.arange(d)) and np.all(den > 0)
                  and np.allclose(qg.T @ qg, np.eye(F), atol=1e-8) and np.allclose(qa.T @ qa, np.eye(K), atol=1e-8))
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"metric: not a Kronecker metric of d = {d} (bad sizes, order, eigenvalues, or "
                             "factors not orthogonal)")
        return Kron(perm.astype(np.int64), qg, qa, den)
