"""The broadcast on the clients' support (``downlink-support = data``, issue 37; :class:`qlsd_flwr.core.downlink.Downlink`).

A softmax regression's gradient never reads the weights of an input that is 0 in every one of a client's examples,
so the broadcast codes only the union of the clients' supports (each potential declares its own,
:func:`qlsd_flwr.core.potential.declared_support`; a Flower server takes them from the handshakes), and the server's
``w`` is θ elsewhere. Checked here:

* **every path runs the same chain** (the protocol on the local engine, its direct twin, in-process Flower with three
  chains, whose server has the support from the handshakes only, the vectorised engine's numpy backend on both its
  paths), the vectorised engine counting, round by round, the bits Flower's server sends, ``theta_support`` included;
* **it does what it says**: on the digits, whose corner pixels are 0 in every image, the code leaves those weights
  out, the downlink is smaller than with ``downlink-support = all``, and the chain is another one; a task whose
  clients' data touch every coordinate (the Gaussian) runs the chain it ran before, bit for bit;
* **hostile supports** are refused by the client, naming the field, before its state changes: bytes of the wrong
  length, a padding bit set, an empty support, one that leaves out a coordinate this client's gradient reads, and
  one sent to a client whose settings do not expect it.
* **each client's own support**: its code carries the union's levels on its own support alone, and it builds the
  server's ``w`` there bit for bit (the chains above are the same on every path, their bits counted alike).
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from qlsd_flwr.config import resolve
from qlsd_flwr.core import downlink as D
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.protocol import broadcast, build
from qlsd_flwr.tasks import loading

DIGITS = {"task": "logistic", "dataset": "digits", "num-clients": 4, "num-rounds": 24, "burn-in": 4,
          "variant": "qlsd-pp", "l": 4, "p": "0.6,1,0.8,0.7", "gamma": "auto", "metric": "diagonal", "s": "4",
          "prior-var": 0.05, "progress": False, "plot": False, "loo": "off", "seed": 2, "norm-bound": "off",
          "downlink": "qsgd", "downlink-s": 8}


#: the main job's clients (200 MNIST digits each, one label dominant): each reads 482–532 of the 658 pixels some
#: client reads
MNIST = {"task": "mnist", "dataset": "mnist_subset", "model": "logistic", "partition": "dominant_label",
         "num-clients": 20, "num-rounds": 8, "burn-in": 2, "variant": "qlsd-pp", "l": 4, "p": "1",
         "gamma": 1e-4, "s": "4", "progress": False, "plot": False, "loo": "off", "seed": 3, "norm-bound": "off",
         "downlink": "qsgd", "downlink-s": 8, "downlink-dither": "subtractive"}


def _bits_down(run_dir) -> list[int]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(float(r["bits_down"])) for r in csv.DictReader(f)]


@pytest.mark.parametrize("feedback, dither", [("ef21-p", "subtractive"), ("none", "stochastic")])
def test_every_path_runs_the_same_chain_on_the_support(feedback, dither, tmp_path, monkeypatch):
    from qlsd_flwr.engines.vectorised import numpy_backend, run_vectorised
    from qlsd_flwr.run.simulate import run_inprocess

    o = {**DIGITS, "downlink-feedback": feedback, "downlink-dither": dither, "output-dir": str(tmp_path)}
    cfg = resolve(o)
    task = loading.load_task(cfg)
    live = broadcast.task_support(task)
    X = np.vstack([c.Xa for c in task.clients])
    assert live is not None and live.size == 10 * int((X != 0).any(axis=0).sum()) < task.dim  # the corners out
    wire = run_local(resolve({**o, "run-name": "wire"}), keep_trace=True)
    direct = run_local(cfg, write=False, keep_trace=True, wire=False)
    assert np.array_equal(wire.trace, direct.trace)
    assert not any(wire.summary.get("rejected", {}).values())
    o3 = {**o, "num-chains": 3, "engine": "inprocess", "run-name": "flower"}
    flower = run_inprocess(resolve(o3), o3, shuffle_seed=4, strategy_kwargs={"keep_trace": True})
    chains = np.asarray(flower.trace).transpose(1, 0, 2)
    assert np.array_equal(chains[0], wire.trace)
    for batched in (True, False):
        monkeypatch.setattr(numpy_backend.NumpyGeneric, "BATCHED", batched)
        v = run_vectorised(resolve({**o3, "engine": "vectorised", "run-name": f"vectorised-{batched}"}), keep_trace=True)
        assert np.array_equal(v.trace, chains), batched
        assert _bits_down(v.run_dir) == _bits_down(flower.run_dir), batched
    every = run_local(resolve({**o, "downlink-support": "all", "run-name": "all"}), keep_trace=True)
    assert not np.array_equal(every.trace, wire.trace)
    # round 0 sends w_0 in full (ef21-p) and the support once to each client: the codes after it are shorter
    assert sum(_bits_down(wire.run_dir)[1:]) < sum(_bits_down(every.run_dir)[1:])
    # gamma = auto's Lanczos sends each client its block of vectors on its own coordinates (compression.fixed's
    # cols; the chains above are the same on every path, so its products are): counted alike on every engine, and
    # shorter than the whole blocks, λ_max the same
    prep = [r.summary["bits"]["preparation"]["power_iteration"] for r in (wire, every)]
    assert prep[0] == flower.summary_data["bits"]["preparation"]["power_iteration"] == v.summary["bits"][
        "preparation"]["power_iteration"] and prep[0]["exchanges"] > 0
    assert prep[0]["downlink"] < prep[1]["downlink"] and wire.summary["lambda_max"] == every.summary["lambda_max"]


def test_each_client_is_sent_the_levels_on_its_own_support_and_builds_the_servers_w_there_bit_for_bit():
    """Each client's code carries the union's levels on its own support alone (the union's norm, ``α`` and dither):
    the client builds the server's ``w_k`` there bit for bit, its code is shorter than the union's, and a code cut
    for another support does not decode to its own size (refused by name). The chains and the engines' counts of
    these codes are the test above's."""
    cfg = resolve(MNIST)  # (the digits' clients each read every pixel some client reads: nothing to cut)
    task = loading.load_task(cfg)
    masks = broadcast.task_supports(task)
    union = D.union_support(masks, task.dim)
    rule = broadcast.downlink_of(cfg, union)
    rng = np.random.default_rng(0)
    theta0, theta1 = rng.normal(size=task.dim), rng.normal(size=task.dim)
    w0, _ = rule.step(theta0, None, 7, 0)
    w1, q = rule.step(theta1, w0, 7, 1)
    whole = rule.code_for(q, None)
    for i, mask in enumerate(masks):
        own = D.own_positions(union, mask)
        assert own is not None and 0 < own.size < union.size  # each client reads fewer pixels than all of them
        code = rule.code_for(q, own)
        assert len(code) < len(whole)
        mine = rule.receive(w0, code, task.dim, 7, 1, own)
        assert np.array_equal(mine[mask], w1[mask]), i  # where its gradient reads w, the server's w to the bit
        assert np.array_equal(mine[~mask], w0[~mask])  # elsewhere what it held
        other = D.own_positions(union, masks[(i + 1) % len(masks)])
        if other.size != own.size:
            with pytest.raises(ValueError, match="theta_code"):
                rule.receive(w0, rule.code_for(q, other), task.dim, 7, 1, own)


def test_own_support_codes_run_the_same_chain_on_every_path_in_fewer_bits(tmp_path, monkeypatch):
    """On the main job's clients: the protocol on the local engine, in-process Flower with two chains (each client's
    support from its handshake) and the vectorised engine run one chain, and count the same bits round by round;
    with every client sent the union's code instead the chain is the same and the codes are longer."""
    from qlsd_flwr.engines.vectorised import run_vectorised
    from qlsd_flwr.protocol import client, downlink
    from qlsd_flwr.run.simulate import run_inprocess

    o = {**MNIST, "output-dir": str(tmp_path)}
    wire = run_local(resolve({**o, "run-name": "wire"}), keep_trace=True)
    assert not any(wire.summary.get("rejected", {}).values())
    o2 = {**o, "num-chains": 2, "engine": "inprocess", "run-name": "flower"}
    flower = run_inprocess(resolve(o2), o2, shuffle_seed=1, strategy_kwargs={"keep_trace": True})
    chains = np.asarray(flower.trace).transpose(1, 0, 2)
    assert np.array_equal(chains[0], wire.trace)
    v = run_vectorised(resolve({**o2, "engine": "vectorised", "run-name": "vectorised"}), keep_trace=True)
    assert np.array_equal(v.trace, chains) and _bits_down(v.run_dir) == _bits_down(flower.run_dir)
    for module in (broadcast, client, downlink):  # every client sent the union's code
        monkeypatch.setattr(module, "own_positions", lambda support, own: None)
    union = run_local(resolve({**o, "run-name": "union"}), keep_trace=True)
    assert np.array_equal(union.trace, wire.trace)
    assert sum(_bits_down(wire.run_dir)[1:]) < 0.9 * sum(_bits_down(union.run_dir)[1:])


def test_a_task_whose_data_touch_every_coordinate_runs_its_chain_as_before():
    o = {"task": "gaussian", "num-clients": 4, "dim": 5, "num-rounds": 30, "burn-in": 5, "variant": "qlsd-pp", "l": 4,
         "p": "0.6,1,0.8,0.7", "gamma": 1e-3, "s": "4", "progress": False, "plot": False, "loo": "off", "seed": 2,
         "downlink": "qsgd", "downlink-s": 8}
    on = run_local(resolve(o), write=False, keep_trace=True)
    off = run_local(resolve({**o, "downlink-support": "all"}), write=False, keep_trace=True)
    assert np.array_equal(on.trace, off.trace)


def _client():
    from qlsd_flwr.core.oracles import ClientState

    cfg = resolve({**DIGITS, "metric": "identity"})  # no metric to send: the support is all it waits for
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, 0, task.clients[0].n_data, task.dim, task.prior)
    return cfg, task, spec, ClientState()


