"""The built-in torch networks, by name (:func:`build_model`); :mod:`.torch_models` turns any of them,
or a user's own ``nn.Module``, into a potential.

* :class:`LinearSoftmax` — multiclass logistic regression;
* :class:`MLP` — fully connected, ReLU;
* :class:`LeNet5` — LeCun et al. 1998 for ``1×28×28`` (first conv padded to 32×32 geometry);
* :class:`ResNet20` — He et al. 2016's CIFAR ResNet-20 (3×32×32, 0.27M parameters), with
  batch norm (the paper warm-starts from pytorchcv's BN ResNet-20), filter response norm
  (Izmailov et al. 2021's HMC reference) or no normalisation.

Inputs may be flat ``(n, C·H·W)`` rows, as :mod:`qlsd_flwr.data.datasets` returns them, or already
shaped ``(n, C, H, W)``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def _as_images(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    return x.reshape(x.shape[0], *shape) if x.dim() != 4 else x


class LinearSoftmax(nn.Module):
    """Multiclass logistic regression: ``logits = x W + b`` on flattened inputs."""

    def __init__(self, in_features: int, n_classes: int):
        super().__init__()
        self.fc = nn.Linear(in_features, n_classes)

    def forward(self, x):
        return self.fc(x.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """Fully connected network with ReLU hidden layers."""

    def __init__(self, in_features: int, n_classes: int, hidden: Sequence[int] = (100,)):
        super().__init__()
        layers, prev = [], in_features
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.ReLU()]
            prev = h
        layers.append(nn.Linear(prev, n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x.reshape(x.shape[0], -1))


class LeNet5(nn.Module):
    """LeNet-5 for ``in_channels×28×28``: conv5(6, pad 2)–pool–conv5(16)–pool–120–84–K."""

    def __init__(self, n_classes: int = 10, in_channels: int = 1, activation: str = "relu"):
        super().__init__()
        self.in_channels = in_channels
        self.act = {"relu": F.relu, "tanh": torch.tanh}[activation]
        self.conv1 = nn.Conv2d(in_channels, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, n_classes)

    def forward(self, x):
        x = _as_images(x, (self.in_channels, 28, 28))
        x = F.max_pool2d(self.act(self.conv1(x)), 2)
        x = F.max_pool2d(self.act(self.conv2(x)), 2)
        x = x.flatten(1)
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


class FilterResponseNorm(nn.Module):
    """FRN + TLU (Singh & Krishnan 2020): per-example, so no batch dependence."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, channels, 1, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.tau = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.eps = eps

    def forward(self, x):
        nu2 = x.pow(2).mean(dim=(2, 3), keepdim=True)
        x = x * torch.rsqrt(nu2 + self.eps)
        return torch.max(self.gamma * x + self.beta, self.tau)


def _norm(kind: str, c: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(c)
    if kind == "frn":
        return FilterResponseNorm(c)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be 'batch', 'frn' or 'none', got {kind!r}")


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=norm == "none")
        self.n1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=norm == "none")
        self.n2 = _norm(norm, cout)
        self.frn = norm == "frn"  # FRN's TLU is the activation
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:  # option B: 1x1 projection
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=norm == "none"),
                                          _norm(norm, cout) if norm != "frn" else nn.Identity())

    def forward(self, x):
        act = (lambda t: t) if self.frn else F.relu
        out = act(self.n1(self.conv1(x)))
        out = self.n2(self.conv2(out))
        return act(out + self.shortcut(x)) if not self.frn else out + self.shortcut(x)


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (three stages of 3 basic blocks, 16/32/64 channels) for 3×32×32."""

    def __init__(self, n_classes: int = 10, norm: str = "batch", in_channels: int = 3):
        super().__init__()
        self.in_channels = in_channels
        self.frn = norm == "frn"
        self.conv = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=norm == "none")
        self.n = _norm(norm, 16)
        blocks, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for k in range(3):
                blocks.append(_Block(cin, cout, stride if k == 0 else 1, norm))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, n_classes)

    def forward(self, x):
        x = _as_images(x, (self.in_channels, 32, 32))
        x = self.n(self.conv(x))
        x = x if self.frn else F.relu(x)
        x = self.blocks(x)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


MODELS = {"logistic": LinearSoftmax, "linear": LinearSoftmax, "mlp": MLP, "lenet5": LeNet5,
          "resnet20": ResNet20}


def build_model(name: str, n_classes: int, input_shape: Sequence[int], seed: int = 0,
                **kw) -> nn.Module:
    """A model by name (``logistic``, ``mlp``, ``lenet5``, ``resnet20``, or a plug-in
    ``module:attr`` called as ``attr(n_classes=, input_shape=)``), seeded init."""
    from qlsd_flwr.plugins import is_plugin, load_object

    if is_plugin(name):
        make = load_object(name, "model")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = make(n_classes=n_classes, input_shape=tuple(input_shape), **kw)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: {name!r} returned {type(model).__name__}, expected a torch.nn.Module")
        return model
    key = str(name).lower().replace("-", "").replace("_", "")
    key = {"lenet": "lenet5", "resnet": "resnet20"}.get(key, key)
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: logistic, mlp, lenet5, resnet20")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if key in ("logistic", "linear", "mlp"):
            return MODELS[key](int(np.prod(input_shape)), n_classes, **kw)
        return MODELS[key](n_classes=n_classes, in_channels=int(input_shape[0]), **kw)
    finally:
        torch.random.set_rng_state(gen_state)
