"""Every bit counted (issue 37): ``summary.json``'s ``bits`` object adds up, the downlink is counted on every
engine alike, and Flower's own message sizes wrap the code lengths.

* The ``bits`` object is the sum of what ``metrics.csv`` (the sampling rounds, both ways), the preparation
  (by kind of exchange), the LOO and the audit counted, and a gradient exchange of the preparation costs
  exactly ``64 d`` bits a client each way.
* The vectorised engine counts the QLSD family's downlink without a protocol server
  (:class:`qlsd_flwr.protocol.downlink.SamplingDownlink`); round by round it must be what the server's
  ``fields_for`` sends on the local engine and in-process Flower (θ_k to each active client, the anchor
  when the client's copy is stale), on both backends.
* In-process Flower: each round's Flower messages are at least their code length and at most a few KiB of
  framing a message longer, both ways.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from qlsd_flwr.compression import fixed
from qlsd_flwr.config import resolve
from qlsd_flwr.engines.local import run_local
from qlsd_flwr.engines.vectorised import run_vectorised
from qlsd_flwr.run.simulate import run_inprocess

#: per message: Flower's records, metadata and the client's settings (sent with its first message)
FRAMING_BYTES = 4096


def _descent_bits(widths: dict, d: int, b: int, held: int = 0) -> tuple[int, int]:
    """The descent's bits both ways from the widths its rule chose (``opt_widths``: width → exchanges): θ down as
    float32 (float64 at 64), less the ``held`` bits a client was not sent at the point it held (``prep_points_held``:
    a recheck that asks the same θ wider, the first exchange of a stage at the point its curvature was taken),
    each gradient up as one fixed-point row at 12 or 16 bits (the raw layout's: at d = 62 a gradient's code is not
    the shorter), else ``width d``."""

    up = sum(n * (fixed.message_bits(1, d, int(w)) if int(w) < 32 else int(w) * d) for w, n in widths.items())
    down = sum(n * (64 if int(w) == 64 else 32) * d for w, n in widths.items()) - held
    return up * b, down * b


def _rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _column(run_dir, name) -> list[int]:
    return [int(r[name]) for r in _rows(run_dir)]


def test_the_bits_object_adds_up_phase_by_phase(tmp_path, capsys):
    # softmax regression: the θ* descent, the curvature, γ's λ_max (Lanczos), then sampling and the LOO
    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "prior-var": 0.05, "variant": "qlsd-pp",
         "metric": "diagonal", "gamma": "auto", "num-rounds": 30, "burn-in": 10, "output-dir": str(tmp_path),
         "run-name": "r", "progress": True, "plot": False, "loo": "psis", "p": "0.5,1,0.7,0.9", "l": 5}
    res = run_local(resolve(o))
    s = json.loads((res.run_dir / "summary.json").read_text())
    bits, d, b = s["bits"], s["d"], 4
    assert bits["total"] == sum(bits["uplink"].values()) + sum(bits["downlink"].values())
    rows = _rows(res.run_dir)
    assert bits["uplink"]["sampling"] == sum(int(r["bits_exact"]) for r in rows) > 0
    assert bits["downlink"]["sampling"] == sum(int(r["bits_down"]) for r in rows) > 0
    prep = bits["preparation"]
    assert {"descent", "curvature", "power_iteration"} <= set(prep)
    assert bits["uplink"]["preparation"] == sum(k["uplink"] for k in prep.values()) == s["prep_uplink_bits"]
    assert bits["downlink"]["preparation"] == sum(k["downlink"] for k in prep.values()) == s["prep_downlink_bits"]
    # the descent: θ down as float32 and ∇U_i(θ) up as a 12- or 16-bit row, each client, at the widths its rule chose
    # (θ* is only where the curvature is taken: descent.DescentWidth); the power iteration: θ and u down, ∇²U_i u up,
    # as 12-bit rows (the metrics' scales span less than fixed.SPREAD_12), θ in float64 at the descent's stages
    # (float32 where the point is exactly a float32 vector, as θ_0 = 0 is) and in float32 at θ*, the descent's result
    # rounded to what it carried (traffic.point_bits): θ's part is n + (its float64 ones) times 32 d b, the last
    # power iteration's `last` exchanges in float32
    n, widths = prep["descent"]["exchanges"], s["opt_widths"]
    assert sum(widths.values()) == n > 0 and set(widths) <= {"12", "16", "32"}
    assert (prep["descent"]["uplink"], prep["descent"]["downlink"]) == _descent_bits(widths, d, b, s.get("prep_points_held", {}).get("descent", 0))
    n, last = prep["power_iteration"]["exchanges"], s["lambda_max_iterations"]
    row = fixed.message_bits(1, d, 12)
    assert s["metric_spread"] <= fixed.SPREAD_12
    assert prep["power_iteration"]["uplink"] == row * b * n > 0 and 0 < last < n
    # θ sent or held (a client keeps the last point; γ's `last` exchanges at θ* send it at most once)
    held = s["prep_points_held"]["power_iteration"]
    points, rest = divmod(prep["power_iteration"]["downlink"] - row * b * n + held * b, 32 * d * b)
    assert rest == 0 and n <= points <= 2 * n - last and held >= 32 * d * (last - 1)
    assert prep["curvature"]["uplink"] == 64 * d * b * prep["curvature"]["exchanges"]  # a diagonal a client
    assert (bits["uplink"]["loo"], bits["downlink"]["loo"]) == (s["loo"]["bits_up"], s["loo"]["bits_down"]) != (0, 0)
    assert bits["uplink"]["other"] == bits["downlink"]["other"] == 0
    # every round θ to each active client, and ζ to those whose copy is stale: at least 64 d a message
    assert all(r["bits_down"] >= 64 * d * r["n_active"] for r in rows)
    err = capsys.readouterr().err
    assert "preparation · θ* descent:" in err and "preparation · λ_max products:" in err
    assert f"preparation: {s['prep_exchanges']} exchanges" in err


def test_the_descent_is_narrower_only_where_theta_star_is_only_the_curvature_point(tmp_path):
    # QLSD*'s control variates rest on Σ_i ∇U_i(θ*) ≈ 0 to opt-tol: its descent stays float64, and so does every
    # exchange's count; in-process Flower sends what the local engine rounds (same θ*, same bits)
    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "prior-var": 0.05, "metric": "diagonal",
         "gamma": "auto", "num-rounds": 4, "burn-in": 0, "progress": False, "plot": False, "loo": "off",
         "output-dir": str(tmp_path)}
    for variant in ("qlsd-pp", "qlsd-star"):
        c = {**o, "variant": variant, "theta-star": "optimise"}
        local = run_local(resolve({**c, "run-name": f"l-{variant}"}))
        s = json.loads((local.run_dir / "summary.json").read_text())
        row = s["bits"]["preparation"]["descent"]
        # QLSD++: θ as float32, each gradient back as one 12- or 16-bit row (a tag byte, a float32 scale, d levels) as
        # its rule chose (opt_widths); QLSD*: float64 both ways, no rule
        assert s["d"] == 62 and row["exchanges"] > 0, variant
        widths = s.get("opt_widths", {"64": row["exchanges"]})
        assert ("opt_widths" in s) == (variant == "qlsd-pp") and sum(widths.values()) == row["exchanges"], variant
        assert (row["uplink"], row["downlink"]) == _descent_bits(widths, 62, 4, s.get("prep_points_held", {}).get("descent", 0)), variant
        flwr = run_inprocess(resolve({**c, "engine": "inprocess", "run-name": f"f-{variant}"}), {**c, "engine": "inprocess"})
        sf = json.loads((flwr.run_dir / "summary.json").read_text())
        assert sf["bits"]["preparation"]["descent"] == row and sf["gamma"] == s["gamma"], variant


@pytest.mark.parametrize("variant", ["qlsd-pp", "qlsd-star", "qlsd"])
def test_the_vectorised_engines_downlink_is_what_the_protocol_server_sends(variant, tmp_path):
    o = {"task": "gaussian", "num-clients": 5, "dim": 6, "num-rounds": 40, "burn-in": 10, "variant": variant, "l": 7,
         "p": "0.5,0.7,0.9,0.3,1", "output-dir": str(tmp_path), "progress": False, "plot": False, "seed": 3,
         "loo": "off", "norm-bound": "off", "num-chains": 3}
    ref = run_inprocess(resolve({**o, "run-name": "flower", "engine": "inprocess"}),
                        {**o, "run-name": "flower", "engine": "inprocess"}, shuffle_seed=4)
    want = _column(ref.run_dir, "bits_down")
    for backend in ("numpy", "numba"):
        v = run_vectorised(resolve({**o, "run-name": backend, "engine": "vectorised"}), backend=backend)
        assert _column(v.run_dir, "bits_down") == want, backend
    one = run_local(resolve({**o, "num-chains": 1, "run-name": "local"}))
    alone = run_vectorised(resolve({**o, "num-chains": 1, "run-name": "alone", "engine": "vectorised"}))
    assert _column(one.run_dir, "bits_down") == _column(alone.run_dir, "bits_down")
    if variant == "qlsd":  # no anchor: θ to each active (chain, client) pair, nothing else
        assert want == [64 * 6 * n for n in _column(ref.run_dir, "n_active")]
    else:  # the anchor travels too, but not every round
        extra = np.array(want) - 64 * 6 * np.array(_column(ref.run_dir, "n_active"))
        assert extra.min() == 0 and extra.max() > 0


def test_flowers_messages_wrap_the_code_lengths_both_ways(tmp_path):
    # QLSD: no anchor, so no message carries two equal arrays (Flower sends an object once a message, and a
    # refresh round's ζ equals θ: there the bytes can be fewer than the code length counts)
    o = {"task": "gaussian", "num-clients": 5, "dim": 300, "num-rounds": 12, "burn-in": 2, "variant": "qlsd",
         "p": "0.5,0.7,0.9,0.3,1", "output-dir": str(tmp_path), "progress": False, "plot": False, "seed": 3,
         "loo": "off", "num-chains": 2, "run-name": "r", "engine": "inprocess"}
    res = run_inprocess(resolve(o), o, shuffle_seed=2)
    for r in _rows(res.run_dir):
        down, up = r["bytes_message_down"] - r["bits_down"] / 8, r["bytes_message"] - r["bits_exact"] / 8
        assert 0 < down <= FRAMING_BYTES * r["n_active"], r
        assert 0 < up <= FRAMING_BYTES * r["n_replied"], r
    s = json.loads((res.run_dir / "summary.json").read_text())
    assert s["bits"]["total"] == s["totals"]["bits_exact"] + s["totals"]["bits_down"]


def test_the_arithmetic_uplink_is_the_same_chain_in_fewer_bits_counted_as_the_clients_send_them(tmp_path):
    # encoding = arith codes the same QSGD levels (the main job's uplink): every engine's chain is auto's, each
    # round's count is the code Flower's clients send (within the framing), the vectorised engine counts it alike
    from qlsd_flwr.compression.format import DecodeError
    from qlsd_flwr.compression.qsgd import QSGD
    from qlsd_flwr.core import rng
    from qlsd_flwr.outputs.recorder import load_samples

    o = {"task": "gaussian", "num-clients": 5, "dim": 300, "num-rounds": 12, "burn-in": 2, "variant": "qlsd-pp",
         "s": "16", "p": "0.5,0.7,0.9,0.3,1", "output-dir": str(tmp_path), "progress": False, "plot": False, "seed": 3,
         "loo": "off", "num-chains": 2, "engine": "inprocess"}
    runs = {}
    for enc in ("auto", "arith"):
        c = {**o, "encoding": enc, "run-name": enc}
        runs[enc] = run_inprocess(resolve(c), c, shuffle_seed=2).run_dir
    v = run_vectorised(resolve({**o, "encoding": "arith", "run-name": "v", "engine": "vectorised"}))
    assert np.array_equal(load_samples(runs["arith"]), load_samples(runs["auto"]))
    assert np.array_equal(load_samples(v.run_dir), load_samples(runs["auto"]))
    assert _column(v.run_dir, "bits_exact") == _column(runs["arith"], "bits_exact")
    auto, arith = sum(_column(runs["auto"], "bits_exact")), sum(_column(runs["arith"], "bits_exact"))
    assert arith < 0.9 * auto, (arith, auto)  # s = 16 at d = 300: mostly zeros and ones
    for r in _rows(runs["arith"]):
        up = r["bytes_message"] - r["bits_exact"] / 8
        assert 0 < up <= FRAMING_BYTES * r["n_replied"], r
    with pytest.raises(ValueError, match="encoding = arith runs on: auto, numpy"):
        run_vectorised(resolve({**o, "encoding": "arith", "run-name": "n", "engine": "vectorised"}), backend="numba")
    # each reader takes its own code only: an arithmetic payload is no Elias or packed one, and the other way round
    q = QSGD(16).quantise(np.linspace(-1, 1, 300), rng.uniform(1, rng.Stream.DITHER, 16, 300, 300))
    with pytest.raises(DecodeError, match="unknown encoding tag"):
        QSGD(16).decode(QSGD(16, encoding="arith").encode(q), 300)
    with pytest.raises(DecodeError, match="unknown encoding tag"):
        QSGD(16, encoding="arith").decode(QSGD(16).encode(q), 300)


def _payloads(seen: list):
    """A client mod that keeps, for each exchange before sampling, ``(kind, precision, up, down)``: the request's
    curvature kind (``grad`` for a gradient) and precision, the reply's payload as the client sent it, and the
    request's θ and vectors as the server sent them (bits)."""
    from qlsd_flwr.flower.records import from_content

    def mod(msg, ctx, call_next):
        reply = call_next(msg, ctx)
        fields = from_content(msg.content)[0]
        if fields.get("phase") in ("grad", "curvature") and not reply.has_error():
            down = 8 * np.asarray(fields.get("theta", [])).nbytes + 8 * len(fields.get("vectors", b""))
            seen.append((fields.get("kind", "grad"), fields.get("precision", 64), 8 * len(reply.content["qlsd"]["payload"]),
                         down, "theta" in fields))
        return reply

    return mod