def test_hostile_supports_at_a_client_change_nothing():
    from qlsd_flwr.protocol.client import handle

    cfg, task, spec, st = _client()
    d, pot = task.dim, task.clients[0]
    union = broadcast.task_support(task)
    own = np.flatnonzero(pot.support())
    first = {"phase": "sample", "round": 0, "client": 0, "theta": np.zeros(d), "anchor_version": 1, "eta_count": 0,
             "anchor_is_theta": 1}
    short = np.setdiff1d(union, own[:1])  # leaves out one coordinate this client's gradient reads
    padded = bytearray(D.support_to_bytes(union, d))
    padded[-1] |= 1  # d = 650: the last byte's two low bits are padding
    for bad, words in ((b"\x01" * 3, "expected 82 bytes"), (bytes(padded), "padding bit"),
                       (bytes(82), "no coordinate is"), (D.support_to_bytes(short, d), "leaves out coordinates")):
        with pytest.raises(ValueError, match=f"theta_support.*{words}|{words}.*theta_support"):
            handle(spec, pot, st, 0, {**first, "theta_support": bad}, d)
        assert st.w is None and st.w_support is None and st.anchor is None
    assert handle(spec, pot, st, 0, first, d)["status"] == "resync"  # no support yet: it asks for one
    assert st.w_support is None
    good = {**first, "theta_support": D.support_to_bytes(union, d)}
    assert handle(spec, pot, st, 0, good, d)["status"] == "ok"
    assert np.array_equal(np.flatnonzero(st.w_support), union)
    # a client whose settings do not expect a support refuses one
    plain = build.client_spec(resolve({**DIGITS, "metric": "identity", "downlink-support": "all"}), 0, pot.n_data, d, task.prior)
    from qlsd_flwr.core.oracles import ClientState

    with pytest.raises(ValueError, match="'theta_support' without downlink-support = data"):
        handle(plain, pot, ClientState(), 0, good, d)


