"""Torch models and :class:`TorchPotential`, which makes any classifier a ``LocalPotential``.

The built-in networks live in :mod:`.torch_nets` and are importable from here too.

Models (inputs may be flat ``(n, C·H·W)`` rows, as :mod:`qlsd_flwr.data.datasets` returns them, or
already shaped ``(n, C, H, W)``):

* :class:`LinearSoftmax` — multiclass logistic regression;
* :class:`MLP` — fully connected, ReLU;
* :class:`LeNet5` — LeCun et al. 1998 for ``1×28×28`` (first conv padded to 32×32 geometry);
* :class:`ResNet20` — He et al. 2016's CIFAR ResNet-20 (3×32×32, 0.27M parameters), with
  batch norm (the paper warm-starts from pytorchcv's BN ResNet-20), filter response norm
  (Izmailov et al. 2021's HMC reference) or no normalisation.

Plugging in your own model and data::

    import torch.nn as nn
    from qlsd_flwr.tasks.torch_models import TorchPotential
    from qlsd_flwr.core.potential import GaussianPrior, Task

    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))          # any nn.Module → logits
    clients = [TorchPotential(net, X_i, y_i) for X_i, y_i in my_client_data]
    task = Task(name="mine", dim=clients[0].dim, clients=clients,
                prior=GaussianPrior(var=0.2), theta0=clients[0].theta0(),
                meta={"blocks": clients[0].blocks})

All clients may share one module: each call first loads ``θ`` into the module's parameters.
``U_ij(θ) = cross_entropy(net(x_ij), y_ij)``, so the potential is the summed cross-entropy;
the prior is separate (``GaussianPrior(var)`` ⇔ weight decay ``1/var``). The module is put in
``eval()`` mode so that dropout is off and batch norm uses its running statistics (buffers,
not parameters): ``U_i`` is then a genuine sum over examples, as the samplers assume.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from qlsd_flwr.tasks.torch_nets import (  # noqa: F401  (the networks' old home: their names stay importable here)
    MLP, MODELS, FilterResponseNorm, LeNet5, LinearSoftmax, ResNet20, build_model)



def resolve_device(device: str | torch.device = "cpu") -> torch.device:
    """``cpu`` or ``cuda[:k]``; asking for CUDA without a usable GPU is an error, not a fallback."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={str(device)!r} was requested but CUDA is not available "
                               f"(torch {torch.__version__}, built with CUDA "
                               f"{torch.version.cuda}); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RuntimeError(f"device={str(device)!r}: only {torch.cuda.device_count()} "
                               "CUDA device(s) visible")
    elif dev.type != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda[:k]', got {str(device)!r}")
    return dev


def _flat(tensors) -> torch.Tensor:
    """``parameters_to_vector`` for tensors in any memory order (its ``view(-1)`` refuses a
    channels-last weight); each flattened in its logical (NCHW) order, so θ's layout is the same."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _one_linear(model: nn.Module, params) -> bool:
    """``model`` computes one affine map of its (flattened) input, whose weight and bias are all of
    ``params``: an ``nn.Linear``, a ``LinearSoftmax``, or an ``nn.Sequential`` of ``nn.Flatten`` and
    ``nn.Identity`` ending with one. A user's own module is not inspected (its ``forward`` is code)."""
    lin = model.fc if isinstance(model, LinearSoftmax) else model
    if isinstance(model, nn.Sequential) and len(model) and \
            all(isinstance(m, (nn.Flatten, nn.Identity)) for m in list(model)[:-1]):
        lin = model[-1]
    if type(lin) is not nn.Linear:
        return False
    return [p.data_ptr() for p in params] == [p.data_ptr() for p in lin.parameters() if p.requires_grad]