def test_the_preparations_rows_are_counted_as_the_bytes_the_clients_send_on_every_engine(tmp_path):
    # issue 37: metric-rank's products, λ_max's and the descent's gradients travel as fixed-point rows
    # (compression.fixed), coded where that is shorter: on digits (d = 650) the count is the bytes the Flower clients
    # sent, at most the raw layout's length, and the direct engine, which sends no bytes, counts the same and samples
    # the same chain
    o = {"task": "logistic", "dataset": "digits", "num-clients": 4, "prior-var": 0.05, "variant": "qlsd-pp",
         "metric": "diagonal", "metric-rank": 3, "gamma": "auto", "num-rounds": 6, "burn-in": 2, "progress": False,
         "plot": False, "loo": "off", "output-dir": str(tmp_path)}
    seen: list = []
    flwr = run_inprocess(resolve({**o, "engine": "inprocess", "run-name": "flwr"}), {**o, "engine": "inprocess"},
                         mods=[_payloads(seen)])
    s = json.loads((flwr.run_dir / "summary.json").read_text())
    prep, d, b, k = s["bits"]["preparation"], s["d"], 4, s["lowrank_block"]
    hvp = sum(n for kind, _, n, *_ in seen if kind == "hvp")
    grads = sum(n for kind, _, n, *_ in seen if kind == "grad")  # rows at 12 and 16 bits, float32 where the rule asked
    assert prep["products"]["uplink"] + prep["power_iteration"]["uplink"] == hvp > 0
    assert prep["products"]["downlink"] + prep["power_iteration"]["downlink"] == sum(m for kind, _, _, m, _ in seen
                                                                                       if kind == "hvp")
    # θ goes to a client once a point: a request at the point it holds names it by its number (PhaseExchanges.ask), and
    # the count is what the requests carry (λ_max's and the products' at θ*: θ in the first only)
    assert sum(k["downlink"] for k in prep.values()) == sum(m for *_, m, _ in seen)
    again = [kind for kind, *_, sent in seen if not sent]
    assert again.count("hvp") >= 4 * (prep["power_iteration"]["exchanges"] + prep["products"]["exchanges"] - 3)
    assert prep["descent"]["uplink"] == grads and {"12", "16"} & set(s["opt_widths"])
    q, n = prep["products"]["exchanges"], prep["power_iteration"]["exchanges"]
    # at most the raw layout's length (16 bits), and the products 0.90 of it (measured; MNIST's: 0.57)
    assert prep["products"]["uplink"] < 0.95 * (8 + k * (16 * d + 32)) * b * q
    assert prep["power_iteration"]["uplink"] <= (8 + 16 * d + 32) * b * n
    assert prep["descent"]["uplink"] <= _descent_bits(s["opt_widths"], d, b)[0]
    local = run_local(resolve({**o, "run-name": "local"}))
    assert json.loads((local.run_dir / "summary.json").read_text())["bits"]["preparation"] == prep
    from qlsd_flwr.outputs.recorder import load_samples

    assert np.array_equal(load_samples(flwr.run_dir), load_samples(local.run_dir))


