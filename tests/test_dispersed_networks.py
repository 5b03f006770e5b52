"""``init = dispersed`` on networks (issue 39): with the identity metric each tensor of a layered
network starts at most twice its own initialisation scale from the centre, not twice the prior's
sd, which threw LeNet-5 out of its working range (the run diverged at round 2: docs/EXPERIMENTS.md).
A GLM (the main job's softmax regression), labels without indices and zero starts keep the prior's
scale (the reference chains of ``tests/golden.py`` are unchanged).

The starts are taken from :func:`qlsd_flwr.protocol.precondition.prepare` itself, as every engine
makes them; θ* is put at the network's initialisation (the test is of the dispersal, not the
descent)."""

from __future__ import annotations

import numpy as np
import pytest

from qlsd_flwr.config import resolve
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol import build, precondition
from qlsd_flwr.protocol.starts import dispersed_starts, initialisation_scale
from qlsd_flwr.tasks import loading

PRIOR_VAR = 5.0


def _prepared(model: str, metric: str = "identity"):
    cfg = resolve({"task": "mnist", "model": model, "num-clients": 4, "prior-var": PRIOR_VAR, "init": "dispersed",
                   "num-chains": 2, "engine": "inprocess", "gamma": 1e-5, "progress": False, "metric": metric})
    task = loading.load_task(cfg)
    task.theta_star = task.theta0.copy()  # the centre: no descent needed for this test
    specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, None) for i in range(cfg.b)]
    prep = precondition.prepare(cfg, task, task.theta0, *build.direct_exchanges(cfg, task, specs))
    return task, prep


def _starts(model: str):
    task, prep = _prepared(model)
    return task, prep.theta0


@pytest.mark.parametrize("model", ["mlp", "lenet5"])
def test_dispersed_starts_keep_a_network_in_its_working_range(model):
    """On the offline MNIST subset: the loss per point at each chain's start is within 2× a fresh
    network's (about ln 10), and the starts are apart (R-hat can see chains that have not met); the
    prior-scaled starts of before are more than 100× over it, so the check can fail."""
    task, starts = _starts(model)
    theta0 = task.theta0
    n = sum(c.n_data for c in task.clients)

    def loss(theta):
        return sum(c.value(theta) for c in task.clients) / n

    fresh = loss(theta0)
    assert starts.shape == (2, task.dim)
    for s in starts:
        assert np.isfinite(loss(s)) and loss(s) < 2 * fresh, (loss(s), fresh)
    assert np.linalg.norm(starts[0] - starts[1]) > 0.5 * np.linalg.norm(theta0)
    prior_scaled = dispersed_starts(theta0, np.full(task.dim, np.sqrt(PRIOR_VAR)), 1, seed=0)[0]
    assert loss(prior_scaled) > 100 * fresh


def test_with_a_diagonal_metric_each_layer_is_capped_too():
    """The metric's root scales a network's poorly determined weights by about the prior's sd; each
    tensor's step is then scaled down to its initialisation's RMS. The same draws uncapped are far
    out of the working range, so the check can fail."""
    task, prep = _prepared("mlp", "diagonal")
    starts, theta0 = prep.theta0, task.theta0
    n = sum(c.n_data for c in task.clients)

    def loss(theta):
        return sum(c.value(theta) for c in task.clients) / n

    fresh = loss(theta0)
    for s in starts:
        assert np.isfinite(loss(s)) and loss(s) < 2 * fresh, (loss(s), fresh)
    assert np.linalg.norm(starts[0] - starts[1]) > 0.5 * np.linalg.norm(theta0)
    uncapped = dispersed_starts(task.theta_star, prep.metric, 1, seed=0)[0]
    assert loss(uncapped) > 10 * fresh, (loss(uncapped), fresh)


def test_a_glm_keeps_the_prior_scale():
    """The softmax regression of task mnist (one weight matrix and its bias, θ_0 torch's
    initialisation): the starts are dispersed by the prior's sd, as before."""
    task, starts = _starts("logistic")
    z = (starts - task.theta0) / (2 * np.sqrt(PRIOR_VAR))
    assert abs(np.std(z) - 1) < 0.05  # d = 7,850 standard normals: sd within 0.05 of 1


def test_one_tensor_labels_without_indices_or_a_zero_start_keep_the_prior_scale():
    mlp = [f"a[{i},0]" for i in range(2)] + [f"b[{i}]" for i in range(2)] + [f"c[0,{i}]" for i in range(2)]
    task = Task(name="t", dim=6, clients=[], meta={"param_labels": mlp})
    got = initialisation_scale(task, np.array([3.0, 4.0, 0.0, 0.0, 1.0, 1.0]))
    assert np.allclose(got[:2], np.sqrt(12.5)) and np.all(np.isinf(got[2:4])) and np.allclose(got[4:], 1.0)
    assert np.all(np.isinf(initialisation_scale(task, np.zeros(6))))  # a zero start: the prior decides
    for labels in ([f"theta[{i}]" for i in range(6)], ["mu", "tau", "a", "b", "c", "e"],
                   [f"W[{i},0]" for i in range(4)] + ["b[0]", "b[1]"]):  # one tensor, no indices, a GLM
        one = Task(name="t", dim=6, clients=[], meta={"param_labels": labels})
        assert np.all(np.isinf(initialisation_scale(one, np.ones(6)))), labels
