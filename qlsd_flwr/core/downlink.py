r"""The compressed downlink (``downlink = qsgd``): the server broadcasts a QSGD code of θ_k instead of θ_k's
``64 d`` bits, and the clients evaluate their gradients at the point ``w_k`` that code gives.

Two rules (``downlink-feedback``):

* ``ef21-p`` (error feedback on the primal point; Gruntkowska, Tyurin & Richtárik 2023, EF21-P; ELF,
  Karagulyan & Richtárik 2023 for Langevin): server and clients hold the same ``w``, and round ``k``'s
  message is ``c_k = C(θ_k − w_{k−1})``, after which both sides set

      w_k = w_{k−1} + α c_k,        α = 1/(ω + 1),

  with ``ω`` QSGD's variance factor (:meth:`~qlsd_flwr.compression.qsgd.QSGD.omega`). ``α C`` is a contractive
  compressor, ``E‖x − α C(x)‖² ≤ (1 − α) ‖x‖²``, which EF21-P needs: with ``α = 1`` and ``ω > 1`` (QSGD at
  ``s = 16`` on ``d = 7,850`` has ``ω = 5.5``) the error ``θ_k − w_k`` would grow without bound. A client
  that missed round ``k − 1`` cannot apply ``c_k``; it is sent ``w_k`` itself (``64 d`` bits) instead. Every
  chain's memory starts at ``w_{−1} = 0``, which every client holds without being sent it, so round 0's message is a
  code like any other (until 2026-12-07 it was ``w_0 = θ_0`` in full: ``64 d`` bits a client and chain, 4.0e7 on
  the main job). The lag ``θ_k − w_k`` then starts at θ_0's size instead of 0, and each round multiplies what it
  carries over by ``1 − α`` in expectation (besides what the chain's own moves and the compression add, as in any
  round); the chain's own θ_k is exact, the lag's first-order term is taken out of the step with
  ``downlink-correction``, and after the main job's 150 rounds of burn-in ``(1 − α)^150 = 0.76^150 ≈ 1e-18`` of
  θ_0's part is left (``downlink-s = 28``).
* ``none``: ``w_k = C(θ_k)``, nothing held; unbiased, but its error scales with ``‖θ_k‖``.

The chain itself stays exact on the server: ``θ_{k+1} = θ_k − γ M ĝ(w_k) + √(2γT) M^{1/2} Z`` (the prior's
gradient, on the server, at θ_k). With ``downlink-correction = metric`` (the default where ``M`` is not the
identity) the server also takes the lag's first-order term out of the step, with the curvature it already models,
``M⁻¹``: the prior's gradient is taken at ``w_k`` too and the step adds ``−γ β (θ_k − w_k)`` (``β = min(1, 1/γ)``,
:func:`lag_beta`: 1 unless γ > 1), so that at ``β = 1``

    θ_{k+1} = θ_k − γ M [ĝ(w_k) + M⁻¹ (θ_k − w_k)] + √(2γT) M^{1/2} Z,

``ĝ(w) + ∇²U (θ − w)`` being ``∇U(θ)`` to first order. On the Gaussian the drift is ``−γ M P (θ_k − μ) +
γ (M P − β I)(θ_k − w_k)`` (``P`` the precision, the prior's included, since the prior is then taken at ``w_k``):
where ``M = P⁻¹`` the broadcast leaves the chain exactly as without it, and elsewhere the lag enters through
``M P − I`` instead of ``M P`` (:func:`transition`'s ``beta``).

On a Gaussian target ``U(θ) = ½ (θ − μ)ᵀ P (θ − μ)`` with exact client
gradients, ``(θ_k, w_k)`` is a linear recursion driven by the Langevin noise and by the quantisation noise
``ε_k = C(x_k) − x_k`` (zero mean, conditional covariance ``diag(v(x_k))``, :func:`qsgd_variance`), white
because it is drawn afresh each round. Its stationary mean is μ and its covariance solves a discrete Lyapunov
equation (:func:`stationary_covariance`); ``tests/test_downlink.py`` checks chains against it. The lag that
``α < 1`` puts between ``w`` and θ does not narrow the stable steps (:func:`stable`: ``γ λ < 4/α − 2``, at least
ULA's 2), but it widens the stationary law along the stiff directions, by the amount that equation gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qlsd_flwr.compression.format import QuantiseError
from qlsd_flwr.compression.qsgd import QSGD, Quantised, dequantise
from qlsd_flwr.core import rng
from qlsd_flwr.errors import ConfigError

FEEDBACKS = ("ef21-p", "none")
#: ``downlink-dither``: how the broadcast's levels round. ``stochastic`` is QSGD's (the level ``⌊r⌋ + 1{ξ < r − ⌊r⌋}``
#: of ``r = s|x_j|/‖x‖``, its variance ``f (1 − f)`` a level², :func:`qsgd_variance`); ``subtractive`` is a subtractive
#: dither (Schuchman 1964; Gray & Stockham 1993): the signed level ``⌊s x_j/N + ξ_j⌋`` and the value
#: ``(level + ½ − ξ_j) N/s``, the dither ``ξ`` drawn by the clients too (stream ``DOWNLINK``, the chain's seed and the
#: round), so that the error is uniform on a level's width whatever ``x``: ``(N/s)²/12`` a coordinate
#: (:func:`subtractive_variance`), about half of QSGD's where most levels are 0 to 2 (the broadcast's), at the same
#: levels and code. ``α`` is QSGD's rule ``1/(ω + 1)``, with ``ω`` the larger of QSGD's and ``d/(12 s²)`` (this
#: error's own factor, the larger where ``d > 144 s²``), so that ``α C`` stays contractive (:meth:`Downlink.alpha`)
DITHERS = ("stochastic", "subtractive")
#: ``downlink-correction``: ``metric`` takes the lag's first-order term out of the step with ``M⁻¹`` as the curvature
#: (:func:`qlsd_flwr.core.server_step.langevin_step`); ``auto`` is ``metric`` where ``M`` is not the identity
CORRECTIONS = ("auto", "metric", "off")
#: the broadcast's code: its messages are dense, and an adaptive arithmetic code sends the same levels within a
#: fraction of a percent of their order-0 entropy on the main job, 8 % fewer bits than the Rice code before it; the
#: writer takes the shorter of the two for each message (:mod:`qlsd_flwr.compression.dense`); the chain does not
#: depend on the code
ENCODING = "dense"


def broadcast_code(s: int) -> QSGD:
    """The broadcast's compressor, ``downlink-s`` levels, on the server and on every client."""
    return QSGD(int(s), encoding=ENCODING)