def test_a_node_that_lost_its_point_is_sent_theta_again_and_the_chain_is_unchanged(tmp_path):
    # issue 37: before sampling θ goes to a client once a point, and a request at the point it holds names it by its
    # number; a restarted node (its context.state wiped here, by a client mod, before every third such request)
    # answers resync, is sent θ again, and the run is the local engine's chain, its resends counted apart
    from qlsd_flwr.flower.records import from_content

    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "prior-var": 0.05, "variant": "qlsd-pp",
         "metric": "diagonal", "metric-rank": 3, "gamma": "auto", "num-rounds": 6, "burn-in": 2, "progress": False,
         "plot": False, "loo": "off", "output-dir": str(tmp_path)}
    seen: list = []

    def restarts(msg, ctx, call_next):
        fields = from_content(msg.content)[0]
        held = fields.get("phase") in ("grad", "curvature") and "theta" not in fields
        if held and int(ctx.node_config["partition-id"]) == 2:
            seen.append("held")
            if len(seen) % 3 == 0:
                for key in list(ctx.state.keys()):
                    del ctx.state[key]
        reply = call_next(msg, ctx)
        if held and not reply.has_error() and reply.content["qlsd"].get("status") == "resync":
            seen.append("resync")
        return reply

    flwr = run_inprocess(resolve({**o, "engine": "inprocess", "run-name": "flwr"}), {**o, "engine": "inprocess"},
                         mods=[restarts])
    local = run_local(resolve({**o, "run-name": "local"}))
    from qlsd_flwr.outputs.recorder import load_samples

    assert np.array_equal(load_samples(flwr.run_dir), load_samples(local.run_dir))
    s, sl = (json.loads((r.run_dir / "summary.json").read_text()) for r in (flwr, local))
    resent = seen.count("resync")
    assert resent >= 3 and s["bits"]["preparation"]["resync"]["exchanges"] == resent
    assert s["bits"]["preparation"]["resync"]["downlink"] >= resent * 32 * s["d"]  # θ at least, float32 or 64
    assert {k: v for k, v in s["bits"]["preparation"].items() if k != "resync"} == sl["bits"]["preparation"]


