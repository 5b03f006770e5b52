"""A sampler added from this file alone (issue 36): declared, registered, and run through the local engine,
the vectorised engine (both backends) and in-process Flower, with no other file touched.

The toy is federated ULA: every active client sends its full gradient ``∇U_i(θ)`` uncompressed, the server
takes the Langevin step. Its client update is written here (:func:`ula_message`, its own formula: the
engines cannot know it), its server update is the paper's step (:func:`qlsd_flwr.core.server_step.langevin_step`).
Its message is QLSD's ``H_i`` for the ``full`` estimator, evaluated by the same expression, so its chain must
equal QLSD's with ``compressor = identity`` bit for bit on every engine that runs it (the numba kernel
compiles the QLSD family's formulas only, and refuses it by name), and with ``p = 1`` its law on the toy
Gaussian is ULA's, whose variance the task gives in closed form.
"""

from __future__ import annotations

import numpy as np
import pytest

from qlsd_flwr import samplers
from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.core.server_step import langevin_step
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.engines.vectorised import run_vectorised
from qlsd_flwr.run.simulate import run_inprocess
from qlsd_flwr.samplers.base import Estimator, Sampler, Settings

BASE = {"task": "gaussian", "num-clients": 4, "dim": 5, "prior-var": 5.0, "num-rounds": 30, "burn-in": 0,
        "progress": False, "gamma": 4.9e-4, "loo": "off", "plot": False, "seed": 3, "p": "0.9,0.6,0.8,0.5"}


def no_tempering(sampler: Sampler, s: Settings) -> None:
    if float(s.raw["temperature"]) != 1.0:
        raise ConfigError(f"temperature: {sampler.name} samples T = 1; allowed: 1.0")


def ula_message(spec, pot, state, seed, round_, theta, local=None):
    """Client ``i``'s ``∇U_i(θ) + w_i ∇U_0(θ)``: its whole data and its share of the prior."""
    return pot.grad_sum(theta) + spec.prior_weight * spec.prior.grad(theta)


ULA = Estimator("ula-gradient", message=ula_message, step=langevin_step)
TOY = Sampler("toy-ula", "federated ULA (a test's)", ULA, compressed=False, memory=False,
              reference="tests/test_toy_sampler.py", not_applicable=frozenset({"local-steps", "tau", "rho", "q"}),
              checks=(no_tempering,))


@pytest.fixture
def toy():
    samplers.register(TOY)
    try:
        yield TOY
    finally:
        samplers.unregister(TOY.name)


def _twin(o: dict) -> dict:
    return {**o, "variant": "qlsd", "compressor": "identity"}


def test_the_toy_sampler_runs_on_every_engine_as_its_pieces_do(toy, tmp_path):
    o = {**BASE, "variant": toy.name, "output-dir": str(tmp_path)}
    cfg = resolve(o)
    assert cfg.sampler is toy and not cfg.compressed and cfg.kind is ULA
    local = run_local(cfg, write=False, keep_trace=True, progress=False).trace
    np.testing.assert_array_equal(local, run_local(resolve(_twin(o)), write=False, keep_trace=True,
                                                   progress=False).trace)
    v = run_vectorised(resolve({**o, "num-chains": 2, "engine": "vectorised"}), write=False, keep_trace=True,
                       progress=False)  # auto: numpy, the toy's own message chain by chain
    np.testing.assert_array_equal(v.trace[0], local)  # chain 0: seed + 0
    for backend in ("numpy", "numba"):  # QLSD's twin, on both backends, is the same chain
        np.testing.assert_array_equal(v.trace, run_vectorised(resolve({**_twin(o), "num-chains": 2}), write=False,
                                                              keep_trace=True, progress=False, backend=backend).trace)
    with pytest.raises(ValueError, match="numba runs the QLSD family only; toy-ula runs on: auto, numpy"):
        run_vectorised(resolve({**o, "num-chains": 2}), write=False, progress=False, backend="numba")
    o2 = {**o, "num-chains": 2, "engine": "inprocess"}
    strat = run_inprocess(resolve(o2), o2, shuffle_seed=9, strategy_kwargs={"keep_trace": True})
    np.testing.assert_array_equal(np.asarray(strat.trace)[:, 0], local)
    assert strat.summary_data["variant"] == toy.name and strat.summary_data["totals"]["n_rejected"] == 0


def test_the_toy_sampler_has_ulas_law_and_its_own_refusal(toy):
    """With every client in every round the toy is ULA on the Gaussian posterior: each coordinate's mean
    is the posterior's and its variance ULA's (the task's ``ula_var_exact``), within 4 batch-means
    standard errors of 8 chains × 2,000 kept rounds (here within 2.6); the posterior's own variance is more
    than 10 standard errors off."""
    o = {**BASE, "variant": toy.name, "p": "1", "num-rounds": 2200, "burn-in": 200, "num-chains": 8,
         "gamma": 2e-3, "engine": "vectorised"}
    res = run_vectorised(resolve(o), write=False, keep_trace=True, progress=False)
    s = res.summary
    # every chain starts at θ_0, 26 posterior sd off; a round contracts by 1 − γλ ≈ 1/3 (γλ = 2/3: ULA's
    # variance is 1/(1 − γλ/2) = 1.5 times the posterior's), so 200 rounds forget the start
    draws = res.trace[:, 200:].reshape(-1, 5)
    mean, var, post = (np.asarray(s[k]) for k in ("posterior_mean_exact", "ula_var_exact", "posterior_var_exact"))
    batches = [b for c in res.trace[:, 200:] for b in np.array_split(c, 20)]  # 20 batches a chain
    se = np.std([b.mean(axis=0) for b in batches], axis=0, ddof=1) / np.sqrt(len(batches))
    assert np.all(np.abs(draws.mean(axis=0) - mean) <= 4 * se), (draws.mean(axis=0) - mean) / se
    e2 = [((b - mean) ** 2).mean(axis=0) for b in batches]
    se_v = np.std(e2, axis=0, ddof=1) / np.sqrt(len(e2))
    got = np.mean(e2, axis=0)
    assert np.all(np.abs(got - var) <= 4 * se_v), (got - var) / se_v
    assert np.all((got - post) / se_v > 10)  # the check tells ULA's law from the posterior (24 to 28 SE here)
    with pytest.raises(ConfigError, match="temperature: toy-ula"):
        resolve({**o, "temperature": 0.5})
    assert resolve({**o, "variant": "toy-ula"}).sampler is toy
