"""The batched oracles of the numpy backend equal the per-client ones bit for bit.

Why bit for bit, not up to a rounding tolerance: the batched logistic gradient
(:meth:`LogisticLocal.grad_sum_batch` / :meth:`LogisticLocal.grad_sum_clients`) performs, for
every (chain, client) row, the very floating-point operations of the one-row ``grad_sum`` on the
same numbers. Its two products are ``np.matmul`` over stacks, and numpy's matmul loop makes for
each matrix of a stack the BLAS call the one-row ``@`` makes: the same routine (``dgemm``, or
``dgemv``/numpy's own loop when a size is 1), sizes, transposition flags and leading dimensions
(derived from the inner two strides, which are the same). No product of another shape (an
``einsum``, a ``(C·n, p+1) @ (p+1, K)`` product) is used, so nothing rests on which kernel BLAS
picks for a shape, on this machine or another. The softmax is the same function on the same
contiguous rows (a maximum, a subtraction, ``exp``, a row sum, a division: elementwise
operations and per-row reductions); the oracles' remaining arithmetic is elementwise over the
chain and client axes. Both sides call the same ``exp`` on the same inputs, so the comparisons
do not depend on the last bits of any math library, only on its determinism; nor on speed.

The backend's compiled draws and quantisation are the compiled twins of ``rng`` and ``QSGD``
that ``tests/test_vectorised.py`` checks bit for bit; here whole runs of the batched path are
compared with the per-client path (``batched=False``), chain by chain, with every count.
"""

import numpy as np
import pytest

from qlsd_flwr import samplers
from qlsd_flwr.compression.qsgd import QSGD
from qlsd_flwr.config import resolve
from qlsd_flwr.core import participation, rng
from qlsd_flwr.core.oracles import (
    ClientSpec,
    ClientState,
    full_local_grad,
    full_local_grad_batch,
    oracle,
    oracle_batch,
    oracle_batch_clients,
)
from qlsd_flwr.core.potential import GaussianPrior
from qlsd_flwr.engines import vectorised as V
from qlsd_flwr.engines.vectorised import driver
from qlsd_flwr.engines.vectorised.numpy_backend import NumpyGeneric
from qlsd_flwr.engines.vectorised.results import ChainStats
from qlsd_flwr.protocol.divergence import DivergenceError
from qlsd_flwr.tasks.logistic import LogisticLocal, build_logistic_task

PRIOR_VAR = 2e-2
TASK = build_logistic_task("breast_cancer", b=4, prior_var=PRIOR_VAR)
ORACLES = ("full", "minibatch", "star", "svrg")


def bits(a):
    """The IEEE bit patterns (``np.array_equal`` alone would take ``-0.0`` for ``0.0``)."""
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)