def test_kfacs_input_factor_travels_once_as_a_square_root_and_the_chain_is_unchanged(tmp_path):
    # issue 37: G_i = Σ x̃x̃ᵀ is the client's data alone, so the descent's later curvature exchanges ask for the output
    # factor Ā_i only, and the one full report sends G's square root; the metric is the one full reports give
    from qlsd_flwr.core import curvature as cv
    from qlsd_flwr.robust.reports import ReportError

    o = {"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "prior-var": 0.05, "variant": "qlsd-pp",
         "metric": "kronecker", "gamma": "auto", "init": "dispersed", "num-rounds": 6, "burn-in": 2, "progress": False,
         "plot": False, "loo": "off", "output-dir": str(tmp_path)}
    local = run_local(resolve({**o, "run-name": "local"}))
    s = json.loads((local.run_dir / "summary.json").read_text())
    d, b, K = s["d"], 4, 2
    F = d // K
    curv = s["bits"]["preparation"]["curvature"]
    n = curv["exchanges"]
    assert n >= 2  # the descent's stages and θ*: one full report, then output factors alone
    # the full report: its numbers in float32, then G's square root in 12-bit rows (compression.root: G_i's rank
    # is the client's), the output factors alone in float64
    from qlsd_flwr.compression import root
    from qlsd_flwr.tasks.loading import load_task

    ranks = [root.factor(c.kron_factors(np.zeros(d))[0])[0].shape[0] for c in load_task(resolve(o)).clients]
    # (the logistic task's layout is the identity: its perm is not sent, core.curvature.kron_report)
    assert curv["uplink"] == (32 * b * (2 + K * K) + sum(root.message_bits(r, F) for r in ranks)
                              + 64 * b * (n - 1) * (2 + K * K))
    flwr = run_inprocess(resolve({**o, "engine": "inprocess", "run-name": "flwr"}), {**o, "engine": "inprocess"})
    sf = json.loads((flwr.run_dir / "summary.json").read_text())
    assert sf["bits"]["preparation"]["curvature"] == curv
    from qlsd_flwr.outputs.recorder import load_samples

    assert np.array_equal(load_samples(flwr.run_dir), load_samples(local.run_dir))

    # the metric from a kept G and a later Ā is, bit for bit, the one the first report's G and that Ā give
    task = __import__("qlsd_flwr.tasks.loading", fromlist=["load_task"]).load_task(resolve(o))
    theta = np.linspace(-0.3, 0.3, d)
    full = {i: cv.check_report(cv.local_curvature(c, theta, "kronecker", 0, i), "kronecker", d)
            for i, c in enumerate(task.clients)}
    kept = cv.KronInputs({i: (r["G"], r["perm"]) for i, r in full.items()})
    part = {i: kept.complete(i, cv.local_curvature(c, theta, cv.KRON_OUTPUTS, 0, i), d) for i, c in enumerate(task.clients)}
    G0 = task.clients[0].kron_factors(theta)[0]
    G0 = 0.5 * G0 + 0.5 * G0.T
    # G as its 12-bit root carried it: semi-definite, and within 1.6e-3 of its largest eigenvalue in every direction
    # (16 times what 16-bit levels kept, 1e-4; measured 2.8e-4)
    w = np.linalg.eigvalsh(full[0]["G"] - G0)
    assert np.max(np.abs(w)) <= 16e-4 * np.linalg.eigvalsh(G0)[-1]
    assert np.linalg.eigvalsh(full[0]["G"])[0] >= -1e-12 * np.max(np.abs(G0))
    # (the later exchanges' Ā travels as float64, the first report's as float32: the same Ā on both sides here)
    m1, _ = cv.metric_from_kronecker({i: {**r, "A": part[i]["A"]} for i, r in full.items()}, task.n_data,
                                     np.full(d, 20.0), d)
    m2, _ = cv.metric_from_kronecker(part, task.n_data, np.full(d, 20.0), d)
    x = np.arange(d, dtype=float)
    assert np.array_equal(m1.apply(x), m2.apply(x))
    # an output factor with nothing on record, of another length or layer shape, or not numbers, is refused before
    # anything is computed from it
    good = cv.kron_outputs_report(F, np.eye(K))
    with pytest.raises(ReportError, match="no input factor on record"):
        cv.KronInputs().complete(0, good, d)
    with pytest.raises(ReportError, match="expected"):  # another layer shape of the same d
        kept.complete(0, np.concatenate([[K, F], np.eye(K).ravel()]), d)
    with pytest.raises(ReportError, match="expected 6 numbers"):
        kept.complete(0, np.concatenate([[1, d], np.eye(d).ravel()]), d)
    with pytest.raises(ReportError, match="non-finite"):
        kept.complete(0, np.full(2 + K * K, np.nan), d)
    with pytest.raises(ReportError, match="not an array"):
        kept.complete(0, ["x"] * (2 + K * K), d)


