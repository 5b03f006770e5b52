"""Each sampler's messages carry exactly the fields its estimator declares (``down``, ``up``) and its
checkpoint exactly the arrays it keeps (``kept``, :mod:`qlsd_flwr.samplers.fields`), and a field or array of
another sampler is refused on every side: by the client (before its state changes), by the server (the reply
rejected), by a resume (naming the array).

Every sampler runs the protocol on the local engine (the very code the Flower apps run) with the messages
recorded as they leave the server and as the replies come back. Clients are asked to resync once, at round 3
(as a restarted node's reply does), so the fields that travel only after a resync (the memory's mirror) are
seen too.
"""

from __future__ import annotations

import numpy as np
import pytest

from qlsd_flwr import samplers
from qlsd_flwr.config import resolve
from qlsd_flwr.core.oracles import ClientState
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.outputs import checkpoint as ckpt
from qlsd_flwr.outputs.checkpoint import CheckpointError
from qlsd_flwr.protocol import build, wire
from qlsd_flwr.protocol.client import handle
from qlsd_flwr.protocol.server import QLSDServer
from qlsd_flwr.protocol.wire import ReplyError
from qlsd_flwr.samplers.fields import CHECKPOINT, FIELDS, PROTOCOL_DOWN, PROTOCOL_UP
from qlsd_flwr.tasks import loading

BASE = {"task": "gaussian", "num-clients": 4, "dim": 5, "prior-var": 5.0, "num-rounds": 12, "burn-in": 0,
        "progress": False, "loo": "off", "plot": False, "seed": 5, "l": 4}
#: what makes every declared field travel: VR-FALD*'s refresh rounds (q), FSGLD's one client a round (p = 1)
OVER = {"vr-fald-star": {"q": 0.5}, "fsgld": {"p": 1.0}}


@pytest.fixture
def recorded(monkeypatch):
    seen = {"down": set(), "up": set(), "kept": set()}
    fields_for, accept, begin, snap = (QLSDServer.fields_for, QLSDServer.accept, QLSDServer.begin_round,
                                       QLSDServer.snapshot)

    def rec_fields(self, i):
        f = fields_for(self, i)
        seen["down"] |= set(f) - set(PROTOCOL_DOWN)
        return f

    def rec_accept(self, i, fields, *a, **k):
        if isinstance(fields, dict) and fields.get("status") == "ok":
            seen["up"] |= set(fields) - set(PROTOCOL_UP)
        return accept(self, i, fields, *a, **k)

    def resync_once(self):
        active = begin(self)
        if self.state.k == 3:  # every client asked to resync (as after a restart): the mirrors travel
            self.needs_resync[:] = True
        return active

    def rec_snapshot(self):
        arrays, meta = snap(self)
        seen["kept"] |= set(arrays) & set(CHECKPOINT)
        return arrays, meta

    monkeypatch.setattr(QLSDServer, "fields_for", rec_fields)
    monkeypatch.setattr(QLSDServer, "accept", rec_accept)
    monkeypatch.setattr(QLSDServer, "begin_round", resync_once)
    monkeypatch.setattr(QLSDServer, "snapshot", rec_snapshot)
    return seen


@pytest.mark.parametrize("variant", list(samplers.SAMPLERS))
def test_every_sampler_s_messages_carry_exactly_the_fields_it_declares(variant, recorded, tmp_path):
    cfg = resolve({**BASE, "variant": variant, "output-dir": str(tmp_path), "checkpoint-every": 6,
                   **OVER.get(variant, {})})
    res = run_local(cfg)
    assert res.summary["rejected"] == {} or sum(res.summary["rejected"].values()) == 0, res.summary["rejected"]
    est = samplers.get(variant).estimator
    assert recorded["down"] == set(est.down), variant
    assert recorded["up"] == set(est.up), variant
    assert recorded["kept"] == set(est.kept), variant


def test_the_table_declares_each_field_once_and_an_estimator_names_only_its_rows():
    assert set(wire.SENT_WITH) | set(wire.UP_GRADIENTS) <= set(FIELDS)
    for est in samplers.ESTIMATORS.values():
        assert all(FIELDS[n].direction == "down" for n in est.down)
        assert all(FIELDS[n].direction == "up" for n in est.up)
    with pytest.raises(ValueError, match="'ref_grad' is not a down field"):
        samplers.Estimator("bad", down=("ref_grad",))
    with pytest.raises(ValueError, match="'zeta' is not a checkpoint array"):
        samplers.Estimator("bad", kept=("zeta",))


def _client(variant: str, i: int = 1):
    cfg = resolve({**BASE, "variant": variant})
    task = loading.load_task(cfg)
    spec = build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, build.blocks_for(cfg, task))
    return spec, task.clients[i], task.dim


def test_a_client_refuses_another_sampler_s_field_before_its_state_changes():
    spec, pot, d = _client("qlsd-pp")
    st = ClientState()
    msg = {"phase": "sample", "round": 0, "client": 1, "theta": np.zeros(d), "anchor_version": 0, "eta_count": 0,
           "anchor": np.ones(d), "surrogate": np.ones(d)}  # FSGLD's λ_i, sent to a QLSD++ client
    with pytest.raises(ValueError, match="'surrogate' is not a field of this sampler's messages; its fields: "
                                         "anchor, eta"):
        handle(spec, pot, st, 0, msg, d)
    assert st.anchor is None and st.anchor_version == -1  # nothing installed
    several = wire.bundle_request({0: {**msg}, 1: {**msg}})
    with pytest.raises(ValueError, match="'surrogate' is not a field"):
        wire.unbundle_request(several, d, spec.kind.down)


def test_the_server_refuses_a_reply_with_another_sampler_s_field():
    fald = samplers.get("fald").estimator
    rep = {"client": 2, "status": "ok", "payload": b"\0" * 8, "anchor_version": -1, "anchor_grad": b"\0" * 40}
    with pytest.raises(ReplyError, match="'anchor_grad' is not a field of this sampler's replies"):
        wire.parse_fields(rep, 2, fald.up)
    assert wire.parse_fields(rep, 2, samplers.get("qlsd-star").estimator.up)["anchor_grad"] == b"\0" * 40
    several = {"client": 2, "chains": [0, 1], "status": ["ok", "ok"], "payload": [b"", b""],
               "anchor_version": [-1, -1], "ref_grad": [b"", b""]}
    with pytest.raises(ReplyError, match="'ref_grad' is not a field"):
        wire.unbundle_reply(several, [0, 1], fald.up)


def test_a_checkpoint_with_another_sampler_s_state_is_refused_by_name(tmp_path):
    o = {**BASE, "variant": "qlsd-pp", "output-dir": str(tmp_path), "run-name": "a", "checkpoint-every": 4}
    run_local(resolve(o))
    path = ckpt.path_in(tmp_path / "a")
    meta, arrays = ckpt.load(path)
    arrays["surrogate"] = np.ones((4, 5))  # FSGLD's
    ckpt.save(path, arrays, {k: v for k, v in meta.items() if k != "format"})
    (tmp_path / "a" / "summary.json").unlink()  # as if the run had been stopped after its checkpoint
    with pytest.raises(CheckpointError, match="'surrogate' .* is not part of qlsd-pp's state"):
        run_local(resolve({**o, "resume": str(tmp_path / "a")}))
