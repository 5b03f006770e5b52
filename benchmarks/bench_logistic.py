"""Logistic regression, QLSD++ and LSD++: the vectorised engine's numpy backend against a plain
numpy loop and a JAX implementation of the same step (issue 15).

Chain-iterations per second (one chain, one round) on two configurations, 8 chains each,
``s = 16``, full participation, the task's own prior on the server, every client's minibatch
``n_i = ⌊N_i/10⌋``, anchor period ``l = 100``:

* ``breast_cancer``, ``b = 4`` clients (``d = 62``);
* ``digits``, ``b = 20`` clients (``d = 650``).

Columns, all measured in this one run (their ratios are what the script is for):

* ``engine``: :func:`qlsd_flwr.engines.vectorised.run_vectorised`, numpy backend, ``write=False``,
  progress off; everything the engine does (counter-based streams, exact subsets, exact code
  lengths, streamed per-chain statistics). The rate is the engine's own loop rate
  (``chain_iterations_per_second``, set-up excluded); the first run of a process (numba
  compiling or loading its cache) is a warm-up, timed apart.
* ``engine, per-client``: the same with ``NumpyGeneric.BATCHED = False``: the former path, one
  oracle call per (chain, client) (the "before" of this issue).
* ``engine, numba kernel``: ``backend="numba"``: the compiled kernel the toy Gaussian uses, with
  its logistic oracle (its own summation order and libm's ``exp``: the chains follow the
  reference's within float rounding, not bit for bit; only when asked for). The kernel runs one
  thread here (``NUMBA_NUM_THREADS = 1`` and one chain group), like every other column.
* ``numpy loop``: the same step written here as a plain numpy loop vectorised over chains and
  clients (minibatch gradients at ``θ`` and ``ζ``, the SVRG anchor every ``l`` rounds, QSGD with
  dither and a float32 norm, the memory, the Langevin noise), with numpy's own generator (not our
  streams), no code lengths and no statistics.
* ``jax``: the same step in JAX (float64 arithmetic), ``jit`` of ``lax.scan`` over blocks of 100
  rounds of a step ``vmap``-ped over chains, the ``rbg`` generator, minibatches by ``lax.top_k``
  of float32 keys (``jax_f64_keys``: the same with float64 keys, reported as an ablation: XLA's
  CPU ``top_k`` is about 8 times slower on them); compile time timed apart (``lower().compile()``). Skipped
  with a message when ``jax`` cannot be imported (``pip install -e '.[bench]'``).

Threads: every column runs on one thread (``--threads``, default 1): ``OPENBLAS_NUM_THREADS``,
``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``NUMBA_NUM_THREADS`` and, for XLA,
``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`` are set before
numpy or jax is imported (values already in the environment are kept); the JSON records them.
Each rate is the median of ``--repeats`` timed runs, the columns interleaved repeat by repeat
(the machine may be shared: a change of load then hits every column alike).

    python benchmarks/bench_logistic.py            # about 70 s on 2 cores
    python benchmarks/bench_logistic.py --quick    # shorter runs
    python benchmarks/bench_logistic.py --no-jax   # without the JAX column

Writes ``benchmarks/logistic.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def _set_threads(n: int) -> None:
    """Before numpy/jax load: one intra-op thread pool size for every library (kept if set)."""
    for v in THREAD_VARS:
        os.environ.setdefault(v, str(n))
    if n == 1:
        os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":  # thread settings first: they only work before the libraries load
    _pre = argparse.ArgumentParser(add_help=False)
    _pre.add_argument("--threads", type=int, default=1)
    _set_threads(_pre.parse_known_args()[0].threads)

import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.smoke import few, small  # noqa: E402
from benchmarks.smoke import out as smoke_out  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.engines.vectorised import driver, run_vectorised  # noqa: E402
from qlsd_flwr.engines.vectorised.numpy_backend import NumpyGeneric  # noqa: E402
from qlsd_flwr.tasks import loading  # noqa: E402

CHAINS = 8
GAMMA = 1e-4
CONFIGS = [("breast_cancer", 4), ("digits", 20)]
VARIANTS = ("qlsd-pp", "lsd-pp")


def make_cfg(dataset: str, b: int, variant: str, K: int):
    over = {"task": "logistic", "dataset": dataset, "num-clients": b, "variant": variant, "num-rounds": K,
            "burn-in": K // 2, "num-chains": CHAINS, "engine": "vectorised", "progress": False,
            "gamma": GAMMA, "l": 100, "seed": 0}
    if variant.startswith("qlsd"):
        over["s"] = "16"
    return resolve(over)


class Problem:
    """The step's data and settings, as the engine builds them (padded over clients)."""

    def __init__(self, cfg, task):
        specs, spec = driver._parts(cfg, task)[:2]
        cl = task.clients
        self.b, self.d, self.C = cfg.b, task.dim, cfg.num_chains
        self.p1, self.K = cl[0].n_features + 1, cl[0].n_classes
        self.N = np.array([c.n_data for c in cl])
        self.n = np.array([s.batch_size for s in specs])
        self.Nmax, self.nmax = int(self.N.max()), int(self.n.max())
        self.X = np.zeros((self.b, self.Nmax, self.p1))
        self.Y = np.zeros((self.b, self.Nmax), dtype=np.int64)
        for i, c in enumerate(cl):
            self.X[i, :c.n_data], self.Y[i, :c.n_data] = c.Xa, c.y
        self.valid = np.arange(self.Nmax) < self.N[:, None]  # (b, Nmax)
        self.bmask = np.arange(self.nmax) < self.n[:, None]  # (b, nmax)
        self.scale = self.N / self.n
        self.s = int(cfg.s[0]) if cfg.compressed else None
        self.alpha = np.asarray(spec.alpha, dtype=np.float64)
        self.w = 1.0 / np.asarray(cfg.p, dtype=np.float64)
        self.gamma, self.l = cfg.gamma, cfg.l
        self.prior_var = float(task.prior.var)
        assert spec.prior_on_server and cfg.oracle == "svrg" and cfg.memory


