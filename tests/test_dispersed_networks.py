"""``init = dispersed`` on networks (issue 39): with the identity metric each chain starts at most
twice its layer's own initialisation scale from the centre, not twice the prior's sd, which threw
LeNet-5 out of its working range (a loss of 6e7 nats per point where a fresh network has 2.3; the
run diverged at round 2). GLMs and zero starts keep the prior's scale (the reference chains of
``tests/golden.py`` are unchanged)."""

from __future__ import annotations

import numpy as np
import pytest

from qlsd_flwr.config import resolve
from qlsd_flwr.core.potential import Task
from qlsd_flwr.protocol.precondition import dispersed_starts, initialisation_scale
from qlsd_flwr.tasks import loading

PRIOR_VAR = 5.0


@pytest.mark.parametrize("model", ["mlp", "lenet5"])
def test_dispersed_starts_keep_a_network_in_its_working_range(model):
    """On the offline MNIST subset: the loss per point at each dispersed start is within 2× a fresh
    network's (about ln 10), and the starts are apart (R-hat can see chains that have not met); the
    prior-scaled starts of before are more than 100× over it, so the check can fail."""
    task = loading.load_task(resolve({"task": "mnist", "model": model, "num-clients": 4, "prior-var": PRIOR_VAR}))
    theta0 = task.theta0
    n = sum(c.n_data for c in task.clients)

    def loss(theta):
        return sum(c.value(theta) for c in task.clients) / n

    prior_sd = np.full(task.dim, np.sqrt(PRIOR_VAR))
    scale = np.minimum(prior_sd, initialisation_scale(task, theta0))
    assert np.all(scale < 0.2)  # every tensor of these networks has its own scale, well under √5
    starts = dispersed_starts(theta0, scale, 2, seed=0)
    fresh = loss(theta0)
    for s in starts:
        assert np.isfinite(loss(s)) and loss(s) < 2 * fresh, (loss(s), fresh)
    assert np.linalg.norm(starts[0] - starts[1]) > 0.5 * np.linalg.norm(theta0)
    assert loss(dispersed_starts(theta0, prior_sd, 1, seed=0)[0]) > 100 * fresh


def test_one_tensor_or_a_zero_start_keeps_the_prior_scale():
    labels = [f"W[{i}]" for i in range(3)] + [f"b[{i}]" for i in range(2)]
    task = Task(name="t", dim=5, clients=[], meta={"param_labels": labels})
    assert np.all(np.isinf(initialisation_scale(task, np.zeros(5))))  # a zero start: the prior decides
    got = initialisation_scale(task, np.array([3.0, 4.0, 0.0, 0.0, 0.0]))
    assert np.allclose(got[:3], np.sqrt(25 / 3)) and np.all(np.isinf(got[3:]))  # b is zero: the prior's
    one = Task(name="t", dim=3, clients=[], meta={"param_labels": [f"theta[{i}]" for i in range(3)]})
    assert np.all(np.isinf(initialisation_scale(one, np.ones(3))))
