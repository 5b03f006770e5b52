"""How EF21-P's ``α`` shapes the chain's stationary law on a Gaussian (issue 37): the derived law
(:func:`qlsd_flwr.core.downlink.stationary_covariance`, with ``downlink-correction``'s ``β = 1``), its variance
along each eigen-direction ÷ the posterior's, for several ``α``.

The model: ``M = I``, a diagonal precision ``P`` whose ``γ M P`` spans the main job's preconditioned curvature
(eigenvalues 0.39 to 2.2, κ 5.7; ``γ = 0.5 / λ_max`` as ``gamma-c = 0.5``), and the broadcast's quantisation noise
``Q = c E‖x‖²/d I`` made self-consistent with the coded vector ``x = θ_k − w_{k−1}`` (``c``: QSGD's realised
variance factor, about 0.2 at 64 levels on the main job). What it shows: a smaller ``α`` (a longer lag) inflates the
stiff directions beyond ULA's own bias and deflates the flat ones, whatever ``c`` (``benchmarks/RESULTS.md``, "Three
ways to fewer broadcast bits").

    python benchmarks/bench_downlink_alpha_law.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.smoke import small  # noqa: E402
from qlsd_flwr.core import downlink as D  # noqa: E402


def law(gamma: float, P: np.ndarray, alpha: float, c: float, iters: int = 60) -> np.ndarray:
    """θ's stationary covariance with ``M = I``, ``β = 1`` and ``Q = c E‖x‖²/d I`` at its fixed point."""
    d = P.shape[0]
    Q = np.zeros((d, d))
    S = 2 * gamma * np.eye(d)
    full = None
    for _ in range(iters):
        A = D.transition(gamma, P, alpha, 1.0)
        full = D._lyapunov(A, np.block([[S, alpha * S], [alpha * S, alpha ** 2 * (S + Q)]]))
        top = A[:d]  # θ_{k+1} = top z_k + ξ: x_{k+1} = θ_{k+1} − w_k
        c_th, c_tw = top @ full @ top.T + S, top @ full[:, d:]
        new = c * np.trace(c_th - c_tw - c_tw.T + full[d:, d:]) / d * np.eye(d)
        if np.allclose(new, Q, rtol=1e-10):
            break
        Q = new
    return full[:d, :d]


def main() -> None:
    d = small(40, 8)
    lam = np.geomspace(2.2 / 5.7, 2.2, d)
    P, gamma = np.diag(lam), 0.5 / lam.max()
    ula = D.stationary_covariance(gamma, P, np.eye(d), 1.0, np.zeros((d, d)), feedback="none")
    print(f"ULA alone: stiffest direction's variance ÷ the posterior's {ula[-1, -1] * lam[-1]:.3f}")
    for c in (0.05, 0.2, 0.5):
        cells = []
        for alpha in (0.15, 0.25, 0.42, 0.5, 0.68, 0.85, 1.0):
            r = np.diag(law(gamma, P, alpha, c)) * lam
            cells.append(f"α {alpha}: {r.max():.3f} / {r.min():.3f}")
        print(f"c = {c} (stiffest / flattest variance ÷ the posterior's): " + "; ".join(cells))


if __name__ == "__main__":
    main()
