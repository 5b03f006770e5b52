"""The public API for users' own models (the front-door issue): ``QLSDStrategy(**kwargs)`` on the
server with only server-side facts, ``make_client_app(potential_fn)`` on the clients, the potential
adapters of :mod:`qlsd_flwr.potentials`, and task plug-ins that run on every engine.

The reference is always a chain the project already trusts (the built-in Gaussian task, whose
engines agree bit for bit and whose samples match the exact posterior in
``test_gaussian_posterior.py``): a user's potential that computes the same numbers in the same
order must give the same chain, bit for bit.
"""

from __future__ import annotations

import inspect
import re
import sys

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from qlsd_flwr.flower import QLSDStrategy, make_client_app
from qlsd_flwr.flower.inprocess import InProcessGrid
from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.potentials import (
    LogDensityPotential,
    NumpyPotential,
    Pooled,
    TorchPotential,
)
from qlsd_flwr.protocol.build import client_spec_from_settings
from qlsd_flwr.run.simulate import run
from qlsd_flwr.tasks.gaussian import GaussianLocal, build_gaussian_task, client_data

B, D, K = 4, 5, 25
SAMPLER = {"variant": "qlsd-pp", "gamma": 2e-3, "num_rounds": K, "burn_in": 5, "s": 8, "l": 10, "p": 0.75,
           "prior_var": 4.0, "seed": 3}


def _config_keys(kw: dict) -> dict:
    return {k.replace("_", "-"): (str(v) if k in ("s", "p") else v) for k, v in kw.items()}


def _user_app(kind: str):
    def potential_fn(context):
        i = int(context.node_config["partition-id"])
        y = client_data(i, D, 0)
        ref = GaussianLocal(y)
        if kind == "numpy":
            return NumpyPotential(ref.grad_sum, ref.value, n_data=len(y), dim=D)
        return ref

    return make_client_app(potential_fn)


def test_strategy_documents_every_keyword_with_its_default():
    sig = inspect.signature(QLSDStrategy.__init__)
    doc = QLSDStrategy.__doc__
    for name, par in sig.parameters.items():
        if name in ("self", "config"):
            continue
        assert par.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert re.search(rf"^\s+{name}\b.*:", doc, re.M) or f", {name}" in doc, f"{name} undocumented"
    assert "**config" in doc


@pytest.mark.parametrize("kind", ["numpy", "plain"])
def test_user_potential_through_the_public_api_equals_the_builtin_chain(tmp_path, kind):
    # server: only b, d, the prior and the settings; clients: their own potentials
    task = build_gaussian_task(B, D, 0, prior_var=4.0)
    strategy = QLSDStrategy(num_clients=B, dim=D, output_dir=str(tmp_path), run_name="user",
                            progress=False, **SAMPLER)
    theta0 = np.linspace(-1, 1, D)
    strategy.start(InProcessGrid(_user_app(kind), B, shuffle_seed=1),
                   initial_arrays=ArrayRecord({"w": Array(theta0)}))
    assert strategy.task.clients == []  # the server never held any client's data
    ref_task = task
    ref_task.theta0 = theta0
    ref = run({**_config_keys(SAMPLER), "num-clients": B, "dim": D, "engine": "local", "progress": False,
               "output-dir": str(tmp_path), "run-name": "ref"}, task=ref_task)
    assert np.array_equal(load_samples(strategy.run_dir), load_samples(ref.run_dir))
    mc = strategy.summary_data["memory_check"]  # the clients' own η_i equal the server's mirrors
    assert mc["clients_reported"] == list(range(B)) and mc["max_abs_mirror_diff"] == 0.0
    assert all(mc["eta_count_agrees"].values())


