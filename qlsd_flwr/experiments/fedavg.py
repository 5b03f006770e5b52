"""FedAvg baseline on the same model, data and split, on Flower's Ray engine.

Flower's own :class:`flwr.serverapp.strategy.FedAvg` (Message API), subclassed only to count
what travels and to time rounds, with a ``ClientApp`` that runs local minibatch SGD in torch on
client ``i``'s partition (the same :mod:`qlsd_flwr.tasks.registry` split a QLSD run uses).

The local objective is the MAP objective of the same posterior, per example:
``mean cross-entropy + ‖θ‖² / (2 σ² N)`` with ``σ²`` the task's prior variance and ``N`` the
total number of training points (so ``N ×`` it is ``U(θ)``), i.e. weight decay
``1/(σ² N)``. Every round all ``b`` clients train (``fraction_train = 1``, so Flower's
unseeded ``sample_nodes`` draws no random subset) and FedAvg averages their weights by
``num-examples``.

Both ways, every round: the server sends each client the global float32 model and each client sends
its own back, ``32 × P`` bits each way (``P`` parameters), counted as the code length of the arrays
the messages carry; the Flower messages' sizes are counted beside. ``bits`` is the run's
:mod:`qlsd_flwr.outputs.bits` object (its ``sampling`` phase: the training rounds).
Predictive metrics use the plug-in predictive ``softmax(model_θ̂(x))`` of the final global
model (:func:`qlsd_flwr.evaluation.evaluate.predictive_metrics`).
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qlsd_flwr.config import resolve
from qlsd_flwr.outputs import jsonio
from qlsd_flwr.outputs.bits import rounds_only


@dataclass
class FedAvgResult:
    metrics: dict  # predictive metrics of the final global model
    rounds: int
    clients: int
    params: int
    uplink_bits_total: float
    uplink_bits_per_round: float
    uplink_bytes_message_total: int
    downlink_bits_total: int  # the global model sent to every client, every round
    downlink_bytes_message_total: int
    bits: dict  # qlsd_flwr.outputs.bits: both ways, every phase (FedAvg: its rounds only)
    wall_seconds_rounds: float  # first round sent → last round aggregated
    wall_seconds_total: float  # including Ray's start-up
    history: list = field(default_factory=list)  # per round: test accuracy, nnll, seconds
    run_dir: Path | None = None
    state_dict: dict | None = None

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("state_dict",)}
        d["run_dir"] = str(self.run_dir) if self.run_dir is not None else None
        return d


FEDAVG_DEFAULTS = {"num_rounds": 50, "local_epochs": 2, "lr": 0.1, "batch_size": 32,
                   "momentum": 0.0}


@functools.lru_cache(maxsize=4)
def _setup(cfg_json: str):
    import torch

    from qlsd_flwr.tasks import registry
    from qlsd_flwr.tasks.torch_models import build_model

    cfg = resolve(json.loads(cfg_json))
    spec = registry.spec_of(cfg)
    ds = registry.dataset_of(spec.dataset, spec.data_seed, spec.b)
    shape = ds.input_shape if len(ds.input_shape) > 1 else (ds.n_features,)
    model_name = spec.model if spec.task == "mnist" else "logistic"

    def make_model():
        return build_model(model_name, ds.n_classes, shape, seed=spec.data_seed)

    n_total = int(sum(len(p) for p in registry.partition_of(spec)))
    torch.set_num_threads(1)
    return cfg, spec, make_model, n_total


def _local_sgd(model, X, y, epochs, lr, batch, wd, momentum, seed_key, device):
    """:func:`qlsd_flwr.flower.fedavg.map_sgd` (the package's one FedAvg step) on client arrays, with torch's
    mean cross-entropy; returns the mean loss over all epochs."""
    import torch
    import torch.nn.functional as F

    from qlsd_flwr.flower.fedavg import map_sgd

    X = torch.as_tensor(np.asarray(X), dtype=torch.float32, device=device)
    y = torch.as_tensor(np.asarray(y), dtype=torch.long, device=device)
    return map_sgd(model, model.parameters(), F.cross_entropy, X, y, epochs, lr, batch, wd, seed_key,
                   momentum=momentum, device=device)[1]  # the mean over all epochs, as this job has reported


def make_client_app(overrides: dict, fed: dict):
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from qlsd_flwr.tasks import registry

    app = ClientApp()
    cfg_json = json.dumps(overrides, sort_keys=True, default=str)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cfg, spec, make_model, n_total = _setup(cfg_json)
        i = int(context.node_config["partition-id"])
        X, y = registry.client_arrays(cfg, i)
        model = make_model().to(spec.device)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        rnd = int(msg.content["config"].get("server-round", 0))
        wd = 1.0 / (spec.prior_var * n_total)
        loss = _local_sgd(model, X, y, int(fed["local_epochs"]), float(fed["lr"]),
                          int(fed["batch_size"]), wd, float(fed["momentum"]),
                          (cfg.seed * 1_000_003 + rnd) * 10_007 + i, spec.device)
        content = RecordDict({"arrays": ArrayRecord(model.cpu().state_dict()),
                              "metrics": MetricRecord({"num-examples": int(len(y)),
                                                       "train-loss": float(loss)})})
        return Message(content=content, reply_to=msg)

    return app


def _array_bits(msg) -> int:
    """The code length of the arrays a Flower message carries (8 bits a byte of their numbers)."""
    return 8 * sum(int(arr.numpy().nbytes) for rec in msg.content.array_records.values() for arr in rec.values())


def _counting_fedavg(b: int, log: dict):
    from flwr.serverapp.strategy import FedAvg

    from qlsd_flwr.flower.sizing import message_nbytes

    class CountingFedAvg(FedAvg):
        """Flower's FedAvg; also counts replies, their bytes and each round's time."""

        def configure_train(self, server_round, arrays, config, grid):
            log["t_round"] = time.perf_counter()
            log.setdefault("t_first", log["t_round"])
            msgs = list(super().configure_train(server_round, arrays, config, grid))
            log["down_bits"].append(sum(_array_bits(m) for m in msgs))
            log["down_bytes"].append(int(sum(message_nbytes(m) for m in msgs)))
            return msgs

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            ok = [m for m in replies if not m.has_error()]
            log["replies"].append(len(ok))
            log["up_bits"].append(sum(_array_bits(m) for m in ok))
            log["bytes"].append(int(sum(message_nbytes(m) for m in ok)))
            out = super().aggregate_train(server_round, replies)
            log["seconds"].append(time.perf_counter() - log["t_round"])
            log["t_last"] = time.perf_counter()
            return out

    return CountingFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=b,
                          min_evaluate_nodes=0, min_available_nodes=b)


def run_fedavg(overrides: dict, num_rounds: int | None = None, local_epochs: int | None = None,
               lr: float | None = None, batch_size: int | None = None, momentum: float | None = None,
               out_dir: str | os.PathLike | None = None, progress: bool | None = None) -> FedAvgResult:
    """FedAvg on Flower's Ray engine for the task/model/split that ``overrides`` (run-config
    keys) describe; ``num-clients`` clients, all training every round. Writes, when
    ``out_dir`` is given, ``fedavg.json`` (settings, history, metrics), ``evaluation.json``,
    ``reliability.png`` and the final weights ``model.pt`` there."""
    import torch
    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from qlsd_flwr.evaluation import evaluate as E
    from qlsd_flwr.flower.server_app import quiet_flower
    from qlsd_flwr.outputs.progress import progress_bar
    from qlsd_flwr.run.simulate import ray_backend_config
    from qlsd_flwr.tasks import registry

    fed = dict(FEDAVG_DEFAULTS)
    for k, v in (("num_rounds", num_rounds), ("local_epochs", local_epochs), ("lr", lr),
                 ("batch_size", batch_size), ("momentum", momentum)):
        if v is not None:
            fed[k] = v
    cfg = resolve(overrides)
    quiet_flower(cfg.verbose)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    _, spec, make_model, _ = _setup(json.dumps(overrides, sort_keys=True, default=str))
    b = spec.b
    X_te, y_te, _, _ = registry.test_set(cfg)
    X_te_t = torch.as_tensor(np.asarray(X_te), dtype=torch.float32)
    log = {"replies": [], "bytes": [], "seconds": [], "history": [], "up_bits": [], "down_bits": [], "down_bytes": []}
    sink: dict = {}
    R = int(fed["num_rounds"])
    bar = progress_bar(R, cfg.progress if progress is None else progress, "fedavg flower-ray")
    evaluator = make_model()

    def probs_of(state_dict, X_t):
        evaluator.load_state_dict(state_dict)
        evaluator.eval()
        with torch.no_grad():
            return torch.softmax(evaluator(X_t).double(), dim=1).numpy()

    def evaluate_fn(rnd: int, arrays: ArrayRecord):
        p = probs_of(arrays.to_torch_state_dict(), X_te_t)
        from qlsd_flwr.evaluation import metrics as M

        log["history"].append({"round": rnd, "accuracy": M.accuracy(p, y_te), "nnll": M.nnll(p, y_te),
                               "seconds": log["seconds"][-1] if rnd > 0 and log["seconds"] else 0.0,
                               "replies": log["replies"][-1] if rnd > 0 and log["replies"] else 0})
        if rnd > 0:
            bar.update(1)
        return MetricRecord({"accuracy": log["history"][-1]["accuracy"]})

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = _counting_fedavg(b, log)
        init = ArrayRecord(make_model().state_dict())
        res = strategy.start(grid=grid, initial_arrays=init, num_rounds=R, evaluate_fn=evaluate_fn)
        sink["arrays"] = res.arrays

    t0 = time.perf_counter()
    run_simulation(server_app=server, client_app=make_client_app(overrides, fed), num_supernodes=b,
                   backend_config=ray_backend_config(cfg), verbose_logging=cfg.verbose)
    wall_total = time.perf_counter() - t0
    bar.close()
    if "arrays" not in sink or len(log["replies"]) != R:
        raise RuntimeError("the FedAvg simulation did not finish; rerun with verbose=true")
    state = sink["arrays"].to_torch_state_dict()
    P = int(sum(v.numel() for v in state.values()))
    bits_rounds = [float(n) for n in log["up_bits"]]
    run_dir = Path(out_dir) if out_dir is not None else None
    probs = probs_of(state, X_te_t)
    ood = {k: probs_of(state, torch.as_tensor(E.ood_inputs(X_te, k), dtype=torch.float32))
           for k in ("permuted", "noise")}
    metrics = E.predictive_metrics(probs, y_te, ood)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        from qlsd_flwr.evaluation import metrics as M

        M.reliability_diagram(probs, y_te, E.N_BINS, path=run_dir / "reliability.png",
                              title=f"FedAvg on {cfg.get('task')}\nECE = {metrics['ece']:.4f} "
                                    f"({E.N_BINS} bins)")
        metrics["reliability_diagram"] = str(run_dir / "reliability.png")
        torch.save(state, run_dir / "model.pt")
    result = FedAvgResult(
        metrics=metrics, rounds=R, clients=b, params=P, uplink_bits_total=float(sum(bits_rounds)),
        uplink_bits_per_round=float(np.mean(bits_rounds)),
        uplink_bytes_message_total=int(sum(log["bytes"])),
        downlink_bits_total=int(sum(log["down_bits"])), downlink_bytes_message_total=int(sum(log["down_bytes"])),
        bits=rounds_only(int(sum(log["up_bits"])), int(sum(log["down_bits"]))),
        wall_seconds_rounds=float(log["t_last"] - log["t_first"]), wall_seconds_total=wall_total,
        history=log["history"], run_dir=run_dir, state_dict=state)
    if run_dir is not None:
        (run_dir / "evaluation.json").write_text(jsonio.dumps(metrics, indent=2))
        (run_dir / "fedavg.json").write_text(jsonio.dumps(
            {"settings": {**fed, "weight_decay": 1.0 / (spec.prior_var * sum(
                len(p) for p in registry.partition_of(spec))), "config": overrides},
             **result.to_dict()}, indent=2, default=str))
    return result