def check_downlink(downlink: str, sampler: str, local: bool, backend: str = "auto") -> None:
    """``downlink = qsgd`` is for the QLSD family (the rivals' clients step from θ itself), on every engine (the
    vectorised one on its numpy backend: ``backend``, ``vectorised-backend``'s value); else ``ConfigError`` naming
    the key and what is allowed."""
    if downlink == "off":
        return
    if local:
        raise ConfigError(f"downlink: qsgd compresses the broadcast of the QLSD family; {sampler}'s clients take "
                          "local steps from θ itself; allowed with it: downlink = off")
    if backend == "numba":
        raise ConfigError("vectorised-backend: numba sends θ in full; with downlink = qsgd allowed: auto, numpy")


def check_correction(v: str, identity: bool) -> str:
    """``downlink-correction``'s value ``v`` (one of :data:`CORRECTIONS`), or ``ConfigError`` naming the key and what is
    allowed where it is ``metric`` and ``M`` is the identity (``identity``: no curvature to take)."""
    if v == "metric" and identity:
        raise ConfigError("downlink-correction: metric takes M⁻¹ as the curvature, and metric = identity has none; "
                          "allowed with it: auto, off")
    return v


def lag_beta(correction: str, gamma: float, identity: bool) -> float:
    """``β`` of ``downlink-correction`` (``correction``; ``"off"`` also when the broadcast is not compressed) for the
    step ``γ``, ``identity``: whether ``M`` is the identity (:class:`~qlsd_flwr.core.server_step.ServerSpec`'s
    ``lag``; 0: none): ``auto`` and ``metric`` alike where ``M`` is not the identity (the configuration refuses
    ``metric`` without one), ``min(1, 1/γ)``: ``γβ ≤ 1`` keeps the recursion stable wherever ULA's is (:func:`stable`)."""
    if correction == "off" or identity:
        return 0.0
    return min(1.0, 1.0 / float(gamma))


