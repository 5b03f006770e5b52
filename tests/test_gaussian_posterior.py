"""Samples against the toy Gaussian's exact posterior, every variant, p = 1 and p = 0.25.

Tolerances come from :mod:`gaussian_theory`: the stationary variance of each variant is
derived in closed form (ULA's ``1/(N(1 − γN/2))`` plus the exactly known participation and
minibatch noise, plus the QSGD noise bounded by ω), and the Monte Carlo error is estimated by
batch means. The mean is z-tested with the chain's exact autocorrelation ``r = 1 − γN``.

The chains come from the vectorised engine's chain 0, which is bit for bit the chain of the
framework-free loop and of the Flower paths for the same config (``tests/test_vectorised.py``,
``tests/test_flower.py``); it runs the 3,000 rounds in milliseconds instead of seconds.
"""

import pytest
from gaussian_theory import check_chain, variance_band

from qlsd_flwr.config import resolve
from qlsd_flwr.engines.vectorised import run_vectorised
from qlsd_flwr.tasks.gaussian import build_gaussian_task

GAMMA = 2e-4  # γN ≈ 0.3: the stochastic-gradient inflation stays moderate, the chain mixes in a few rounds
K, BURN = 3000, 300
TASK = build_gaussian_task(b=20, d=50, data_seed=0)

CASES = [
    # variant, s (None: uncompressed)
    ("qlsd", 2**8),
    ("qlsd-sharp", 2**8),
    ("qlsd-star", 2**8),
    ("qlsd-pp", 2**16),  # the ++ formula is exact as ω → 0 (here ω ≈ 1e-8)
    ("lsd-star", None),
    ("lsd-pp", None),
]


@pytest.mark.parametrize("p", [1.0, 0.25])
@pytest.mark.parametrize("variant, s", CASES)
def test_moments_match_theory(variant, s, p):
    cfg = resolve({"variant": variant, "gamma": GAMMA, "num-rounds": K, "burn-in": 0, "p": str(p),
                   "s": str(s or 2), "l": 50, "seed": 1, "progress": False, "engine": "vectorised"})
    res = run_vectorised(cfg, task=TASK, write=False, keep_trace=True, progress=False)
    band = variance_band(TASK, variant, GAMMA, p, s)
    out = check_chain(res.trace[0, BURN:], TASK, GAMMA, band)
    assert out["mean_ok"], out
    assert out["var_ok"], out