def test_theta_goes_downlink_as_an_array_record_with_the_client_settings(tmp_path):
    seen = []

    def spy(msg, ctx, call_next):
        if msg.metadata.message_type == "train":
            seen.append((ctx.node_id, msg.content))
        return call_next(msg, ctx)

    app = make_client_app(lambda c: GaussianLocal(client_data(int(c.node_config["partition-id"]), D, 0)),
                          mods=[spy])
    grid = InProcessGrid(app, B)
    strategy = QLSDStrategy(num_clients=B, dim=D, write=False, progress=False, keep_trace=True,
                            **{**SAMPLER, "num_rounds": 6, "burn_in": 0})
    strategy.start(grid)
    assert seen
    first: set = set()
    for node, content in seen:
        arrays = content["arrays"]
        assert isinstance(arrays, ArrayRecord) and arrays["theta"].numpy().shape == (D,)
        assert "theta" not in content["qlsd"]  # no θ as bytes in a ConfigRecord
        # the settings travel with the first message to each client only; it keeps them
        assert ("qlsd-settings" in content) == (node not in first)
        if node not in first:
            settings = content["qlsd-settings"]
            assert isinstance(settings, ConfigRecord) and settings["s"] == 8 and settings["oracle"] == "svrg"
            first.add(node)
    # a node that lost its state (a restart) asks again (resync) and gets them: the chain goes on
    for nid in grid.node_ids:
        grid.contexts[nid].state = type(grid.contexts[nid].state)()
    again = QLSDStrategy(num_clients=B, dim=D, write=False, progress=False, keep_trace=True,
                         **{**SAMPLER, "num_rounds": 6, "burn_in": 0})
    again._settings_sent = set(range(B))  # as if the settings had gone before the restart
    again.start(grid)
    assert again.summary_data["rejected"].get("resync", 0) >= 1 and np.all(np.isfinite(again.trace))


def test_client_settings_are_checked_and_name_the_bad_value():
    good = {"oracle": "svrg", "memory": True, "alpha": 0.5, "s": 8, "encoding": "auto", "blocks": "",
            "batch_fraction": 0.1, "prior_var": 1.0, "prior_mean": 0.0, "prior_weight": 0.0, "seed": 0}
    client_spec_from_settings(good, 0, 10, D)
    for key, bad in [("oracle", "sgd"), ("s", -1), ("alpha", 2.0), ("batch_fraction", 0.0), ("prior_var", -1.0),
                     ("blocks", "2,2"), ("seed", -5)]:
        with pytest.raises(ValueError, match=key):
            client_spec_from_settings({**good, key: bad}, 0, 10, D)
    with pytest.raises(ValueError, match="missing"):
        client_spec_from_settings({k: v for k, v in good.items() if k != "alpha"}, 0, 10, D)


def test_a_potential_fn_returning_something_else_is_a_counted_client_error(tmp_path):
    strategy = QLSDStrategy(num_clients=B, dim=D, write=False, progress=False, **{**SAMPLER, "num_rounds": 2, "burn_in": 0})
    with pytest.raises(Exception, match="potential_fn returned list, which lacks n_data, dim, grad_sum, value"):
        strategy.start(InProcessGrid(make_client_app(lambda c: [1, 2]), B))


def test_strategy_refuses_bad_keywords_naming_them():
    with pytest.raises(ValueError, match="gamma"):
        QLSDStrategy(num_clients=B, dim=D, gamma=-1.0, write=False)
    with pytest.raises(ValueError, match="did you mean gamma"):
        QLSDStrategy(num_clients=B, dim=D, gama=1e-3, write=False)
    with pytest.raises(ValueError, match="theta_star"):
        QLSDStrategy(num_clients=B, dim=D, variant="qlsd-star", theta_star=np.zeros(D + 1), write=False)
    with pytest.raises(ValueError, match="blocks"):
        QLSDStrategy(num_clients=B, dim=D, blocks=[2, 2], write=False)


