"""Ground-truth samplers for a :class:`~qlsd_flwr.core.potential.Task`: MALA, HMC and ULA.

All three use the *full* gradient ``∇U = ∇U_0 + Σ_i ∇U_i`` (``task.grad_potential``) and
``U`` (``task.potential``), run several independent chains, and return a
:class:`ReferenceResult` with samples of shape ``(chain, draw, dim)``, the potential at every
kept draw (for HPD thresholds), acceptance rates and R-hat/ESS.

* :func:`mala` — Metropolis-adjusted Langevin (Roberts & Tweedie 1996). Proposal
  ``θ' = θ − h∇U(θ) + √(2h) Z``. The acceptance ratio uses the forward density
  ``q(θ'|θ) ∝ exp(−‖θ' − θ + h∇U(θ)‖²/4h)`` *and* the backward density
  ``q(θ|θ') ∝ exp(−‖θ − θ' + h∇U(θ')‖²/4h)`` with the gradient at the proposal; the
  authors' reference reused ``∇U(θ)`` in both, which breaks detailed balance (see
  :func:`mala_log_accept`). The step is tuned per chain during warm-up by dual averaging
  (Hoffman & Gelman 2014) towards acceptance 0.574 (Roberts & Rosenthal 1998), then frozen.
* :func:`hmc` — full-batch HMC with a fixed number of leapfrog steps (identity mass), step
  tuned the same way towards 0.8; the reference for small neural nets.
* :func:`ula` — the unadjusted Langevin algorithm, no accept/reject (biased by ``O(h)``).

Results are cached on disk as ``.npz`` under ``cache_dir`` (default ``$QLSD_CACHE`` or
``~/.cache/qlsd_flwr``), in ``reference/``, keyed by a SHA-256 of the task's data (every
client's arrays), the prior, the initial point(s) and all settings. Pass ``cache=False`` to
skip it. A task whose clients cannot be fingerprinted (e.g. they hold callables) is run
uncached with a warning; such a client can define ``cache_fingerprint()`` returning
bytes/str.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import numpy as np

from qlsd_flwr.evaluation.reference_cache import ReferenceResult, _cached_run


# ----------------------------------------------------------------------------- helpers
def _value_and_grad(task) -> Callable[[np.ndarray], tuple[float, np.ndarray]]:
    if hasattr(task, "value_and_grad"):
        return task.value_and_grad
    return lambda th: (float(task.potential(th)), np.asarray(task.grad_potential(th), np.float64))


def _inits(task, n_chains: int, init, init_scale: float, seed: int) -> np.ndarray:
    if init is not None:
        x = np.asarray(init, dtype=np.float64)
        if x.ndim == 1:
            x = np.broadcast_to(x, (n_chains, x.size))
        if x.shape != (n_chains, task.dim):
            raise ValueError(f"init must be ({task.dim},) or ({n_chains}, {task.dim}), got {x.shape}")
        return x.copy()
    base = task.theta0 if getattr(task, "theta0", None) is not None else np.zeros(task.dim)
    out = np.empty((n_chains, task.dim))
    for c in range(n_chains):
        r = np.random.default_rng(np.random.SeedSequence([int(seed), c, 1]))
        out[c] = np.asarray(base, dtype=np.float64) + init_scale * r.standard_normal(task.dim)
    return out


class DualAveraging:
    """Hoffman & Gelman (2014, §3.2.1) step-size adaptation on ``log h``."""

    def __init__(self, h0: float, target: float, gamma: float = 0.05, t0: float = 10.0,
                 kappa: float = 0.75):
        self.mu = math.log(10.0 * h0)
        self.target, self.gamma, self.t0, self.kappa = target, gamma, t0, kappa
        self.t, self.hbar, self.log_h, self.log_h_avg = 0, 0.0, math.log(h0), 0.0

    def update(self, accept_prob: float) -> float:
        self.t += 1
        t = self.t
        a = 0.0 if not np.isfinite(accept_prob) else min(1.0, accept_prob)
        self.hbar = (1 - 1 / (t + self.t0)) * self.hbar + (self.target - a) / (t + self.t0)
        self.log_h = self.mu - math.sqrt(t) / self.gamma * self.hbar
        w = t ** (-self.kappa)
        self.log_h_avg = w * self.log_h + (1 - w) * self.log_h_avg
        return math.exp(self.log_h)

    @property
    def final(self) -> float:
        return math.exp(self.log_h_avg) if self.t else math.exp(self.log_h)


def mala_log_accept(theta, U, grad, prop, U_prop, grad_prop, h: float) -> float:
    """``log[π(θ') q(θ|θ') / (π(θ) q(θ'|θ))]`` for the MALA proposal with step ``h``.

    ``q(θ'|θ) = N(θ'; θ − h∇U(θ), 2h I)`` and ``q(θ|θ') = N(θ; θ' − h∇U(θ'), 2h I)``: the
    reverse move uses the gradient *at the proposal*. It is antisymmetric in the two states,
    as detailed balance requires.
    """
    fwd = prop - theta + h * grad  # θ' − (θ − h∇U(θ))
    bwd = theta - prop + h * grad_prop  # θ − (θ' − h∇U(θ'))
    return float((U - U_prop) + (fwd @ fwd - bwd @ bwd) / (4.0 * h))


def _log_accept_prob(log_r: float) -> float:
    """``log min(1, r)``; a NaN ratio (overflowed proposal) is a rejection."""
    return -math.inf if math.isnan(log_r) else min(0.0, log_r)


def _initial_step(vg, x, target: float, rng, propose_log_r, h0: float = 0.1) -> float:
    """Double/halve ``h`` until one-step acceptance crosses ``target`` (Hoffman & Gelman Alg. 4)."""
    U, g = vg(x)
    h = h0
    def acc(h):
        with np.errstate(all="ignore"):
            return math.exp(_log_accept_prob(propose_log_r(x, U, g, h, rng)))
    up = acc(h) > target
    for _ in range(60):
        h2 = h * 2.0 if up else h / 2.0
        if (acc(h2) > target) != up:
            return h2 if not up else h
        h = h2
    return h


def _diagnostics(samples: np.ndarray, potentials: np.ndarray, max_dim: int) -> dict:
    out: dict[str, Any] = {}
    n_chain, n_draw = potentials.shape
    if n_draw < 4:
        return out
    pot = diagnostics_of(potentials[:, :, None])
    out.update({f"{k}_potential": v for k, v in pot.items()})
    if samples.shape[-1] <= max_dim:
        out.update(diagnostics_of(samples))
    return out


def diagnostics_of(x: np.ndarray) -> dict:
    """``x`` ``(chain, draw, k)``: ArviZ's R-hat, bulk, tail and mean ESS per coordinate, by the
    package's one implementation (:func:`qlsd_flwr.outputs.diagnostics.rhat_ess`)."""
    from qlsd_flwr.outputs.diagnostics import ess_mean, rhat_ess

    r, bulk, tail = rhat_ess(x)
    return {"rhat": r, "ess_bulk": bulk, "ess_tail": tail, "ess_mean": ess_mean(x)}


def _settings(**kw) -> dict:
    return {k: (v.tolist() if isinstance(v, np.ndarray) and v.size <= 64 else v)
            for k, v in kw.items()}


def _metropolis_loop(x, U, g, h, rng, step, da, n_warmup, n_draws, thin, samples_c, pots_c):
    """One chain of a Metropolis-adjusted sampler: ``n_warmup`` iterations (dual averaging of
    the step ``h`` when ``da`` is given, then frozen at its average), then ``n_draws·thin``
    iterations, every ``thin``-th state written to ``samples_c``/``pots_c``. ``step(x, U, g, h,
    rng) -> (y, U_y, g_y, log_r)`` proposes. Returns ``(h, acceptance, warm-up acceptance)``."""
    n_acc_w = n_acc = 0
    for t in range(n_warmup + n_draws * thin):
        if t == n_warmup and da is not None:
            h = da.final
        y, Uy, gy, log_r = step(x, U, g, h, rng)
        log_a = _log_accept_prob(log_r)
        accept = math.log(rng.uniform()) < log_a
        if accept:
            x, U, g = y, Uy, gy
        if t < n_warmup:
            n_acc_w += accept
            if da is not None:
                h = da.update(math.exp(log_a))
        else:
            n_acc += accept
            k = t - n_warmup
            if (k + 1) % thin == 0:
                samples_c[k // thin] = x
                pots_c[k // thin] = U
    return h, n_acc / max(1, n_draws * thin), n_acc_w / max(1, n_warmup)


def _run_chains(method: str, stream: int, task, kernel, settings: dict, n_draws: int, n_warmup: int,
                n_chains: int, seed: int, step_size, adapt: bool, target_accept: float, thin: int, init,
                init_scale: float, store_dtype, max_diag_dim: int) -> ReferenceResult:
    """``n_chains`` independent Metropolis chains of ``kernel(vg, d) -> (step, prop_log_r)``:
    chain ``c`` draws from ``SeedSequence([seed, c, stream])``, starts its step from
    ``step_size`` or a doubling/halving search, and tunes it by dual averaging when ``adapt``."""
    from qlsd_flwr.tasks.threads import apply_threads

    # torch's threads set as a local engine's are (one less than the cores): left at one per core,
    # they spin-wait on each other under any other load (the quickstart network's full gradient
    # took 131 ms with 2 threads beside two busy processes, 15 ms with 1); numpy's BLAS on one thread, as
    # every engine's (tasks/threads: the reference is then a function of its seed on any core count)
    apply_threads({"engine": "local"}, client=False)
    vg = _value_and_grad(task)
    x0s = _inits(task, n_chains, init, init_scale, seed)
    d = task.dim
    step, prop_log_r = kernel(vg, d)
    samples = np.empty((n_chains, n_draws, d), dtype=store_dtype)
    pots = np.empty((n_chains, n_draws))
    acc_rate, warm_acc, steps = np.empty(n_chains), np.empty(n_chains), np.empty(n_chains)
    for c in range(n_chains):
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), c, stream]))
        x = x0s[c].copy()
        h = step_size if step_size is not None else _initial_step(vg, x, 0.5, rng, prop_log_r)
        U, g = vg(x)
        da = DualAveraging(h, target_accept) if adapt else None
        steps[c], acc_rate[c], warm_acc[c] = _metropolis_loop(
            x, U, g, h, rng, step, da, n_warmup, n_draws, thin, samples[c], pots[c])
    return ReferenceResult(method, samples, pots, acc_rate, steps, _diagnostics(samples, pots, max_diag_dim),
                           settings, warmup_acceptance=warm_acc)


# ----------------------------------------------------------------------------- MALA
def mala(task, n_draws: int = 2000, n_warmup: int = 1000, n_chains: int = 4, seed: int = 0,
         step_size: float | None = None, adapt: bool = True, target_accept: float = 0.574,
         thin: int = 1, init: np.ndarray | None = None, init_scale: float = 0.1,
         cache: bool = True, cache_dir: str | os.PathLike | None = None,
         store_dtype=np.float64, max_diag_dim: int = 5000) -> ReferenceResult:
    """Metropolis-adjusted Langevin on ``π ∝ exp(−U)``, ``n_chains`` independent chains.

    Warm-up: ``n_warmup`` iterations (discarded) during which, if ``adapt``, each chain's step
    is tuned by dual averaging towards ``target_accept``; the averaged step is then frozen.
    ``step_size`` is the starting (or, with ``adapt=False``, the fixed) step; ``None`` picks
    one by doubling/halving. Then ``n_draws·thin`` iterations, every ``thin``-th kept.
    Chains start at ``init`` (``(dim,)`` or ``(chain, dim)``) or at ``task.theta0`` plus
    ``N(0, init_scale² I)`` jitter. ``acceptance`` is the post-warm-up acceptance rate.
    """
    settings = _settings(n_draws=n_draws, n_warmup=n_warmup, n_chains=n_chains, seed=seed,
                         step_size=step_size, adapt=adapt, target_accept=target_accept,
                         thin=thin, init=init, init_scale=init_scale,
                         store_dtype=np.dtype(store_dtype).str)

    def kernel(vg, d):
        def prop_log_r(x, U, g, h, rng):
            y = x - h * g + math.sqrt(2 * h) * rng.standard_normal(d)
            Uy, gy = vg(y)
            return mala_log_accept(x, U, g, y, Uy, gy, h)

        def mala_step(x, U, g, h, rng):
            y = x - h * g + math.sqrt(2.0 * h) * rng.standard_normal(d)
            with np.errstate(all="ignore"):
                Uy, gy = vg(y)
                log_r = mala_log_accept(x, U, g, y, Uy, gy, h) \
                    if np.isfinite(Uy) and np.all(np.isfinite(gy)) else -np.inf
            return y, Uy, gy, log_r

        return mala_step, prop_log_r

    def run() -> ReferenceResult:
        return _run_chains("mala", 2, task, kernel, settings, n_draws, n_warmup, n_chains, seed,
                           step_size, adapt, target_accept, thin, init, init_scale, store_dtype,
                           max_diag_dim)

    return _cached_run(task, "mala", settings, cache, cache_dir, run)


# ----------------------------------------------------------------------------- HMC
def hmc(task, n_draws: int = 500, n_warmup: int = 200, n_chains: int = 2, seed: int = 0,
        step_size: float | None = None, n_leapfrog: int = 20, adapt: bool = True,
        target_accept: float = 0.8, jitter: float = 0.1, thin: int = 1,
        init: np.ndarray | None = None, init_scale: float = 0.1, cache: bool = True,
        cache_dir: str | os.PathLike | None = None, store_dtype=np.float64,
        max_diag_dim: int = 5000) -> ReferenceResult:
    """Full-batch HMC (identity mass), ``n_leapfrog`` leapfrog steps per iteration.

    The step is tuned during warm-up by dual averaging towards ``target_accept`` and then
    frozen; each iteration uses ``h·U[1 − jitter, 1 + jitter]`` to avoid periodic orbits.
    For neural nets use ``store_dtype=np.float32`` and ``thin`` to bound memory; the
    accept/reject step needs accurate energies, so prefer a float64 ``TorchPotential``
    (``dtype=torch.float64``) for small nets.
    """
    settings = _settings(n_draws=n_draws, n_warmup=n_warmup, n_chains=n_chains, seed=seed,
                         step_size=step_size, n_leapfrog=n_leapfrog, adapt=adapt,
                         target_accept=target_accept, jitter=jitter, thin=thin, init=init,
                         init_scale=init_scale, store_dtype=np.dtype(store_dtype).str)

    def kernel(vg, d):
        def trajectory(x, U, g, h, rng, L):
            p0 = rng.standard_normal(d)
            p = p0 - 0.5 * h * g
            y = x.copy()
            with np.errstate(all="ignore"):
                for i in range(L):
                    y = y + h * p
                    Uy, gy = vg(y)
                    if not (np.isfinite(Uy) and np.all(np.isfinite(gy))):
                        return y, Uy, gy, -np.inf
                    if i < L - 1:
                        p = p - h * gy
                p = p - 0.5 * h * gy
                log_r = (U + 0.5 * p0 @ p0) - (Uy + 0.5 * p @ p)
            return y, Uy, gy, float(log_r) if np.isfinite(log_r) else -np.inf

        def hmc_step(x, U, g, h, rng):
            hj = h * (1.0 + jitter * (2.0 * rng.uniform() - 1.0)) if jitter else h
            return trajectory(x, U, g, hj, rng, n_leapfrog)

        return hmc_step, lambda x_, U_, g_, h_, r_: trajectory(x_, U_, g_, h_, r_, 1)[3]

    def run() -> ReferenceResult:
        return _run_chains("hmc", 3, task, kernel, settings, n_draws, n_warmup, n_chains, seed,
                           step_size, adapt, target_accept, thin, init, init_scale, store_dtype,
                           max_diag_dim)

    return _cached_run(task, "hmc", settings, cache, cache_dir, run)


# ----------------------------------------------------------------------------- ULA
def ula(task, step_size: float, n_draws: int = 2000, n_warmup: int = 1000, n_chains: int = 4,
        seed: int = 0, thin: int = 1, init: np.ndarray | None = None, init_scale: float = 0.1,
        cache: bool = True, cache_dir: str | os.PathLike | None = None,
        store_dtype=np.float64, max_diag_dim: int = 5000) -> ReferenceResult:
    """Full-gradient ULA ``θ ← θ − h∇U(θ) + √(2h) Z`` (no correction: ``O(h)`` bias).

    ``U`` is evaluated only at kept draws.
    """
    settings = _settings(step_size=step_size, n_draws=n_draws, n_warmup=n_warmup,
                         n_chains=n_chains, seed=seed, thin=thin, init=init,
                         init_scale=init_scale, store_dtype=np.dtype(store_dtype).str)

    def run() -> ReferenceResult:
        x0s = _inits(task, n_chains, init, init_scale, seed)
        d = task.dim
        h = float(step_size)
        samples = np.empty((n_chains, n_draws, d), dtype=store_dtype)
        pots = np.empty((n_chains, n_draws))
        for c in range(n_chains):
            rng = np.random.default_rng(np.random.SeedSequence([int(seed), c, 4]))
            x = x0s[c].copy()
            for t in range(n_warmup + n_draws * thin):
                x = x - h * np.asarray(task.grad_potential(x)) + math.sqrt(2 * h) * rng.standard_normal(d)
                k = t - n_warmup
                if k >= 0 and (k + 1) % thin == 0:
                    samples[c, k // thin] = x
                    pots[c, k // thin] = task.potential(x)
        return ReferenceResult("ula", samples, pots, np.full(n_chains, np.nan),
                               np.full(n_chains, h), _diagnostics(samples, pots, max_diag_dim),
                               settings)

    return _cached_run(task, "ula", settings, cache, cache_dir, run)