def same(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def random_potential(gen, N=None, p=None, K=None):
    N = N or int(gen.integers(1, 150))
    p = p or int(gen.integers(1, 70))
    K = K or int(gen.integers(2, 11))
    X = gen.normal(size=(N, p)) * gen.uniform(0.1, 4.0)
    return LogisticLocal(X, gen.integers(0, K, N), K)


def subsets(gen, N, n, C):
    return np.sort(np.stack([gen.choice(N, n, replace=False) for _ in range(C)]), axis=1)


def test_grad_sum_batch_is_grad_sum_row_by_row():
    gen = np.random.default_rng(0)
    for case in range(120):
        pot = random_potential(gen)
        C = int(gen.integers(1, 17))
        th = gen.normal(size=(C, pot.dim)) * gen.uniform(0.01, 3.0)
        # n = 1 (numpy's gemv / own loop), n = N (every row), and anything between
        n = (1, pot.n_data, int(gen.integers(1, pot.n_data + 1)))[case % 3]
        idx = subsets(gen, pot.n_data, n, C)
        for ix in (None, idx):
            G = pot.grad_sum_batch(th, ix)
            for c in range(C):
                assert same(G[c], pot.grad_sum(th[c], None if ix is None else ix[c])), (case, c, ix is None)
    # a strided parameter array (rows of a bigger one, a broadcast θ*) gives the same
    pot = random_potential(gen, N=40, p=9, K=3)
    big = gen.normal(size=(5, 2 * pot.dim))
    idx = subsets(gen, 40, 6, 5)
    assert same(pot.grad_sum_batch(big[:, ::2], idx), pot.grad_sum_batch(np.ascontiguousarray(big[:, ::2]), idx))
    star = gen.normal(size=pot.dim)
    assert same(pot.grad_sum_batch(np.broadcast_to(star, (5, pot.dim)), idx)[3], pot.grad_sum(star, idx[3]))


def test_grad_sum_clients_is_grad_sum_slice_by_slice():
    gen = np.random.default_rng(1)
    for case in range(80):
        p, K = int(gen.integers(1, 70)), int(gen.integers(2, 11))
        pots = [random_potential(gen, N=int(gen.integers(1, 120)), p=p, K=K) for _ in range(int(gen.integers(1, 6)))]
        A, C = int(gen.integers(1, 3)), int(gen.integers(1, 10))
        th = gen.normal(size=(A, C, pots[0].dim))
        # each client its own minibatch size (1, all rows, anything between) or all its data (None)
        idxs = [None if gen.random() < 0.25 else
                subsets(gen, pt.n_data, (1, pt.n_data, int(gen.integers(1, pt.n_data + 1)))[int(gen.integers(3))], C)
                for pt in pots]
        out = LogisticLocal.grad_sum_clients(pots, th, idxs)
        for g, pt in enumerate(pots):
            for a in range(A):
                for c in range(C):
                    ref = pt.grad_sum(th[a, c], None if idxs[g] is None else idxs[g][c])
                    assert same(out[g, a, c], ref), (case, g, a, c)
    with pytest.raises(ValueError, match="one model"):
        LogisticLocal.grad_sum_clients([random_potential(gen, p=3, K=2), random_potential(gen, p=4, K=2)],
                                       np.zeros((1, 1, 8)), [np.zeros((1, 1), np.int64)] * 2)


def _spec(i, kind, n, w, prior_var=PRIOR_VAR):
    return ClientSpec(index=i, kind=samplers.ESTIMATORS[kind], batch_size=n, compressor=QSGD(16), memory=kind == "svrg",
                      alpha=0.5, prior=GaussianPrior(var=prior_var), prior_weight=w)


class RowByRow:
    """A potential with ``grad_sum`` only: the batched oracles must fall back to rows."""

    def __init__(self, pot):
        self.pot, self.n_data, self.dim = pot, pot.n_data, pot.dim

    def grad_sum(self, theta, idx=None):
        return self.pot.grad_sum(theta, idx)


@pytest.mark.parametrize("kind", ORACLES)
def test_every_oracle_batched_equals_per_chain(kind):
    gen = np.random.default_rng(2)
    C, d = 6, TASK.dim
    for case in range(6):
        w, pv = ((0.0, np.inf), (0.25, PRIOR_VAR), (1.0, 0.5))[case % 3]  # prior on the server, shared, all
        th = gen.normal(size=(C, d)) * 0.3
        zeta = gen.normal(size=(C, d)) * 0.3
        theta_star = gen.normal(size=d) * 0.3
        specs, idxs, ags = [], [], []
        for i, pot in enumerate(TASK.clients):
            n = max(1, pot.n_data // 10)
            specs.append(_spec(i, kind, n, w, pv))
            idxs.append(None if kind == "full" else subsets(gen, pot.n_data, n, C))
            ags.append(full_local_grad_batch(specs[-1], pot, zeta))
        anchor = zeta if kind == "svrg" else theta_star
        for i, pot in enumerate(TASK.clients):
            refs = []
            for c in range(C):
                st = ClientState(anchor=zeta[c] if kind == "svrg" else theta_star,
                                 anchor_grad=full_local_grad(specs[i], pot, zeta[c]))
                assert same(ags[i][c], st.anchor_grad)  # the anchor refresh, batched
                refs.append(oracle(specs[i], pot, st, th[c], None if idxs[i] is None else idxs[i][c]))
            refs = np.stack(refs)
            got = oracle_batch(specs[i], pot, th, idxs[i], anchor, ags[i])
            assert same(got, refs), (kind, case, i)
            slow = oracle_batch(specs[i], RowByRow(pot), th, idxs[i], anchor, ags[i])
            assert same(slow, refs), (kind, case, i)
        # every client together (their own minibatch sizes): oracle_batch_clients
        got = oracle_batch_clients(specs, list(TASK.clients), th, idxs, anchor, np.stack(ags, axis=1))
        for i, pot in enumerate(TASK.clients):
            assert same(got[:, i], oracle_batch(specs[i], pot, th, idxs[i], anchor, ags[i])), (kind, case, i)
        rows = [RowByRow(p) for p in TASK.clients]  # no grad_sum_clients: client by client, row by row
        slow = oracle_batch_clients(specs, rows, th, idxs, anchor, np.stack(ags, axis=1))
        assert same(slow, got)


def _cfg(over: dict, K: int, chains: int = 3):
    return resolve({"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "prior-var": PRIOR_VAR,
                    "num-rounds": K, "burn-in": K // 2, "seed": 11, "progress": False, "num-chains": chains,
                    "engine": "vectorised", "gamma": 2e-4, **over})


def _run(cfg, task, batched: bool, monkeypatch):
    monkeypatch.setattr(NumpyGeneric, "BATCHED", batched)
    return V.run_vectorised(cfg, task=task, write=False, keep_trace=True, progress=False, backend="numpy")


RUNS = [
    ({"variant": "qlsd-pp", "s": "16", "l": 7}, 40),
    ({"variant": "qlsd-pp", "s": "3", "p": "0.4", "l": 5, "aggregation": "active-fraction",
      "prior-on": "clients", "encoding": "elias"}, 40),
    ({"variant": "lsd-pp", "p": "0.6", "l": 6}, 30),
    ({"variant": "qlsd-sharp", "s": "4", "p": "0.7", "batch-fraction": 0.05}, 30),
    ({"variant": "qlsd-star", "s": "16", "theta-star": "optimise", "opt-rounds": 50,
      "opt-accept-unconverged": True, "encoding": "packed"}, 30),
    ({"variant": "qlsd", "s": "8"}, 20),  # the full-gradient oracle
    ({"variant": "qlsd-sharp", "s": "16", "batch-fraction": 1.0}, 20),  # n_i = N_i: every row
]


@pytest.mark.parametrize("over, K", RUNS, ids=[f'{o["variant"]}-{j}' for j, (o, _) in enumerate(RUNS)])
def test_batched_run_equals_per_client_run(over, K, monkeypatch):
    cfg = _cfg(over, K)
    a = _run(cfg, TASK, True, monkeypatch)
    b = _run(cfg, TASK, False, monkeypatch)
    assert same(a.trace, b.trace)  # every chain, every round
    for name in ("bits_exact", "bits_bound", "bytes_payload", "n_active", "skipped", "sum_theta",
                 "sum_theta2", "sum_f", "sum_f2"):
        x, y = np.asarray(getattr(a.stats, name)), np.asarray(getattr(b.stats, name))
        assert np.array_equal(x.view(np.uint64) if x.dtype == np.float64 else x,
                              y.view(np.uint64) if y.dtype == np.float64 else y), name
    assert not same(a.trace[0], a.trace[1])  # chains differ


def test_groups_of_clients_equal_per_client_runner():
    """Clients computed together in groups of any size (here: all, pairs, none) give the chains
    of the per-client path; and an iid split (equal minibatch sizes) as well."""
    for task, over in ((TASK, {}), (build_logistic_task("breast_cancer", b=6, partition="iid", prior_var=PRIOR_VAR),
                                    {"num-clients": 6, "partition": "iid"})):
        cfg = _cfg({"variant": "qlsd-pp", "s": "16", "l": 4, **over}, 25)
        parts = driver._parts(cfg, task)
        ref = NumpyGeneric(cfg, task, *parts[:4], ChainStats(3, task.dim), batched=False)
        ref.run_block(0, 25, False)
        b = cfg.b
        for groups in ([np.arange(b)], [np.arange(j, min(j + 2, b)) for j in range(0, b, 2)], []):
            ng = NumpyGeneric(cfg, task, *parts[:4], ChainStats(3, task.dim), batched=True)
            assert len(ng.ogroups) == 1 and len(ng.ogroups[0]) == b  # d = 62: one group
            ng.ogroups = groups
            ng.run_block(0, 25, False)
            assert same(ng.theta, ref.theta)


def test_round_draws_equal_the_reference_streams(monkeypatch):
    """The compiled draws give what participation.active_mask, rng.subset and rng.uniform give,
    for the active (chain, client) pairs; a tie at the n_i-th key falls back to rng.subset."""
    cfg = _cfg({"variant": "qlsd-sharp", "s": "16", "p": "0.5"}, 20, chains=4)
    parts = driver._parts(cfg, TASK)
    ng = NumpyGeneric(cfg, TASK, *parts[:4], ChainStats(4, TASK.dim), batched=True)
    seeds, d = ng.seeds, TASK.dim
    for k in (0, 1, 7, 1234):
        active, idxs, U = ng._draw(k)
        assert np.array_equal(active, participation.active_mask(seeds, k, cfg.p))
        for i, pot in enumerate(TASK.clients):
            ref = rng.subset(seeds, rng.Stream.MINIBATCH, k, i, pot.n_data, parts[0][i].batch_size)
            u = rng.uniform(seeds, rng.Stream.DITHER, k, i, d)
            act = active[:, i]
            assert np.array_equal(idxs[i][act], ref[act]) and same(U[act, i], u[act])
    import qlsd_flwr.engines.vectorised.numpy_draws as nb
    real = nb.draw_round

    def tied(*args):
        real(*args)
        args[-2][1, :] = 1  # pretend client sub[1] had a tie in every chain

    monkeypatch.setattr(nb, "draw_round", tied)
    active, idxs, _ = ng._draw(3)
    i = int(ng.sub[1])
    assert np.array_equal(idxs[i], rng.subset(seeds, rng.Stream.MINIBATCH, 3, i, TASK.clients[i].n_data,
                                              parts[0][i].batch_size))


def test_checkpoint_arrays_carry_over_between_paths():
    """A batched runner's checkpoint restores into a per-client runner (and back) mid-period."""
    cfg = _cfg({"variant": "qlsd-pp", "s": "16", "l": 9}, 30)
    parts = driver._parts(cfg, TASK)

    def runner(batched):
        return NumpyGeneric(cfg, TASK, *parts[:4], ChainStats(3, TASK.dim), batched=batched)

    whole = runner(True)
    whole.run_block(0, 30, False)
    for first, second in ((True, False), (False, True)):
        a = runner(first)
        a.run_block(0, 13, False)  # ζ refreshed at rounds 0 and 9: restore in the middle of a period
        b = runner(second)
        b.restore({k: np.array(v, copy=True) for k, v in a.checkpoint_arrays().items()})
        b.run_block(13, 17, False)
        assert same(b.theta, whole.theta)


def test_divergence_is_reported_alike(monkeypatch):
    # the prior's share grows each client's message until its QSGD norm overflows float32
    cfg = _cfg({"variant": "qlsd-pp", "s": "16", "gamma": 1e3, "prior-on": "clients"}, 40)
    msgs = []
    for batched in (True, False):
        monkeypatch.setattr(NumpyGeneric, "BATCHED", batched)
        with pytest.raises(DivergenceError) as exc:
            V.run_vectorised(cfg, task=TASK, write=False, progress=False, backend="numpy")
        msgs.append(str(exc.value))
    assert msgs[0] == msgs[1] and "float32" in msgs[0], msgs