@dataclass(frozen=True)
class Downlink:
    """The broadcast's compressor and rule; the same object on the server and on every client.

    ``on_support`` (``downlink-support = data``): the code carries only ``support``, the coordinates the server names
    (``theta_support``; sorted indices, or ``None`` for all) to each client once, and again after a resync. They are
    the union of the clients' supports (:func:`union_support`): off it no client's gradient reads θ (a
    softmax regression's weights of an input that is 0 in every client's data), so the code leaves those
    coordinates out, ``α`` and the dither are those of the shorter vector, and the server's ``w`` there is θ_k
    itself; a client keeps whatever it holds there."""

    compressor: QSGD
    feedback: str = "ef21-p"
    dither: str = "stochastic"
    on_support: bool = False
    support: np.ndarray | None = field(default=None, compare=False, repr=False)

    def alpha(self, d: int) -> float:
        """``α``: ``1/(ω + 1)`` under ``ef21-p`` (a contractive step), 1 under ``none``; ``ω`` QSGD's, or under the
        subtractive dither the larger of it and that dither's own factor ``d/(12 s²)`` (its error's variance over
        ``‖x‖²``), which exceeds QSGD's bound where ``d > 144 s²``: ``α C`` stays contractive either way. ``d``: the
        coded vector's length (the support's size where there is one)."""
        if self.feedback != "ef21-p":
            return 1.0
        omega = self.compressor.omega(d)
        if self.dither == "subtractive":
            omega = max(omega, d / (12.0 * self.compressor.s ** 2))
        return 1.0 / (1.0 + omega)

    def send(self, theta: np.ndarray, w: np.ndarray | None, seed: int, k: int) -> tuple[np.ndarray, bytes | None]:
        """Round ``k``'s ``(w_k, code)`` from θ_k and ``w_{k−1}`` (ignored under ``none``; ``None``: a chain's first
        round, from ``w_{−1} = 0``). ``ValueError`` (from QSGD) when the coded vector is not finite or too large to
        code."""
        w_k, q = self.step(theta, w, seed, k)
        return w_k, None if q is None else self.compressor.encode(q)

    def code_for(self, q: Quantised, own: np.ndarray | None) -> bytes:
        """The code a client is sent of round's levels ``q`` (:meth:`step`): those at ``own`` alone, the positions of
        its own support in the coded vector (sorted; ``None``: every level). Its gradient reads no other coordinate,
        and the norm, ``α`` and the dither stay the whole code's, so on its support the client builds the server's
        ``w_k`` bit for bit (:meth:`receive`)."""
        if own is None:
            return self.compressor.encode(q)
        return self.compressor.encode(Quantised(q.norms, q.levels[own], q.s, (int(own.size),)))

    def step(self, theta: np.ndarray, w: np.ndarray | None, seed: int, k: int) -> tuple[np.ndarray, Quantised | None]:
        """:meth:`send`'s ``w_k`` and the levels its code carries."""
        if self.feedback == "ef21-p" and w is None:  # a chain's first round: from w_{−1} = 0 (module docstring)
            w = np.zeros_like(theta)
        x = theta - w if self.feedback == "ef21-p" else theta
        S = self.support
        if S is not None:
            x = x[S]
        n = x.shape[0]
        u = rng.uniform(seed, rng.Stream.DOWNLINK, k, 0, n)
        if self.dither == "subtractive":
            q = subtractive_quantise(x, u, self.compressor.s)
            c = subtractive_value(q, u)
        else:
            q = self.compressor.quantise(x, u)
            c = dequantise(q)
        return self._place(theta, w, c, n, self.support), q

    def receive(self, w: np.ndarray | None, code, d: int, seed: int = 0, k: int = 0,
                own: np.ndarray | None = None) -> np.ndarray:
        """``w_k`` from ``w_{k−1}`` and the code of round ``k`` of the chain of ``seed`` (the subtractive dither's
        key), bit for bit the server's on the support, or on ``own`` (:meth:`code_for`'s positions, the client's own
        support; off it, ``w``'s own numbers, or 0 under ``none``); ``ValueError`` naming ``theta_code`` when the code
        does not decode to that many finite numbers."""
        if not isinstance(code, (bytes, bytearray)):
            raise ValueError(f"sample: 'theta_code' must be bytes, not {type(code).__name__}")
        n = d if self.support is None else int(self.support.size)
        try:
            q = self.compressor.decode(bytes(code), n if own is None else int(own.size))
        except ValueError as exc:  # DecodeError is a ValueError
            raise ValueError(f"sample: 'theta_code' does not decode: {exc}") from None
        if self.dither == "subtractive":
            u = rng.uniform(seed, rng.Stream.DOWNLINK, k, 0, n)
            c = subtractive_value(q, u if own is None else u[own])
        else:
            c = dequantise(q)
        at = self.support if own is None else own if self.support is None else self.support[own]
        out = self._place(np.zeros(d) if w is None else w, w, c, n, at)
        if not np.all(np.isfinite(out)):
            raise ValueError("sample: 'theta_code' gives a point that is not finite")
        return out

    def _place(self, base: np.ndarray, w: np.ndarray | None, c: np.ndarray, n: int,
               at: np.ndarray | None) -> np.ndarray:
        """``w_k``: ``w_{k−1} + α c`` (``ef21-p``) or ``c`` at ``at`` (``None``: every coordinate), ``base``
        elsewhere; ``α`` that of the coded vector's ``n`` coordinates."""
        if at is None:
            return self._next(w, c, n)
        out = np.array(base, dtype=np.float64, copy=True)
        out[at] = self._next(None if w is None else w[at], c, n)
        return out

    def _next(self, w, c, d):
        return w + self.alpha(d) * c if self.feedback == "ef21-p" else c


