"""Datasets, partitions, the logistic potential and TorchPotential (gradients by finite
differences), and the fast, explained failure of online loaders without network."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from qlsd_flwr.data import datasets as data
from qlsd_flwr.data import hub
from qlsd_flwr.data import partition
from qlsd_flwr.tasks.logistic import LogisticLocal, build_logistic_task, predict_proba


# ----------------------------------------------------------------------------- loaders
@pytest.fixture(scope="module")
def mnist5k():
    return data.load_mnist_subset(seed=0)


def test_offline_loader_shapes(mnist5k):
    bc = data.load_dataset("breast_cancer")
    assert bc.X_train.shape == (455, 30) and bc.X_test.shape == (114, 30)
    assert bc.n_classes == 2 and bc.y_train.dtype == np.int64
    # standardised with training statistics
    np.testing.assert_allclose(bc.X_train.mean(0), 0, atol=1e-10)
    np.testing.assert_allclose(bc.X_train.std(0), 1, atol=1e-10)
    dg = data.load_dataset("digits")
    assert dg.X_train.shape[1] == 64 and len(dg.y_train) + len(dg.y_test) == 1797
    assert set(np.unique(dg.y_train)) == set(range(10))
    m = mnist5k
    assert m.X_train.shape == (4000, 784) and m.X_test.shape == (1000, 784)
    assert m.X_train.dtype == np.float32 and m.input_shape == (1, 28, 28)
    assert 0.0 <= m.X_train.min() and m.X_train.max() <= 1.0 and m.X_train.max() > 0.99
    assert np.bincount(m.y_train).tolist() == [400] * 10  # stratified 80/20 of 500 per digit
    json.dumps(m.summary())


def test_split_is_seeded():
    a, b = data.load_digits(seed=3), data.load_digits(seed=3)
    np.testing.assert_array_equal(a.X_train, b.X_train)
    c = data.load_digits(seed=4)
    assert not np.array_equal(a.y_train, c.y_train)


def test_synthetic_fedprox():
    ds = data.synthetic_fedprox(alpha=1, beta=1, b=12, seed=5)
    Xs, ys = ds.per_client()
    assert len(Xs) == 12 == len(ds.natural_partition)
    assert all(x.shape[1] == 60 for x in Xs) and all(len(x) == len(y) for x, y in zip(Xs, ys))
    sizes = np.array(ds.meta["client_sizes"])
    assert sizes.min() >= 50  # ⌊lognormal⌋ + 50
    np.testing.assert_array_equal([len(y) for y in ys], sizes - np.round(0.2 * sizes))
    assert ds.y_train.min() >= 0 and ds.y_train.max() < 10
    # heterogeneous: clients' label distributions differ (FedProx's W_k ~ N(u_k, 1))
    hist = np.array([np.bincount(y, minlength=10) / len(y) for y in ys])
    assert np.ptp(hist, axis=0).max() > 0.3  # some label's share varies by > 30 points
    again = data.synthetic_fedprox(alpha=1, beta=1, b=12, seed=5)
    np.testing.assert_array_equal(again.X_train, ds.X_train)
    small = data.synthetic_fedprox(b=3, seed=0, n_features=2, n_classes=2, max_size=100)
    assert small.X_train.shape[1] == 2 and max(small.meta["client_sizes"]) <= 100


def test_unknown_dataset_lists_names():
    with pytest.raises(ValueError, match="allowed: .*breast_cancer.*mnist_subset.*cifar10"):
        data.load_dataset("imagenet")


# ----------------------------------------------------------------------------- online
def test_online_loader_fails_fast_without_hub(monkeypatch):
    """Probe path: an unreachable hub endpoint is reported at once, with the way out."""
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy",
              "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused
    with pytest.raises(data.DatasetUnavailableError) as ei:
        data.load_dataset("mnist", timeout=2.0)  # the loader's own bound; no wall-clock assertion
    msg = str(ei.value)
    for needle in ("network", "Hugging Face hub", "breast_cancer", "digits", "mnist_subset",
                   "synthetic", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE"):
        assert needle in msg, needle


def test_online_loader_offline_mode_empty_cache(tmp_path):
    """HF_HUB_OFFLINE=1 with an empty cache: datasets' own error becomes ours, quickly."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path),
           "HF_DATASETS_CACHE": str(tmp_path / "ds")}
    code = ("from qlsd_flwr.data import datasets as data\n"
            "try:\n    data.load_dataset('cifar10')\n"
            "except data.DatasetUnavailableError as e:\n    print('UNAVAILABLE', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert "UNAVAILABLE" in out.stdout, out.stdout + out.stderr
    assert "uoft-cs/cifar10" in out.stdout and "mnist_subset" in out.stdout


def test_hub_conversion_on_in_memory_dataset(monkeypatch):
    """The array conversion of hub datasets, fed an in-memory stand-in for the download."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(0)

    def fake(kind, n, shape):
        imgs = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)) for _ in range(n)]
        cols = {"image" if kind != "cifar10" else "img": imgs,
                "label" if kind != "femnist" else "character": rng.integers(0, 10, n).tolist()}
        if kind == "femnist":
            cols["writer_id"] = [f"w{i % 4}" for i in range(n)]
        return datasets.Dataset.from_dict(cols)

    monkeypatch.setattr(hub, "_hub_load", lambda name, timeout: datasets.DatasetDict(
        {"train": fake(name, 24, (32, 32, 3) if name == "cifar10" else (28, 28)),
         "test": fake(name, 6, (32, 32, 3) if name == "cifar10" else (28, 28))}))
    c = data.load_dataset("cifar10", max_train=10)
    assert c.X_train.shape == (10, 3 * 32 * 32) and c.X_test.shape == (6, 3072)
    assert c.X_train.dtype == np.float32 and 0 <= c.X_train.min() and c.X_train.max() <= 1
    m = data.load_dataset("mnist")
    assert m.X_train.shape == (24, 784) and m.input_shape == (1, 28, 28)
    f = data.load_dataset("femnist", n_writers=3, test_frac=0.2)
    assert len(f.natural_partition) == 3 and len(f.meta["writers"]) == 3
    assert len(f.y_train) + len(f.y_test) == 18  # 3 writers × 6 images
    np.testing.assert_array_equal(np.concatenate(f.natural_partition), np.arange(len(f.y_train)))


# ----------------------------------------------------------------------------- partitions
CASES = [("iid", {}), ("dirichlet", {"alpha": 0.5}), ("pathological", {"classes_per_client": 2}),
         ("dominant_label", {})]


@pytest.mark.parametrize("name,kw", CASES)
def test_partition_deterministic_and_exact_cover(mnist5k, name, kw):
    y = mnist5k.y_train
    p1 = partition.make_partition(name, y, 20, seed=7, **kw)
    p2 = partition.make_partition(name, y, 20, seed=7, **kw)
    assert len(p1) == 20
    for a, b in zip(p1, p2):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.int64 and np.all(np.diff(a) > 0)
    allix = np.concatenate(p1)
    np.testing.assert_array_equal(np.sort(allix), np.arange(len(y)))  # each index exactly once
    p3 = partition.make_partition(name, y, 20, seed=8, **kw)
    assert any(not np.array_equal(a, b) for a, b in zip(p1, p3))
    d = partition.describe(p1, y)
    json.dumps(d)
    assert d["n_unassigned"] == 0 and np.sum(d["counts"]) == len(y)
    if name == "iid":
        assert max(d["sizes"]) - min(d["sizes"]) <= 1
    if name == "pathological":
        assert all(np.count_nonzero(c) <= 2 for c in d["counts"])


def test_dominant_label_proportions(mnist5k):
    # 400 points per label, b = 20, 10 labels: clients i and i+10 are dominated by label i.
    # Others: .01·400 = 4 each (18 clients, 72 points); dominant: .4·400 = 160
    # each, plus half of the remainder 400 − 320 − 72 = 8, i.e. 164 = 41% of the label.
    y = mnist5k.y_train
    p = partition.dominant_label(y, 20, seed=0)
    counts = np.array(partition.describe(p, y)["counts"])
    for i in range(20):
        dom = i % 10
        assert counts[i, dom] == 164
        assert all(counts[i, c] == 4 for c in range(10) if c != dom)
    # drop_remainder: exactly 40% / 1%, the 2% remainder of each label unused
    p = partition.dominant_label(y, 20, seed=0, drop_remainder=True)
    counts = np.array(partition.describe(p, y)["counts"])
    assert all(counts[i, i % 10] == 160 for i in range(20))
    assert counts.sum() == 4000 - 10 * 8
    # unbalanced labels: largest-remainder rounding keeps every count within 1 of its share
    y2 = np.random.default_rng(0).choice(10, 3000, p=np.linspace(1, 2, 10) / 15)
    p = partition.dominant_label(y2, 20, seed=1, drop_remainder=True)
    counts = np.array(partition.describe(p, y2)["counts"])
    n_c = np.bincount(y2)
    for i in range(20):
        for c in range(10):
            frac = 0.4 if c == i % 10 else 0.01
            assert abs(counts[i, c] - frac * n_c[c]) < 1
    with pytest.raises(ValueError, match="exceeds"):
        partition.dominant_label(y, 20, dominant_frac=0.6)


def test_partition_registry_errors(mnist5k):
    y = mnist5k.y_train
    with pytest.raises(ValueError, match="allowed: iid, dirichlet, pathological, dominant_label"):
        partition.make_partition("kmeans", y, 5)
    with pytest.raises(ValueError, match="does not take"):
        partition.make_partition("iid", y, 5, alpha=0.1)
    with pytest.raises(ValueError):
        partition.make_partition("iid", y, 0)


# ----------------------------------------------------------------------------- logistic
def _fd_grad(f, theta, h=1e-6):
    g = np.zeros_like(theta)
    for k in range(len(theta)):
        e = np.zeros_like(theta)
        e[k] = h
        g[k] = (f(theta + e) - f(theta - e)) / (2 * h)
    return g


def test_logistic_gradient_finite_differences():
    # Central differences: truncation O(h² f''') ≈ 1e-12·|U|, round-off ≈ ε|U|/h ≈ 1e-16·30/1e-6
    # = 3e-9 per coordinate; tolerance 1e-6 relative to ‖∇U‖ (≈ 10) leaves a wide margin, and
    # a wrong gradient (e.g. a missing bias row) is off by O(1).
    ds = data.load_digits(seed=0)
    X, y = ds.X_train[:40], ds.y_train[:40] % 3
    pot = LogisticLocal(X, y, 3)
    assert pot.dim == 65 * 3 and pot.n_data == 40
    theta = 0.1 * np.random.default_rng(0).standard_normal(pot.dim)
    g = pot.grad_sum(theta)
    np.testing.assert_allclose(g, _fd_grad(pot.value, theta), atol=1e-6 * np.linalg.norm(g))
    # idx: the sum over a subset equals the gradient of the subset's potential
    idx = np.array([1, 4, 5, 20, 39], dtype=np.int64)
    np.testing.assert_allclose(pot.grad_sum(theta, idx),
                               LogisticLocal(X[idx], y[idx], 3).grad_sum(theta), rtol=1e-12)
    assert pot.value(theta) == pytest.approx(pot.values(theta).sum())
    # at θ = 0 every class has probability 1/K: U = N log K
    assert pot.value(np.zeros(pot.dim)) == pytest.approx(40 * np.log(3))


def test_logistic_predict_proba_and_task():
    ds = data.load_breast_cancer(seed=0)
    task = build_logistic_task(ds, b=5, partition="dirichlet", prior_var=2e-2, seed=0,
                               partition_kw={"alpha": 1.0})
    assert task.dim == 31 * 2 and task.b == 5 and task.n_data.sum() == len(ds.y_train)
    json.dumps(task.meta["partition_description"])
    theta = 0.05 * np.random.default_rng(1).standard_normal(task.dim)
    g = task.grad_potential(theta)
    np.testing.assert_allclose(g, _fd_grad(task.potential, theta), atol=1e-6 * np.linalg.norm(g))
    S = 0.1 * np.random.default_rng(2).standard_normal((7, task.dim))
    pr = predict_proba(S, ds.X_test)
    assert pr.shape == (len(ds.X_test), 2)
    np.testing.assert_allclose(pr.sum(1), 1.0, rtol=1e-12)
    # by hand for one sample and one point: softmax([x,1]W)
    W = S[0].reshape(31, 2)
    z = np.append(ds.X_test[0], 1.0) @ W
    np.testing.assert_allclose(predict_proba(S[0], ds.X_test[:1])[0],
                               np.exp(z) / np.exp(z).sum(), rtol=1e-12)
    nat = build_logistic_task(data.synthetic_fedprox(b=4, seed=0, max_size=200), b=4,
                              partition="natural")
    assert nat.b == 4 and nat.dim == 61 * 10


# ----------------------------------------------------------------------------- torch
def test_torch_potential_gradient_finite_differences():
    import torch

    from qlsd_flwr.tasks.torch_models import MLP, TorchPotential, build_model

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((13, 4)), rng.integers(0, 3, 13)
    net = MLP(4, 3, hidden=(5,))
    pot = TorchPotential(net, X, y, batch_size=5, dtype=torch.float64)  # 3 chunks
    assert pot.dim == 4 * 5 + 5 + 5 * 3 + 3 and pot.n_data == 13
    theta = pot.theta0()
    g = pot.grad_sum(theta)
    # float64 throughout: same error budget as the logistic test
    np.testing.assert_allclose(g, _fd_grad(pot.value, theta), atol=1e-6 * np.linalg.norm(g))
    idx = np.array([0, 3, 7, 12], dtype=np.int64)
    sub = TorchPotential(MLP(4, 3, hidden=(5,)), X[idx], y[idx], dtype=torch.float64)
    np.testing.assert_allclose(pot.grad_sum(theta, idx), sub.grad_sum(theta), rtol=1e-10)
    # value = summed cross-entropy, by hand from the logits
    with torch.no_grad():
        z = net(torch.as_tensor(X)).numpy()
    ce = np.log(np.exp(z).sum(1)) - z[np.arange(13), y]
    assert pot.value(theta) == pytest.approx(ce.sum(), rel=1e-12)
    pr = pot.predict_proba(np.stack([theta, theta]), X)
    np.testing.assert_allclose(pr, np.exp(z) / np.exp(z).sum(1, keepdims=True), rtol=1e-10)
    # the built-in models run on flat rows
    for name, shape in (("lenet5", (1, 28, 28)), ("resnet20", (3, 32, 32))):
        m = build_model(name, 10, shape)
        assert m(torch.zeros(2, int(np.prod(shape)))).shape == (2, 10)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            TorchPotential(net, X, y, device="cuda")


def test_a_convolutional_potential_keeps_channels_last_and_its_gradient_is_the_plain_layouts():
    """A conv net's weights stay channels-last through every θ loaded (the speed-up would otherwise
    end at the first one), θ's layout is the plain NCHW flattening, and the gradient, value and
    predictive equal the NCHW model's up to float rounding (float64: the two layouts sum in
    another order, so ~1e-15 relative, checked at 1e-10), with finite differences on top."""
    import copy

    import torch

    from qlsd_flwr.tasks.torch_models import TorchPotential, build_model

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    X, y = rng.random((12, 784)), rng.integers(0, 10, 12)
    net = build_model("lenet5", 10, (1, 28, 28))
    plain = TorchPotential(copy.deepcopy(net), X, y, dtype=torch.float64, channels_last=False)
    fast = TorchPotential(copy.deepcopy(net), X, y, dtype=torch.float64)  # the default for a conv net on the CPU
    # conv2's weight (16, 6, 5, 5): conv1's single input channel is contiguous in both orders
    assert fast.model.conv2.weight.is_contiguous(memory_format=torch.channels_last)
    assert not plain.model.conv2.weight.is_contiguous(memory_format=torch.channels_last)
    theta = plain.theta0()
    np.testing.assert_array_equal(fast.theta0(), theta)  # the same flat layout
    theta = theta + 0.01 * rng.standard_normal(theta.size)
    g = plain.grad_sum(theta, np.arange(5))
    np.testing.assert_allclose(fast.grad_sum(theta, np.arange(5)), g, rtol=0, atol=1e-10 * np.abs(g).max())
    assert fast.model.conv2.weight.is_contiguous(memory_format=torch.channels_last)  # kept through the load
    np.testing.assert_array_equal(fast.theta0(), theta)  # and θ went in exactly
    assert fast.value(theta) == pytest.approx(plain.value(theta), rel=1e-12)
    np.testing.assert_allclose(fast.predict_proba(theta, X), plain.predict_proba(theta, X), atol=1e-12)
    j = int(np.argmax(np.abs(g[:150])))  # a conv1 weight: the layout's own gradient, by finite differences
    e = np.zeros_like(theta)
    e[j] = 1e-6
    fd = (fast.value(theta + e) - fast.value(theta - e)) / 2e-6
    assert fast.grad_sum(theta)[j] == pytest.approx(fd, rel=1e-5)
    assert fast.curvature_diag(theta).shape == (fast.dim,)
