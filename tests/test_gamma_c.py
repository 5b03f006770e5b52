"""``gamma-c = auto`` (issue 39): ``γ = c/λ_max`` with ``c = 0.25`` where the posterior is declared
log-concave (every client's potential and the prior) and ``c = 0.125`` otherwise (a network, whose
curvature at θ* understates the chain's: benchmarks/RESULTS.md measures the bias of 0.25 against
HMC). What is declared, and by whom: the built-in GLMs and the Gaussian task say so, a torch model
says so only when it is one ``nn.Linear`` under cross-entropy, a user's potential only when told;
in a user's Flower app each client's handshake says it, and anything but ``True`` reads as no.

Checked on every path that chooses γ: the local engine's preparation, and a user's ServerApp over
Flower's in-process grid, where γ must be exactly ``c/λ_max`` with the ``c`` of the rule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from qlsd_flwr.config import resolve
from qlsd_flwr.core import curvature as cv
from qlsd_flwr.core.potential import GaussianPrior, Task, declares_log_concave
from qlsd_flwr.core.priors import BlockPrior, FunctionPrior, LogHalfNormalPrior, StudentTPrior
from qlsd_flwr.flower import InProcessGrid, QLSDStrategy, make_client_app
from qlsd_flwr.potentials import NumpyPotential, Pooled, TorchPotential
from qlsd_flwr.protocol import build, precondition
from qlsd_flwr.tasks import loading
from qlsd_flwr.tasks.torch_nets import MLP, LinearSoftmax

X = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)
Y = np.arange(12) % 3


def _torch(model, **kw):
    return TorchPotential(model, X, Y, **kw)


def test_what_declares_itself_log_concave():
    assert _torch(nn.Linear(4, 3)).log_concave
    assert _torch(nn.Sequential(nn.Flatten(), nn.Linear(4, 3))).log_concave
    assert _torch(LinearSoftmax(4, 3)).log_concave
    # a hidden layer, an output nonlinearity, two stacked maps, a user's own likelihood: not declared
    assert not _torch(MLP(4, 3, (5,))).log_concave
    assert not _torch(nn.Sequential(nn.Linear(4, 3), nn.Tanh())).log_concave
    assert not _torch(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 3))).log_concave
    ll = lambda out, y: -nn.functional.cross_entropy(out, y, reduction="none")  # noqa: E731
    assert not _torch(nn.Linear(4, 3), log_likelihood=ll).log_concave
    # the user's word wins either way
    assert _torch(MLP(4, 3, (5,)), log_concave=True).log_concave
    assert not _torch(nn.Linear(4, 3), log_concave=False).log_concave
    numpy_pot = dict(grad_sum=lambda t, i: t, value=lambda t: 0.0, n_data=3, dim=2)
    assert not NumpyPotential(**numpy_pot).log_concave and NumpyPotential(**numpy_pot, log_concave=True).log_concave
    # priors: the Gaussian (flat too) and the log half-normal are; Student-t is not; blocks: all of them
    assert declares_log_concave(GaussianPrior(var=5.0)) and declares_log_concave(GaussianPrior())
    assert declares_log_concave(LogHalfNormalPrior()) and not declares_log_concave(StudentTPrior())
    assert not declares_log_concave(FunctionPrior(np.sum, np.ones_like))
    assert declares_log_concave(FunctionPrior(np.sum, np.ones_like, log_concave=True))
    assert declares_log_concave(BlockPrior([(slice(0, 1), GaussianPrior(1.0)), (slice(1, 2), LogHalfNormalPrior())], 2))
    assert not declares_log_concave(BlockPrior([(slice(0, 1), GaussianPrior(1.0)), (slice(1, 2), StudentTPrior())], 2))
    # a handshake's field is untrusted: only True itself declares
    for said in (1, "yes", "True", 1.0, None, [True]):
        assert not declares_log_concave(type("Node", (), {"log_concave": said})())


def test_a_task_is_log_concave_when_its_prior_and_every_client_are():
    lin, net = _torch(nn.Linear(4, 3)), _torch(MLP(4, 3, (5,)))
    task = Task(name="t", dim=lin.dim, clients=[lin, lin], prior=GaussianPrior(var=5.0))
    assert task.log_concave and Pooled(task.clients).log_concave
    assert not Task(name="t", dim=lin.dim, clients=[lin, lin], prior=StudentTPrior()).log_concave
    mixed = Task(name="t", dim=net.dim, clients=[net, net])
    assert not mixed.log_concave and not Pooled(mixed.clients).log_concave
    assert not Task(name="external", dim=3, clients=[]).log_concave  # a user's ServerApp: the handshakes say
    for over in ({"task": "gaussian", "dim": 3, "num-clients": 2},
                 {"task": "logistic", "dataset": "breast_cancer", "num-clients": 2}):
        assert loading.load_task(resolve(over)).log_concave, over


def test_gamma_c_words_and_numbers():
    assert cv.gamma_c("auto", True) == cv.GAMMA_AUTO_C == 0.25
    assert cv.gamma_c(" AUTO ", False) == cv.GAMMA_AUTO_C_NETWORK == 0.125
    assert cv.gamma_c(0.5, False) == 0.5 and cv.gamma_c("0.75", True) == 0.75
    assert resolve({}).get("gamma-c") == "auto"


def _step(task, over):
    cfg = resolve({"task": "gaussian", "num-clients": len(task.clients), "dim": task.dim, "gamma": "auto",
                   "progress": False, "variant": "lsd-pp", **over})
    specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, None) for i in range(cfg.b)]
    prep = precondition.prepare(cfg, task, task.theta0, *build.direct_exchanges(cfg, task, specs))
    return prep.gamma, prep.info


@pytest.mark.parametrize("given", ["auto", 0.25, 0.125])
def test_the_preparation_takes_c_by_the_rule_or_as_given(given):
    """γ is exactly ``c/λ_max`` with ``c`` from the rule (auto) or the key; the same network and the
    same GLM differ only in ``c``."""
    rng = np.random.default_rng(1)
    Xs = [rng.normal(size=(20, 4)).astype(np.float32) for _ in range(2)]
    ys = [np.arange(20) % 3 for _ in range(2)]

    def task_of(make):
        clients = [TorchPotential(make(), x, y, dtype=torch.float64) for x, y in zip(Xs, ys)]
        return Task(name="t", dim=clients[0].dim, clients=clients, prior=GaussianPrior(var=5.0),
                    theta0=clients[0].theta0(), theta_star=clients[0].theta0())

    def net():
        torch.manual_seed(0)
        return MLP(4, 3, (5,))

    def glm():
        torch.manual_seed(0)
        return nn.Linear(4, 3)

    for make, concave in ((net, False), (glm, True)):
        gamma, info = _step(task_of(make), {"gamma-c": given, "theta-star": "closed-form"})
        c = (0.25 if concave else 0.125) if given == "auto" else given
        assert info["log_concave"] is concave and info["gamma_c"] == c
        assert gamma == c / info["lambda_max"]


@pytest.mark.parametrize("network", [True, False, "one says not"])
def test_a_user_s_app_takes_c_from_its_clients_handshakes(quickstart, tmp_path, network):
    """The quickstart's wine network (c = 0.125) and a softmax regression on the same clients
    (0.25), through a user's ServerApp: the server has no potential, only the handshakes. λ_max's products are held
    by the rule the majority of the handshakes names (``robust.products.factors``): one client saying its softmax
    regression is not log-concave halves c (the safer step) but cannot switch the products to the network's weaker
    rule."""
    b = 4
    liar = network == "one says not"
    network = network is True

    def linear(i):
        torch.manual_seed(0)
        return TorchPotential(nn.Linear(13, 3), *quickstart.load_partition(i, b), log_concave=not (liar and i == 2))

    pots = [quickstart.potential(i, b) if network else linear(i) for i in range(b)]
    app = make_client_app(lambda ctx: pots[int(ctx.node_config["partition-id"])])
    st = QLSDStrategy(num_clients=b, dim=pots[0].dim, variant="qlsd-pp", gamma="auto", num_rounds=4, burn_in=1,
                      s=16, seed=0, prior_var=quickstart.PRIOR_VAR, output_dir=str(tmp_path), run_name="c",
                      progress=False, loo="off", plot=False)
    st.start(InProcessGrid(app, b), initial_arrays=None)
    summary = json.loads((Path(st.run_dir) / "summary.json").read_text())
    c = 0.125 if network or liar else 0.25
    assert summary["log_concave"] is (not (network or liar)) and summary["gamma_c"] == c
    assert summary["products_rule"] == ("network" if network else "log-concave")
    assert summary["gamma"] == pytest.approx(c / summary["lambda_max"], rel=1e-12)
