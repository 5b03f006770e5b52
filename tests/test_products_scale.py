"""One client cannot steer ``gamma = auto`` (issue 38; :mod:`qlsd_flwr.robust.products`).

``gamma = auto`` is ``c / λ_max`` with ``λ_max`` from the power iteration's Hessian-vector products (each
client's own, as fixed-point rows, since issue 37; central differences of the clients' gradients before, and
still where an engine cannot ask for products). Before the rule, one client whose differences were ×1e4 made γ about
5,000× smaller (and ×1e8 froze the chain); ×−1e4 stopped the run with "λ_max is zero (a flat potential)".

Now each client's product is held per datum to ``FACTOR_PRODUCT`` times the clients' lower median before the
sum, then its part of the Rayleigh quotient to ``a_i = max(SHARE, FACTOR_SHARE_DATUM · N_i / N_{−i})`` times the
others' and the prior's. On the toy Gaussian (``∇²U_j = N_j I``: every client's part along a unit ``u`` is
``N_j``) the Rayleigh quotient is then at most ``(N − N_i + 1/σ²)(1 + a_i)``, and never more than the per-datum
clip's ``(N − N_i) + F N_i + 1/σ²``, so γ shrinks by at most the smaller of the two factors; a
sign flip is held from below (since 2026-12-06) to ``−a_i/(1 + a_i)`` times the others', so γ grows by at most
``1 + a_i`` times the others' curvature over the whole (before, ×−1e4 stopped the run: "not convex"). θ* is in closed form, so the only curvature the client gives before
sampling is these products.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.protocol.divergence import DivergenceError
from qlsd_flwr.robust.products import FACTOR_PRODUCT, FACTOR_SHARE_DATUM, SHARE, hold_shares
from qlsd_flwr.run.simulate import run
from qlsd_flwr.tasks.gaussian import build_gaussian_task

O = {"task": "gaussian", "num-clients": 5, "dim": 5, "prior-var": 5.0, "variant": "lsd-pp", "gamma": "auto",
     "theta-star": "closed-form", "num-rounds": 4, "burn-in": 0, "engine": "inprocess", "progress": False,
     "loo": "off", "plot": False}


def scaled_products(factor: float, client: int = 0, dim: int = O["dim"]):
    """Client ``client`` multiplies every Hessian-vector product it gives before sampling by ``factor`` (``dim``:
    the task's)."""
    from flwr.app import ConfigRecord

    from qlsd_flwr.compression import fixed
    from qlsd_flwr.flower.records import from_content

    def mod(msg, ctx, call_next):
        reply = call_next(msg, ctx)
        fields = from_content(msg.content)[0]
        if msg.metadata.message_type != "train" or int(ctx.node_config["partition-id"]) != client \
                or reply.has_error() or fields.get("kind") != "hvp":
            return reply
        rec = dict(reply.content["qlsd"])
        buf = bytes(rec["payload"])  # at the width asked (12 or 16 bits since issue 37), or refused as malformed
        rec["payload"] = fixed.encode(fixed.decode(buf, dim) * factor, fixed.width_of(buf))
        reply.content["qlsd"] = ConfigRecord(rec)
        return reply

    return mod


def test_one_client_s_products_move_gamma_auto_at_most_by_the_stated_factor(tmp_path):
    task = build_gaussian_task(5, 5, 0, prior_var=5.0)
    sizes = [int(c.n_data) for c in task.clients]
    client = int(np.argsort(sizes)[len(sizes) // 2])  # a client of median size: its N_i is not clamped
    N, Ni, prec = sum(sizes), sizes[client], 1.0 / 5.0
    honest = run({**O, "output-dir": str(tmp_path), "run-name": "honest"})
    g0 = honest.summary["gamma"]
    assert "products_clipped" not in honest.summary.get("ts_info", honest.summary)
    per_datum = (N + prec) / (N - Ni + FACTOR_PRODUCT * Ni + prec)  # the per-datum clip's largest shrink
    share = (N + prec) / ((N - Ni + prec) * (1 + max(SHARE, FACTOR_SHARE_DATUM * Ni / (N - Ni))))
    floor = max(per_datum, share)  # the rules' largest shrink: here the share's, 0.367 against 0.184
    assert share > per_datum
    for factor in (1e4, 1e8):
        r = run({**O, "output-dir": str(tmp_path), "run-name": f"x{factor:g}"}, mods=[scaled_products(factor, client)])
        ratio = r.summary["gamma"] / g0
        assert floor * (1 - 0.05) <= ratio <= 1.0, (factor, ratio, floor)  # 5 %: the iteration's own tolerance
        assert r.summary["rejected"].get("phase_reply", 0) == 0
        # the lie reached the rule (a product at another width is refused and taken from gradients instead, which
        # made this test pass with γ unchanged from 12-07's 12-bit rows until the mod wrote the width it was asked)
        info = r.summary.get("ts_info", r.summary)
        assert info.get("products_clipped", 0) > 0 and not info.get("products_rejected"), info
        assert ratio < 0.9, ratio
    # a sign flip: its part is held from below to −a/(1 + a) of the others' (since 2026-12-06), so the curvature
    # reads at least (N − N_i + 1/σ²)/(1 + a) and γ is larger by at most (N + 1/σ²)(1 + a)/(N − N_i + 1/σ²) (before,
    # ×−1e4 stopped the run, "not convex"). Either it samples with γ within that factor, or the chain runs away at that
    # γ and the run stops naming the client whose products were held: never a silent, unbounded γ
    a = max(SHARE, FACTOR_SHARE_DATUM * Ni / (N - Ni))
    try:
        r = run({**O, "output-dir": str(tmp_path), "run-name": "flip"}, mods=[scaled_products(-1e4, client)])
    except DivergenceError as exc:
        assert f"the likely cause is client {client}" in str(exc), exc
    else:
        # (not below the honest γ but by the iteration's tolerance: 12-bit rows round the two runs' products apart)
        assert 1.0 - 0.05 <= r.summary["gamma"] / g0 <= (N + prec) * (1 + a) / (N - Ni + prec) * 1.05
        assert r.summary.get("ts_info", r.summary).get("products_clipped", 0) > 0  # the lie reached the rule


def test_the_power_iteration_finds_the_largest_signed_eigenvalue():
    """An indefinite curvature (a saddle, or false products): the dominant eigenvalue by size is −10, the largest
    is 3; before, the iteration returned max(−10, 0) = 0 and the run stopped reading "a flat potential"."""
    from qlsd_flwr.core.curvature import lambda_max
    from qlsd_flwr.core.metric import Identity

    for diag, largest in (([3.0, -10.0, 1.0], 3.0), ([2.0, 0.5, 1.0], 2.0), ([-1.0, -4.0, -2.0], -1.0)):
        A = np.diag(diag)
        lam, _ = lambda_max(lambda th: A @ th, np.zeros(3), Identity(), seed=0, iters=200, tol=1e-6)
        assert abs(lam - largest) <= 1e-3 * max(1.0, abs(largest)), (diag, lam)


def test_one_client_of_ten_raises_the_power_iteration_s_lambda_at_most_by_one_plus_its_share():
    """The share rule alone (:func:`hold_shares`), on ten clients of equal ``N`` with random PSD curvatures of
    different sizes (d = 30): one client answering each product with any vector (its honest product ×1e6, or
    ``c·u``, a spike along the vector it was asked about) raises the power iteration's λ to at most
    ``1 + max(SHARE, FACTOR_SHARE_DATUM/9)`` times the honest federation's λ_max, and honest products are
    returned as they came (the same objects: no client held)."""
    from qlsd_flwr.core.curvature import lambda_max
    from qlsd_flwr.core.metric import Identity

    gen = np.random.default_rng(3)
    d, b, n = 30, 10, 40
    H = []
    for k in range(b):
        A = gen.normal(size=(d, 2 * d)) * (1.0 + 2.0 * (k % 3))  # clients' curvatures 1× to 9× apart
        H.append(A @ A.T / (2 * d) * n)
    P0 = np.eye(d) * 0.2
    counts = {k: n for k in range(b)}
    honest = float(np.linalg.eigvalsh(sum(H) + P0)[-1])
    bound = 1 + max(SHARE, FACTOR_SHARE_DATUM * n / ((b - 1) * n))

    def hvp_with(lie):
        def hvp(th, u, eps):
            parts = {k: H[k] @ u for k in range(b)}
            if lie is not None:
                parts[4] = lie(u, parts[4])
            held, why = hold_shares(parts, counts, u, float(u @ P0 @ u))
            if lie is None:
                assert not why and all(held[k] is parts[k] for k in parts)
            return sum(held[k] for k in sorted(held)) + P0 @ u
        return hvp

    lam0, _ = lambda_max(None, np.zeros(d), Identity(), seed=0, iters=500, tol=1e-9, hvp=hvp_with(None))
    assert abs(lam0 - honest) <= 1e-6 * honest
    for lie in (lambda u, h: h * 1e6, lambda u, h: u * 1e9):
        lam, _ = lambda_max(None, np.zeros(d), Identity(), seed=0, iters=500, tol=1e-9, hvp=hvp_with(lie))
        assert honest <= lam * (1 + 1e-6) and lam <= bound * honest, (lam / honest, bound)
    # lowering it (since 2026-12-06): its part held from below to −a/(1 + a) of the others', and the value at least the
    # start's quotient, so λ stays at least the others' quotient at the (random) start over 1 + a, whatever it sends:
    # its products negated and ×1e6, a negative spike along the vector asked about, or the others' products cancelled
    # (before, the first two read "not convex" and the last made λ as small as it liked)
    from qlsd_flwr.core.spectral import _random_start

    v0 = _random_start(0, d)
    v0 = v0 / np.linalg.norm(v0)
    floor = float(v0 @ (sum(H[k] for k in range(b) if k != 4) + P0) @ v0) / bound
    others = sum(H[k] for k in range(b) if k != 4) + P0
    for lie in (lambda u, h: -h * 1e6, lambda u, h: -u * 1e9, lambda u, h: -(others @ u) + 1e-3 * u):
        lam, _ = lambda_max(None, np.zeros(d), Identity(), seed=0, iters=500, tol=1e-9, hvp=hvp_with(lie))
        assert floor * (1 - 1e-9) <= lam <= bound * honest, (lam, floor, honest)


def test_a_network_s_dominant_honest_client_is_not_held_and_a_liar_is_held_to_the_network_bound():
    """A model not declared log-concave (``info['products_rule'] = 'network'``, as ``prepare`` sets it for a network)
    takes :func:`factors`' network constants. Twenty clients of equal ``N`` (d = 30), one of which (as a client
    whose labels θ* misfits) has 7× the others' curvature together along its own directions, 133× theirs per datum,
    and one with negative curvature in a direction (not convex): the log-concave constants hold the dominant client
    (γ would come out larger than the honest sum's); the network's hold nobody, so λ is the honest one to the last
    bit. A liar answering ×1e6 or ×1e17 (a part the others' sum would round away if it were taken as ``Σ q − q_i``, as
    before a review found it) raises λ by at most ``λ_max(B_{−i}) + a λ_max(P_0 + Σ_{j≠i} |H_j|)`` (the network's hold
    is against the others' parts' absolute values), 301× the honest λ here at most; one answering ×−1e17 leaves λ at least the
    others' quotient at the (random) start over ``1 + SHARE_NETWORK_BELOW`` (4)."""
    from qlsd_flwr.core.curvature import lambda_max
    from qlsd_flwr.core.metric import Identity
    from qlsd_flwr.robust.products import SHARE_NETWORK, SHARE_NETWORK_BELOW, factors, held_parts

    assert factors(False)[2] == SHARE_NETWORK and factors(True)[1:] == (FACTOR_SHARE_DATUM, SHARE)
    gen = np.random.default_rng(5)
    d, b, n = 30, 20, 40
    H = [(lambda A: A @ A.T / (2 * d) * n * 0.05)(gen.normal(size=(d, 2 * d))) for _ in range(b)]
    E = np.linalg.qr(gen.normal(size=(d, 3)))[0]
    H[3] = H[3] + E @ E.T * 7.0 * float(np.trace(sum(H)) / d)  # dominant along E: its labels misfit
    e = gen.normal(size=d)
    e /= np.linalg.norm(e)
    H[5] = H[5] - 3.0 * np.outer(e, e) * float(e @ H[5] @ e)  # negative curvature there (the sum stays PD)
    assert np.linalg.eigvalsh(H[5])[0] < 0 and np.linalg.eigvalsh(sum(H))[0] > 0
    P0 = np.eye(d) * 0.2
    counts = np.full(b, n)  # the clients' claimed N_i, as the preparation passes them
    honest = float(np.linalg.eigvalsh(sum(H) + P0)[-1])

    def hvp_with(concave, lie=None, seen=None):
        def hvp(th, u, eps):
            parts = {k: H[k] @ u for k in range(b)}
            if lie is not None:
                parts[4] = lie(parts[4])
            info = {"products_rule": "log-concave" if concave else "network"}
            held, scaled = held_parts(parts, counts, info, u, float(u @ P0 @ u))
            if seen is not None:
                seen.update(info.get("products_clipped_clients", []))
            return sum(held[k] for k in sorted(held)) + P0 @ u
        return hvp

    def lam(hvp):
        return lambda_max(None, np.zeros(d), Identity(), seed=0, iters=500, tol=1e-9, hvp=hvp)[0]

    held_as_convex: set = set()
    assert lam(hvp_with(True, seen=held_as_convex)) < honest * (1 - 1e-3) and 3 in held_as_convex
    held_as_network: set = set()
    assert lam(hvp_with(False, seen=held_as_network)) == lam(lambda th, u, eps: sum(H[k] @ u for k in range(b)) + P0 @ u)
    assert not held_as_network and abs(lam(hvp_with(False)) - honest) <= 1e-6 * honest
    def top(A):
        return float(np.linalg.eigvalsh(A)[-1])

    def absolute(A):  # |A|: its eigenvalues' absolute values, so that |uᵀAu| ≤ uᵀ|A|u
        w, V = np.linalg.eigh(A)
        return (V * np.abs(w)) @ V.T

    rest = [k for k in range(b) if k != 4]
    bound = (top(sum(H[k] for k in rest) + P0) + SHARE_NETWORK * top(sum(absolute(H[k]) for k in rest) + P0)) / honest
    assert bound <= 1 + SHARE_NETWORK + 1e-9  # the federation is PSD in sum; only client 5 is indefinite
    for factor in (1e6, 1e17):
        lied = lam(hvp_with(False, lie=lambda h, f=factor: h * f))
        assert honest * (1 - 1e-6) <= lied <= bound * honest * (1 + 1e-9), (factor, lied / honest, bound)
    from qlsd_flwr.core.spectral import _random_start

    v0 = _random_start(0, d)
    v0 = v0 / np.linalg.norm(v0)
    floor = float(v0 @ (sum(H[k] for k in rest) + P0) @ v0) / (1 + SHARE_NETWORK_BELOW)
    assert lam(hvp_with(False, lie=lambda h: h * -1e17)) >= floor * (1 - 1e-9)


def test_the_preparation_tells_the_products_rule_whether_the_model_is_log_concave_gamma_given_or_not():
    """:func:`held_parts` reads ``info['products_rule']``: the preparation sets it for every run, γ given or not (a given
    γ with a metric still takes λ_max for its stability warning; ``gamma = auto``: ``tests/test_gamma_c.py``). The toy
    Gaussian as it is, and with its clients declaring nothing (as a user's potential that does not say)."""
    from qlsd_flwr.config import resolve
    from qlsd_flwr.protocol import build, precondition
    from qlsd_flwr.tasks import loading

    for concave in (True, False):
        cfg = resolve({"task": "gaussian", "dim": 5, "num-clients": 4, "variant": "lsd-pp", "gamma": 1e-3,
                       "metric": "diagonal", "num-rounds": 1, "burn-in": 0, "progress": False, "loo": "off",
                       "plot": False})
        task = loading.load_task(cfg)
        for c in task.clients:
            c.log_concave = concave
        specs = [build.client_spec(cfg, i, task.clients[i].n_data, task.dim, task.prior, build.blocks_for(cfg, task))
                 for i in range(cfg.b)]
        prep = precondition.prepare(cfg, task, build.theta0_of(task), *build.direct_exchanges(cfg, task, specs))
        assert prep.info["log_concave"] is concave
        assert prep.info["products_rule"] == ("log-concave" if concave else "network")
