"""The paper's heterogeneous-MNIST LeNet-5 table on this CPU (issue 39): QLSD++ with p = 1 and
p = 0.25, 4 chains each, 10^4 rounds, FedAvg beside it, into ``benchmarks/lenet_table.json``.

The paper's settings (Vono et al. 2022, S5.3; ``ALGORITHMS.md``) where this machine allows them:
LeNet-5 (d = 61,706), 20 clients with the dominant-label split (each ≈40 % one digit, 1 % the
others), prior N(0, I/5) (weight decay 5), QLSD++ with s = 2 (1-bit QSGD), l = 20, α = 1/(ω+1),
minibatch 64 per client, Bernoulli(p) participation with 1/p weights. The data are the offline MNIST
subset (4,000 training images, 200 a client; 1,000 held out), 15× less than the paper's. The step
keeps the paper's drift per round, γN = 6e-3 (the paper: γ = 1e-7, N = 60,000), so γ = 1.5e-6 here;
10^4 rounds instead of 10^5, the first half burn-in, 100 kept draws a chain.

Each chain is its own run of the framework-free engine (``engine = local``: the Flower apps' client
and server code, messages encoded and decoded, exact code lengths) with seed ``seed + c``, started
dispersed around the seeded PyTorch initialisation (``init = dispersed``: each layer perturbed by
twice its own initialisation scale, ``qlsd_flwr.protocol.starts``). The chains run ``--jobs`` at a
time, one torch thread each; a row's ``wall_seconds`` is the sum of its chains' engine seconds, and
``table_wall_seconds`` the whole table's.

Per row, from the 4 × 100 kept draws on the 1,000 held-out images: the posterior predictive's
accuracy, ECE (10 bins), nNLL and Brier; the R-hat and bulk ESS of the held-out log-likelihood
(``qlsd_flwr.outputs.convergence.predictive``, ArviZ's rank-normalised split R-hat) and the worst
test point's; and the single-draw accuracy averaged over the first and the last tenth of the kept
window (a chain still learning or collapsing shows as a gap). FedAvg: Flower's ``FedAvg`` on the
Ray engine on the same clients and prior (50 rounds; ``simulations/mnist_table.py``'s row).

    python benchmarks/bench_lenet_table.py                       # the issue's 10^4 rounds: about 2.9 h on 2 idle cores
    python benchmarks/bench_lenet_table.py --rounds 5000 --gamma 2.5e-6   # the recorded table: 88 min
    python benchmarks/bench_lenet_table.py --rounds 400 --out /tmp/lenet_table.json   # a quick look
    python benchmarks/bench_lenet_table.py --rounds 10000 --device cuda --gamma 2.5e-6 --fedavg-from benchmarks/lenet_table.json --torch-threads 4 --out benchmarks/lenet_table_cuda.json   # a GPU: 9 min on an H200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "simulations"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from benchmarks.smoke import SMOKE, folder, out as out_path  # noqa: E402
from mnist_table import BASE, N_TRAIN, PAPER  # noqa: E402  one home for the paper's setting and figures

GAMMA_N = 6e-3  # the paper's drift per round: γ = 1e-7 with N = 60,000


def chain_config(args, p: float, c: int, runs_dir: Path) -> dict:
    burn = args.rounds // 2
    thin = max(1, (args.rounds - burn) // args.draws)
    return {**BASE, "num-clients": args.clients, "variant": "qlsd-pp", "l": args.l, "s": str(args.s),
            "batch-fraction": args.batch * args.clients / N_TRAIN, "p": str(p), "gamma": args.gamma,
            "num-rounds": args.rounds, "burn-in": burn, "thin": thin, "init": "dispersed",
            "seed": args.seed + c, "torch-threads": args.torch_threads, "loo": "off", "convergence-criterion": "theta",
            "opt-rounds": 1,  # dispersed around the initialisation itself: a descent at step γ would barely move it
            "output-dir": str(runs_dir), "run-name": f"p{p:g}-chain{c}"}


def row_config(args, p: float, runs_dir: Path) -> dict:
    """A whole row, its chains side by side in one run of the vectorised engine (``--device cuda``: the
    torch backend, every part of a round on the GPU); chain ``c`` has seed ``seed + c`` as above."""
    return {**chain_config(args, p, 0, runs_dir), "engine": "vectorised", "num-chains": args.chains,
            "device": args.device, "vectorised-backend": "torch", "torch-threads": args.torch_threads,
            "run-name": f"p{p:g}"}


def run_chain(cfg: dict) -> dict:
    """One run (a chain, or a row's chains side by side): sampled, or read back where its folder
    already has a ``summary.json``."""
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg["torch-threads"]))
    import torch

    torch.set_num_threads(int(cfg["torch-threads"]))
    from qlsd_flwr.protocol.divergence import DivergenceError
    from qlsd_flwr.run.simulate import run

    run_dir = Path(cfg["output-dir"]) / cfg["run-name"]
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    else:
        try:
            summary = run(cfg, progress=False).summary
        except DivergenceError:  # a result of the row, not the end of the table
            summary = json.loads((run_dir / "summary.json").read_text())
    print(f"{cfg['run-name']}: {summary.get('rounds')} rounds in {summary.get('wall_seconds', float('nan')):.0f} s",
          flush=True)
    return {"run_dir": str(run_dir), "wall_seconds": summary.get("wall_seconds"),
            "engine_seconds": summary.get("engine_seconds"), "backend": summary.get("backend"),
            "torch_device_name": summary.get("torch_device_name"), "verdict": summary.get("convergence"),
            "bits": summary["totals"]["bits_exact"], "rounds": summary.get("rounds"),
            "error": summary.get("error"), "diverged_at_round": summary.get("diverged_at_round")}


def evaluate_row(p: float, chains: list[dict], cfg: dict) -> dict:
    """The row's predictive metrics and convergence from its chains' kept draws."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.evaluation.evaluate import predictive_metrics
    from qlsd_flwr.outputs import convergence
    from qlsd_flwr.outputs.recorder import load_samples
    from qlsd_flwr.tasks import registry

    diverged = [ch for ch in chains if ch.get("diverged_at_round") is not None]
    chains = [ch for ch in chains if ch.get("diverged_at_round") is None]
    lost = [{"run_dir": ch["run_dir"], "round": ch["diverged_at_round"], "error": ch["error"]} for ch in diverged]
    if not chains:  # every chain diverged: the row says so
        return {"p": p, "chains": 0, "rounds": cfg["num-rounds"], "gamma": cfg["gamma"], "device": cfg.get("device", "cpu"),
                "diverged_chains": lost}
    c = resolve(cfg)
    X, y, _, _ = registry.test_set(c)
    pred = registry.predictor_of(c)
    kept = [a for ch in chains for a in np.asarray(load_samples(ch["run_dir"]))]  # every run folder's chains
    n = min(len(t) for t in kept)
    ll = np.empty((len(kept), n, len(y)))
    acc = np.empty((len(kept), n))
    mean_probs = np.zeros((len(y), int(y.max()) + 1))
    for k, draws in enumerate(kept):
        for j, th in enumerate(draws[:n]):
            probs = pred.predict_proba(th, X)
            ll[k, j] = np.log(np.maximum(probs[np.arange(len(y)), y], 1e-300))
            acc[k, j] = float(np.mean(probs.argmax(1) == y))
            mean_probs += probs
    mean_probs /= len(kept) * n
    m = predictive_metrics(mean_probs, y)
    cv = convergence.predictive(ll)
    tenth = max(1, n // 10)
    return {"p": p, "chains": len(kept), "rounds": cfg["num-rounds"], "burn_in": cfg["burn-in"],
            "thin": cfg["thin"], "draws_per_chain": n, "gamma": cfg["gamma"],
            "rhat_loglik": cv["rhat_loglik"], "ess_bulk_loglik": cv["ess_bulk_loglik"],
            "rhat_pred_max": cv["rhat_pred_max"], "ess_bulk_pred_min": cv["ess_bulk_pred_min"],
            "accuracy_first_tenth": float(acc[:, :tenth].mean()), "accuracy_last_tenth": float(acc[:, -tenth:].mean()),
            "accuracy_single_draw_by_chain": [[float(a[:tenth].mean()), float(a[-tenth:].mean())] for a in acc],
            "accuracy": m["accuracy"], "ece": m["ece"], "nnll": m["nnll"], "brier": m["brier"],
            "uplink_bits": float(sum(ch["bits"] for ch in chains)),
            "wall_seconds": float(sum(ch["wall_seconds"] or 0.0 for ch in chains + diverged)),
            "device": cfg.get("device", "cpu"), "engine": cfg.get("engine", "local"), "backend": chains[0].get("backend"),
            "device_name": chains[0].get("torch_device_name"),
            "engine_seconds": float(sum(ch.get("engine_seconds") or 0.0 for ch in chains)),
            "run_dirs": [ch["run_dir"] for ch in chains],
            "diverged_chains": lost}


def _num(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10_000)
    ap.add_argument("--chains", type=int, default=4)
    ap.add_argument("--ps", default="1,0.25", help="participation probabilities, one row each")
    ap.add_argument("--draws", type=int, default=100, help="kept draws per chain (sets the thinning)")
    ap.add_argument("--gamma", type=float, default=GAMMA_N / N_TRAIN, help="step (default 6e-3/N = 1.5e-6)")
    ap.add_argument("--s", type=int, default=2)
    ap.add_argument("--l", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--device", default="cpu",
                    help="cpu: each chain its own framework-free run, --jobs at a time; cuda[:k]: each row's chains "
                         "side by side in one vectorised run on the GPU (the torch backend)")
    ap.add_argument("--vectorised", action="store_true",
                    help="each row's chains side by side on the torch backend (the default with --device cuda)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch's CPU threads in each run")
    ap.add_argument("--fedavg-from", default=None,
                    help="a table JSON whose fedavg row is copied (a GPU machine without Flower)")
    ap.add_argument("--fedavg-rounds", type=int, default=50)
    ap.add_argument("--no-fedavg", action="store_true")
    ap.add_argument("--runs-dir", default=None, help="where the run folders go (default outputs/lenet_table/<time>)")
    ap.add_argument("--reuse", default=None, help="a runs folder of an earlier invocation: finished chains are read back")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "lenet_table.json"))
    args = ap.parse_args(argv)
    if SMOKE:
        args.rounds, args.draws, args.chains, args.jobs, args.no_fedavg = 12, 4, 2, 1, True
        if args.device != "cpu":  # the documented GPU command: the same code on the CPU, fewer rounds
            import torch

            args.rounds, args.draws = 4, 2
            if not torch.cuda.is_available():
                args.device, args.vectorised = "cpu", True
        args.runs_dir = str(folder("lenet_table_runs"))
    out = out_path(args.out)
    runs_dir = Path(args.reuse) if args.reuse else \
        Path(args.runs_dir or ROOT / "outputs" / "lenet_table") / time.strftime("%Y%m%d-%H%M%S")
    runs_dir.mkdir(parents=True, exist_ok=True)
    ps = [float(x) for x in args.ps.split(",")]
    t0 = time.perf_counter()
    if args.device == "cpu" and not args.vectorised:
        jobs = [chain_config(args, p, c, runs_dir) for p in ps for c in range(args.chains)]
        with ProcessPoolExecutor(max_workers=args.jobs) as ex:  # p = 1's chains first: the longest
            done = list(ex.map(run_chain, jobs))
    else:  # one vectorised run a row, in this process (the GPU is one device)
        jobs = [row_config(args, p, runs_dir) for p in ps]
        done = [run_chain(j) for j in jobs]
    rows = []
    for p in ps:
        idx = [k for k, j in enumerate(jobs) if float(j["p"]) == p]
        rows.append(evaluate_row(p, [done[k] for k in idx], jobs[idx[0]]))
    fedavg = None
    if args.fedavg_from:
        fedavg = {**json.loads(Path(args.fedavg_from).read_text())["fedavg"], "copied_from": args.fedavg_from}
    elif not args.no_fedavg:
        from mnist_table import run_fedavg_row

        fa = run_fedavg_row(SimpleNamespace(clients=args.clients, seed=args.seed, fedavg_rounds=args.fedavg_rounds,
                                            fedavg_epochs=2, fedavg_lr=0.1, fedavg_batch=32), runs_dir)
        fedavg = {"rounds": fa["rounds"], "accuracy": fa["metrics"]["accuracy"], "ece": fa["metrics"]["ece"],
                  "nnll": fa["metrics"]["nnll"], "brier": fa["metrics"]["brier"],
                  "uplink_bits": fa["bits_exact_total"], "wall_seconds": fa["wall_seconds"],
                  "settings": "Flower FedAvg, Ray engine, 2 local epochs of SGD (lr 0.1, batch 32), same prior as weight decay"}
    total = time.perf_counter() - t0
    import torch

    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if args.device != "cpu":
        machine += f", {torch.cuda.get_device_name(args.device)}"
    result = {"command": "python benchmarks/bench_lenet_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine, "device": args.device,
              "cuda": "not run: no GPU was lent to this session" if args.device == "cpu" else
              "this table: the torch backend of the vectorised engine on the GPU", "table_wall_seconds": total,
              "settings": {"dataset": "mnist_subset (4,000 train, 1,000 held out)", "model": "lenet5", "d": 61706,
                           "clients": args.clients, "partition": "dominant_label", "prior_var": 0.2, "s": args.s,
                           "l": args.l, "batch": args.batch, "gamma": args.gamma, "gamma_N": args.gamma * N_TRAIN,
                           "init": "dispersed", "engine": "local" if args.device == "cpu" else "vectorised (torch backend)",
                           "seeds": f"{args.seed} + c"},
              "rows": rows, "fedavg": fedavg, "paper": PAPER, "runs_dir": str(runs_dir)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    for r in rows:
        if not r["chains"]:
            print(f"p = {r['p']:g}: every chain diverged")
            continue
        print(f"p = {r['p']:g}: acc {100 * r['accuracy']:.1f} %, ECE {r['ece']:.4f}, nNLL {r['nnll']:.4f}, "
              f"R-hat ll {_num(r['rhat_loglik'], '.3f')} (ESS {_num(r['ess_bulk_loglik'], '.0f')}), single-draw acc "
              f"{100 * r['accuracy_first_tenth']:.1f} → {100 * r['accuracy_last_tenth']:.1f} %, {r['wall_seconds']:.0f} s")
    if fedavg:
        print(f"FedAvg: acc {100 * fedavg['accuracy']:.1f} %, ECE {fedavg['ece']:.4f}, nNLL {fedavg['nnll']:.4f}")
    print(f"table: {total:.0f} s on {machine}; {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
