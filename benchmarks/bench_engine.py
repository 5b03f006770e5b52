"""Throughput of the vectorised engine against a bare numpy lower bound (issue "Long chains").

Measures chain-iterations per second (wall clock, after compilation; the CPU seconds of all
threads are reported too, since a shared machine's load shows in the wall clock only):

* ``bound``: a bare numpy loop doing only the arithmetic of one QLSD* step for the same batch
  of chains, vectorised over chains and clients: minibatch sums (a gather and a sum over
  ``n_i`` rows per client, with indices from numpy's fast generator), the control-variate
  oracle, QSGD norms/levels/dequantisation with ``Generator.random`` dither, the sum over
  clients and the Langevin update with ``Generator.standard_normal``. No exact subset draw,
  no counter-based streams, no code lengths, no statistics: a lower bound on the time of one
  step written in numpy.
* ``engine``: :func:`qlsd_flwr.engines.vectorised.run_vectorised` (numba backend) on QLSD* ``s = 2^4``,
  the same chains, with everything (exact subsets, exact code lengths, streamed statistics).
* ``side by side``: the toy figure's 7 configurations in one pass (:func:`run_side_by_side`).
* ``numpy backend`` and the framework-free ``local`` loop, for scale.

Scaling: seconds per chain-iteration against the number of clients ``b`` (20, 100, 1000;
``d = 50``) and the dimension ``d`` (50, 1e4, 1e6; ``b = 20``, ten points per client so that
the data fit in memory at ``d = 1e6``).

    python benchmarks/bench_engine.py            # everything (a few minutes)
    python benchmarks/bench_engine.py --quick    # smaller runs
    python benchmarks/bench_engine.py --profile  # where the kernel's time goes (ablations)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.smoke import few, small  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.core.potential import GaussianPrior, Task  # noqa: E402
from qlsd_flwr.engines.local import run_local  # noqa: E402
from qlsd_flwr.engines.vectorised import run_side_by_side, run_vectorised  # noqa: E402
from qlsd_flwr.tasks.gaussian import GaussianLocal, build_gaussian_task, client_data  # noqa: E402

FIGURE = [("qlsd-sharp", 4), ("qlsd-sharp", 8), ("qlsd-sharp", 16),
          ("qlsd-star", 4), ("qlsd-star", 8), ("qlsd-star", 16), ("lsd-star", None)]


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def small_task(b: int, d: int, points: int = 10) -> Task:
    """``b`` clients with ``points`` points each in dimension ``d`` (for large ``d``)."""
    ys = [client_data(i, d, 0, n_min=points, n_max=points) for i in range(b)]
    n = sum(y.shape[0] for y in ys)
    mean = sum(y.sum(axis=0) for y in ys) / n
    return Task(name="gaussian", dim=d, clients=[GaussianLocal(y) for y in ys], prior=GaussianPrior(),
                theta_star=mean, posterior_mean=mean, posterior_var=np.full(d, 1.0 / n),
                theta0=np.zeros(d), meta={"N": n})


def cfg_for(task: Task, variant: str, bits, K: int, chains: int, gamma: float | None = None):
    N = sum(c.n_data for c in task.clients)
    return resolve({"variant": variant, "s": str(2 ** bits if bits else 2), "num-rounds": K,
                    "burn-in": K // 2, "num-chains": chains, "engine": "vectorised",
                    "num-clients": task.b, "dim": task.dim, "progress": False,
                    "gamma": gamma if gamma is not None else 0.3 / N})


def lower_bound(task: Task, chains: int, K: int, s: int = 16, gamma: float = 4.9e-4, seed: int = 0):
    """The bare numpy QLSD* loop; returns (wall, cpu) seconds for ``K`` rounds of ``chains`` chains."""
    gen = np.random.default_rng(seed)
    b, d = task.b, task.dim
    Ns = np.array([c.n_data for c in task.clients])
    ns = np.maximum(1, np.floor(Ns * 0.1).astype(int))
    nmax = int(ns.max())
    Y = np.concatenate([c.y for c in task.clients] + [np.zeros((1, d))])  # last row: padding
    off = np.concatenate([[0], np.cumsum(Ns)[:-1]])
    pad = np.arange(nmax)[None, :] >= ns[:, None]  # (b, nmax)
    scale = (Ns / ns)[:, None]
    fn = ns[:, None].astype(float)
    ts = np.asarray(task.theta_star)
    theta = np.zeros((chains, d))
    sq = np.sqrt(2 * gamma)

    def run():
        nonlocal theta
        for _ in range(K):
            idx = off[None, :, None] + (gen.random((chains, b, nmax)) * Ns[None, :, None]).astype(np.int64)
            idx[:, pad] = Y.shape[0] - 1
            S = Y[idx].sum(axis=2)  # (C, b, d)
            H = scale * ((fn * theta[:, None, :] - S) - (fn * ts - S))
            norm = np.sqrt(np.sum(H * H, axis=-1, keepdims=True))
            r = np.minimum(np.abs(H) * s / np.where(norm > 0, norm, 1.0), s)
            lo = np.floor(r)
            lev = np.copysign(lo + (gen.random(H.shape) < r - lo), H)
            gh = norm.astype(np.float32).astype(np.float64) * lev / s
            theta = theta - gamma * gh.sum(axis=1) + sq * gen.standard_normal((chains, d))
        return theta

    w, c, _ = timed(run)
    return w, c


def engine(task: Task, chains: int, K: int, variant="qlsd-star", bits=4, gamma=None, backend="auto"):
    cfg = cfg_for(task, variant, bits, K, chains, gamma)
    run_vectorised(cfg_for(task, variant, bits, 4, chains, gamma), task=task, write=False,
                   progress=False, backend=backend)  # compile / warm up
    w, c, _ = timed(lambda: run_vectorised(cfg, task=task, write=False, progress=False, backend=backend))
    return w, c


def side_by_side(task: Task, chains: int, K: int):
    cfgs = [cfg_for(task, v, b, K, chains, 4.9e-4) for v, b in FIGURE]
    run_side_by_side([cfg_for(task, v, b, 4, chains, 4.9e-4) for v, b in FIGURE], task=task)
    w, c, _ = timed(lambda: run_side_by_side(cfgs, task=task))
    return w, c


def row(name, n_chain_it, w, c, extra=""):
    return {"name": name, "chain_it_per_s": n_chain_it / w, "chain_it_per_cpu_s": n_chain_it / c,
            "us_per_chain_it": 1e6 * w / n_chain_it, "wall_s": w, "cpu_s": c, "note": extra}


def throughput(args) -> list[dict]:
    task = build_gaussian_task(b=20, d=50, data_seed=0)
    C = args.chains
    K = small(2000 if args.quick else 20000, 20)
    out = []
    w, c = lower_bound(task, C, K // 4)
    out.append(row("bound: bare numpy QLSD* step", C * K // 4, w, c))
    for variant, bits in few((("qlsd-star", 4), ("qlsd-sharp", 4), ("qlsd-star", 16), ("lsd-star", None))):
        w, c = engine(task, C, K, variant, bits, 4.9e-4)
        out.append(row(f"engine (numba): {variant} s=2^{bits}" if bits else f"engine (numba): {variant}", C * K, w, c))
    w, c = side_by_side(task, C, K)
    out.append(row("engine (numba), 7 figure configs side by side", 7 * C * K, w, c, "per configuration-chain"))
    Kn = small(100 if args.quick else 400, 5)
    w, c = engine(task, C, Kn, "qlsd-star", 4, 4.9e-4, backend="numpy")
    out.append(row("engine (numpy backend): qlsd-star s=2^4", C * Kn, w, c))
    Kl = small(100 if args.quick else 300, 12)
    cfg = resolve({"variant": "qlsd-star", "s": "16", "num-rounds": Kl, "burn-in": 10, "progress": False,
                   "engine": "local"})
    w, c, _ = timed(lambda: run_local(cfg, task=task, write=False, progress=False))
    out.append(row("local loop (1 chain, encode/decode)", Kl, w, c))
    return out


def scaling(args) -> list[dict]:
    out = []
    quick = args.quick
    for b in few((20, 100, 1000)):
        task = build_gaussian_task(b=b, d=50, data_seed=0)
        C, K = (8, 200 if quick else 1000) if b < 1000 else (8, 20 if quick else 100)
        K = small(K, 10)
        we, ce = engine(task, C, K)
        wb, cb = lower_bound(task, C, max(2, K // 5), gamma=0.3 / task.meta["N"])
        out.append({"axis": "b", "b": b, "d": 50, "chains": C, "engine_s_per_chain_it": we / (C * K),
                    "engine_cpu_s_per_chain_it": ce / (C * K), "bound_s_per_chain_it": wb / (C * max(2, K // 5)),
                    "N": int(task.meta["N"])})
    for d in few((50, 10_000, 1_000_000)):
        task = small_task(20, d)
        C = 8 if d <= 10_000 else 2
        K = small({50: 2000, 10_000: 100, 1_000_000: 4}[d] // (4 if quick else 1) or 2, 10)
        we, ce = engine(task, C, K)
        Kb = max(2, K // 5)
        wb, cb = lower_bound(task, C, Kb, gamma=0.3 / task.meta["N"])
        out.append({"axis": "d", "b": 20, "d": d, "chains": C, "engine_s_per_chain_it": we / (C * K),
                    "engine_cpu_s_per_chain_it": ce / (C * K), "bound_s_per_chain_it": wb / (C * Kb),
                    "N": int(task.meta["N"])})
        del task
    return out


ABLATIONS = {  # edits of the kernel's source (qlsd_flwr/engines/vectorised/kernel.py)
    "Langevin noise (log1p, cos)": [("rng.normal_row_nb(rng.key_rc_nb(ks_noise, k, 0), z)", "z[:] = 0.5")],
    "exact code length (Elias)": [("if encoding[v] != _PACKED:", "if False:")],
    "minibatch subset draw (SplitMix64 keys + selection)": [
        ("tie = rng.subset_nb(kmini, N, n, keys, cand_i, cand_k, amb, sel)",
         "tie = 0\n    for jj in range(n):\n        sel[jj] = jj")],
    "minibatch row sums": [("""        row = off + sel[jj]
        for q in range(d):
            acc[q] = acc[q] + y[row, q]""", """        acc[0] += sel[jj]""")],
    "QSGD dither + quantise + dequantise": [
        ("e = quantise_block_nb(h, u, s[v, i], lev, gh, n32)", "e = 0\n                            gh[:] = h"),
        ("rng.dither_nb(rng.key_rc_nb(ks_dith, k, i), d, u, nzpos)", "pass")],
}


def profile(args) -> list[dict]:
    """Where the kernel's time goes: recompile it with one part removed and time the difference
    (sampling profilers see a numba kernel as one opaque frame). Single thread, CPU time."""
    import types

    from qlsd_flwr.engines.vectorised import kernel, numba_backend

    src = Path(kernel.__file__).read_text().replace("cache=True", "cache=False")
    task = build_gaussian_task(b=20, d=50, data_seed=0)
    K, C = small((2000, 4) if args.quick else (10000, 4), (20, 2))
    out = []

    def measure(label, edits, side=False):
        s = src
        for a, b in edits:
            if a not in s:
                raise RuntimeError(f"profile: cannot find {a[:60]!r}")
            s = s.replace(a, b)
        mod = types.ModuleType(f"vabl{len(out)}")
        mod.__file__ = str(ROOT / "qlsd_flwr" / "_ablation.py")
        sys.modules[mod.__name__] = mod
        exec(compile(s, mod.__file__, "exec"), mod.__dict__)
        combos = FIGURE if side else [("qlsd-star", 4)]
        cfgs = [cfg_for(task, v, b, K, C, 4.9e-4) for v, b in combos]
        numba_backend.chains_block = mod.chains_block  # the backend calls the edited kernel
        try:
            run_side_by_side([cfg_for(task, v, b, 4, C, 4.9e-4) for v, b in combos], task=task, threads=1)
            best = min(timed(lambda: run_side_by_side(cfgs, task=task, threads=1))[1] for _ in range(2))
        finally:
            numba_backend.chains_block = kernel.chains_block
        out.append({"part": label, "side_by_side": side, "us_cpu_per_chain_it": 1e6 * best / (K * C * len(combos))})

    for side in few((False, True)):
        measure("full kernel", [], side)
        for label, edits in few(ABLATIONS).items():
            measure(f"without {label}", edits, side)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--chains", type=int, default=30)
    ap.add_argument("--only", choices=["throughput", "scaling", "profile"], action="append")
    ap.add_argument("--profile", action="store_true", help="also run the ablation profile")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    parts = args.only or (["throughput", "scaling"] + (["profile"] if args.profile else []))
    res = {"machine": {"cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                       "load_before": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}}
    if "throughput" in parts:
        res["throughput"] = throughput(args)
        bound = res["throughput"][0]["chain_it_per_s"]
        bound_cpu = res["throughput"][0]["chain_it_per_cpu_s"]
        print("\n| run | chain-it/s (wall) | chain-it per CPU-s | ratio to bound (wall) |\n| --- | --- | --- | --- |")
        for r in res["throughput"]:
            print(f"| {r['name']} | {r['chain_it_per_s']:,.0f} | {r['chain_it_per_cpu_s']:,.0f} | "
                  f"{r['chain_it_per_s'] / bound:.2f} |")
        print(f"(bound per CPU-s: {bound_cpu:,.0f})")
    if "scaling" in parts:
        res["scaling"] = scaling(args)
        print("\n| axis | b | d | N | chains | engine s/chain-it (wall) | engine CPU s/chain-it | bound s/chain-it | bound/engine |"
              "\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in res["scaling"]:
            print(f"| {r['axis']} | {r['b']} | {r['d']:,} | {r['N']:,} | {r['chains']} | {r['engine_s_per_chain_it']:.3g} | "
                  f"{r['engine_cpu_s_per_chain_it']:.3g} | {r['bound_s_per_chain_it']:.3g} | "
                  f"{r['bound_s_per_chain_it'] / r['engine_s_per_chain_it']:.2f} |")
    if "profile" in parts:
        res["profile"] = profile(args)
        print("\n| kernel | side by side | µs CPU per chain-it |\n| --- | --- | --- |")
        for r in res["profile"]:
            print(f"| {r['part']} | {r['side_by_side']} | {r['us_cpu_per_chain_it']:.2f} |")
    res["machine"]["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    print(f"\nload average before/after: {res['machine']['load_before']}, {res['machine']['load_after']}")
    if args.json:
        smoke_out(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
