"""The vectorised engine's torch backend on its device: its parts against the numpy reference, a run
against itself, and LeNet-5 round times (issue 39; ``benchmarks/RESULTS.md``).

On the device it runs on (``--device cuda`` on a GPU machine; ``cpu`` anywhere):

* **parts**: the random streams (participation, minibatch keys, dither) bit for bit against
  :mod:`qlsd_flwr.core.rng`, the minibatch subsets, the Langevin normals (largest difference), QSGD's
  levels and exact code lengths against :class:`~qlsd_flwr.compression.qsgd.QSGD` on the same input;
* **chains**: an uncompressed LSD++ LeNet-5 run of the torch backend against the numpy backend (the
  largest relative difference of θ over the rounds: float rounding), and a QLSD++ run twice (bitwise
  equal: a run is a function of its seed on the device too);
* **rounds**: seconds per round of the heterogeneous-MNIST LeNet-5 setting (20 clients, batch 64,
  QLSD++ ``s = 2``, ``l = 20``, 4 chains) at ``p = 1`` and ``p = 0.25``, after a warm-up.

    python benchmarks/bench_torch_backend.py --device cuda --out benchmarks/torch_backend_cuda.json
    python benchmarks/bench_torch_backend.py --rounds 20 --out /tmp/torch_backend.json   # the CPU, a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.smoke import SMOKE, out as out_path  # noqa: E402

LENET = {"task": "mnist", "dataset": "mnist_subset", "model": "lenet5", "partition": "dominant_label",
         "num-clients": 20, "prior-var": 0.2, "s": "2", "alpha": "auto", "variant": "qlsd-pp", "l": 20,
         "batch-fraction": 0.32, "gamma": 2.5e-6, "burn-in": 0, "thin": 1, "engine": "vectorised",
         "progress": False, "init": "dispersed", "opt-rounds": 1, "loo": "off", "convergence-criterion": "theta",
         "vectorised-backend": "torch", "data-seed": 0, "seed": 0}


def parts(device: str) -> dict:
    """The torch twins against the numpy reference, on ``device``."""
    import torch

    from qlsd_flwr.compression.qsgd import QSGD
    from qlsd_flwr.core import rng
    from qlsd_flwr.engines.vectorised import torch_twins

    dev = torch.device(device)
    seeds = np.array([0, 1, 7, 2**40 + 3], dtype=np.int64)
    clients = np.arange(20)
    res = {}
    for name, stream, n in (("participation", rng.Stream.PARTICIPATION, 1), ("minibatch_keys", rng.Stream.MINIBATCH, 200),
                            ("dither", rng.Stream.DITHER, 61706)):
        ref = rng.uniform(seeds[:, None], stream, 12345, clients[None, :], n)
        k = torch_twins.keys(torch_twins.seed_keys(seeds, int(stream), dev), 12345, torch.as_tensor(clients, device=dev))
        got = torch_twins.uniform(k, n).cpu().numpy()
        res[f"{name}_bitwise"] = bool(np.array_equal(ref.view(np.uint64), got.view(np.uint64)))
    ref = rng.subset(seeds[:, None], rng.Stream.MINIBATCH, 99, clients[None, :], 200, 64)
    k = torch_twins.keys(torch_twins.seed_keys(seeds, int(rng.Stream.MINIBATCH), dev), 99, torch.as_tensor(clients, device=dev))
    res["subsets_equal"] = bool(np.array_equal(ref, torch_twins.subset(k, 200, 64).cpu().numpy()))
    ref = rng.normal(seeds, rng.Stream.NOISE, 5, 0, 61706)
    k = torch_twins.keys(torch_twins.seed_keys(seeds, int(rng.Stream.NOISE), dev), 5, torch.zeros(1, dtype=torch.int64, device=dev))[:, 0]
    got = torch_twins.normal(k, 61706).cpu().numpy()
    res["normal_max_abs_diff"] = float(np.max(np.abs(ref - got)))
    res["normal_bitwise_share"] = float(np.mean(ref.view(np.uint64) == got.view(np.uint64)))
    gen = np.random.default_rng(0)
    V = gen.standard_normal((8, 61706)) * np.exp(gen.standard_normal((8, 1)))
    V[0, ::3] = 0.0
    U = gen.random(V.shape)
    mism, bits_eq = 0, True
    for s in (2, 16, 256):
        for enc in ("auto", "elias", "packed"):
            q = QSGD(s=s, encoding=enc)
            norms, levels = q.quantise_batch(V, U)
            n32, lv, ok = torch_twins.quantise(torch.as_tensor(V, device=dev), torch.as_tensor(U, device=dev), s)
            lv = lv.cpu().numpy()
            mism += int(np.sum(lv != levels))
            code = torch_twins.CodeLength(V.shape[1], s, enc, dev)
            bits_eq &= bool(np.array_equal(code(torch.as_tensor(levels, device=dev)).cpu().numpy(),
                                           q.code_length_bits_batch(levels)))
            bits_eq &= bool(ok.all())
    res["qsgd_level_mismatches"] = mism
    res["qsgd_code_lengths_equal"] = bits_eq
    return res


def _run(cfg: dict, backend: str, keep_trace: bool = False):
    from qlsd_flwr.config import resolve
    from qlsd_flwr.engines.vectorised import run_vectorised

    return run_vectorised(resolve(cfg), write=False, keep_trace=keep_trace, backend=backend)


def chains(device: str, rounds: int) -> dict:
    """LSD++ torch against numpy (float rounding), and a QLSD++ torch run against itself (bitwise)."""
    cfg = {**LENET, "device": device, "num-chains": 2, "num-rounds": rounds, "p": "0.5"}
    lsd = {**cfg, "variant": "lsd-pp"}
    t = _run(lsd, "torch", keep_trace=True)
    n = _run(lsd, "numpy", keep_trace=True)
    rel = float(np.max(np.abs(t.trace - n.trace)) / np.max(np.abs(n.trace)))
    moved = float(np.max(np.abs(n.trace[:, -1] - n.trace[:, 0])) / np.max(np.abs(n.trace)))
    a = _run(cfg, "torch", keep_trace=True)
    b = _run(cfg, "torch", keep_trace=True)
    return {"rounds": rounds, "lsd_pp_torch_vs_numpy_max_rel_diff": rel, "lsd_pp_moved_rel": moved,
            "lsd_pp_same_messages": bool(np.array_equal(t.stats.n_active, n.stats.n_active)
                                         and np.array_equal(t.stats.bits_exact, n.stats.bits_exact)),
            "qlsd_pp_twice_bitwise": bool(np.array_equal(a.trace, b.trace))}


def round_times(device: str, rounds: int, chains_: int = 4) -> dict:
    """Seconds per round of the LeNet-5 setting, ``p = 1`` and ``0.25`` (a warm-up run first)."""
    import torch

    out = {}
    for p in ("1.0", "0.25"):
        cfg = {**LENET, "device": device, "num-chains": chains_, "p": p}
        _run({**cfg, "num-rounds": min(21, rounds)}, "torch")  # cuDNN's plans, the first anchor
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = _run({**cfg, "num-rounds": rounds}, "torch")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        out[f"p={p}"] = {"rounds": rounds, "chains": chains_, "wall_seconds": wall,
                         "engine_seconds": r.summary.get("engine_seconds"),
                         "seconds_per_round": r.summary["engine_seconds"] / rounds,
                         "chain_rounds_per_second": rounds * chains_ / r.summary["engine_seconds"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=200, help="rounds of each timed LeNet-5 run")
    ap.add_argument("--chain-rounds", type=int, default=30, help="rounds of the chain comparisons")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "torch_backend.json"))
    args = ap.parse_args(argv)
    import torch

    if SMOKE:
        args.rounds, args.chain_rounds = 3, 3
        if not torch.cuda.is_available():  # the documented GPU command, on the CPU: the same code on a
            args.device = "cpu"            # small network (LeNet-5's vmapped convolutions are slow there)
            LENET.update({"dataset": "digits", "model": "mlp", "num-clients": 4})

    torch.set_num_threads(min(4, torch.get_num_threads()))
    res = {"command": "python benchmarks/bench_torch_backend.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "device": args.device, "torch": torch.__version__,
           "machine": f"{platform.machine()}, torch threads {torch.get_num_threads()}"
                      + (f", {torch.cuda.get_device_name(args.device)}" if args.device.startswith("cuda") else "")}
    for name, fn in (("parts", lambda: parts(args.device)), ("chains", lambda: chains(args.device, args.chain_rounds)),
                     ("round_times", lambda: round_times(args.device, args.rounds))):
        try:  # one failing part is recorded; the others still run
            res[name] = fn()
        except Exception as exc:
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({name: res[name]}), flush=True)
    out = out_path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
