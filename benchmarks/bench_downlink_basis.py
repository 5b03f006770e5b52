"""The broadcast coded in the metric's whitened coordinates, measured on the main job (issue 37): bits and the
predictive's distance to the HMC reference, for several bases, levels and EF21-P steps.

Today's broadcast (``downlink = qsgd``) codes ``x = θ_k − w_{k−1}`` in θ's own coordinates, so QSGD's error is spread
evenly over θ's coordinates, and in the metric's whitened coordinates it is large along the stiff directions: the
main job needs 128 levels (2.65 bits a coordinate, 62 % of its traffic) to stay within 1.8× the HMC halves' total
variation. This script codes ``z = B⁻¹ x`` instead and moves ``w`` by ``α B C(z)``, for a basis ``B``:

* ``theta``: ``B = I`` (the package's broadcast);
* ``kfac<e>``: ``M_K^e``, a power of K-FAC's metric (the metric's base, without ``metric-block``'s and
  ``metric-rank``'s corrections): ``kfac0.5`` its symmetric root (the error shaped like ``M_K``), ``kfac0.25`` halfway
  between it and θ's coordinates;
* ``dense``: the metric's own root ``S`` (``M = S Sᵀ``), built dense (7,850², about 20 s and 1 GB; slow rounds).

EF21-P needs no exact inverse: server and clients apply the same ``B`` to the same levels, and what an inexact ``B⁻¹``
leaves out is coded the next round. ``α`` is the package's rule ``1/(ω + 1)`` unless given. Each row runs QLSD++'s half
of the main job (its keys, ``./dev demo``'s chains) on the vectorised engine, with
:class:`~qlsd_flwr.protocol.downlink.ChainsBroadcast` patched here (the package's broadcast is not changed), then
reads the total variation of its predictive to the cached reference of ``bench_mainjob_reference.py``. The clients'
messages stay in θ's coordinates (``--uplink-basis theta``), as when these rows were measured; the main job has
quantised them in K-FAC's block basis since (``compression-basis = auto``, :mod:`qlsd_flwr.core.block_basis`).

    python benchmarks/bench_downlink_basis.py --rows theta:128 theta:16 kfac0.5:16 kfac0.5:16:0.5 kfac0.5:32 \
        kfac0.5:64 kfac0.25:32 kfac0.25:64 dense:16 --seed 0
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.smoke import SMOKE, out, small  # noqa: E402


def _basis(name: str, metric, d: int):
    """``(B, B⁻¹)`` as functions of a vector, for the basis ``name``."""
    if name == "theta":
        return (lambda x: x), (lambda x: x)
    if name.startswith("kfac"):  # kfac<e>: M_K^e, e = 0.5 K-FAC's root
        kr, e = metric.kron, float(name[4:])
        if kr is None:
            raise SystemExit("bench_downlink_basis: a kfac basis needs a K-FAC metric")
        return (lambda x: kr.apply(x, -e)), (lambda x: kr.apply(x, e))
    S = np.ascontiguousarray(metric.apply_root(np.eye(d)).T)  # apply_root's rows are S e_j: the columns of S
    Si = np.linalg.inv(S)
    return (lambda x: S @ x), (lambda x: Si @ x)


def run_row(basis: str, s: int, alpha: float | None, seed: int, root: Path, uplink: str) -> dict:
    from qlsd_flwr.compression.qsgd import dequantise
    from qlsd_flwr.core import rng
    from qlsd_flwr.engines.vectorised import numpy_backend as nb
    from qlsd_flwr.experiments.mainjob import QLSD_MAIN
    from qlsd_flwr.protocol import downlink as pdl
    from qlsd_flwr.run.simulate import run

    held: dict = {}
    init0, send0 = nb.NumpyGeneric.__init__, pdl.ChainsBroadcast.send

    def init(self, *a, **k):
        init0(self, *a, **k)
        held["B"], held["Binv"] = _basis(basis, self.spec.metric, self.d)

    def send(self, theta, k, code_bits):  # ChainsBroadcast.send under ef21-p, coded in the basis
        rule, d = self.rule, theta.shape[1]
        a = rule.alpha(d) if alpha is None else alpha
        w = theta.copy()
        for c in range(w.shape[0]):
            if self.w is not None:
                q = rule.compressor.quantise(held["Binv"](theta[c] - self.w[c]),
                                             rng.uniform(int(self.seeds[c]), rng.Stream.DOWNLINK, k, 0, d))
                w[c] = self.w[c] + a * held["B"](dequantise(q))
                code_bits[c] = 8 * len(rule.compressor.encode(q))
        self.w = w

    nb.NumpyGeneric.__init__, pdl.ChainsBroadcast.send = init, send
    name = f"{basis}-s{s}-a{'rule' if alpha is None else alpha}-seed{seed}"
    cfg = {**QLSD_MAIN, "engine": "vectorised", "downlink-s": s, "seed": seed, "output-dir": str(root),
           "run-name": name, "plot": False, "compression-basis": uplink}
    if SMOKE:
        cfg.update({"num-rounds": 6, "burn-in": 0, "thin": 1, "metric-block": 10, "metric-rank": 0})
    t0 = time.perf_counter()
    try:
        r = run(cfg)
    finally:
        nb.NumpyGeneric.__init__, pdl.ChainsBroadcast.send = init0, send0
    sm = r.summary
    rounds = int(sm["rounds"])
    row = {"basis": basis, "uplink_basis": uplink, "s": s, "alpha": alpha if alpha is not None else "rule", "seed": seed,
           "bits_total": sm["bits"]["total"], "bits_broadcast": sm["bits"]["downlink"]["sampling"],
           "bits_per_coordinate": sm["bits"]["downlink"]["sampling"] / (rounds * cfg["num-chains"] * cfg["num-clients"]
                                                                         * int(sm["d"])),
           "verdict": sm["convergence"]["verdict"], "ess_bulk_min": sm["convergence"].get("ess_bulk_min"),
           "rhat_max": sm["convergence"].get("rhat_max"), "seconds": time.perf_counter() - t0, "run": str(r.run_dir)}
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=["theta:128", "kfac0.25:64"],
                    help="basis:levels[:alpha] (basis: theta, kfac<e> for M_K^e, dense; alpha: the rule 1/(ω + 1) when left "
                         "out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--uplink-basis", default="theta", choices=("theta", "block", "auto"),
                    help="the clients' messages' compression-basis (theta: as these rows were measured, before the main "
                         "job took block)")
    ap.add_argument("--out", default="downlink_basis.json", help="file name under benchmarks/")
    ap.add_argument("--runs-dir", default="/tmp/bench_downlink_basis", help="where the runs' folders go")
    a = ap.parse_args(argv)
    from benchmarks import bench_mainjob_reference as ref

    have_ref = Path(ref.CACHE).is_file()
    if not have_ref and not SMOKE:
        raise SystemExit("bench_downlink_basis: no HMC reference; run python benchmarks/bench_mainjob_reference.py first")
    rows = []
    for spec in small(a.rows, a.rows[:1]):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not (parts[0] in ("theta", "dense") or re.fullmatch(r"kfac(0|[01]?\.\d+|1)", parts[0])):
            raise SystemExit(f"bench_downlink_basis: --rows {spec!r}: expected basis:levels[:alpha], basis one of "
                             "theta, kfac<e> (0 ≤ e ≤ 1), dense")
        row = run_row(parts[0], int(parts[1]), float(parts[2]) if len(parts) == 3 else None, a.seed,
                      Path(out(Path(a.runs_dir))), a.uplink_basis)
        if have_ref:
            z = np.load(ref.CACHE, allow_pickle=False)
            tv = ref.tv(ref.run_predictive(Path(row["run"])), z["p_all"])
            row.update({"tv": tv, "tv_ratio": tv / ref.tv(z["p_a"], z["p_b"])})
        rows.append(row)
        print(json.dumps(row), flush=True)
    out(HERE / a.out).write_text(json.dumps({"command": "python benchmarks/bench_downlink_basis.py "
                                             + " ".join(argv or sys.argv[1:]), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