def union_support(masks, d: int) -> np.ndarray | None:
    """The coordinates some client's gradient reads: the union of ``masks`` (each a boolean ``(d,)`` array, or
    ``None``: every coordinate), as sorted indices; ``None`` where that is every coordinate (or no mask is given)."""
    masks = list(masks)
    if not masks or any(m is None for m in masks):
        return None
    live = np.zeros(d, dtype=bool)
    for m in masks:
        live |= m
    return None if live.all() else np.flatnonzero(live)


def own_positions(support: np.ndarray | None, own: np.ndarray | None) -> np.ndarray | None:
    """The positions in the broadcast's coded vector (``support``: sorted indices, ``None``: every coordinate) of a
    client's own support (a boolean ``(d,)`` mask, ``None``: every coordinate), which its code carries
    (:meth:`Downlink.code_for`); ``None`` where that is all of them."""
    if own is None:
        return None
    pos = np.flatnonzero(own if support is None else own[support])
    return None if pos.size == (own.size if support is None else support.size) else pos


def support_to_bytes(support: np.ndarray, d: int) -> bytes:
    """``support`` (sorted indices, or a boolean ``(d,)`` mask) as it travels: ``d`` bits, one a coordinate, packed
    (``⌈d/8⌉`` bytes)."""
    live = np.zeros(d, dtype=bool)
    live[support] = True
    return np.packbits(live).tobytes()