def test_log_density_potential_matches_the_closed_form():
    # U_ij = ‖θ − y_j‖²/2: autograd in float64 against the closed form; both sum the same
    # d-vectors, so they agree to a few ulps of the largest term (N · max|θ − y|)
    y = client_data(1, D, 0)
    ref = GaussianLocal(y)
    pot = LogDensityPotential(lambda th, batch: -0.5 * ((th - batch) ** 2).sum(dim=1), y, D, batch_size=7)
    theta = np.linspace(-2, 2, D)
    idx = np.array([0, 3, 5, 8])
    scale = len(y) * np.abs(theta[None] - y).max()
    assert np.allclose(pot.grad_sum(theta), ref.grad_sum(theta), rtol=0, atol=64 * np.finfo(float).eps * scale)
    assert np.allclose(pot.grad_sum(theta, idx), ref.grad_sum(theta, idx), rtol=0, atol=1e-12)
    assert pot.value(theta) == pytest.approx(ref.value(theta), rel=1e-12)
    assert pot.n_data == len(y) and pot.dim == D


def test_torch_potential_takes_a_per_example_loss_or_log_likelihood():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2).double()
    X, y = torch.randn(11, 3, dtype=torch.float64), torch.randint(0, 2, (11,))
    ce = TorchPotential(net, X, y)
    ll = TorchPotential(net, X, y, log_likelihood=lambda out, t: -torch.nn.functional.cross_entropy(out, t, reduction="none"))
    theta = ce.theta0() + 0.1
    assert np.allclose(ce.grad_sum(theta), ll.grad_sum(theta), rtol=1e-12, atol=1e-12)
    assert ce.value(theta) == pytest.approx(ll.value(theta), rel=1e-12)
    reg = TorchPotential(torch.nn.Linear(3, 1).double(), X, torch.randn(11, 1, dtype=torch.float64),
                         loss=lambda out, t: 0.5 * ((out - t) ** 2).sum(dim=1))
    assert reg.grad_sum(reg.theta0()).shape == (reg.dim,)
    names = list(ce.named_arrays())
    assert names == ["weight", "bias"] and ArrayRecord(ce.named_arrays())["weight"].numpy().shape == (2, 3)
    with pytest.raises(ValueError, match="not both"):
        TorchPotential(net, X, y, loss=lambda o, t: o, log_likelihood=lambda o, t: o)


def test_pooled_potential_sums_its_clients():
    parts = [GaussianLocal(client_data(i, D, 0)) for i in range(3)]
    pool, whole = Pooled(parts), GaussianLocal(np.concatenate([p.y for p in parts]))
    theta = np.linspace(0, 1, D)
    idx = np.array([0, parts[0].n_data, parts[0].n_data + parts[1].n_data + 2])
    assert pool.n_data == whole.n_data
    assert np.allclose(pool.grad_sum(theta), whole.grad_sum(theta), atol=1e-9)
    assert np.allclose(pool.grad_sum(theta, idx), whole.grad_sum(theta, idx), atol=1e-12)


# ---- a task plug-in runs on every engine and gives the same chain ------------------------------
def make_task(num_clients: int, data_seed: int):
    """A user's task plug-in (``task = "test_public_api:make_task"``): the toy Gaussian, built
    from the public names only."""
    from qlsd_flwr.potentials import GaussianPrior, Task

    clients = [NumpyPotential(GaussianLocal(client_data(i, D, data_seed)).grad_sum,
                              GaussianLocal(client_data(i, D, data_seed)).value,
                              n_data=len(client_data(i, D, data_seed)), dim=D) for i in range(num_clients)]
    return Task(name="user-gaussian", dim=D, clients=clients, prior=GaussianPrior(var=4.0))


BATCH_CALLS: list = []


def make_batched_task(num_clients: int, data_seed: int):
    """The same plug-in with a user's ``grad_sum_batch`` (rows one by one: bitwise by
    construction; it records the number of rows of each call)."""
    from qlsd_flwr.potentials import GaussianPrior, Task

    def potential(i):
        local = GaussianLocal(client_data(i, D, data_seed))

        def batch(thetas, idx):
            BATCH_CALLS.append(len(thetas))
            return np.stack([local.grad_sum(t, None if idx is None else ix)
                             for t, ix in zip(thetas, [None] * len(thetas) if idx is None else idx)])
        return NumpyPotential(local.grad_sum, local.value, n_data=len(local.y), dim=D, grad_sum_batch=batch)

    return Task(name="user-gaussian-batched", dim=D, clients=[potential(i) for i in range(num_clients)],
                prior=GaussianPrior(var=4.0))


