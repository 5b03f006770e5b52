"""Every bit a run moves, both ways, phase by phase: ``summary.json``'s ``bits`` object.

A run's traffic is counted where it happens, as exact code lengths of what was sent (a float64 array
is 64 bits a number, a QSGD message its Elias or packed code, a byte string 8 bits a byte), over all
chains; Flower's framing is not in them (the Flower message sizes are recorded beside: ``metrics.csv``'s
``bytes_message`` and ``bytes_message_down``). :func:`bits_object` gathers the counts a finished run's
summary holds:

* ``preparation``: before the first sampling round (:mod:`qlsd_flwr.protocol.traffic`): the θ*
  descent's gradients, the curvature reports, the Hessian-vector products, the power iteration's
  gradients, the warm-up's gradients and the θ* claims, each both ways (``prep_bits``, by kind);
* ``sampling``: the rounds (``metrics.csv``: ``bits_exact`` up, ``bits_down`` down, summed in
  ``totals``);
* ``loo``: the federated LOO after the run (the kept draws down, the pointwise values up);
* ``other``: VR-FALD*'s reference refreshes (their full gradients up) and the memory audit after the
  run (each client's ``η_i`` up).

``total`` is the sum of the eight numbers; it is what a comparison with FedAvg counts.
"""

from __future__ import annotations

#: the phases of a run, in the order they happen
PHASES = ("preparation", "sampling", "loo", "other")
#: the preparation's kinds of exchange (``prep_bits``), in the order they happen
PREP_KINDS = ("descent", "curvature", "products", "power_iteration", "warmup", "claims", "resync")


def rounds_only(uplink: int, downlink: int) -> dict:
    """The ``bits`` object of a run that is its rounds only (FedAvg: ``sampling`` holds its training rounds)."""
    up = {p: 0 for p in PHASES}
    down = {p: 0 for p in PHASES}
    up["sampling"], down["sampling"] = int(uplink), int(downlink)
    return {"uplink": up, "downlink": down, "total": int(uplink) + int(downlink), "preparation": {}}


def _int(x) -> int:
    try:
        return int(round(float(x)))
    except (TypeError, ValueError):
        return 0


def bits_object(summary: dict) -> dict:
    """``{"uplink": {phase: n}, "downlink": {phase: n}, "total": n, "preparation": {kind: {"uplink": n,
    "downlink": n, "exchanges": n}}}`` from a run's summary (see the module docstring)."""
    prep = summary.get("prep_bits") or {}
    up = {p: 0 for p in PHASES}
    down = {p: 0 for p in PHASES}
    for kind in prep.values():
        up["preparation"] += _int(kind.get("uplink"))
        down["preparation"] += _int(kind.get("downlink"))
    totals = summary.get("totals") or {}
    up["sampling"], down["sampling"] = _int(totals.get("bits_exact")), _int(totals.get("bits_down"))
    loo = summary.get("loo") or {}
    up["loo"], down["loo"] = _int(loo.get("bits_up")), _int(loo.get("bits_down"))
    refresh = summary.get("reference_refresh_per_chain") or [summary.get("reference_refresh") or {}]
    up["other"] = sum(_int(r.get("uplink_bits")) for r in refresh) + _int(summary.get("memory_check_bits", {}).get("uplink"))
    down["other"] = _int(summary.get("memory_check_bits", {}).get("downlink"))
    return {"uplink": up, "downlink": down, "total": sum(up.values()) + sum(down.values()),
            "preparation": {k: dict(prep[k]) for k in PREP_KINDS if k in prep}}