# ------------------------------------------------------------------------------ numpy loop
def numpy_loop(P: Problem, K: int, seed: int = 0) -> float:
    """``K`` rounds of the plain numpy step for ``P.C`` chains; returns the wall seconds."""
    gen = np.random.default_rng(seed)
    C, b, d, p1, Kc = P.C, P.b, P.d, P.p1, P.K
    theta = np.zeros((C, d))
    zeta = np.zeros((C, d))
    ag = np.zeros((C, b, d))
    eta_i = np.zeros((C, b, d))
    onehot_full = (P.Y[..., None] == np.arange(Kc)) * P.valid[..., None]  # (b, Nmax, K)
    bi = np.arange(b)[None, :, None]
    sum_th = np.zeros((C, d))
    t0 = time.perf_counter()
    for k in range(K):
        if k % P.l == 0:  # ζ = θ and ∇U_i(ζ) on all local data
            zeta = theta.copy()
            z = np.matmul(P.X[None], zeta.reshape(C, 1, p1, Kc))  # (C, b, Nmax, K)
            e = np.exp(z - z.max(axis=-1, keepdims=True))
            r = e / e.sum(axis=-1, keepdims=True) * P.valid[..., None] - onehot_full
            ag = np.matmul(P.X.transpose(0, 2, 1)[None], r).reshape(C, b, d)
        keys = gen.random((C, b, P.Nmax))
        keys[:, ~P.valid] = 2.0
        idx = np.argsort(keys, axis=-1)[..., :P.nmax]  # (C, b, nmax): a uniform subset per client
        Xr = P.X[bi, idx]  # (C, b, nmax, p1)
        yr = P.Y[bi, idx]
        W = np.stack([theta, zeta]).reshape(2, C, 1, p1, Kc)
        z = np.matmul(Xr[None], W)  # (2, C, b, nmax, K)
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        r = e / e.sum(axis=-1, keepdims=True) - (yr[..., None] == np.arange(Kc))
        r *= P.bmask[:, :, None]
        g = np.matmul(Xr.transpose(0, 1, 3, 2)[None], r).reshape(2, C, b, d)
        h = P.scale[:, None] * (g[0] - g[1]) + ag - eta_i  # H_i − η_i
        if P.s is not None:  # QSGD with dither, the norm sent in float32
            u = gen.random((C, b, d))
            nrm = np.sqrt(np.sum(h * h, axis=-1, keepdims=True))
            safe = np.where(nrm > 0, nrm, 1.0)
            rr = np.minimum(np.abs(h) * P.s / safe, P.s)
            lo = np.floor(rr)
            lev = np.copysign(lo + (u < rr - lo), h)
            gh = nrm.astype(np.float32).astype(np.float64) * lev / P.s
        else:
            gh = h
        grad = np.einsum("b,cbd->cd", P.w, gh) + eta_i.sum(axis=1) + theta / P.prior_var
        eta_i = eta_i + P.alpha[:, None] * gh
        theta = theta - P.gamma * grad + np.sqrt(2 * P.gamma) * gen.standard_normal((C, d))
        sum_th += theta
    dt = time.perf_counter() - t0
    assert np.all(np.isfinite(theta)), "numpy loop diverged"
    return dt