def test_a_client_without_a_first_kfac_report_is_asked_for_a_full_one_not_left_out():
    # a client that missed (or failed) the first curvature exchange answers a later one; the exchange is made again
    # with full reports, so it keeps its curvature for the rest of the preparation
    from qlsd_flwr.core import curvature as cv
    from qlsd_flwr.protocol.curvature_exchange import curvature_metric
    from qlsd_flwr.tasks.loading import load_task

    cfg = resolve({"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "prior-var": 0.05,
                   "metric": "kronecker", "gamma": "auto"})
    task = load_task(cfg)
    theta = np.linspace(-0.2, 0.2, task.dim)
    asked = []

    def curv_fn(th, kind, who=(0, 1, 2, 3)):
        asked.append(kind)
        return {i: cv.local_curvature(task.clients[i], th, kind, 0, i) for i in who}

    inputs = cv.KronInputs()
    curvature_metric(cfg, task, theta, lambda th, kind: curv_fn(th, kind, (0, 1, 2)), task.n_data, inputs)
    assert asked == ["kronecker"] and sorted(inputs) == [0, 1, 2]
    m, info = curvature_metric(cfg, task, theta, curv_fn, task.n_data, inputs)
    assert asked == ["kronecker", cv.KRON_OUTPUTS, "kronecker"] and sorted(inputs) == [0, 1, 2, 3]
    assert info["curvature_reports"] == 4 and not info["curvature_rejected"]
    ref, _ = curvature_metric(cfg, task, theta, curv_fn, task.n_data)  # full reports from everyone
    x = np.arange(task.dim, dtype=float)
    assert np.array_equal(m.apply(x), ref.apply(x))
    curvature_metric(cfg, task, theta, curv_fn, task.n_data, inputs)
    assert asked[-1] == cv.KRON_OUTPUTS  # all on record: the output factors alone


