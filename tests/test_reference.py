"""The reference samplers against closed forms.

Tolerances come from Monte Carlo error: a mean estimate has standard error ``sd/√ESS`` and a
second-moment estimate ``E[(θ_a−μ_a)(θ_b−μ_b)]`` has variance ``(Σ_aa Σ_bb + Σ_ab²)/ESS``
for a Gaussian (``2Σ_aa²/ESS`` on the diagonal), with ESS estimated by arviz on the relevant
statistic. We require ``|z| < 4`` for each of 9 statistics (two-sided false alarm
≈ 9 · 6e−5 per run with a fresh seed; the seeds here are fixed).
"""

import math

import numpy as np
import pytest

from qlsd_flwr.core.potential import GaussianPrior, Task
from qlsd_flwr.evaluation import reference as R
from qlsd_flwr.evaluation.reference import diagnostics_of


class Quadratic:
    """One client with ``U(θ) = ½ (θ−μ)ᵀ P (θ−μ)``: the posterior is ``N(μ, P⁻¹)``."""

    def __init__(self, mu, P):
        self.mu, self.P = np.asarray(mu, float), np.asarray(P, float)
        self.n_data, self.dim = 1, len(self.mu)

    def grad_sum(self, theta, idx=None):
        return self.P @ (theta - self.mu)

    def value(self, theta):
        r = theta - self.mu
        return 0.5 * r @ self.P @ r


MU = np.array([1.0, -2.0, 0.5])
_A = np.array([[1.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.2, -0.3, 0.5]])
SIGMA = _A @ _A.T  # correlations .6, .2/.., condition number ≈ 12
N_CHAINS, N_DRAWS, N_WARMUP = 4, 2000, 1000


def gaussian_task(mu=MU, sigma=SIGMA):
    return Task(name="quad3", dim=len(mu), clients=[Quadratic(mu, np.linalg.inv(sigma))],
                prior=GaussianPrior(), theta0=np.zeros(len(mu)))


def _ess(stat):  # stat: (chain, draw)
    return float(diagnostics_of(stat[:, :, None])["ess_mean"][0])


def assert_gaussian_moments(samples, mu, sigma, zmax=4.0, min_ess=100):
    """z-tests of every mean and every (co)variance against the closed form.

    Each statistic must also have ESS ≥ ``min_ess``: below that the normal approximation of
    ``z`` is poor and a broken (stuck, badly mixing) chain would pass only by having huge
    error bars.
    """
    d = len(mu)
    for a in range(d):
        x = samples[:, :, a]
        ess = _ess(x)
        assert ess >= min_ess, f"mean[{a}]: ESS {ess:.0f} < {min_ess}"
        z = (x.mean() - mu[a]) / math.sqrt(sigma[a, a] / ess)
        assert abs(z) < zmax, f"mean[{a}]: {x.mean():.4f} vs {mu[a]}, z = {z:.2f}"
    for a in range(d):
        for b in range(a, d):
            prod = (samples[:, :, a] - mu[a]) * (samples[:, :, b] - mu[b])
            sd = math.sqrt(sigma[a, a] * sigma[b, b] + sigma[a, b] ** 2)
            ess = _ess(prod)
            assert ess >= min_ess, f"cov[{a},{b}]: ESS {ess:.0f} < {min_ess}"
            z = (prod.mean() - sigma[a, b]) / (sd / math.sqrt(ess))
            assert abs(z) < zmax, f"cov[{a},{b}]: {prod.mean():.4f} vs {sigma[a, b]:.4f}, z={z:.2f}"


@pytest.fixture(scope="module")
def mala_run():
    return R.mala(gaussian_task(), n_draws=N_DRAWS, n_warmup=N_WARMUP, n_chains=N_CHAINS,
                  seed=0, init_scale=2.0, cache=False)


def test_mala_recovers_gaussian(mala_run):
    res = mala_run
    assert res.samples.shape == (N_CHAINS, N_DRAWS, 3)
    assert np.all(res.rhat < 1.01 + 0.05)  # 4 well-mixed chains
    assert np.all(res.ess > 300)  # not degenerate: ESS/n ≈ .06–.2 expected here
    assert_gaussian_moments(res.samples, MU, SIGMA)
    # the stored potentials are U at the stored states
    u = np.array([gaussian_task().potential(t) for t in res.samples[0, :5]])
    np.testing.assert_allclose(res.potentials[0, :5], u, rtol=1e-12)


def test_mala_acceptance_after_tuning(mala_run):
    # Post-warm-up acceptance rate pooled over 4·2000 draws: its MC sd is ≈ √(.25/8000) ≈ .006
    # (inflated a little by autocorrelation); the frozen dual-averaging step adds an error of
    # a few % in acceptance. Band: ±.05 around .574.
    acc = float(np.mean(res := mala_run.acceptance))
    assert abs(acc - 0.574) < 0.05, res
    assert np.all(np.abs(mala_run.warmup_acceptance - 0.574) < 0.1)