# ------------------------------------------------------------------------------------ jax
def jax_runner(P: Problem, R: int, key_dtype: str = "float32"):
    """A compiled block of ``R`` rounds for ``P.C`` chains: ``(run(state, k0) -> state, init, compile_s)``.

    The minibatch is the ``n_i`` smallest of ``N_i`` uniform keys (``lax.top_k``), with float32
    keys by default: XLA's CPU ``top_k`` took about 8 times longer on float64 keys here (the
    ``key_dtype="float64"`` ablation), and float32 keys tie with probability about ``N_i²·2^-25``
    per draw, which changes nothing measurable in a throughput benchmark."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    kdt = {"float32": jnp.float32, "float64": jnp.float64}[key_dtype]
    C, b, d, p1, Kc = P.C, P.b, P.d, P.p1, P.K
    X, Y = jnp.asarray(P.X), jnp.asarray(P.Y)
    valid, bmask = jnp.asarray(P.valid), jnp.asarray(P.bmask)
    scale, alpha, w = jnp.asarray(P.scale), jnp.asarray(P.alpha), jnp.asarray(P.w)
    nmax, s, gamma, ell, pv = P.nmax, P.s, P.gamma, P.l, P.prior_var
    onehot_full = jax.nn.one_hot(Y, Kc) * valid[..., None]

    def grads(th2, Xr, yr, mask):  # th2 (A, d), Xr (b, n, p1) -> (A, b, d)
        z = jnp.einsum("bnp,apk->abnk", Xr, th2.reshape(-1, p1, Kc))
        r = (jax.nn.softmax(z, axis=-1) - jax.nn.one_hot(yr, Kc)) * mask[None, :, :, None]
        return jnp.einsum("bnp,abnk->abpk", Xr, r).reshape(-1, b, d)

    def step(state, k):  # one chain
        theta, zeta, ag, eta_i, key, sum_th = state
        key, k_mini, k_dith, k_noise = jax.random.split(key, 4)

        def refresh(_):
            z = jnp.einsum("bnp,pk->bnk", X, theta.reshape(p1, Kc))
            r = jax.nn.softmax(z, axis=-1) * valid[..., None] - onehot_full
            return theta, jnp.einsum("bnp,bnk->bpk", X, r).reshape(b, d)

        zeta, ag = jax.lax.cond(k % ell == 0, refresh, lambda _: (zeta, ag), None)
        keys = jnp.where(valid, jax.random.uniform(k_mini, valid.shape, dtype=kdt), 2.0)
        _, idx = jax.lax.top_k(-keys, nmax)  # the nmax smallest keys: a uniform subset
        Xr = jnp.take_along_axis(X, idx[..., None], axis=1)
        yr = jnp.take_along_axis(Y, idx, axis=1)
        g = grads(jnp.stack([theta, zeta]), Xr, yr, bmask)
        h = scale[:, None] * (g[0] - g[1]) + ag - eta_i
        if s is not None:
            u = jax.random.uniform(k_dith, (b, d))
            nrm = jnp.sqrt(jnp.sum(h * h, axis=-1, keepdims=True))
            safe = jnp.where(nrm > 0, nrm, 1.0)
            rr = jnp.minimum(jnp.abs(h) * s / safe, s)
            lo = jnp.floor(rr)
            lev = jnp.copysign(lo + (u < rr - lo), h)
            gh = nrm.astype(jnp.float32).astype(jnp.float64) * lev / s
        else:
            gh = h
        grad = w @ gh + eta_i.sum(axis=0) + theta / pv
        eta_i = eta_i + alpha[:, None] * gh
        theta = theta - gamma * grad + jnp.sqrt(2 * gamma) * jax.random.normal(k_noise, (d,))
        return (theta, zeta, ag, eta_i, key, sum_th + theta), None

    def block(state, k0):
        ks = k0 + jnp.arange(R)
        return jax.lax.scan(jax.vmap(step, in_axes=(0, None)), state, ks)[0]

    init = (jnp.zeros((C, d)), jnp.zeros((C, d)), jnp.zeros((C, b, d)), jnp.zeros((C, b, d)),
            jax.random.split(jax.random.PRNGKey(0), C), jnp.zeros((C, d)))
    t0 = time.perf_counter()
    run = jax.jit(block).lower(init, jnp.int64(0)).compile()
    return run, init, time.perf_counter() - t0


class JaxColumn:
    """A compiled JAX runner; :meth:`measure` times ``blocks`` blocks of ``R`` rounds."""

    def __init__(self, P: Problem, R: int, blocks: int, key_dtype: str = "float32"):
        import jax

        self.jax, self.P, self.R, self.blocks = jax, P, R, blocks
        self.run, self.init, self.compile_s = jax_runner(P, R, key_dtype)
        t0 = time.perf_counter()
        jax.block_until_ready(self.run(self.init, 0))  # first execution
        self.first_run_s = time.perf_counter() - t0

    def measure(self) -> float:
        st = self.init
        t0 = time.perf_counter()
        for j in range(self.blocks):
            st = self.run(st, j * self.R)
        self.jax.block_until_ready(st)
        dt = time.perf_counter() - t0
        assert bool(np.all(np.isfinite(np.asarray(st[0])))), "jax run diverged"
        return self.R * self.blocks * self.P.C / dt


# ---------------------------------------------------------------------------------- engine
def engine_warmup(cfg, task, batched: bool, backend: str = "numpy") -> float:
    """One short run (numba compiling or loading its cache, first touches); its seconds."""
    t0 = time.perf_counter()
    engine_rate(resolve({**cfg.raw, "num-rounds": 20, "burn-in": 10}), task, batched, backend)
    return time.perf_counter() - t0


def engine_rate(cfg, task, batched: bool, backend: str = "numpy") -> float:
    """The engine's loop rate (chain-iterations/s, set-up excluded) on the batched or per-client
    numpy path, or on the compiled kernel (``backend="numba"``: within float rounding of the
    reference, not bitwise; asked for explicitly)."""
    NumpyGeneric.BATCHED = batched
    try:
        res = run_vectorised(cfg, task=task, write=False, progress=False, backend=backend,
                             threads=1)  # the kernel's chain groups: one thread, as every column
    finally:
        NumpyGeneric.BATCHED = True
    assert np.all(np.isfinite(res.theta)), "engine run diverged"
    return float(res.summary["chain_iterations_per_second"])


def profile_engine(cfg, task, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    run_vectorised(cfg, task=task, write=False, progress=False, backend="numpy")
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("ncalls"))
    head = [ln for ln in lines[:start] if "function calls" in ln]
    return "\n".join(head + lines[start:]).replace(str(ROOT) + "/", "").replace(
        str(Path(np.__file__).parents[1]) + "/", "")


def machine() -> dict:
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if ln.startswith("Model name"))
    except Exception:  # noqa: BLE001 (no lscpu)
        model = platform.processor()
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "load_avg_start": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--no-jax", action="store_true", help="skip the JAX column")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="threads of every library (set before import)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "logistic.json"))
    args = ap.parse_args()
    q = args.quick
    args.repeats = small(args.repeats, 1)
    info = machine()
    info["threads"] = {v: os.environ.get(v) for v in (*THREAD_VARS, "XLA_FLAGS", "JAX_PLATFORMS")}
    have_jax, jax_why = False, ""
    if not args.no_jax:
        try:
            import jax

            have_jax = True
            info["jax"] = jax.__version__
        except Exception as exc:  # noqa: BLE001
            jax_why = f"jax not importable ({type(exc).__name__}: {exc}); pip install -e '.[bench]'"
            print(f"[skip] JAX column: {jax_why}")
    else:
        jax_why = "--no-jax"
    if have_jax:
        import jax

        jax.config.update("jax_enable_x64", True)  # float64, as the engine and the numpy loop
        jax.config.update("jax_default_prng_impl", "rbg")  # the faster of threefry/rbg measured here
        info["jax_config"] = {"x64": True, "prng": "rbg", "devices": [str(dv) for dv in jax.devices()]}
    rows = []
    # rounds per timed run (multiples of l = 100, so every column refreshes the anchor as often)
    rounds = {"breast_cancer": {"engine": 1500, "per-client": 300, "loop": 1500, "jax": 2000, "jax64": 500,
                                "numba": 10000},
              "digits": {"engine": 300, "per-client": 100, "loop": 300, "jax": 500, "jax64": 300, "numba": 2000}}
    for dataset, b in few(CONFIGS):
        for variant in few(VARIANTS):
            R = {k: small(max(100, v // 5 // 100 * 100) if q else v, 100) for k, v in rounds[dataset].items()}
            cfg = make_cfg(dataset, b, variant, R["engine"])
            cfg_pc = make_cfg(dataset, b, variant, R["per-client"])
            cfg_nb = make_cfg(dataset, b, variant, R["numba"])
            task = loading.load_task(cfg)
            P = Problem(cfg, task)
            row = {"dataset": dataset, "b": b, "d": task.dim, "chains": CHAINS, "variant": variant,
                   "N_i": P.N.tolist(), "n_i": P.n.tolist(), "rounds": R}
            print(f"{dataset} b={b} {variant}: warm-up ...", flush=True)
            warm = {"engine_s": engine_warmup(cfg, task, True),
                    "engine_per_client_s": engine_warmup(cfg_pc, task, False),
                    "engine_numba_s": engine_warmup(cfg_nb, task, True, "numba")}
            numpy_loop(P, 5)
            cols = {"engine": lambda: engine_rate(cfg, task, True),
                    "engine_per_client": lambda: engine_rate(cfg_pc, task, False),
                    "engine_numba": lambda: engine_rate(cfg_nb, task, True, "numba"),
                    "numpy_loop": lambda: R["loop"] * CHAINS / numpy_loop(P, R["loop"])}
            if have_jax:
                jx = JaxColumn(P, 100, R["jax"] // 100)
                jx64 = JaxColumn(P, 100, R["jax64"] // 100, key_dtype="float64")
                warm.update(jax_compile_s=jx.compile_s, jax_first_run_s=jx.first_run_s,
                            jax_f64_keys_compile_s=jx64.compile_s)
                cols["jax"], cols["jax_f64_keys"] = jx.measure, jx64.measure
            row["warmup"] = warm
            got: dict[str, list] = {c: [] for c in cols}
            print(f"{dataset} b={b} {variant}: timing {', '.join(cols)} x{args.repeats} (interleaved) ...", flush=True)
            for _ in range(args.repeats):  # interleaved, so that a load change hits every column alike
                for c, f in cols.items():
                    got[c].append(f())
            for c, v in got.items():
                row[c] = {"chain_it_per_s": float(np.median(v)), "all": v}
            if not have_jax:
                row["jax"] = {"skipped": jax_why}
            e = row["engine"]["chain_it_per_s"]
            row["ratios"] = {"engine/numpy_loop": e / row["numpy_loop"]["chain_it_per_s"],
                             "engine/per_client": e / row["engine_per_client"]["chain_it_per_s"]}
            row["ratios"]["engine_numba/numpy_loop"] = row["engine_numba"]["chain_it_per_s"] / row["numpy_loop"]["chain_it_per_s"]
            if have_jax:
                row["ratios"]["engine_numba/jax"] = row["engine_numba"]["chain_it_per_s"] / row["jax"]["chain_it_per_s"]
                row["ratios"]["engine/jax"] = e / row["jax"]["chain_it_per_s"]
                row["ratios"]["engine/jax_f64_keys"] = e / row["jax_f64_keys"]["chain_it_per_s"]
            rows.append(row)
    info["load_avg_end"] = os.getloadavg()
    prof_cfg = make_cfg("breast_cancer", 4, "qlsd-pp", small(300 if q else 1500, 100))
    profile = profile_engine(prof_cfg, loading.load_task(prof_cfg))
    out = {"machine": info, "gamma": GAMMA, "rows": rows,
           "profile_engine_breast_cancer_qlsd_pp": profile,
           "command": "python benchmarks/bench_logistic.py" + (" --quick" if q else "")}
    smoke_out(args.out).write_text(json.dumps(out, indent=2))
    print_table(out)
    print(f"\nwrote {smoke_out(args.out)}")


def print_table(out: dict) -> None:
    hdr = (f"{'task':<16}{'b':>3}{'d':>5} {'variant':<8}{'engine':>10}{'per-client':>12}{'numpy loop':>12}"
           f"{'jax':>10}{'eng/loop':>10}{'eng/jax':>9}{'after/before':>14}{'numba kernel':>14}{'numba/jax':>11}")
    print("\nchain-iterations per second (median; 8 chains, one thread each)\n" + hdr + "\n" + "-" * len(hdr))
    for r in out["rows"]:
        jx = r["jax"].get("chain_it_per_s")
        ej = r["ratios"].get("engine/jax")
        print(f"{r['dataset']:<16}{r['b']:>3}{r['d']:>5} {r['variant']:<8}{r['engine']['chain_it_per_s']:>10,.0f}"
              f"{r['engine_per_client']['chain_it_per_s']:>12,.0f}{r['numpy_loop']['chain_it_per_s']:>12,.0f}"
              f"{(f'{jx:,.0f}' if jx else 'skipped'):>10}{r['ratios']['engine/numpy_loop']:>10.2f}"
              f"{(f'{ej:.3f}' if ej else '-'):>9}{r['ratios']['engine/per_client']:>14.2f}"
              f"{r['engine_numba']['chain_it_per_s']:>14,.0f}"
              f"{(f'{nj:.2f}' if (nj := r['ratios'].get('engine_numba/jax')) else '-'):>11}")
    print("\nJAX with float64 subset keys (ablation): " + "; ".join(
        f"{r['dataset']} {r['variant']}: {r['jax_f64_keys']['chain_it_per_s']:,.0f}" for r in out["rows"]
        if "jax_f64_keys" in r))
    print("warm-up / compile (s, excluded above): " + "; ".join(
        f"{r['dataset']} {r['variant']}: engine {r['warmup']['engine_s']:.2f}"
        + (f", jax compile {r['warmup']['jax_compile_s']:.2f}" if "jax_compile_s" in r["warmup"] else "")
        for r in out["rows"]))


if __name__ == "__main__":
    main()