def test_the_metric_goes_once_a_message_and_is_counted_once(tmp_path):
    """``compression-basis = metric``: a client's first message carries the run's metric once, however many of its
    chains need it (``wire.bundle_request``), so the first round's extra downlink is the same with 1 and 3 chains,
    in-process Flower and the vectorised engine alike (QLSD: no anchor; p = 1: every client in every round)."""
    o = {"task": "gaussian", "num-clients": 3, "dim": 8, "num-rounds": 3, "burn-in": 0, "variant": "qlsd", "p": "1",
         "metric": "diagonal", "gamma": "auto", "compression-basis": "metric", "s": "8", "progress": False,
         "plot": False, "loo": "off", "norm-bound": "off", "output-dir": str(tmp_path)}
    extra = {}
    for chains in (1, 3):
        oc = {**o, "num-chains": chains, "engine": "inprocess", "run-name": f"flower-{chains}"}
        down = _column(run_inprocess(resolve(oc), oc, shuffle_seed=1).run_dir, "bits_down")
        assert down[1] == down[2] == 64 * 8 * 3 * chains  # θ to every (chain, client) pair
        extra[chains] = down[0] - down[1]
        v = run_vectorised(resolve({**oc, "engine": "vectorised", "run-name": f"vectorised-{chains}"}))
        assert _column(v.run_dir, "bits_down") == down, chains
    assert extra[1] == extra[3] > 0