def test_a_users_potential_declares_its_support_and_a_wrong_one_is_named():
    from qlsd_flwr.core.potential import declared_support
    from qlsd_flwr.potentials import NumpyPotential

    task = loading.load_task(resolve(DIGITS))
    pot = task.clients[0]
    user = NumpyPotential(pot.grad_sum, pot.value, pot.n_data, task.dim, support=pot.support())
    assert np.array_equal(declared_support(user, task.dim), pot.support())
    assert declared_support(NumpyPotential(pot.grad_sum, pot.value, pot.n_data, task.dim), task.dim) is None
    for bad in (pot.support()[:-1], pot.support().astype(float)):
        with pytest.raises(ValueError, match=r"support\(\): expected a boolean array of shape \(650,\)"):
            declared_support(NumpyPotential(pot.grad_sum, pot.value, pot.n_data, task.dim, support=bad), task.dim)


def test_a_run_written_before_the_key_resumes_on_every_coordinate_and_a_prior_share_refuses_a_support(tmp_path):
    import json

    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.outputs.resume import resume_overrides
    from qlsd_flwr.protocol.client import handle

    old = {k: v for k, v in DIGITS.items()}  # a config.json of a run before downlink-support: no such key
    (tmp_path / "config.json").write_text(json.dumps({"config": old}))
    assert resume_overrides({"resume": str(tmp_path)})["downlink-support"] == "all"
    (tmp_path / "config.json").write_text(json.dumps({"config": {**old, "downlink-support": "data"}}))
    assert resume_overrides({"resume": str(tmp_path)})["downlink-support"] == "data"
    # a client that takes a share of the prior (prior-on = clients) reads every coordinate: no support leaves one out
    cfg, task, spec, _ = _client()
    shared = spec.__class__(**{**spec.__dict__, "prior_weight": 0.25})
    d = task.dim
    msg = {"phase": "sample", "round": 0, "client": 0, "theta": np.zeros(d), "anchor_version": 1, "eta_count": 0,
           "anchor_is_theta": 1, "theta_support": D.support_to_bytes(broadcast.task_support(task), d)}
    with pytest.raises(ValueError, match="'theta_support' leaves out coordinates"):
        handle(shared, task.clients[0], ClientState(), 0, msg, d)
    assert handle(spec, task.clients[0], ClientState(), 0, msg, d)["status"] == "ok"


