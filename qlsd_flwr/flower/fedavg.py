"""FedAvg next to QLSD on a user's own model: Flower's own ``FedAvg`` strategy, and a ClientApp
that trains the same :class:`~qlsd_flwr.potentials.TorchPotential` the QLSD clients sample.

The local objective is the MAP objective of the same posterior, per example: the potential's
own per-example loss (cross-entropy by default, or the user's ``loss`` / ``−log_likelihood``)
averaged over a minibatch, plus ``‖θ‖² / (2 σ² N)`` for a Gaussian prior ``N(0, σ² I)`` with
``N`` the total number of training points (so ``N`` times it is ``U(θ)``): weight decay
``1 / (σ² N)``. Each client runs ``local_epochs`` epochs of minibatch SGD from the global
weights, seeded by ``(seed, round, client)``.

Use::

    from flwr.serverapp.strategy import FedAvg  # Flower's own, nothing changed
    from qlsd_flwr.flower import fedavg_strategy, make_fedavg_client_app

    client_app = make_fedavg_client_app(potential_fn, prior_var=5.0, n_total=178)
    strategy = fedavg_strategy(num_clients)          # every client every round
    result = strategy.start(grid, initial_arrays=ArrayRecord(pot.named_arrays()), num_rounds=50)

and evaluate ``result.arrays`` with :func:`qlsd_flwr.evaluation.evaluate.predictive_metrics`
next to the QLSD run's posterior predictive (``examples/quickstart-torch/compare.py``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def map_sgd(model, params, batch_loss, X, y, epochs: int, lr: float, batch_size: int, weight_decay: float,
            seed: int, momentum: float = 0.0, device=None) -> tuple[float, float]:
    """FedAvg's local step, the package's one: minibatch SGD on ``model`` (in place) for the per-example MAP
    objective ``batch_loss(model(X[S]), y[S])`` with weight decay ``1/(σ² N)``, the minibatch order drawn
    by a torch generator seeded with ``seed``; returns the mean loss of the last epoch and of all epochs. The user-facing
    ClientApp below and the main job's FedAvg (:mod:`qlsd_flwr.experiments.fedavg`) both train with it."""
    import torch

    gen = torch.Generator().manual_seed(int(seed))
    opt = torch.optim.SGD(params, lr=float(lr), momentum=float(momentum), weight_decay=float(weight_decay))
    n, last, overall = len(y), 0.0, 0.0
    model.train()
    for _ in range(int(epochs)):
        perm = torch.randperm(n, generator=gen).to(device)
        total = 0.0
        for s in range(0, n, int(batch_size)):
            sel = perm[s:s + int(batch_size)]
            opt.zero_grad()
            loss = batch_loss(model(X[sel]), y[sel])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(sel)
        last, overall = total / max(n, 1), overall + total
    model.eval()
    return last, overall / max(n * int(epochs), 1)


def map_train(pot, epochs: int, lr: float, batch_size: int, weight_decay: float, seed: int) -> float:
    """:func:`map_sgd` on a :class:`~qlsd_flwr.potentials.TorchPotential`'s model and data, with its own
    per-example loss (cross-entropy by default, or the user's ``loss`` / ``−log_likelihood``)."""
    return map_sgd(pot.model, pot.params, lambda out, y: pot.example_losses(out, y).mean(), pot.X, pot.y, epochs,
                   lr, batch_size, weight_decay, seed, device=pot.device)[0]


def make_fedavg_client_app(potential_fn: Callable, *, prior_var: float, n_total: int, local_epochs: int = 2,
                           lr: float = 0.1, batch_size: int = 32, seed: int = 0):
    """A Flower ``ClientApp`` for Flower's ``FedAvg``: load the global weights into this node's
    potential's model, train it on the MAP objective, reply with its weights and ``num-examples``.

    Parameters
    ----------
    potential_fn : callable
        ``potential_fn(context) -> TorchPotential``, the same function the QLSD ClientApp uses.
    prior_var : float
        ``σ²`` of the Gaussian prior ``N(0, σ² I)`` (the QLSD run's ``prior_var``).
    n_total : int
        ``N``, the training points over all clients (the weight decay is ``1/(σ² N)``).
    local_epochs, lr, batch_size : int, float, int
        Local minibatch SGD per round (defaults 2, 0.1, 32: the main job's FedAvg).
    seed : int
        Minibatch order: client ``i`` in round ``r`` uses ``(seed · 1000003 + r) · 10007 + i``.
    """
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    if not (prior_var > 0 and n_total >= 1):
        raise ValueError(f"prior_var must be > 0 and n_total >= 1 (got {prior_var}, {n_total})")
    wd = 1.0 / (float(prior_var) * int(n_total))
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pot = potential_fn(context)
        i = int(context.node_config.get("partition-id", 0))
        rnd = int(msg.content["config"].get("server-round", 0)) if "config" in msg.content else 0
        load_arrays(pot, msg.content["arrays"])
        loss = map_train(pot, local_epochs, lr, batch_size, wd, (seed * 1_000_003 + rnd) * 10_007 + i)
        content = RecordDict({"arrays": ArrayRecord(pot.named_arrays()),
                              "metrics": MetricRecord({"num-examples": int(pot.n_data), "train-loss": float(loss)})})
        return Message(content=content, reply_to=msg)

    return app


def fedavg_strategy(num_clients: int):
    """Flower's own ``FedAvg``, every client every round (``fraction_train = 1``: Flower's unseeded
    node sampling then draws no subset), no client-side evaluation."""
    from flwr.serverapp.strategy import FedAvg

    b = int(num_clients)
    return FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=b, min_evaluate_nodes=0,
                  min_available_nodes=b)


def load_arrays(pot, arrays) -> None:
    """The weights of ``arrays`` (an ``ArrayRecord`` keyed like ``named_parameters()``) into ``pot``'s model."""
    import torch

    state = arrays.to_torch_state_dict()
    with torch.no_grad():
        for name, p in pot.model.named_parameters():
            p.copy_(state[name].to(p.dtype))


def plug_in_probs(pot, arrays, X) -> np.ndarray:
    """``softmax(model_θ̂(X))`` for the weights ``arrays`` (an ``ArrayRecord``, e.g. FedAvg's
    ``result.arrays``), as float64 ``(n, K)``: FedAvg's plug-in predictive."""
    import torch

    load_arrays(pot, arrays)
    with torch.no_grad():
        out = pot.model(torch.as_tensor(np.asarray(X), dtype=pot.dtype, device=pot.device))
        return torch.softmax(out.double(), dim=-1).cpu().numpy()