@pytest.mark.parametrize("tol", [1e-4, 1e-7])
def test_the_narrow_descent_reaches_theta_star_within_its_tolerance(tol):
    # the descent's gradients come back as rows as narrow as its stopping rule allows (descent.DescentWidth): the θ*
    # it ends at must meet the stopping rule with the exact float64 gradient, ‖∇U(θ*)‖ ≤ opt-tol (1 + ‖∇U(θ_0)‖), as
    # the float64 descent's does (QLSD*'s, on the same task), and it must end near that one; the width grows as the
    # threshold shrinks (at 1e-7, 16-bit rows' rounding is above it: float32)
    from qlsd_flwr.core.curvature import KronInputs
    from qlsd_flwr.protocol import build, descent, precondition
    from qlsd_flwr.protocol.traffic import Traffic, counted
    from qlsd_flwr.tasks import loading

    out = {}
    for variant in ("qlsd-pp", "qlsd-star"):
        cfg = resolve({"task": "logistic", "dataset": "breast_cancer", "num-clients": 4, "prior-var": 0.05,
                       "metric": "diagonal", "gamma": "auto", "theta-star": "optimise", "variant": variant,
                       "opt-tol": tol, "progress": False})
        task = loading.load_task(cfg)
        specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, build.blocks_for(cfg, task))
                 for i in range(cfg.b)]
        traffic, info, n = Traffic(cfg.b, task.dim, {}), {}, np.array([c.n_data for c in task.clients])
        grad_fn, curv_fn = counted(*build.direct_exchanges(cfg, task, specs), traffic)
        theta = precondition.curvature_point(cfg, task, build.theta0_of(task), grad_fn, curv_fn, n, None, info,
                                             KronInputs(), precondition.products_for(task, grad_fn, curv_fn, n, info))
        exact = sum(c.grad_sum(theta) for c in task.clients) + task.prior.grad(theta)
        assert info["opt_converged"], variant
        # the rule's allowance: the exact gradient within 1 + ROUNDING_SHARE of the threshold
        assert np.linalg.norm(exact) <= (1 + descent.ROUNDING_SHARE) * tol * (1.0 + info["opt_grad0_norm"]), variant
        row = traffic.info["prep_bits"]["descent"]
        widths = traffic.info.get("opt_widths", {"64": row["exchanges"]})
        assert (row["uplink"], row["downlink"]) == _descent_bits(widths, task.dim, cfg.b,
                                                                 traffic.info.get("prep_points_held", {}).get("descent", 0)), variant
        out[variant] = (theta, widths)
    narrow = out["qlsd-pp"][1]
    assert "12" in narrow and ("32" in narrow) == (tol < 1e-6), narrow  # 12 bits far out; float32 only for 1e-7
    ref = out["qlsd-star"][0]
    assert np.max(np.abs(out["qlsd-pp"][0] - ref)) <= 1e-3 * (tol / 1e-4) * np.max(np.abs(ref))


