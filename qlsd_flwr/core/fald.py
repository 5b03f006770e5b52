r"""FALD and VR-FALD\* (Plassier, Durmus, Moulines, AISTATS 2023): federated averaging Langevin
dynamics, and its variance-reduced version with control variates at a reference point.

One round ``k → k+1``, ``K`` local steps on every client, full local gradients: each client ``i``
starts from θ_k and takes ``K`` steps

    θ_i ← θ_i − (h/w_i) ∇Ũ_i(θ_i) + √(2h) (√τ ξ_j + √((1 − τ)/w_i) ξ_{i,j}),   j = 0 … K−1,

then the server averages, ``θ_{k+1} = Σ_i w_i θ_i``. Here ``w_i = N_i / N`` (``Σ_i w_i = 1``), ``Ũ_i =
U_i + w_i U_0`` (the prior shared in proportion to the data), ``ξ_j`` the **common** noise of local
step ``j`` (every client draws the same one: stream ``(seed, NOISE, k, 0)``, positions
``[jd, (j+1)d)``) and ``ξ_{i,j}`` client ``i``'s own (stream ``(seed, LOCAL, k, i)``); ``τ ∈ [0, 1]``
is the share of the noise that is common (the papers' privacy knob: ``τ = 1`` sends only shared
noise, ``τ = 0`` only private noise).

**Why this scaling targets π and not a cooled posterior.** With ``K = 1`` the average takes exactly
the unadjusted Langevin step of size ``h`` on ``U = Σ_i Ũ_i``: its drift is ``−h Σ_i ∇Ũ_i(θ)``, its
noise variance ``2h (τ (Σ_i w_i)² + (1 − τ) Σ_i w_i² / w_i) = 2h``. The FALD repository's
deep-learning variant injects one shared ``√(2γ/b) ξ`` with the full-data drift, whose average
targets ``exp(−b U)``, a posterior cooled by the number of clients; the same paper's numpy
version has this module's scaling with ``w_i = 1/b`` (``h = γ/b``). With ``K > 1`` each client
drifts toward its own mode between averages: the stationary law moves by ``O(hK)`` on
heterogeneous clients (the local-step bias, ``O(h(K − 1))``; none on the toy Gaussian with ``w_i = N_i/N``, where
the clients' curvatures are proportional to their weights), besides ULA's ``O(h)``. For the toy Gaussian the
round is a linear Gaussian recursion and ``tests/laws_fald.py``'s ``gaussian_stationary`` gives its law exactly; the
tests compare the chain with it.

**Partial participation** (client ``i`` active with probability ``p_i``, the set ``A``): the server
takes ``θ_{k+1} = θ_k + Σ_{i∈A} (w_i/p_i)(θ_i − θ_k)`` (the Horvitz–Thompson weights of
``aggregation = unbiased``), and tells every active client ``S_A = Σ_{j∈A} w_j/p_j``, with which it
scales its noise: common ``√τ/S_A``, private ``√((1 − τ) p_i/(w_i S_A))``. Given ``A`` the averaged
noise is then exactly ``√(2h)`` times a standard normal (common part ``Σ_A (w_i/p_i)·√τ/S_A = √τ``,
private variance ``Σ_A (w_i/p_i)² (1 − τ) p_i/(w_i S_A) = 1 − τ``), and with ``K = 1`` the drift
``h Σ_A ∇Ũ_i/p_i`` is unbiased for ``h ∇U``: FALD is then SGLD with the participation's gradient
noise, for any τ. At ``p = 1``, ``S_A = 1`` and the scales are the ones above. A round in which no
client replies leaves θ where it is (counted as skipped). ``tests/laws_fald.py``'s ``gaussian_stationary`` gives the law
with participation too, exactly (the expectation over every active set).

**The message** a client sends is ``Δ_i = (θ_k − θ_i)/h`` (:func:`message`), which the server
decodes and applies as ``θ_{k+1} = θ_k − h Σ_{i∈A} (w_i/p_i) Δ̂_i``
(:func:`qlsd_flwr.samplers.fald.average_step`); with QSGD it is compressed like a gradient
(unbiased, so the average is; the noise it carries is part of what is compressed, so the
quantisation adds variance of order ``ω`` relative to the Langevin noise).

The round protocol, the Flower apps and the local and Ray engines run it (``variant = fald``,
``vr-fald-star``; :mod:`qlsd_flwr.protocol.server`); :func:`run` is the framework-free reference.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.core import participation, rng


def weights(n_data, rule: str = "data") -> np.ndarray:
    """``w_i``: ``N_i / N`` (``data``) or ``1/b`` (``equal``, the FALD repository's numpy code)."""
    n = np.asarray(n_data, dtype=np.float64)
    if rule not in ("data", "equal"):
        raise ValueError(f"FALD weights: 'data' or 'equal', got {rule!r}")
    return n / n.sum() if rule == "data" else np.full(n.size, 1.0 / n.size)


def round_shares(n_data, kept, active, p) -> tuple[np.ndarray, float]:
    """``(w, S_A)``: the data shares ``w_i = N_i / Σ_{j kept} N_j`` (0 for a client no longer kept) and
    the active set's ``S_A = Σ_{i∈A} w_i/p_i`` (the server's, each round: :mod:`qlsd_flwr.protocol.server`)."""
    n = np.asarray(n_data, dtype=np.float64)
    on = np.zeros(n.size, dtype=bool)
    on[list(kept)] = True
    w = np.where(on, n, 0.0) / float(np.sum(n[on])) if on.any() else np.zeros(n.size)
    a = np.asarray(list(active), dtype=np.int64)
    return w, float(np.sum(w[a] / np.asarray(p, dtype=np.float64)[a])) if a.size else 0.0


def noise_scales(w: float, tau: float, share: float = 1.0, p: float = 1.0) -> tuple[float, float]:
    """``(a, b)``: the common and the private noise's coefficients of client ``i`` (module docstring):
    ``a = √τ / S_A``, ``b = √((1 − τ) p_i / (w_i S_A))``."""
    return float(np.sqrt(tau) / share), float(np.sqrt((1.0 - tau) * p / (w * share)))


def local_steps(grad_u, theta: np.ndarray, w: float, h: float, tau: float, steps: int, seed: int, k: int,
                i: int, share: float = 1.0, p: float = 1.0, temperature: float = 1.0, metric=None) -> np.ndarray:
    """Client ``i``'s ``K = steps`` local steps from ``θ`` at round ``k`` (``grad_u = ∇Ũ_i``); ``share``
    ``S_A`` and ``p`` ``p_i`` scale the noise (module docstring), ``temperature`` ``T`` multiplies its
    variance (the chain then targets ``π^{1/T}``). ``metric``: a metric ``M``
    (:class:`qlsd_flwr.core.metric.Metric` of any kind, or ``d`` numbers for a diagonal one; ``None``:
    the identity): each step is then ``x − (h/w_i) M ∇Ũ_i(x) + √(2hT) M^{1/2} (noise)``, whose average
    over the clients is the preconditioned Langevin step ``θ − h M ∇U(θ) + √(2hT) M^{1/2} ξ`` (with one
    local step). In the whitened coordinates ``φ = M^{-1/2} x`` it is FALD on ``Ũ_i(M^{1/2} φ)``; with
    a diagonal ``M`` every coordinate is FALD with the step ``h m_j``."""
    d = theta.shape[-1]
    common = rng.normal(seed, rng.Stream.NOISE, k, 0, steps * d).reshape(steps, d)
    own = rng.normal(seed, rng.Stream.LOCAL, k, i, steps * d).reshape(steps, d)
    a, b = noise_scales(w, tau, share, p)
    noise_sd = np.sqrt(2.0 * h * temperature)
    x = np.asarray(theta, dtype=np.float64).copy()
    if metric is None:
        for j in range(steps):
            x = x - (h / w) * grad_u(x) + noise_sd * (a * common[j] + b * own[j])
        return x
    M = as_metric(metric)
    for j in range(steps):
        x = x - (h / w) * M.apply(grad_u(x)) + noise_sd * M.apply_root(a * common[j] + b * own[j])
    return x


def as_metric(metric):
    """A :class:`~qlsd_flwr.core.metric.Metric`, or ``d`` numbers taken as a diagonal one."""
    from qlsd_flwr.core.metric import Diagonal, Metric

    return metric if isinstance(metric, Metric) else Diagonal(metric)


def message(grad_u, theta: np.ndarray, w: float, h: float, tau: float, steps: int, seed: int, k: int, i: int,
            share: float = 1.0, p: float = 1.0, temperature: float = 1.0, metric=None) -> np.ndarray:
    """What client ``i`` sends: ``Δ_i = (θ − θ_i)/h`` after its :func:`local_steps`."""
    theta = np.asarray(theta, dtype=np.float64)
    return (theta - local_steps(grad_u, theta, w, h, tau, steps, seed, k, i, share, p, temperature, metric)) / h


def run(task, h: float, steps: int, rounds: int, tau: float = 0.0, seed: int = 0, theta0=None,
        rule: str = "data", anchor=None, q: float = 0.0, p=None) -> np.ndarray:
    r"""``rounds`` rounds of FALD on ``task`` (its clients' ``grad_sum``; a Gaussian prior or a flat
    one), weights by ``rule`` (:func:`weights`), client ``i`` active with probability ``p_i`` (``p``:
    one value or one per client; ``None``: all, every round). Returns ``θ_1 … θ_K`` ``(rounds, d)``.

    With ``anchor`` (a reference point θ_r, e.g. the mode θ*), **VR-FALD\***: each client's local
    gradient is the control-variate estimate ``G_i(x) = ∇Ũ_i(x) − ∇Ũ_i(θ_r) + w_i ∇U(θ_r)``, whose
    weighted sum over clients is still ``∇U(x)`` at a common point. The control variate pulls every
    client's local steps toward the federation's mode instead of its own: with θ_r = θ* and ``q = 0``
    the stationary mean on the toy Gaussian is exact for any weights and ``K``.

    **The refresh** (``q > 0``), as the round protocol runs it: round ``k`` refreshes with probability
    ``q`` (stream ``(seed, REFRESH, k, 0)``). In that round every client takes part (``p_i = 1`` for
    the round: ``S_A = 1``) and, besides its local steps with the current θ_r, gives ``∇Ũ_i(θ_k)``;
    θ_r becomes θ_k from round ``k + 1`` on, once the sum ``∇U(θ_k)`` is whole (the authors' code also
    installs a new reference one step after it computes it). Any θ_r fixed before the rounds it serves
    keeps ``Σ_i G_i = ∇U`` at a common point, so the refresh changes the local-step bias (a θ_r near
    the chain instead of θ*), never the unbiasedness; ``tests/laws_fald.py``'s ``gaussian_stationary_refresh`` gives the
    law."""
    d = task.dim
    w = weights([c.n_data for c in task.clients], rule)
    prior = task.prior  # Ũ_i = U_i + w_i U_0: the prior's own gradient (any mean, any prior with one)
    grads = [lambda x, p=pot, wi=w[i]: p.grad_sum(x) + wi * prior.grad(x) for i, pot in enumerate(task.clients)]
    theta = np.zeros(d) if theta0 is None else np.asarray(theta0, dtype=np.float64).copy()
    ref = None if anchor is None else np.asarray(anchor, dtype=np.float64).copy()
    at_ref = None if ref is None else [g(ref) for g in grads]
    pp = np.ones(task.b) if p is None else np.broadcast_to(np.asarray(p, dtype=np.float64), (task.b,))
    out = np.empty((rounds, d))
    for k in range(rounds):
        fresh = ref is not None and refreshes(q, seed, k)
        pk = np.ones(task.b) if fresh else pp  # a refresh round asks every client
        on = np.flatnonzero(np.ones(task.b, dtype=bool) if fresh else participation.active_mask(seed, k, pp))
        share = float(np.sum(w[on] / pk[on]))
        step = np.zeros(d)
        for i in on:  # θ_{k+1} = θ_k + Σ_A (w_i/p_i)(θ_i − θ_k)
            g = grads[i]
            if ref is not None:  # VR-FALD*: G_i(x) = ∇Ũ_i(x) − ∇Ũ_i(θ_r) + w_i ∇U(θ_r)
                total = np.sum(at_ref, axis=0)
                g = (lambda x, g=g, c=w[i] * total - at_ref[i]: g(x) + c)
            step += (w[i] / pk[i]) * (local_steps(g, theta, w[i], h, tau, steps, seed, k, i, share, pk[i]) - theta)
        if fresh:  # θ_r = θ_k from the next round: every client's ∇Ũ_i(θ_k) came with its reply
            ref, at_ref = theta.copy(), [g(theta) for g in grads]
        theta = theta + step
        out[k] = theta
    return out


def refreshes(q: float, seed: int, k: int) -> bool:
    """Whether round ``k`` refreshes VR-FALD*'s reference (probability ``q``; its own stream)."""
    return q > 0 and rng.uniform(seed, rng.Stream.REFRESH, k, 0, 1)[0] < q
