"""Potentials users already have, as a :class:`~qlsd_flwr.core.potential.LocalPotential`.

A client's local potential is ``U_i(θ) = Σ_{j<N_i} U_ij(θ)`` (the negative log-likelihood of its
``N_i`` examples; the prior ``U_0`` is the server's, see ``prior_var``). The samplers call
``grad_sum(θ, idx)`` (``Σ_{j∈idx} ∇U_ij(θ)``, ``idx = None`` for all ``j``) and ``value(θ)``, with
θ a float64 vector of length ``d``:

* :class:`NumpyPotential` — your own numpy ``grad_sum``/``value`` pair;
* :class:`TorchPotential` — a torch module with a per-example loss (cross-entropy by default) or a
  per-example log-likelihood, θ being its trainable parameters in ``named_parameters()`` order;
* :class:`LogDensityPotential` — a per-example log-density ``log_lik(θ, batch)`` written in torch
  (gradients by autograd).

Priors for the server (``QLSDStrategy(prior=...)`` or a task plug-in's ``Task(prior=...)``):
``GaussianPrior``, ``StudentTPrior``, ``LogHalfNormalPrior``, ``FunctionPrior`` (your own value and
gradient) and ``BlockPrior`` (different priors on different coordinates); see
:mod:`qlsd_flwr.core.priors`. A potential may also offer ``curvature_diag(θ)`` (and ``hessian(θ)``)
for ``metric = diagonal`` (``dense``); otherwise the client estimates it from ``grad_sum``.

Hand one to :func:`qlsd_flwr.flower.make_client_app` (``potential_fn(context)`` returns this node's),
or build a :class:`qlsd_flwr.core.potential.Task` of them for a task plug-in
(``task = "module:callable"``), which runs on every engine.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from qlsd_flwr.core.potential import GaussianPrior, LocalPotential, Task, declares_log_concave
from qlsd_flwr.core.priors import BlockPrior, FunctionPrior, LogHalfNormalPrior, StudentTPrior

# TorchPotential comes from the module __getattr__ below (it imports torch only when used)
__all__ = ["NumpyPotential", "TorchPotential", "LogDensityPotential", "Pooled",  # noqa: F822
           "Task", "GaussianPrior", "LocalPotential",
           "StudentTPrior", "LogHalfNormalPrior", "FunctionPrior", "BlockPrior"]


def _vector(x, d: int, what: str) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64)
    if v.shape != (d,):
        raise ValueError(f"{what} returned shape {v.shape}, expected ({d},)")
    return v


class NumpyPotential:
    """``U_i`` from numpy functions.

    Parameters
    ----------
    grad_sum : callable
        ``grad_sum(theta, idx) -> (d,)``: ``Σ_{j∈idx} ∇U_ij(θ)``; ``idx`` is a sorted int64 array of
        distinct indices in ``[0, n_data)``, or ``None`` for all examples.
    value : callable
        ``value(theta) -> float``: ``U_i(θ) = Σ_j U_ij(θ)``.
    n_data : int
        ``N_i``, the number of examples.
    dim : int
        ``d``, the length of θ.
    grad_sum_batch : callable, optional
        ``grad_sum_batch(thetas, idx) -> (C, d)``: ``grad_sum`` of every row of ``thetas``
        ``(C, d)`` at once, row ``c`` on the minibatch ``idx[c]`` (``idx`` ``(C, n)``, or ``None``
        for all examples). With it, the vectorised engine and a several-chain Flower client
        compute all their chains' gradients in one call
        (:func:`qlsd_flwr.core.oracles.oracle_batch`). Make row ``c`` bitwise equal to
        ``grad_sum(thetas[c], idx[c])`` if chains are to agree bit for bit across engines.
    pointwise_log_lik : callable, optional
        ``pointwise_log_lik(theta) -> (n_data,)``: ``log p(x_j | θ)`` of every example, normalised.
        With it the run ends with the federated leave-one-out (``loo`` key, :func:`qlsd_flwr.loo`).
    log_concave : bool, default False
        Say ``True`` if ``U_i`` is convex in θ (a GLM with a log-concave likelihood): ``gamma-c =
        auto`` keeps the larger step of a log-concave posterior (0.25, not 0.125) when every
        client and the prior say so.
    support : array of bool, optional
        ``(d,)``: ``True`` on every coordinate of θ that ``grad_sum`` reads (default: all). Where some
        are never read (a softmax regression's weights of inputs that are 0 in all of this node's
        data), ``downlink-support = data`` leaves them out of the broadcast's code; a coordinate the
        gradient does read but ``support`` leaves out would be evaluated where it is stale.
    """

    def __init__(self, grad_sum: Callable, value: Callable, n_data: int, dim: int,
                 grad_sum_batch: Callable | None = None, pointwise_log_lik: Callable | None = None,
                 log_concave: bool = False, support: np.ndarray | None = None):
        self._grad, self._value = grad_sum, value
        self.log_concave = bool(log_concave)
        self._support = None if support is None else np.asarray(support)
        self.n_data, self.dim = int(n_data), int(dim)
        if self.n_data < 1 or self.dim < 1:
            raise ValueError(f"n_data and dim must be >= 1 (got {n_data}, {dim})")
        if grad_sum_batch is not None:  # only then: the engines look for the method itself
            self._grad_batch = grad_sum_batch
            self.grad_sum_batch = self._batch
        if pointwise_log_lik is not None:  # likewise: the LOO looks for the method
            self._ll = pointwise_log_lik
            self.pointwise_log_lik = self._pointwise

    def support(self) -> np.ndarray | None:
        """The coordinates ``grad_sum`` reads, as given (``None``: all; :func:`qlsd_flwr.core.potential.declared_support`
        checks it)."""
        return self._support

    def _batch(self, thetas: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        thetas = np.asarray(thetas, dtype=np.float64)
        out = np.asarray(self._grad_batch(thetas, idx), dtype=np.float64)
        if out.shape != thetas.shape:
            raise ValueError(f"grad_sum_batch returned shape {out.shape}, expected {thetas.shape}")
        return out

    def _pointwise(self, theta: np.ndarray) -> np.ndarray:
        return _vector(self._ll(theta), self.n_data, "pointwise_log_lik")

    def grad_sum(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        return _vector(self._grad(theta, idx), self.dim, "grad_sum")

    def value(self, theta: np.ndarray) -> float:
        return float(self._value(theta))


class LogDensityPotential:
    """``U_ij(θ) = −log_lik(θ, x_j)`` from a per-example log-density written in torch.

    Parameters
    ----------
    log_lik : callable
        ``log_lik(theta, batch) -> (n,) tensor``: the log-likelihood of each example of ``batch``
        at ``theta`` (a float64 tensor of shape ``(d,)``); ``batch`` is ``data[idx]`` (each of
        ``data``'s arrays indexed when it is a tuple).
    data : array or tuple of arrays
        The node's examples along the first axis (as torch tensors or numpy arrays).
    dim : int
        ``d``, the length of θ.
    batch_size : int, default 4096
        Examples per autograd pass (bounds memory).
    log_concave : bool, default False
        Say ``True`` if ``log_lik`` is concave in θ (as :class:`NumpyPotential`'s).
    """

    def __init__(self, log_lik: Callable, data: Any, dim: int, batch_size: int = 4096, log_concave: bool = False):
        import torch

        self.log_concave = bool(log_concave)

        def tensor(a):
            t = a if torch.is_tensor(a) else torch.as_tensor(np.asarray(a))
            return t.double() if t.is_floating_point() else t

        self._torch, self._log_lik = torch, log_lik
        self._tuple = isinstance(data, tuple)
        self.data = tuple(tensor(a) for a in data) if self._tuple else tensor(data)
        first = self.data[0] if self._tuple else self.data
        self.n_data, self.dim, self.batch_size = int(first.shape[0]), int(dim), int(batch_size)

    def _batches(self, idx):
        torch = self._torch
        sel = torch.arange(self.n_data) if idx is None else torch.as_tensor(np.asarray(idx, dtype=np.int64))
        for s in range(0, len(sel), self.batch_size):
            ix = sel[s:s + self.batch_size]
            yield tuple(a[ix] for a in self.data) if self._tuple else self.data[ix]

    def _sum(self, theta_t, idx):
        total = theta_t.new_zeros(())
        for batch in self._batches(idx):
            ll = self._log_lik(theta_t, batch)
            total = total - ll.sum()
        return total

    def grad_sum(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        t = self._torch.tensor(np.asarray(theta, dtype=np.float64), requires_grad=True)
        (g,) = self._torch.autograd.grad(self._sum(t, idx), t, allow_unused=True)
        return np.zeros(self.dim) if g is None else g.detach().numpy().astype(np.float64)

    def value(self, theta: np.ndarray) -> float:
        with self._torch.no_grad():
            return float(self._sum(self._torch.tensor(np.asarray(theta, dtype=np.float64)), None))

    def pointwise_log_lik(self, theta: np.ndarray) -> np.ndarray:
        """``log_lik(θ, x_j)`` of every example (the federated LOO's input)."""
        with self._torch.no_grad():
            t = self._torch.tensor(np.asarray(theta, dtype=np.float64))
            return np.concatenate([self._log_lik(t, b).double().reshape(-1).numpy() for b in self._batches(None)])


class Pooled:
    """Several potentials as one (``N = Σ N_i``; example ``j`` of the pool is example ``j − offset``
    of its client): SGLD's single client."""

    def __init__(self, clients: Sequence[LocalPotential]):
        self.clients = list(clients)
        self.dim = int(self.clients[0].dim)
        self.offsets = np.cumsum([0] + [int(c.n_data) for c in self.clients])
        self.n_data = int(self.offsets[-1])

    @property
    def log_concave(self) -> bool:
        return all(declares_log_concave(c) for c in self.clients)

    def grad_sum(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        g = np.zeros(self.dim)
        for c, lo, hi in zip(self.clients, self.offsets[:-1], self.offsets[1:]):
            if idx is None:
                g = g + c.grad_sum(theta)
                continue
            sub = idx[(idx >= lo) & (idx < hi)] - lo
            if len(sub):
                g = g + c.grad_sum(theta, sub)
        return g

    def value(self, theta: np.ndarray) -> float:
        return float(sum(c.value(theta) for c in self.clients))


def __getattr__(name: str):
    # TorchPotential imports torch: only when asked for
    if name == "TorchPotential":
        from qlsd_flwr.tasks.torch_models import TorchPotential

        return TorchPotential
    raise AttributeError(name)