def test_a_users_batched_gradient_is_called_for_all_chains_and_keeps_the_chains(tmp_path, monkeypatch):
    # NumpyPotential(grad_sum_batch=...): the vectorised engine and a several-chain Flower client
    # hand it all their chains at once; the chains stay those of the plug-in without it
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    import test_public_api as mod

    base = {**_config_keys(SAMPLER), "variant": "qlsd-pp", "num-clients": B, "dim": D, "prior-var": 4.0,
            "num-chains": 3, "progress": False, "output-dir": str(tmp_path)}
    for engine in ("inprocess", "vectorised"):
        ref = load_samples(run({**base, "task": "test_public_api:make_task", "engine": engine,
                                "run-name": f"{engine}-plain"}).run_dir)
        mod.BATCH_CALLS.clear()
        out = run({**base, "task": "test_public_api:make_batched_task", "engine": engine, "run-name": engine})
        assert mod.BATCH_CALLS and max(mod.BATCH_CALLS) >= 3, engine  # the chains (θ and ζ rows) in one call
        assert np.array_equal(load_samples(out.run_dir), ref), engine
    bad = NumpyPotential(lambda th, idx: th, lambda th: 0.0, 4, D, grad_sum_batch=lambda ths, idx: ths[:1])
    with pytest.raises(ValueError, match=r"grad_sum_batch returned shape \(1, 5\), expected \(3, 5\)"):
        bad.grad_sum_batch(np.zeros((3, D)))
    sys.modules.pop("test_public_api", None)


@pytest.mark.parametrize("variant", ["qlsd-pp", "qlsd-sharp"])
def test_a_task_plugin_gives_the_builtin_chain_on_every_non_ray_engine(tmp_path, monkeypatch, variant):
    # the Ray engine runs a user's task in the flwr-run test (test_flwr_run.py)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    base = {**_config_keys(SAMPLER), "variant": variant, "num-clients": B, "dim": D, "prior-var": 4.0,
            "progress": False, "output-dir": str(tmp_path)}
    ref = load_samples(run({**base, "engine": "local", "run-name": "builtin"}).run_dir)
    for engine in ("local", "inprocess", "vectorised"):
        out = run({**base, "task": "test_public_api:make_task", "engine": engine, "run-name": engine})
        assert np.array_equal(load_samples(out.run_dir), ref), engine
    sys.modules.pop("test_public_api", None)


@pytest.mark.parametrize("variant", ["qlsd", "qlsd-sharp", "qlsd-pp", "sgld"])
def test_a_forged_anchor_version_is_a_counted_rejection_and_changes_nothing(variant):
    # Flower's records carry 2^63 (it does not fit the server's int64 bookkeeping): the reply is
    # rejected and counted, and the round ends exactly as if that client had not replied
    from qlsd_flwr.config import resolve
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol.client import handle
    from qlsd_flwr.protocol.server import QLSDServer
    from qlsd_flwr.protocol.wire import vectors_to_bytes

    cfg = resolve({"variant": variant, "num-clients": 3, "dim": D, "s": "8", "num-rounds": 5, "burn-in": 0,
                   "progress": False})
    task = build_gaussian_task(cfg.b, D, 0) if variant != "sgld" else build_gaussian_task(3, D, 0, pooled=True)

    def one_round(forge: bool):
        server = QLSDServer(cfg, task)
        server.begin(task.theta_star)
        specs = [client_spec_from_settings(server.settings[i], i, task.clients[i].n_data, D)[0] for i in range(cfg.b)]
        for i in server.begin_round():
            reply = handle(specs[i], task.clients[i], ClientState(), cfg.seed,
                           vectors_to_bytes(server.fields_for(i)), D)
            if forge and i == 0:
                reply["anchor_version"] = 2 ** 63
            server.accept(i, reply)
        server.end_round()
        return server

    forged, honest = one_round(True), one_round(False)
    assert forged.rejected == {"stale_anchor": 1}
    assert 0 in forged.missed_rounds and 0 not in honest.missed_rounds
    assert forged.anchor_acked[0] == -2 and forged.eta_count[0] == 0  # nothing of the reply was kept