class TorchPotential:
    """``U_i(θ) = Σ_j loss(model_θ(x_ij), y_ij)`` on the flat parameter vector ``θ``.

    ``loss``: a per-example loss ``loss(outputs, y) -> (n,)`` (default: cross-entropy of logits,
    a classifier), or give ``log_likelihood(outputs, y) -> (n,)`` instead (``U_ij = −log p``).

    ``θ`` goes in and gradients come out as ``float64`` numpy vectors: θ is the parameters with
    ``requires_grad`` in ``model.named_parameters()`` order, each flattened (as
    ``parameters_to_vector``); frozen parameters and buffers are not part of it. Inside, torch
    computes in the model's dtype (``dtype=torch.float64`` converts the model, e.g. for gradient
    checks). ``batch_size`` (default 1024) bounds memory: sums are accumulated over chunks of that
    many examples.

    ``device`` (default ``"cpu"``): where the model and this client's ``X``, ``y`` live and torch
    computes: ``"cpu"``, ``"cuda"`` or ``"cuda:k"`` (a string or a ``torch.device``). θ and the
    gradients still cross as float64 numpy vectors on the CPU. Asking for CUDA where torch sees no
    GPU (or fewer than ``k + 1``) is a ``RuntimeError``, never a silent fall-back to the CPU; any
    other device type is a ``ValueError``. On a GPU, the vectorised engine's torch backend
    (:mod:`qlsd_flwr.engines.vectorised.torch_backend`) stacks the clients' data there and computes a
    whole round on the device; it ran on an NVIDIA H200 (``benchmarks/RESULTS.md``). The Flower
    engines with ``device = "cuda"`` have not run on a GPU.

    ``log_concave`` (default ``None``: found from the model) says whether ``U_i`` is convex in θ.
    Found true only for a softmax regression: the model is one ``nn.Linear`` (itself,
    :class:`~qlsd_flwr.tasks.torch_nets.LinearSoftmax`, or an ``nn.Sequential`` of ``nn.Flatten`` /
    ``nn.Identity`` ending with it) under the default cross-entropy. ``gamma-c = auto`` takes the
    network's smaller step unless every client and the prior are log-concave; give ``True`` for
    another convex model, ``False`` to force the smaller step.

    ``channels_last`` (default ``None``: true for a model with 2-D convolutions on the CPU) keeps
    its 4-D weights in channels-last memory order, where oneDNN's CPU convolutions and pooling are
    faster (LeNet-5's minibatch gradient: 1.1× faster here, ``benchmarks/RESULTS.md``). The numbers
    are the same up to float rounding (the kernels sum in another order), not bit for bit.

    :meth:`predict_proba` gives the posterior predictive of new inputs, and
    :func:`qlsd_flwr.posterior_predictive` / :func:`qlsd_flwr.load_draw` use it and θ's layout.
    """

    def __init__(self, model: nn.Module, X, y, device: str = "cpu", batch_size: int = 1024,
                 dtype: torch.dtype | None = None, loss=None, log_likelihood=None, log_concave: bool | None = None,
                 channels_last: bool | None = None):
        if loss is not None and log_likelihood is not None:
            raise ValueError("give loss or log_likelihood, not both")
        self._per_example = None  # the per-example loss of a user's own loss or log-likelihood
        if log_likelihood is not None:
            self._loss_sum = lambda out, y: -log_likelihood(out, y).sum()
            self._per_example = lambda out, y: -log_likelihood(out, y)
        elif loss is not None:
            self._loss_sum = lambda out, y: loss(out, y).sum()
            self._per_example = loss
        else:  # one fused reduction, as before the option existed (same bits)
            self._loss_sum = lambda out, y: F.cross_entropy(out, y, reduction="sum")
        self.device = resolve_device(device)
        if dtype is not None:
            model = model.to(dtype)
        self.model = model.to(self.device).eval()
        if channels_last is None:
            channels_last = self.device.type == "cpu" and any(isinstance(m, nn.Conv2d) for m in self.model.modules())
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.dtype = self.params[0].dtype
        X = torch.as_tensor(np.asarray(X) if not torch.is_tensor(X) else X)
        self.X = X.to(self.device, self.dtype)
        y = torch.as_tensor(np.asarray(y) if not torch.is_tensor(y) else y)
        # class labels stay integers; regression targets take the model's dtype
        self.y = (y.long() if not y.is_floating_point() else y.to(self.dtype)).to(self.device)
        if len(self.X) != len(self.y):
            raise ValueError(f"X has {len(self.X)} rows but y has {len(self.y)}")
        self.n_data = int(len(self.y))
        self.blocks = tuple(int(p.numel()) for p in self.params)
        self.dim = int(sum(self.blocks))
        self.batch_size = int(batch_size)
        self.log_concave = (self._per_example is None and _one_linear(self.model, self.params)) \
            if log_concave is None else bool(log_concave)

    def cache_fingerprint(self) -> bytes:
        """Bytes identifying the potential (architecture, buffers, data, dtype), not ``θ``."""
        import hashlib

        h = hashlib.sha256()
        h.update(repr(self.model).encode())
        h.update(str(self.dtype).encode())
        for name, buf in self.model.named_buffers():
            h.update(name.encode())
            h.update(buf.detach().cpu().numpy().tobytes())
        h.update(self.X.detach().cpu().numpy().tobytes())
        h.update(self.y.detach().cpu().numpy().tobytes())
        return h.digest()

    def named_arrays(self) -> dict:
        """The trainable parameters by name, in ``named_parameters()`` order (θ's layout), as
        detached tensors: ``ArrayRecord(pot.named_arrays())`` is the ``initial_arrays`` of a
        :class:`qlsd_flwr.flower.QLSDStrategy`."""
        return {n: p.detach().cpu() for n, p in self.model.named_parameters() if p.requires_grad}

    def theta0(self) -> np.ndarray:
        """The model's current parameters (e.g. its default random init) as a flat vector."""
        return _flat(self.params).detach().cpu().double().numpy()

    def _load(self, theta: np.ndarray) -> None:
        theta = np.asarray(theta, dtype=np.float64)
        if theta.shape != (self.dim,):
            raise ValueError(f"theta must have shape ({self.dim},), got {theta.shape}")
        flat = torch.tensor(theta, dtype=self.dtype, device=self.device)
        with torch.no_grad():  # a copy: the parameters must never alias the caller's θ (in-place training);
            at = 0             # copy_ keeps each parameter's memory order (channels_last), where rebinding would not
            for p in self.params:
                p.copy_(flat[at:at + p.numel()].view_as(p))
                at += p.numel()

    def _chunks(self, idx):
        if idx is None:
            for s in range(0, self.n_data, self.batch_size):
                yield slice(s, s + self.batch_size)
        else:
            idx = torch.as_tensor(np.asarray(idx, dtype=np.int64), device=self.device)
            for s in range(0, len(idx), self.batch_size):
                yield idx[s:s + self.batch_size]

    def grad_sum(self, theta: np.ndarray, idx: np.ndarray | None = None) -> np.ndarray:
        self._load(theta)
        for p in self.params:
            p.grad = None
        any_ = False
        for sel in self._chunks(idx):
            loss = self._loss_sum(self.model(self.X[sel]), self.y[sel])
            loss.backward()
            any_ = True
        if not any_:
            return np.zeros(self.dim)
        g = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return _flat(g).detach().cpu().double().numpy()

    def kron_factors(self, theta: np.ndarray):
        """K-FAC's factors at ``θ`` for a model that is one ``nn.Linear`` (with bias) under the default
        cross-entropy (softmax regression, :class:`LinearSoftmax`): ``G = Σ_j x̃_j x̃_jᵀ`` (inputs with a
        constant 1), ``A = Σ_j (diag p_j − p_j p_jᵀ)``, and ``perm`` placing θ's coordinates (weight
        ``(K, F)`` row by row, then the bias) as the ``(F̃, K)`` matrix of the metric. ``ValueError``
        for any other model (``metric = kronecker`` covers one dense layer)."""
        lin = [m for m in self.model.modules() if isinstance(m, nn.Linear)]
        if self._per_example is not None or len(lin) != 1 or lin[0].bias is None or \
                [p.data_ptr() for p in self.params] != [lin[0].weight.data_ptr(), lin[0].bias.data_ptr()]:
            raise ValueError("metric = kronecker needs a model that is one nn.Linear with bias under the default "
                             "cross-entropy (softmax regression); use metric = diagonal")
        n_out, n_in = lin[0].weight.shape
        self._load(theta)
        with torch.no_grad():
            x = torch.cat([self.X.reshape(self.n_data, -1).double(),
                           torch.ones(self.n_data, 1, dtype=torch.float64, device=self.device)], dim=1)
            p = F.softmax(self.model(self.X).double(), dim=-1)
            G = (x.T @ x).cpu().numpy()
            A = (torch.diag(p.sum(0)) - p.T @ p).cpu().numpy()
        f, k = np.meshgrid(np.arange(n_in + 1), np.arange(n_out), indexing="ij")
        perm = np.where(f < n_in, k * n_in + f, n_out * n_in + k).ravel()
        return G, A, perm

    def kron_inputs(self, theta: np.ndarray):
        """``(X̃, P)`` for ``metric-block`` (:func:`qlsd_flwr.core.kron_block.block_report`): the inputs with a
        constant 1 and the softmax outputs at ``θ``, float64; the model is one ``nn.Linear`` (:meth:`kron_factors`
        says so otherwise)."""
        self.kron_factors(theta)  # the model's check, one home
        with torch.no_grad():
            x = torch.cat([self.X.reshape(self.n_data, -1).double(),
                           torch.ones(self.n_data, 1, dtype=torch.float64, device=self.device)], dim=1)
            p = F.softmax(self.model(self.X).double(), dim=-1)
        return x.cpu().numpy(), p.cpu().numpy()

    def curvature_diag(self, theta: np.ndarray, chunk: int = 64) -> np.ndarray:
        """The diagonal of this client's curvature at ``θ`` (``metric-from = curvature``), from
        per-example gradients (``torch.func``):

        * the default classifier (cross-entropy of logits): the Fisher information's diagonal
          ``Σ_j Σ_c p_jc (∂ log p_jc / ∂θ)²``, ``p_jc`` the model's class probabilities. For
          softmax outputs it equals the Gauss–Newton matrix's diagonal, the usual curvature of a
          network (positive where the Hessian may not be);
        * a user's ``loss`` / ``log_likelihood``: the empirical Fisher ``Σ_j (∇U_ij)²``.
        """
        from torch.func import functional_call, grad, vmap

        self._load(theta)
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        params = {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        buffers = dict(self.model.named_buffers())
        per_example = self._per_example

        def out_of(prm, x):
            return functional_call(self.model, (prm, buffers), (x[None],))[0]

        total = [torch.zeros_like(params[n]) for n in names]
        with torch.no_grad():
            n_classes = None if per_example is not None else int(self.model(self.X[:1]).shape[-1])
        for a in range(0, self.n_data, chunk):
            x, y = self.X[a:a + chunk], self.y[a:a + chunk]
            if per_example is not None:
                g = vmap(grad(lambda prm, xi, yi: per_example(out_of(prm, xi)[None], yi[None]).sum()),
                         in_dims=(None, 0, 0))(params, x, y)
                for t, n in zip(total, names):
                    t += (g[n] ** 2).sum(0)
                continue
            with torch.no_grad():
                p = F.softmax(self.model(x), dim=-1)
            for c in range(n_classes):
                g = vmap(grad(lambda prm, xi: F.log_softmax(out_of(prm, xi), dim=-1)[c]),
                         in_dims=(None, 0))(params, x)
                w = p[:, c]
                for t, n in zip(total, names):
                    t += torch.einsum("j,j...->...", w, g[n] ** 2)
        return _flat(total).detach().cpu().double().numpy()

    def value(self, theta: np.ndarray) -> float:
        self._load(theta)
        total = 0.0
        with torch.no_grad():
            for sel in self._chunks(None):
                total += float(self._loss_sum(self.model(self.X[sel]), self.y[sel]).double())
        return total

    def example_losses(self, out, y):
        """``U_ij`` of each example from the model's outputs: the user's loss or ``−log_likelihood``,
        else the cross-entropy of logits (a tensor of shape ``(n,)``)."""
        if self._per_example is not None:
            return self._per_example(out, y)
        return F.cross_entropy(out, y, reduction="none")

    def pointwise_log_lik(self, theta: np.ndarray) -> np.ndarray:
        """``−U_ij(θ)`` for every example: ``log p(y_j | x_j, θ)`` under the default cross-entropy or a
        user's ``log_likelihood``; under a user's ``loss`` it is ``−loss``, a log-likelihood only if
        that loss is a normalised negative log-density (the federated LOO's input)."""
        self._load(theta)
        with torch.no_grad():
            parts = [self.example_losses(self.model(self.X[sel]), self.y[sel]).double().reshape(-1)
                     for sel in self._chunks(None)]
        return -torch.cat(parts).cpu().numpy() if parts else np.zeros(0)

    def predict_proba(self, theta_samples: np.ndarray, X, batch_size: int | None = None) -> np.ndarray:
        """Posterior predictive ``(1/S) Σ_s softmax(model_{θ_s}(X))`` as float64 ``(n, K)``.

        Parameters
        ----------
        theta_samples : array_like
            The draws, ``(S, d)`` or any shape ending in ``d`` (e.g. ``(chain, draw, d)``, flattened
            to its rows in C order), or one θ ``(d,)``.
        X : array_like or torch.Tensor
            The inputs, examples along the first axis; cast to the model's dtype and ``device``.
        batch_size : int, optional
            Examples per forward pass; default: the potential's ``batch_size``.

        Returns
        -------
        numpy.ndarray
            float64 ``(n, K)``, the softmax of the model's outputs averaged over the draws (the
            model is loaded with each draw in turn; its weights afterwards are the last draw's).
        """
        th = np.asarray(theta_samples, dtype=np.float64)
        th = th.reshape(-1, th.shape[-1])
        X = torch.as_tensor(np.asarray(X) if not torch.is_tensor(X) else X)
        X = X.to(self.device, self.dtype)
        bs = batch_size or self.batch_size
        out = None
        with torch.no_grad():
            for t in th:
                self._load(t)
                probs = torch.cat([F.softmax(self.model(X[s:s + bs]).double(), dim=1)
                                   for s in range(0, len(X), bs)])
                out = probs if out is None else out + probs
        return (out / len(th)).cpu().numpy()
