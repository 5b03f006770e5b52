"""How many product exchanges ``metric-rank``'s correction needs on the main job (issue 37: the products were
the preparation's largest uplink, 3.2e9 bits for 20 exchanges of 32 vectors).

Offline, with the exact Hessian: the main job's posterior (softmax regression on 4,000 MNIST digits, d = 7,850,
prior N(0, I/5)), its MAP ``θ̂`` (L-BFGS), the K-FAC metric ``M = R Rᵀ`` from the 20 clients' reports at ``θ̂``
(the very functions a run calls), and ``B = Rᵀ ∇²U(θ̂) R``. For each number of exchanges ``q`` the correction
(:func:`qlsd_flwr.core.lowrank.correction`, blocks of ``b``, rank 150) is made from exact products ``∇²U W``, and the
corrected ``B' = Cᵀ B C`` is diagonalised: its condition number ``κ`` sets the slowest direction's relaxation
(about ``κ/c`` rounds at ``γ = c/λ_max``), ``λ_max`` the step. Float64 products here.

``--bits DOWN:UP ...`` instead measures the width of the fixed-point rows the products travel in
(:mod:`qlsd_flwr.compression.fixed`), at the default block and exchanges: the block rounded to ``DOWN`` bits
as the clients receive it, each of the 20 clients' own products (exact, ``hvp_batch``) rounded to ``UP`` bits
as it sends them, then summed with the prior's part (``32``: float32, the width before 16-bit rows).

    python benchmarks/bench_lowrank_exchanges.py --block 32 --q 4 8 10 12 14 16 18 20 24
    python benchmarks/bench_lowrank_exchanges.py --block 8 16 --q 24 32 48 64 --out lowrank_exchanges_blocks.json
    python benchmarks/bench_lowrank_exchanges.py --bits 32:32 16:16 12:12 16:12 12:16 16:8 8:16 8:8 --out lowrank_bits.json

``--gamma SEED ...`` measures ``γ``'s ``λ_max(B')`` at the defaults (16-bit rows both ways), for each seed of the
Krylov space's random start: the exact value (``eigvalsh``), the power iteration a run makes from the top
uncorrected Ritz pair (:func:`qlsd_flwr.core.spectral.lambda_max` with ``start``; the run's since 2026-12-03) and
from a random start (before), each with its number of product exchanges (exact products here).

    python benchmarks/bench_lowrank_exchanges.py --gamma 0 1 2 --out lowrank_gamma.json

``--subspace k ...`` measures base metrics that might make the products unnecessary (issue 37: "a base metric
that is less wrong at the bottom of the spectrum"), each without any correction: EK-FAC (K-FAC's eigenbasis,
its diagonal re-estimated), and K-FAC with the exact curvature on the subspace spanned by ``G``'s top ``k``
eigenvectors and every output (``kK`` dimensions, their couplings included), K-FAC elsewhere. The exact block is
what a client could report, ``Σ_j (Q_kᵀ x̃_j)(Q_kᵀ x̃_j)ᵀ ⊗ (diag p_j − p_j p_jᵀ)``, given ``Q_k`` (``k F̃``
numbers down); computed here from each client's data as a client would, and checked against the exact
Hessian's restriction. Bits: float32 rows, the block's upper triangle up, ``Q_k`` down, over the 20 clients.

    python benchmarks/bench_lowrank_exchanges.py --subspace 10 30 50 100 150 --out lowrank_subspace.json

``--lanczos SEED ...`` measures ``γ``'s ``λ_max`` from a random start (each seed one start) on the metrics without a
Ritz vector to start from: K-FAC alone and K-FAC with ``metric-block = 50`` and ``100`` (the exact ``B``, exact
products): the exact value, :func:`qlsd_flwr.core.spectral.lambda_max` (the Lanczos method, since 2026-12-04) and the
power iteration it replaced (:func:`qlsd_flwr.core.spectral.rough_lambda_max` at ``γ``'s former ``tol = 1e-2``,
``iters = 60``), each with its exchanges of products.

    python benchmarks/bench_lowrank_exchanges.py --lanczos 0 1 2 3 4 --out lowrank_lanczos.json

``--on-block k ...`` with ``--q``: ``metric-rank`` on top of ``metric-block = k`` (the products' Krylov space kept off
the block's directions, as a run keeps it), ``q`` exchanges of 16 exact products (``0``: the block alone), rank
``--rank``: κ, λ_max and λ_min of the corrected ``B``.

    python benchmarks/bench_lowrank_exchanges.py --on-block 50 100 --q 0 2 4 8 16 --out lowrank_on_block.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.bench_mainjob_reference import Posterior  # noqa: E402
from benchmarks.smoke import SMOKE, out  # noqa: E402
from qlsd_flwr.compression import fixed  # noqa: E402
from qlsd_flwr.config import resolve  # noqa: E402
from qlsd_flwr.core import curvature as cv  # noqa: E402
from qlsd_flwr.core import lowrank as lr  # noqa: E402
from qlsd_flwr.robust.reports import loo_excess, share_allowance  # noqa: E402
from qlsd_flwr.experiments.mainjob import QLSD_MAIN  # noqa: E402
from qlsd_flwr.tasks import loading  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--q", type=int, nargs="*", default=[4, 6, 8, 10, 14, 20])
    ap.add_argument("--rank", type=int, default=150)
    ap.add_argument("--block", type=int, nargs="*", default=[lr.LOWRANK_BLOCK],
                    help="vectors per exchange b (each b is run with each q)")
    ap.add_argument("--bits", nargs="*", default=[], metavar="DOWN:UP",
                    help="widths of the block (down) and the clients' products (up): 32 is float32, 2-16 fixed point")
    ap.add_argument("--gamma", type=int, nargs="*", default=[], metavar="SEED",
                    help="γ's λ_max(B') from the top Ritz pair and from a random start, for these Krylov seeds")
    ap.add_argument("--subspace", type=int, nargs="*", default=[], metavar="K",
                    help="κ of K-FAC with the exact curvature on G's top K input directions (and of EK-FAC)")
    ap.add_argument("--lanczos", type=int, nargs="*", default=[], metavar="SEED",
                    help="γ's λ_max from random starts: the Lanczos method against the power iteration")
    ap.add_argument("--on-block", type=int, nargs="*", default=[], metavar="K",
                    help="metric-rank on top of metric-block = K, for each --q (0: the block alone)")
    ap.add_argument("--out", default="lowrank_exchanges.json", help="a JSON file under benchmarks/")
    a = ap.parse_args(argv)
    over = {"num-clients": 4, "dataset": "digits", "task": "logistic"} if SMOKE else {}
    cfg = resolve({**QLSD_MAIN, "engine": "local", "num-chains": 1, **over})
    task, post = loading.load_task(cfg), Posterior(cfg)
    t0 = time.perf_counter()
    mode = minimize(lambda t: tuple(x[0] for x in post.value_and_grad(t)), np.zeros(post.d), jac=True,
                    method="L-BFGS-B", options={"maxiter": 20000, "gtol": 1e-9, "ftol": 1e-15}).x
    H = post.hessian(mode)
    reps = {i: cv.check_report(cv.local_curvature(c, mode, "kronecker", 0, i), "kronecker", post.d)
            for i, c in enumerate(task.clients)}
    m, _ = cv.metric_from_kronecker(reps, task.n_data, np.full(post.d, post.prec), post.d)
    R = np.stack([m.apply_root(e) for e in np.eye(post.d)], axis=1)  # M's root, column by column
    B = R.T @ H @ R
    B = 0.5 * (B + B.T)
    ev = np.linalg.eigvalsh(B)
    rows = [{"q": 0, "products": 0, "kappa": float(ev[-1] / ev[0]), "lambda_max": float(ev[-1])}]
    print(json.dumps(rows[0]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    for down, up in (tuple(int(x) for x in w.split(":")) for w in a.bits):
        def products(W, down=down, up=up):  # as the clients receive the block, and as each sends its products
            W = _width(W, down)
            return sum(_width(c.hvp_batch(mode, W), up) for c in task.clients) + W * post.prec

        (u, t), info = lr.correction(products, lambda x: R @ x, lambda x: R.T @ x, post.d, a.rank, cfg.seed)
        C = np.eye(post.d) + (u * (t ** -0.5 - 1.0)) @ u.T
        e = np.linalg.eigvalsh(C.T @ B @ C)
        row = {"bits_down": down, "bits_up": up, "block": lr.LOWRANK_BLOCK, "q": lr.LOWRANK_EXCHANGES,
               "kept": int(info["lowrank_rank"]), "converged": int(info["lowrank_converged"]),
               "kappa": float(e[-1] / e[0]), "lambda_max": float(e[-1]), "lambda_min": float(e[0])}
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if a.subspace:
        rows += _subspace_rows(task, post, mode, H, m.kron, a.subspace, t0)
    if a.lanczos:
        rows += _lanczos_rows(task, post, mode, H, m.kron, a.lanczos, t0)
    if a.on_block:
        rows += _on_block_rows(task, post, mode, H, m.kron, a.on_block, a.q, a.rank, t0)
    for seed in a.gamma:
        rows.append(_gamma_row(task, post, mode, H, R, B, m, a.rank, seed))
        print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    for b, q in [(b, q) for b in a.block for q in a.q] if not (a.bits or a.gamma or a.subspace or a.lanczos or a.on_block) else []:
        (u, t), info = lr.correction(lambda W: (H @ W.T).T, lambda x: R @ x, lambda x: R.T @ x, post.d, a.rank,
                                     cfg.seed, block=b, exchanges=q)
        C = np.eye(post.d) + (u * (t ** -0.5 - 1.0)) @ u.T
        e = np.linalg.eigvalsh(C.T @ B @ C)
        row = {"block": b, "q": q, "products": q * b, "kept": int(info["lowrank_rank"]),
               "converged": int(info["lowrank_converged"]), "kappa": float(e[-1] / e[0]),
               "lambda_max": float(e[-1]), "lambda_min": float(e[0]),
               "uplink_bits": 32 * q * b * post.d * len(task.clients)}
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    out(HERE / a.out).write_text(json.dumps(
        {"command": "python benchmarks/bench_lowrank_exchanges.py " + " ".join(sys.argv[1:]), "rank": a.rank,
         "rows": rows}, indent=1))


def _gamma_row(task, post, mode, H, R, B, m, rank: int, seed: int) -> dict:
    """λ_max(B') exactly, and as the power iteration finds it from the top Ritz pair and from a random start."""
    def products(W):  # the block and each client's products as they travel (16-bit rows)
        W = fixed.rounded(W, fixed.BITS)
        return sum(fixed.rounded(c.hvp_batch(mode, W), fixed.BITS) for c in task.clients) + W * post.prec

    top: list = []
    (u, t), info = lr.correction(products, lambda x: R @ x, lambda x: R.T @ x, post.d, rank, seed, start=top)
    C = np.eye(post.d) + (u * (t ** -0.5 - 1.0)) @ u.T
    Bp = C.T @ B @ C
    exact = float(np.linalg.eigvalsh(Bp)[-1])
    corrected = m.corrected(u, t)
    ritz, n_ritz = cv.lambda_max(None, mode, corrected, seed, hvp=lambda th, v, eps: H @ v, start=top[0])
    rand, n_rand = cv.lambda_max(None, mode, corrected, seed, hvp=lambda th, v, eps: H @ v)
    return {"seed": seed, "lambda_max_exact": exact, "ritz_top": float(top[0] @ Bp @ top[0]), "from_ritz": ritz,
            "from_ritz_exchanges": n_ritz, "from_random": rand, "from_random_exchanges": n_rand,
            "from_random_error": rand / exact - 1.0, "from_ritz_error": ritz / exact - 1.0,
            "converged": int(info["lowrank_converged"])}


def _subspace_rows(task, post, mode, H, kr, ks, t0) -> list[dict]:
    """κ of the whitened Hessian under EK-FAC and under K-FAC with the exact block on ``G``'s top ``k`` input
    directions (module docstring), in K-FAC's eigenbasis ``Q = Q_G ⊗ Q_A``, where K-FAC is the diagonal ``den``."""
    from scipy.linalg import eigh

    F, K = kr.den.shape
    assert np.array_equal(kr.perm, np.arange(post.d)), "the logistic task's θ is already the (F̃, K) matrix"
    Ht = np.einsum("fkgl,fa,kb,gc,ld->abcd", H.reshape(F, K, F, K), kr.qg, kr.qa, kr.qg, kr.qa,
                   optimize=True).reshape(post.d, post.d)
    Ht = 0.5 * (Ht + Ht.T)

    def kappa(s, idx=None, Rs=None):  # B = R Ht R, R = diag(s) but the block Rs on idx
        B = s[:, None] * Ht * s[None, :]
        if idx is not None:
            B[idx, :] = Rs @ (Ht[idx, :] * s[None, :])
            B[:, idx] = B[idx, :].T
            B[np.ix_(idx, idx)] = Rs @ Ht[np.ix_(idx, idx)] @ Rs
        e = eigh(0.5 * (B + B.T), eigvals_only=True)
        return {"kappa": float(e[-1] / e[0]), "lambda_max": float(e[-1]), "lambda_min": float(e[0])}

    b = len(task.clients)
    # where K-FAC is wrong: the share of each of B's 5 lowest eigenvectors on G's top 1 and top 5 input directions
    s = kr.den.ravel() ** -0.5
    _, V = eigh(s[:, None] * Ht * s[None, :], subset_by_index=[0, 4])
    mass = (V**2).reshape(F, K, 5).sum(axis=1)  # (F̃, 5): each input direction's share (eigh: the top ones last)
    where = {"bottom5_on_top1_input": [round(float(x), 3) for x in mass[-1]],
             "bottom5_on_top5_inputs": [round(float(x), 3) for x in mass[-5:].sum(axis=0)]}
    rows = [{"base": "kfac", **kappa(s), **where},
            {"base": "ekfac", "uplink_bits": 32 * post.d * b, "downlink_bits": 32 * F * F * b,
             **kappa(np.diag(Ht) ** -0.5)}]
    for r in rows:
        print(json.dumps(r), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    for k in sorted({min(k, F) for k in ks}):  # k = F̃ is the exact Hessian: κ = 1
        Qk = kr.qg[:, F - k:]  # eigh's order: the top k input directions are the last
        block = sum(_client_block(c, mode, Qk) for c in task.clients)  # (k K, k K), f-major, outputs unrotated
        Ik = np.kron(np.eye(k), kr.qa)  # rotate the outputs to Q_A's basis, as Ht is
        idx = np.arange((F - k) * K, post.d)
        exact = Ht[np.ix_(idx, idx)]
        reported = Ik.T @ block @ Ik + post.prec * np.eye(k * K)
        w, U = np.linalg.eigh(0.5 * (reported + reported.T))
        # what honest clients use of the rules that hold a block (core.kron_block.correction): the per-datum trace
        # over the lower median (cap: REPORT_CAP) and the leave-one-out excess over its allowance (cap: 1)
        per = {i: _client_block(c, mode, Qk) for i, c in enumerate(task.clients)}
        n = np.asarray(task.n_data, dtype=np.float64)
        tr = sorted(float(np.trace(B)) / n[i] for i, B in per.items())
        allow = share_allowance(task.n_data, per)
        floor = post.prec * (Qk.T @ Qk)  # the isotropic prior's part, in the block's coordinates
        floor = np.kron(floor, np.eye(K))
        loo = max(loo_excess(B, floor + block - B) / allow[i] for i, B in per.items())
        row = {"base": "kfac+block", "k": k, "block_dim": k * K, "honest_trace_over_median": tr[-1] / tr[(len(tr) - 1) // 2],
               "honest_loo_share": float(loo),
               "block_vs_exact": float(np.abs(reported - exact).max() / np.abs(exact).max()),
               "uplink_bits": 32 * (k * K) * (k * K + 1) // 2 * b, "downlink_bits": 32 * k * F * b,
               **kappa(kr.den.ravel() ** -0.5, idx, (U * w ** -0.5) @ U.T)}
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def _block_matrices(task, post, mode, H, kr, ks) -> dict:
    """The whitened ``B`` in K-FAC's eigenbasis (as :func:`_subspace_rows`) under K-FAC (``"kfac"``) and under K-FAC
    with the exact block on ``G``'s top ``k`` input directions (``k``, for each of ``ks``), with the block's
    coordinates (the last ``kK``)."""
    F, K = kr.den.shape
    Ht = np.einsum("fkgl,fa,kb,gc,ld->abcd", H.reshape(F, K, F, K), kr.qg, kr.qa, kr.qg, kr.qa,
                   optimize=True).reshape(post.d, post.d)
    Ht = 0.5 * (Ht + Ht.T)
    s = kr.den.ravel() ** -0.5
    mats = {"kfac": (s[:, None] * Ht * s[None, :], np.arange(0))}
    for k in sorted({min(k, F) for k in ks}):
        Qk = kr.qg[:, F - k:]
        block = sum(_client_block(c, mode, Qk) for c in task.clients)
        Ik = np.kron(np.eye(k), kr.qa)
        idx = np.arange((F - k) * K, post.d)
        w, U = np.linalg.eigh(0.5 * (Ik.T @ block @ Ik + (Ik.T @ block @ Ik).T) + post.prec * np.eye(k * K))
        Rs = (U * w ** -0.5) @ U.T
        B = s[:, None] * Ht * s[None, :]
        B[idx, :] = Rs @ (Ht[idx, :] * s[None, :])
        B[:, idx] = B[idx, :].T
        B[np.ix_(idx, idx)] = Rs @ Ht[np.ix_(idx, idx)] @ Rs
        mats[k] = (0.5 * (B + B.T), idx)
    return mats


def _lanczos_rows(task, post, mode, H, kr, seeds, t0) -> list[dict]:
    """γ's λ_max from random starts on K-FAC's ``B`` and on K-FAC with the exact block (``k = 50, 100``): exact,
    Lanczos, power iteration."""
    from scipy.linalg import eigh

    from qlsd_flwr.core.metric import Identity

    rows = []
    for k, (B, _) in _block_matrices(task, post, mode, H, kr, (50, 100)).items():
        name = k if k == "kfac" else f"kfac+block k={k}"
        exact = float(eigh(B, eigvals_only=True, subset_by_index=[post.d - 1, post.d - 1])[0])
        for seed in seeds:
            hvp = lambda th, u, eps, B=B: B @ u  # noqa: E731
            lz, n_lz = cv.lambda_max(None, np.zeros(post.d), Identity(), seed, hvp=hvp)
            pw, n_pw = cv.rough_lambda_max(None, np.zeros(post.d), Identity(), seed, iters=60, tol=1e-2, hvp=hvp)
            rows.append({"base": name, "seed": seed, "lambda_max_exact": exact, "lanczos": lz, "lanczos_exchanges": n_lz,
                         "lanczos_error": lz / exact - 1.0, "power": pw, "power_exchanges": n_pw,
                         "power_error": pw / exact - 1.0})
            print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def _on_block_rows(task, post, mode, H, kr, ks, qs, rank: int, t0) -> list[dict]:
    """``metric-block = k`` with ``metric-rank`` on top (:func:`qlsd_flwr.core.lowrank.correction` off the block's
    coordinates, ``q`` exchanges of 16 exact products; ``q = 0``: the block alone): κ, λ_max, λ_min of the corrected
    ``B``, and the products' uplink in 16-bit rows over the clients."""
    from scipy.linalg import eigh

    rows = []
    for k, (B, idx) in _block_matrices(task, post, mode, H, kr, ks).items():
        if k == "kfac":
            continue
        comp = np.setdiff1d(np.arange(post.d), idx)  # off the block: its whitened coordinates are the last kK
        Bc = B[np.ix_(comp, comp)]
        for q in qs:
            C, kept = np.eye(post.d), 0
            if q and comp.size:  # k = F̃ (the smoke's digits): the block is the whole Hessian, nothing is left
                low, info = lr.correction(lambda W, Bc=Bc: W @ Bc, lambda x: x, lambda x: x, comp.size, rank, 0,
                                          exchanges=q)
                if low is not None:
                    u, t = low
                    C[np.ix_(comp, comp)] += (u * (t ** -0.5 - 1.0)) @ u.T
                    kept = int(t.size)
            e = eigh(C.T @ B @ C, eigvals_only=True)
            rows.append({"base": "kfac+block", "k": k, "q": q, "products": q * lr.LOWRANK_BLOCK, "kept": kept,
                         "kappa": float(e[-1] / e[0]), "lambda_max": float(e[-1]), "lambda_min": float(e[0]),
                         "products_uplink_bits": 16 * q * lr.LOWRANK_BLOCK * post.d * len(task.clients)})
            print(json.dumps(rows[-1]), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def _client_block(c, theta, Qk) -> np.ndarray:
    """A client's exact curvature on ``span(Q_k) ⊗ R^K``: ``Σ_j z_j z_jᵀ ⊗ (diag p_j − p_j p_jᵀ)``, ``z_j = Q_kᵀ x̃_j``
    (the prior's part left to the server)."""
    K = c.n_classes
    p = np.exp(c.Xa @ theta.reshape(-1, K) - (c.Xa @ theta.reshape(-1, K)).max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    Z = c.Xa @ Qk  # (n, k)
    k = Z.shape[1]
    Y = (Z[:, :, None] * p[:, None, :]).reshape(len(Z), k * K)
    out = -(Y.T @ Y)
    for a in range(K):  # the diag p_j part: Σ_j p_ja z_j z_jᵀ on the (·, a), (·, a) entries
        out[a::K, a::K] += (Z * p[:, a:a + 1]).T @ Z
    return out


def _width(X, bits: int) -> np.ndarray:
    """``X``'s rows as a ``bits``-wide exchange carries them: float32 at 32, else fixed point."""
    return np.asarray(X, np.float32).astype(np.float64) if bits == 32 else fixed.rounded(X, bits)


if __name__ == "__main__":
    main()