def test_the_descent_width_rule_and_its_recheck():
    # protocol.descent.DescentWidth: before an exchange, the narrowest width whose rounding bound Σ_i √d σ_i/2L is
    # within ROUNDING_SHARE of max(T, ‖∇U‖); after it, a reading that may end the descent (within its rounding of T)
    # with a bound above ROUNDING_SHARE T is asked again at the width that meets it (a review's case: after a reading
    # of 4T the rule takes 12 bits, whose bound is 0.98 T)
    from qlsd_flwr.protocol.descent import ROUNDING_SHARE, DescentWidth

    d, scales = 100, [1000.0] * 4
    rule = DescentWidth(d, 1e-2)
    assert rule(None, None) == 16 and rule.recheck(scales, 999.0, 16) is None  # θ_0's reading: T = 10
    rule.saw(999.0)
    T = 1e-2 * 1000.0
    assert rule(scales, 4 * T) == 12 and rule.bound(scales, 12) / T == pytest.approx(0.977, rel=1e-3)
    again = rule.recheck(scales, T, 12)
    assert again == 16 and rule.bound(scales, again) <= ROUNDING_SHARE * T
    assert rule.recheck(scales, 3 * T, 12) is None  # far above T: the reading cannot end the descent
    fine = DescentWidth(d, 1e-4)  # T = 0.1: 16-bit rows' bound, 0.61, is above a quarter of it
    fine.saw(999.0)
    assert fine(scales, 0.05) == 32 and fine._narrowest(scales, 1e-12) == 64
    rule.saw(5.0)  # later readings leave θ_0's alone
    assert rule.g0 == 999.0


def test_a_clients_point_is_kept_by_number_and_a_bad_request_is_refused_by_name():
    # protocol.client.prep_point: θ with its number is kept; the number alone gives it back; another number, or a
    # client that holds none, gives None (the client answers resync); a request with neither, or a number that is
    # not an integer ≥ 0, is refused naming the field
    from qlsd_flwr.core.oracles import ClientState
    from qlsd_flwr.protocol.client import prep_point

    st, theta = ClientState(), np.arange(4.0)
    assert prep_point(st, {"phase": "grad", "point": 0}, 4) is None
    assert np.array_equal(prep_point(st, {"phase": "grad", "theta": theta, "point": 7}, 4), theta)
    assert np.array_equal(prep_point(st, {"phase": "curvature", "point": 7}, 4), theta)
    assert prep_point(st, {"phase": "curvature", "point": 8}, 4) is None
    assert np.array_equal(prep_point(st, {"phase": "grad", "theta": theta + 1}, 4), theta + 1)  # not kept: no number
    assert np.array_equal(prep_point(st, {"phase": "grad", "point": 7}, 4), theta)
    for bad, why in (({"phase": "grad"}, "neither 'theta' nor 'point'"), ({"phase": "grad", "point": -1}, "'point'"),
                     ({"phase": "grad", "point": True}, "'point'"), ({"phase": "curvature", "point": "7"}, "'point'")):
        with pytest.raises(ValueError, match=why):
            prep_point(st, bad, 4)
    # θ on the client's own support (theta_on): its numbers there, 0 elsewhere, kept by number as θ is; refused
    # where the client reads every coordinate, beside theta, or of another length
    own = np.array([True, False, True, True])
    got = prep_point(st, {"phase": "grad", "theta_on": np.array([5.0, 6.0, 7.0]), "point": 9}, 4, own)
    assert np.array_equal(got, [5.0, 0.0, 6.0, 7.0]) and np.array_equal(prep_point(st, {"phase": "grad", "point": 9}, 4), got)
    for bad, o, why in (({"theta_on": np.ones(3)}, None, "reads every coordinate"),
                        ({"theta_on": np.ones(3), "theta": theta}, own, "'theta_on' with 'theta'"),
                        ({"theta_on": np.ones(4)}, own, "shape")):
        with pytest.raises(ValueError, match=why):
            prep_point(st, {"phase": "grad", "point": 10, **bad}, 4, o)
    assert np.array_equal(prep_point(st, {"phase": "grad", "point": 9}, 4), got)  # a refused request changes nothing