def test_mala_exact_with_large_fixed_step():
    # Without adaptation and a step 2.5x the tuned one (acceptance ≈ .2), MALA is still exact;
    # an incorrect acceptance ratio (e.g. reusing ∇U(θ) in q(θ|θ')) biases the variances.
    res = R.mala(gaussian_task(), n_draws=3000, n_warmup=300, n_chains=4, seed=1,
                 step_size=0.7, adapt=False, cache=False)
    assert 0.05 < res.acceptance.mean() < 0.5
    assert_gaussian_moments(res.samples, MU, SIGMA)


def test_mala_log_accept_is_antisymmetric():
    # Detailed balance needs log r(θ→θ') = −log r(θ'→θ), which holds only when the reverse
    # proposal density uses ∇U(θ').
    task = gaussian_task()
    rng = np.random.default_rng(3)
    for _ in range(5):
        x, y, h = rng.standard_normal(3), rng.standard_normal(3), 0.3
        Ux, gx = task.potential(x), task.grad_potential(x)
        Uy, gy = task.potential(y), task.grad_potential(y)
        fwd = R.mala_log_accept(x, Ux, gx, y, Uy, gy, h)
        bwd = R.mala_log_accept(y, Uy, gy, x, Ux, gx, h)
        assert fwd == pytest.approx(-bwd, abs=1e-10)
        # the authors' bug: ∇U(θ) in both densities -> not antisymmetric
        buggy = lambda a, Ua, ga, b, Ub: (Ua - Ub) + (
            (b - a + h * ga) @ (b - a + h * ga) - (a - b + h * ga) @ (a - b + h * ga)) / (4 * h)
        assert abs(buggy(x, Ux, gx, y, Uy) + buggy(y, Uy, gy, x, Ux)) > 1e-3


def test_hmc_recovers_gaussian():
    res = R.hmc(gaussian_task(), n_draws=1500, n_warmup=200, n_chains=4, seed=0,
                n_leapfrog=8, cache=False)
    assert np.all(res.acceptance > 0.5)
    assert_gaussian_moments(res.samples, MU, SIGMA)


def test_ula_stationary_variance():
    # 1-d U = θ²/2 (σ² = 1): θ' = (1−h)θ + √(2h)Z has stationary variance
    # 2h / (1 − (1−h)²) = 1/(1 − h/2): for h = .5, 4/3 (not 1: ULA is biased).
    task = gaussian_task(np.zeros(1), np.eye(1))
    res = R.ula(task, step_size=0.5, n_draws=4000, n_warmup=100, n_chains=2, seed=0,
                cache=False)
    v = 1.0 / (1.0 - 0.25)
    assert_gaussian_moments(res.samples, np.zeros(1), np.array([[v]]))


def test_cache_round_trip(tmp_path, monkeypatch):
    task = gaussian_task()
    kw = dict(n_draws=50, n_warmup=50, n_chains=2, seed=0)
    a = R.mala(task, cache_dir=tmp_path, **kw)
    assert not a.from_cache and a.path and a.path.startswith(str(tmp_path))
    b = R.mala(task, cache_dir=tmp_path, **kw)
    assert b.from_cache and b.key == a.key
    np.testing.assert_array_equal(a.samples, b.samples)
    np.testing.assert_array_equal(a.potentials, b.potentials)
    np.testing.assert_array_equal(a.acceptance, b.acceptance)
    np.testing.assert_allclose(a.rhat, b.rhat)
    # a different setting, or different data, is a different entry
    c = R.mala(task, cache_dir=tmp_path, **{**kw, "seed": 1})
    assert not c.from_cache and c.key != a.key
    d = R.mala(gaussian_task(mu=MU + 1e-9), cache_dir=tmp_path, **kw)
    assert not d.from_cache and d.key != a.key
    # the same run without cache gives the same numbers (the cache stores, never alters)
    e = R.mala(task, cache=False, **kw)
    np.testing.assert_array_equal(e.samples, a.samples)
    # QLSD_CACHE is the default location
    monkeypatch.setenv("QLSD_CACHE", str(tmp_path / "env"))
    f = R.mala(task, **kw)
    assert f.path.startswith(str(tmp_path / "env")) and not f.from_cache
    assert R.mala(task, **kw).from_cache


def test_overflowing_proposals_are_rejected():
    # A step so large that U(θ') overflows (inf − inf = nan in the ratio) must be a rejection,
    # never an acceptance; the chains then stay at their start.
    assert R._log_accept_prob(float("nan")) == -math.inf
    assert R._log_accept_prob(5.0) == 0.0 and R._log_accept_prob(-2.0) == -2.0
    with np.errstate(all="ignore"):
        res = R.mala(gaussian_task(), n_draws=20, n_warmup=0, n_chains=2, seed=0,
                     step_size=1e300, adapt=False, cache=False)
    assert np.all(res.acceptance == 0) and np.all(np.isfinite(res.samples))
    np.testing.assert_array_equal(res.samples[:, 0], res.samples[:, -1])