def test_the_preparation_sends_each_client_its_point_on_its_own_coordinates(tmp_path):
    """Issue 37: the preparation's points (the descent's θs, θ*) go to each client on its own coordinates alone
    (``theta_on``), on every engine alike and in fewer bits than whole; the chain is the one whole points give,
    since nothing a client computes before sampling reads the rest."""
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.run.simulate import run_inprocess

    o = {**MNIST, "num-rounds": 3, "burn-in": 0, "output-dir": str(tmp_path), "metric": "diagonal", "gamma": "auto",
         "opt-rounds": 2, "opt-accept-unconverged": True}
    local = run_local(resolve({**o, "run-name": "local"}), keep_trace=True)
    flwr = run_inprocess(resolve({**o, "engine": "inprocess", "run-name": "flwr"}), {**o, "engine": "inprocess"},
                         strategy_kwargs={"keep_trace": True})
    whole = run_local(resolve({**o, "downlink-support": "all", "run-name": "whole"}), keep_trace=True)
    prep = local.summary["bits"]["preparation"]
    assert json.loads((flwr.run_dir / "summary.json").read_text())["bits"]["preparation"] == prep
    down, down_whole = (({k: v["downlink"] for k, v in r.summary["bits"]["preparation"].items()}) for r in (local, whole))
    # the descent's downlink is its points alone: each client's share is its own coordinates' of the d (exact, in bits)
    task = loading.load_task(resolve(o))
    own = sum(int(np.count_nonzero(m)) for m in broadcast.task_supports(task))
    assert down["descent"] * task.b * task.dim == down_whole["descent"] * own and own < 0.8 * task.b * task.dim
    assert down["power_iteration"] < down_whole["power_iteration"]
    assert np.array_equal(local.trace, np.asarray(flwr.trace)) and local.summary["gamma"] == whole.summary["gamma"]
    assert np.array_equal(load_samples(local.run_dir), load_samples(flwr.run_dir))