def support_from_bytes(x, d: int, name: str = "theta_support") -> np.ndarray:
    """The boolean ``(d,)`` mask :func:`support_to_bytes` packed; ``ValueError`` naming ``name`` when ``x`` is not
    ``⌈d/8⌉`` bytes, a padding bit is set, or no coordinate is."""
    if not isinstance(x, (bytes, bytearray)) or len(x) != -(-d // 8):
        raise ValueError(f"{name}: expected {-(-d // 8)} bytes (one bit a coordinate of θ), "
                         f"got {len(x) if isinstance(x, (bytes, bytearray)) else type(x).__name__}")
    bits = np.unpackbits(np.frombuffer(bytes(x), dtype=np.uint8))
    if bits[d:].any() or not bits[:d].any():
        raise ValueError(f"{name}: a padding bit is set, or no coordinate is")
    return bits[:d].astype(bool)


def subtractive_quantise(x: np.ndarray, u: np.ndarray, s: int) -> Quantised:
    """``x``'s subtractively dithered levels (:data:`DITHERS`) as a one-norm QSGD message: the norm ``N``, float32
    rounded up so that ``|s x_j/N| ≤ s``, and the signed levels ``⌊s x_j/N + u_j⌋`` (in ``[−s, s]``: QSGD's code
    carries them as they are). ``ValueError`` as QSGD's when ``x`` is not finite or its norm beyond float32's."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(QuantiseError.NON_FINITE.message)
    n = float(np.linalg.norm(x))
    with np.errstate(over="ignore"):
        N = np.float32(n)
    if not np.isfinite(N):
        raise ValueError(QuantiseError.NORM_OVERFLOW.message)
    if float(N) < n:
        N = np.nextafter(N, np.float32(np.inf))
        if not np.isfinite(N):  # within half a float32 step of its largest value: rounded up, beyond it
            raise ValueError(QuantiseError.NORM_OVERFLOW.message)
    if N == 0.0:
        return Quantised(np.zeros(1, np.float32), np.zeros(x.shape[0], np.int64), int(s), (x.shape[0],))
    levels = np.clip(np.floor(s * x / float(N) + u), -s, s).astype(np.int64)
    return Quantised(np.array([N], dtype=np.float32), levels, int(s), (x.shape[0],))


def subtractive_value(q: Quantised, u: np.ndarray) -> np.ndarray:
    """The broadcast's vector from subtractively dithered levels and the same dither: ``(ℓ_j + ½ − u_j) N/s``
    (0 where ``N`` is 0, a zero vector's code)."""
    N = float(q.norms[0])
    if N == 0.0:
        return np.zeros(q.d)
    return (q.levels + 0.5 - u) * (N / q.s)


def subtractive_variance(x: np.ndarray, s: int) -> np.ndarray:
    """``Var[C(x)_j]`` under ``downlink-dither = subtractive``: ``(N/s)²/12`` in every coordinate, ``N ≈ ‖x‖``
    (uniform on a level's width, whatever ``x``)."""
    return np.full(np.shape(x), (float(np.linalg.norm(x)) / s) ** 2 / 12.0)


def qsgd_variance(x: np.ndarray, s: int) -> np.ndarray:
    """``Var[C(x)_j]`` of one-norm QSGD with ``s`` levels, coordinate by coordinate: with ``r = s|x_j|/‖x‖`` and
    ``f = r − ⌊r⌋``, ``(‖x‖/s)² f (1 − f)`` (the level is ``⌊r⌋`` or ``⌊r⌋ + 1`` with probability ``f``)."""
    n = float(np.linalg.norm(x))
    if n == 0.0:
        return np.zeros_like(x)
    r = s * np.abs(x) / n
    f = r - np.floor(r)
    return (n / s) ** 2 * f * (1.0 - f)


def transition(gamma: float, MP: np.ndarray, alpha: float, beta: float = 0.0) -> np.ndarray:
    r"""The linear part of the ``ef21-p`` recursion on ``z_k = (θ_k − μ, w_k − μ)`` with exact client gradients,
    ``MP = M P``: ``θ_{k+1} = (1 − γβ) θ_k + γ (β I − M P)(w_k − μ) + ξ`` (``β = 1``: ``downlink-correction =
    metric``; 0: off), ``w_{k+1} = (1 − α) w_k + α θ_{k+1} + α ε_{k+1}``."""
    d = MP.shape[0]
    eye = np.eye(d)
    top = np.hstack([(1 - gamma * beta) * eye, gamma * (beta * eye - MP)])
    return np.vstack([top, alpha * top + np.hstack([0 * eye, (1 - alpha) * eye])])


def stable(gamma_lambda: float, alpha: float, gamma_beta: float = 0.0) -> bool:
    """Whether the ``ef21-p`` recursion is stable along a direction where ``γ λ(M P) = gamma_lambda`` (``g``), with
    ``gamma_beta = γ β`` (``b``; 0 without ``downlink-correction``): the spectral radius of its ``2 × 2`` block
    ``[[1 − b, b − g], [α (1 − b), 1 − α + α (b − g)]]`` is below 1. Its determinant is ``(1 − b)(1 − α)`` and its
    trace ``2 − b − α + α b − α g``, so by Jury's test, for ``0 ≤ b ≤ 1``, it is stable exactly for
    ``0 < g < 2 ((1 − α)(1 − b) + 1)/α`` (``4/α − 2`` at ``b = 0``), which is at least ULA's own ``g < 2`` for every
    ``α ≤ 1``: neither the lag nor its correction narrows the steps a chain may take (the step keeps ``b ≤ 1``,
    :data:`qlsd_flwr.core.server_step.ServerSpec.lag`)."""
    g, b = gamma_lambda, gamma_beta
    A = np.array([[1 - b, b - g], [alpha * (1 - b), 1 - alpha + alpha * (b - g)]])
    return bool(np.max(np.abs(np.linalg.eigvals(A))) < 1.0)


def _lyapunov(A: np.ndarray, N: np.ndarray) -> np.ndarray:
    """``Σ = A Σ Aᵀ + N`` for a stable ``A``: ``Σ_j A^j N A^jᵀ``, the sum doubled each pass."""
    sigma, Ak = N.copy(), A.copy()
    for _ in range(64):
        sigma = sigma + Ak @ sigma @ Ak.T
        Ak = Ak @ Ak
        if np.abs(Ak).max() < 1e-300:
            break
    return sigma


def stationary_covariance(gamma: float, P: np.ndarray, M: np.ndarray, alpha: float, Q: np.ndarray,
                          temperature: float = 1.0, feedback: str = "ef21-p", beta: float = 0.0) -> np.ndarray:
    r"""θ's stationary covariance (``d × d``) of the chain with exact client gradients on the Gaussian whose clients'
    precisions sum to ``P`` (without the correction a flat prior: a prior's gradient is taken on the server at θ_k, not at
    ``w_k``; with it the prior is taken at ``w_k`` and ``P`` may include it), metric ``M``, and broadcast noise of covariance ``Q`` (the mean of ``diag`` :func:`qsgd_variance` over
    the chain's coded vectors). ``ef21-p``: the θ block of the ``2d`` recursion's :func:`transition`, noise
    ``(ξ, α ξ + α ε)``; ``none``: the gradient is at ``θ + ε``, so ``A = I − γ M P`` and the noise ``ξ − γ (M P − β I) ε``.
    ``beta``: 1 with ``downlink-correction = metric``, 0 without."""
    d = P.shape[0]
    S = 2 * gamma * temperature * M
    if feedback == "none":
        G = gamma * (M @ P - beta * np.eye(d))
        return _lyapunov(np.eye(d) - gamma * M @ P, S + G @ Q @ G.T)
    N = np.block([[S, alpha * S], [alpha * S, alpha ** 2 * (S + Q)]])
    return _lyapunov(transition(gamma, M @ P, alpha, beta), N)[:d, :d]
