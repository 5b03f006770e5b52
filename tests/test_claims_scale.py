"""A claim that would freeze the chain excludes the liar, never the honest majority (issue 38).

VR-FALD*'s and FSGLD's clients are all sent ``∇U(θ*) = Σ_j c_j`` (VR-FALD*'s refreshed reference too) and take
their local steps with it. Before the rule of :func:`qlsd_flwr.robust.claims.out_of_scale`, one client's claim
×1e6 (a ``ref_grad`` installed at a refresh and repeated consistently, or a θ* claim told in the descent and the
claims alike) moved every honest client's steps: with ``norm-bound = 2000`` 2,995 of 3,000 honest replies were
refused and the run ended 49 sd off with exit 0; under ``auto`` it stopped as run away, blaming the step.

Now the lie is refused and its client excluded before it reaches anyone's steps; the chain then samples the
posterior of the other clients' data (closed form), within 1 posterior sd over 400 kept draws (Monte Carlo error
about 0.1 sd), and no honest reply is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from qlsd_flwr.outputs.recorder import load_samples
from qlsd_flwr.run.simulate import run
from qlsd_flwr.tasks.gaussian import build_gaussian_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_theta_star_lie import posterior_without  # noqa: E402

sys.path.pop(0)

GAUSS = {"task": "gaussian", "num-clients": 5, "dim": 5, "s": "16", "engine": "inprocess", "progress": False,
         "prior-var": 5.0, "loo": "off", "num-rounds": 600, "burn-in": 200, "theta-star": "optimise"}
FACTOR = 1e6


def scaled_liar(what: str):
    """Client 0 multiplies by :data:`FACTOR` its ``ref_grad`` and every ``∇U_i`` it repeats at a reference it
    reported so (``what = "ref_grad"``: honest at θ*, so no answer of it ever contradicts another), or its
    claim at θ* and the repeat of it (``"claims"``)."""
    from flwr.app import ConfigRecord

    from qlsd_flwr.flower.records import from_content

    refs: set = set()

    def scale(b):
        return (np.frombuffer(bytes(b), dtype="<f8") * FACTOR).astype("<f8").tobytes()

    def mod(msg, ctx, call_next):
        reply = call_next(msg, ctx)
        if msg.metadata.message_type != "train" or int(ctx.node_config["partition-id"]) != 0 or reply.has_error():
            return reply
        fields = from_content(msg.content)[0]
        rec = dict(reply.content["qlsd"])
        if fields.get("phase") == "grad" and what == "claims":
            rec["payload"] = scale(rec["payload"])
        if fields.get("phase") == "sample":
            if "ref_grad" in rec and what == "ref_grad":
                refs.add(np.asarray(fields["theta"], dtype=np.float64).tobytes())
                rec["ref_grad"] = scale(rec["ref_grad"])
            if "anchor_grad" in rec and (what == "claims" or
                                         np.asarray(fields["anchor"], dtype=np.float64).tobytes() in refs):
                rec["anchor_grad"] = scale(rec["anchor_grad"])
        reply.content["qlsd"] = ConfigRecord(rec)
        return reply

    return mod


CASES = {
    # variant, what is lied, extra keys
    "vr-fald-star ref_grad, B = 2000": ("vr-fald-star", "ref_grad", {"q": 0.2, "norm-bound": 2000}),
    "vr-fald-star ref_grad, auto": ("vr-fald-star", "ref_grad", {"q": 0.2}),
    # θ* in closed form: the claims are the only gradients the client gives before sampling (a lie in a
    # descent too would either throw the descent, or be a consistent scaling whose zero is its own mode)
    "vr-fald-star claims, q = 0": ("vr-fald-star", "claims", {"q": 0.0, "theta-star": "closed-form"}),
    "fsgld claims": ("fsgld", "claims", {"p": 1.0, "theta-star": "closed-form"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_claim_out_of_scale_excludes_its_client_and_no_honest_reply(tmp_path, case):
    variant, what, extra = CASES[case]
    task = build_gaussian_task(5, 5, 0, prior_var=5.0)
    mean, sd = posterior_without(task, {0}, 5.0)
    r = run({**GAUSS, "variant": variant, **extra, "output-dir": str(tmp_path)}, mods=[scaled_liar(what)])
    s = r.summary
    assert "0" in s["excluded"], s
    honest_refused = {k: v for k, v in s["rejected"].items() if k not in ("ref_grad_refused",)}
    assert honest_refused == {}, s["rejected"]  # not one honest reply refused
    if what == "ref_grad":
        assert s["rejected"]["ref_grad_refused"] == 1 and s["excluded"]["0"] >= 1
    err = np.abs(load_samples(r.run_dir)[0].mean(axis=0) - mean) / sd
    assert np.max(err) <= 1.0, err
