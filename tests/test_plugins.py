"""Users' own dataset and torch model, named as ``module:attr`` (examples/wine_mlp.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from qlsd_flwr.config import ConfigError, resolve
from qlsd_flwr.engines.local import run_local

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
CFG = {"task": "mnist", "dataset": "wine_mlp:load", "model": "wine_mlp:make", "num-clients": 3,
       "partition": "iid", "variant": "qlsd-pp", "s": "16", "l": 10, "gamma": 1e-3,
       "num-rounds": 200, "burn-in": 100, "progress": False}


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)


def test_plugin_dataset_and_model_sample_and_predict():
    """The plug-ins are used (dimension = the MLP's 13·16+16+16·3+3 = 275 parameters; the
    dataset's name is recorded), the chain is reproducible, and the posterior predictive
    classifies wine's test set (36 points, 3 classes, 40 % majority) far above chance."""
    from qlsd_flwr.tasks import registry

    cfg = resolve(CFG)
    res = run_local(cfg, write=False, keep_trace=True, progress=False, wire=False)
    assert res.trace.shape == (200, 275) and np.all(np.isfinite(res.trace))
    again = run_local(resolve({**CFG, "num-rounds": 20, "burn-in": 0}), write=False,
                      keep_trace=True, progress=False, wire=False)
    np.testing.assert_array_equal(res.trace[:20], again.trace)
    assert registry.build(cfg).meta["summary_extra"]["dataset"]["name"] == "wine"
    X_te, y_te, _, _ = registry.test_set(cfg)
    probs = registry.predictor_of(cfg).predict_proba(res.trace[100::10], X_te)
    assert probs.shape == (len(y_te), 3)
    assert np.mean(probs.argmax(1) == y_te) > 0.8
    # the predictive is exactly the user's module at the samples: mean of softmax(make(θ)(x))
    import torch
    import wine_mlp

    net = wine_mlp.make(3, (13,))
    by_hand = []
    for theta in res.trace[100::10]:
        torch.nn.utils.vector_to_parameters(torch.as_tensor(theta, dtype=torch.float32), net.parameters())
        with torch.no_grad():
            by_hand.append(torch.softmax(net(torch.as_tensor(X_te)), dim=1).double().numpy())
    np.testing.assert_allclose(probs, np.mean(by_hand, axis=0), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("key,value,match", [
    ("model", "wine_mlp:nope", "model: module 'wine_mlp' has no attribute 'nope'"),
    ("model", "no_such_module_xyz:make", "model: cannot import module 'no_such_module_xyz'"),
    ("dataset", "wine_mlp:missing", "dataset: .*no attribute 'missing'"),
])
def test_bad_plugin_names_are_config_errors(key, value, match):
    with pytest.raises(ConfigError, match=match):
        resolve({**CFG, key: value})