def make_named_task(num_clients: int, data_seed: int):
    """:func:`make_task` whose coordinates are named, or misnamed (``LABELS_KEY``)."""
    task = make_task(num_clients, data_seed)
    task.meta[LABELS_KEY] = [f"mu[{j}]" for j in range(D)]
    return task


LABELS_KEY = "param_labels"


def test_a_plugin_names_its_coordinates_in_param_labels_and_a_lookalike_key_is_refused(tmp_path, monkeypatch):
    import arviz as az

    import test_public_api as mod
    from qlsd_flwr.config import ConfigError

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    base = {**_config_keys(SAMPLER), "num-clients": B, "progress": False, "output-dir": str(tmp_path),
            "task": "test_public_api:make_named_task", "engine": "vectorised", "loo": "off"}
    out = run({**base, "run-name": "named"})
    assert az.from_netcdf(out.run_dir / "samples.nc").posterior["theta_dim_0"].values.tolist() == \
        [f"mu[{j}]" for j in range(D)]
    monkeypatch.setattr(mod, "LABELS_KEY", "names")  # a guess that used to leave them numbered silently
    with pytest.raises(ConfigError, match=r"meta\['names'\].*meta\['param_labels'\]"):
        run({**base, "run-name": "guessed"})
    sys.modules.pop("test_public_api", None)


def test_config_json_holds_only_the_keys_that_apply(tmp_path):
    import json

    strategy = QLSDStrategy(num_clients=B, dim=D, output_dir=str(tmp_path), run_name="user", progress=False,
                            **SAMPLER)
    strategy.start(InProcessGrid(_user_app("plain"), B, shuffle_seed=1),
                   initial_arrays=ArrayRecord({"w": Array(np.zeros(D))}))
    doc = json.loads((strategy.run_dir / "config.json").read_text())
    for key in ("model", "dataset", "partition", "theta-star", "opt-rounds", "metric-from", "dim", "gamma-c"):
        assert key not in doc["config"] and key in doc["not_applicable"], key
    assert doc["config"]["variant"] == "qlsd-pp" and doc["config"]["gamma"] == SAMPLER["gamma"]
    # the coordinates are named from the initial arrays' names
    import arviz as az

    assert az.from_netcdf(strategy.run_dir / "samples.nc").posterior["theta_dim_0"].values.tolist()[:2] == \
        ["w[0]", "w[1]"]


def test_a_users_resumed_run_keeps_the_coordinate_names_of_its_initial_arrays(tmp_path):
    # initial_arrays name θ's coordinates; a resume takes no initial_arrays (θ is the checkpoint's):
    # the names come back from the checkpoint, so samples.nc reads as the uninterrupted run's
    import arviz as az

    def stop_at_7(strategy):
        if strategy.state.k == 7:
            raise KeyboardInterrupt

    kw = dict(num_clients=B, dim=D, output_dir=str(tmp_path), run_name="user", progress=False, checkpoint_every=5,
              **SAMPLER)
    with pytest.raises(KeyboardInterrupt):
        QLSDStrategy(**kw, on_round=stop_at_7).start(InProcessGrid(_user_app("plain"), B, shuffle_seed=1),
                                                    initial_arrays=ArrayRecord({"w": Array(np.zeros(D))}))
    again = QLSDStrategy(**{**kw, "resume": str(tmp_path / "user")})
    again.start(InProcessGrid(_user_app("plain"), B, shuffle_seed=1))
    names = az.from_netcdf(again.run_dir / "samples.nc").posterior["theta_dim_0"].values.tolist()
    assert names == [f"w[{j}]" for j in range(D)]
