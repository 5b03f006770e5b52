"""How the metric ``M`` is chosen: the clients' curvature reports and ``gamma = auto``.

* :func:`local_curvature` — what a client reports: its potential's own ``curvature_diag`` /
  ``hessian`` when it has them, otherwise an estimate from ``grad_sum`` alone.
* :func:`check_report` — a report as the server accepts it, or :class:`~qlsd_flwr.robust.reports.ReportError`.
* :func:`metric_from_curvature`, :func:`metric_from_kronecker` — ``M = (prior curvature + Σ_i H_i)^{-1}``
  from the valid reports at θ*, each bounded per datum (:mod:`qlsd_flwr.robust.reports`).
* :func:`lambda_max` (from :mod:`qlsd_flwr.core.spectral`) — the largest eigenvalue of ``M^{1/2} ∇²U M^{1/2}`` by
  the Lanczos method on Hessian-vector products (the clients' own, or differences of their gradients; the engine's ``hvp``);
  :data:`GAMMA_AUTO_C` ``/ λ_max`` is ``gamma = auto``.

It is framework-free numpy; engines call it through :mod:`qlsd_flwr.protocol.precondition`.
"""

from __future__ import annotations

import numpy as np

from qlsd_flwr.compression import root
from qlsd_flwr.core import rng
from qlsd_flwr.core.kron import Kron
from qlsd_flwr.core.lowrank import fd_step
from qlsd_flwr.core.metric import Dense, Diagonal, Kronecker, Metric, MetricError
from qlsd_flwr.core.spectral import (LANCZOS_BYTES, LANCZOS_MIN, lambda_max, lanczos_vectors,  # noqa: F401
                                     rough_lambda_max)
from qlsd_flwr.robust.reports import (FACTOR_SHARE, REPORT_CAP, REPORT_MAX, ReportError, cap_kron_leave_one_out,
                                     cap_leave_one_out, cap_reports, clamped_counts, lower_median, share_allowance)

#: ``gamma = auto`` sets ``γ = c / λ_max(M^{1/2} ∇²U(θ*) M^{1/2})`` with this ``c``. With exact
#: gradients on a Gaussian, a direction of curvature ``λ`` has stationary variance
#: ``1/(λ (1 − γλ/2))`` (the discrete Lyapunov equation), so the stiffest direction's variance is
#: inflated by at most ``1/(1 − c/2)``: 14 % (sd 7 %) at ``c = 0.25``; flatter directions less.
#: Larger ``c`` mixes faster and costs more bias; the stability limit is ``c < 2``.
GAMMA_AUTO_C = 0.25
#: ``gamma-c = auto``'s ``c`` where the posterior is not declared log-concave (a network). There the
#: curvature at θ* understates the curvature the chain meets, so ``c = 0.25`` at θ* is a larger ``c``
#: where the chain travels and its bias shows. Measured against full-batch HMC (the predictive's TV as
#: a multiple of HMC's own halves' TV, benchmarks/RESULTS.md): the quickstart's wine network 2.74× at
#: 0.25 (4 chains × 20,000 rounds), 1.48× at 0.125 (40,000); the digits MLP 1.82× at 0.25 and 1.75×
#: at 0.125 (16 chains). Half the step costs twice the rounds for the same ESS.
GAMMA_AUTO_C_NETWORK = 0.125


def gamma_c(value, log_concave: bool) -> float:
    """``c`` of ``γ = c / λ_max`` for the ``gamma-c`` key's ``value``: a number as given; ``"auto"``:
    :data:`GAMMA_AUTO_C` on a log-concave posterior, :data:`GAMMA_AUTO_C_NETWORK` otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return GAMMA_AUTO_C if log_concave else GAMMA_AUTO_C_NETWORK
    return float(value)


#: ``metric = dense`` keeps a ``d × d`` matrix and its factor on the server and asks each client
#: for a ``d × d`` curvature: refused above this ``d`` (Stan's ``dense_e`` has the same trade-off).
DENSE_MAX_DIM = 2000
#: above this spread of ``M``'s scales, QSGD's noise (set by the message's norm, i.e. by the stiff
#: coordinates) multiplied by ``M`` dominates the flat directions: measured on the regressions of
#: ``benchmarks/bench_metric.py`` (spread 5.9e3: no effect; 2.6e5 and 2.2e6: sd up to 1.4× and 5.7×)
COMPRESSED_SPREAD_WARN = 1e4
#: Hutchinson probes of :func:`local_curvature`'s estimate for potentials without ``curvature_diag``.
HUTCHINSON_PROBES = 64



def local_curvature(pot, theta: np.ndarray, kind: str, seed: int, client: int) -> np.ndarray | bytes:
    """Client ``i``'s curvature of its data potential at ``θ``: ``(d,)`` (``kind = diagonal``) or
    ``(d, d)`` (``dense``), positive semi-definite.

    Uses the potential's own ``curvature_diag(θ)`` / ``hessian(θ)`` when it has them (the built-in tasks
    do: exact, or the Gauss–Newton matrix). Otherwise it is estimated from ``grad_sum`` alone: the diagonal
    by Hutchinson's estimator ``E[v ⊙ H v]`` over :data:`HUTCHINSON_PROBES` Rademacher probes ``v`` (stream
    ``(seed, INIT, −1, client)``), ``H v`` by central differences; the dense matrix by central differences
    along each axis, symmetrised. A negative diagonal value (noise, or a non-convex point) is set to zero,
    and a dense matrix's negative eigenvalues are sent by their magnitude, ``Q |Λ| Qᵀ`` (saddle-free
    Newton, Dauphin et al. 2014); the server adds the prior's curvature. Why: θ*'s descent takes it far from
    the mode, where a regression with an unknown σ is not convex. A zero there left ``M`` huge along the negative
    direction, and kidiq's descent from ``β = 0`` (posteriordb) did not converge in 5,000 exchanges; now it does
    in 253 (``benchmarks/bench_posteriordb.py --descent``).
    """
    d = theta.shape[0]
    if kind in ("kronecker", KRON_OUTPUTS):
        if not hasattr(pot, "kron_factors"):
            raise ValueError("metric = kronecker needs a potential with kron_factors(theta) (one dense softmax "
                             "layer: the logistic tasks, TorchPotential of a single nn.Linear); use diagonal")
        G, A, perm = pot.kron_factors(theta)
        return kron_report(G, A, perm) if kind == "kronecker" else kron_outputs_report(G.shape[0], A)
    if kind == "diagonal" and hasattr(pot, "curvature_diag"):
        h = np.asarray(pot.curvature_diag(theta), dtype=np.float64)
    elif kind == "dense" and hasattr(pot, "hessian"):
        h = np.asarray(pot.hessian(theta), dtype=np.float64)
    elif kind == "diagonal":
        u = rng.uniform(seed, rng.Stream.INIT, -1 & 0xFFFFFFFF, client, HUTCHINSON_PROBES * d)
        V = np.where(u.reshape(HUTCHINSON_PROBES, d) < 0.5, -1.0, 1.0)
        eps = fd_step(theta)
        h = np.zeros(d)
        for v in V:
            hv = (pot.grad_sum(theta + eps * v) - pot.grad_sum(theta - eps * v)) / (2.0 * eps)
            h += v * hv
        h /= HUTCHINSON_PROBES
    else:
        eps = fd_step(theta)
        h = np.empty((d, d))
        for j in range(d):
            e = np.zeros(d)
            e[j] = eps
            h[j] = (pot.grad_sum(theta + e) - pot.grad_sum(theta - e)) / (2.0 * eps)
        h = 0.5 * (h + h.T)
    if kind == "diagonal":
        return np.maximum(h, 0.0)
    w, Q = np.linalg.eigh(0.5 * (h + h.T))
    return (Q * np.abs(w)) @ Q.T


#: K-FAC's first report: ``[F̃, K, Ā (K²), perm (d)]`` as float32 numbers (``[F̃, −K, Ā]`` for the identity layout,
#: :func:`kron_report`), then ``G_i`` as its square root in 12-bit
#: rows (:mod:`qlsd_flwr.compression.root`). ``G_i``'s float32 triangle, ``F̃(F̃+1)/2 = 308,505`` numbers a client,
#: was 2.0e8 of the main job's preparation uplink; its root, of rank at most the client's data count plus one
#: (198–200 of 785), is 4.5e7, and positive semi-definite whatever arrives. ``Ā`` (the softmax's Hessian has the all-ones
#: null vector) may come a little indefinite from float32's rounding, which the check allows and shifts back
#: (:func:`_psd`'s ``rounding``)
KRON_REPORT_DTYPE = np.float32
#: the curvature kind of K-FAC's later exchanges: the output factor ``Ā_i`` alone. The input factor ``G_i =
#: Σ_j x̃_j x̃_jᵀ`` is the client's data alone, the same at every θ, so the server keeps it from the client's
#: first report (:class:`KronInputs`) instead of receiving its ``F̃²`` numbers at every stage of the descent
#: (issue 37: on the main job they were 2.4e9 of the preparation's uplink, three times the same matrix).
KRON_OUTPUTS = "kronecker-a"


def kron_report(G: np.ndarray, A: np.ndarray, perm) -> bytes:
    """K-FAC's first report as it travels: ``[F̃, K, Ā (K²), perm (d)]`` as float32 numbers (``[F̃, −K, Ā]`` where
    ``perm`` is the identity: ``d`` numbers that carry nothing, 5.0e6 of the main job's uplink), then ``½G + ½Gᵀ``'s
    square root (:func:`qlsd_flwr.compression.root.encode`: 12-bit rows of its pivoted Cholesky factor)."""
    G = np.asarray(G, dtype=np.float64)
    F, K = G.shape[0], np.shape(A)[0]
    A = 0.5 * np.asarray(A, dtype=np.float64) + 0.5 * np.asarray(A, dtype=np.float64).T  # both round alike in float32
    perm = np.asarray(perm, dtype=np.float64)
    if np.array_equal(perm, np.arange(perm.size)):  # the identity layout (a softmax regression's): −K, no perm
        head_nums = [[F, -K], np.ravel(A)]
    else:
        head_nums = [[F, K], np.ravel(A), perm]
    with np.errstate(over="ignore"):  # beyond float32's range: inf, which the server refuses as not finite
        head = np.concatenate(head_nums).astype("<f4")
    return head.tobytes() + root.encode(0.5 * G + 0.5 * G.T)


def kron_outputs_report(F: int, A: np.ndarray) -> np.ndarray:
    """K-FAC's later reports (:data:`KRON_OUTPUTS`): ``[F̃, K, Ā (K²)]``."""
    A = np.asarray(A, dtype=np.float64)
    return np.concatenate([[F, A.shape[0]], A.ravel()])


class KronInputs(dict):
    """``{client: (G_i, perm_i)}``: each client's input factor and layout from its first valid
    :func:`kron_report`, for the exchanges that ask only for :data:`KRON_OUTPUTS`. It rests on ``G_i`` not
    depending on θ, which holds for one dense layer (``kron_factors``' contract: ``G = Σ_j x̃_j x̃_jᵀ``)."""

    def complete(self, i: int, h, d: int) -> dict:
        """Client ``i``'s :data:`KRON_OUTPUTS` reply ``h`` checked and completed with its kept ``G`` and ``perm``,
        or :class:`ReportError`: no first report on record, a length other than that report's layer gives
        (checked before anything is computed from the reply), or what :func:`check_report` refuses."""
        if i not in self:
            raise ReportError("an output factor alone, and no input factor on record from an earlier report")
        G, perm = self[i]
        F, K = G.shape[0], perm.shape[0] // G.shape[0]
        if np.size(h) != 2 + K * K:
            raise ReportError(f"expected {2 + K * K} numbers (the output factor of a {F} × {K} layer), got "
                              f"{np.size(h)}")
        # the length fixes K, and check_report then holds F·K = d: the layer is the first report's
        return {"G": G, "A": check_report(h, KRON_OUTPUTS, d)["A"], "perm": perm}


def check_report(h, kind: str, d: int) -> np.ndarray:
    """A client's curvature report as a float64 array, or :class:`ReportError` saying why: the wrong
    length, a value that is not finite, a negative diagonal, an asymmetric or indefinite matrix."""
    if kind == "kronecker":  # bytes: float32 numbers and G's root
        return _check_kron_report(h, d)
    try:
        a = np.asarray(h, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ReportError(f"not an array of numbers ({type(exc).__name__})") from None
    if a.size and np.all(np.isfinite(a)) and float(np.max(np.abs(a))) > REPORT_MAX:
        raise ReportError(f"values above {REPORT_MAX:g}")
    if kind == KRON_OUTPUTS:
        return _check_kron_outputs(a, d)
    shape = (d,) if kind == "diagonal" else (d, d)
    if kind == "dense" and a.shape == (d * d,):  # as it travels: the matrix row by row
        a = a.reshape(d, d)
    if a.shape != shape:
        raise ReportError(f"expected shape {shape}, got {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ReportError("non-finite values")
    if kind == "diagonal":
        if np.any(a < 0):
            raise ReportError("negative curvature on the diagonal")
        return a
    return _psd(a, "the matrix")


def _psd(a: np.ndarray, what: str, rounding: float = 0.0) -> np.ndarray:
    """``a`` symmetrised, or :class:`ReportError`: not symmetric, or an eigenvalue below ``−1e-9`` of its largest
    entry. ``rounding``: the relative error of a float32 report (``n 2⁻²⁴`` for ``n × n``, a bound on its spectral
    norm over the largest entry), allowed below zero as well; the matrix is then shifted by its smallest eigenvalue
    where that is negative, so that it is semi-definite again (a change within that bound)."""
    scale = float(np.max(np.abs(a))) or 1.0
    if not np.allclose(a, a.T, rtol=0.0, atol=1e-9 * scale):
        raise ReportError(f"{what} is not symmetric")
    sym = 0.5 * a + 0.5 * a.T  # (never a + a.T: it could overflow)
    try:
        low = float(np.linalg.eigvalsh(sym)[0])
    except np.linalg.LinAlgError:
        raise ReportError(f"{what}: its eigenvalues cannot be computed") from None
    if low < -(1e-9 + rounding) * scale:
        raise ReportError(f"{what} is not positive semi-definite")
    if rounding and low < 0:
        sym[np.diag_indices_from(sym)] -= low
    return sym


def _kron_sizes(a: np.ndarray, d: int) -> tuple[int, int]:
    if a.ndim != 1 or a.size < 2:
        raise ReportError("expected a flat Kronecker report")
    if not np.all(np.isfinite(a)):
        raise ReportError("non-finite values")
    F, K = a[0], a[1]
    if F != int(F) or K != int(K) or F < 1 or K < 1 or F * K != d:
        raise ReportError(f"the layer's sizes {F:g} × {K:g} do not make d = {d}")
    return int(F), int(K)


def _check_kron_outputs(a: np.ndarray, d: int) -> dict:
    """A :func:`kron_outputs_report` as ``{"F", "K", "A"}``, or :class:`ReportError`."""
    F, K = _kron_sizes(a, d)
    if a.size != 2 + K * K:
        raise ReportError(f"expected {2 + K * K} numbers, got {a.size}")
    return {"F": F, "K": K, "A": _psd(a[2:].reshape(K, K), "A")}


#: why a K-FAC report whose layer is not the majority's is refused
FOREIGN_LAYOUT = "a layer shape or layout (perm) other than the other clients'"


def kron_layout(buf, d: int) -> tuple[int, int, bytes]:
    """A :func:`kron_report`'s layer ``(F̃, K, perm's bytes)`` from its float32 numbers alone, ``G`` not decoded, or
    :class:`ReportError`: what the clients vote on (:func:`common_layout`) before any ``F̃ × F̃`` matrix is built,
    since a client sets ``F̃`` (a 63 kB report with ``F̃ = d``, ``K = 1`` would make the server build ``d × d``)."""
    F, K, a, _ = _kron_head(buf, d)
    return F, K, a[2 + K * K:].tobytes()


def common_layout(keys: dict) -> object:
    """The layout most reports give, ``keys`` ``{client: layout}``; a tie goes to the lowest client's (a function
    of the reports alone, never of hashing)."""
    votes = {k: sum(v == k for v in keys.values()) for k in keys.values()}
    return keys[min(keys, key=lambda i: (-votes[keys[i]], i))]


def _check_kron_report(buf, d: int) -> dict:
    """A :func:`kron_report` as a dict ``{"G", "A", "perm"}``, or :class:`ReportError`: its float32 numbers
    first (sizes, ``Ā``, ``perm``), then ``G``'s root, which decodes to a positive semi-definite matrix or not at
    all (:mod:`qlsd_flwr.compression.root`)."""
    F, K, a, at = _kron_head(buf, d)
    A = a[2:2 + K * K].reshape(K, K)
    perm = a[2 + K * K:]
    try:
        G = root.decode(bytes(buf[at:]), F)
    except ValueError as exc:
        raise ReportError(f"G: {exc}") from None
    if max(float(np.max(np.abs(G), initial=0.0)), float(np.max(np.abs(A)))) > REPORT_MAX:
        raise ReportError(f"values above {REPORT_MAX:g}")
    eps = float(np.finfo(KRON_REPORT_DTYPE).eps) / 2  # float32's rounding, 2⁻²⁴
    return {"G": G, "A": _psd(A, "A", K * eps), "perm": perm.astype(np.int64)}


def _kron_head(buf, d: int) -> tuple[int, int, np.ndarray, int]:
    """``(F̃, K, [F̃, K, Ā, perm], their bytes)`` of a :func:`kron_report`'s float32 numbers, checked, or
    :class:`ReportError`."""
    if not isinstance(buf, (bytes, bytearray)) or len(buf) < 8:
        raise ReportError("expected K-FAC's report as bytes (float32 numbers, then G's square root)")
    sizes = np.frombuffer(buf, dtype="<f4", count=2).astype(np.float64)
    ident = bool(sizes[1] < 0)  # −K: the identity layout, its perm not sent
    F, K = _kron_sizes(np.array([sizes[0], abs(sizes[1])]), d)  # F̃ as sent: a negative one is refused
    n = 2 + K * K + (0 if ident else d)
    if len(buf) < 4 * n:
        raise ReportError(f"expected at least {4 * n} bytes (the layer's sizes, Ā and perm), got {len(buf)}")
    a = np.frombuffer(buf, dtype="<f4", count=n).astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise ReportError("non-finite values")
    if ident:  # as if sent: every engine, and the clients' vote on the layout, see the same numbers
        a = np.concatenate([[F, K], a[2:], np.arange(d, dtype=np.float64)])
    if not np.array_equal(np.sort(a[2 + K * K:]), np.arange(d, dtype=np.float64)):
        raise ReportError("perm is not an ordering of θ's coordinates")
    return F, K, a, 4 * n


#: why a report was scaled (``curvature_scaled_why``; the log names it): the per-datum cap, then the leave-one-out rule
_CAPPED = f"scaled down to {REPORT_CAP:g} × the clients' per-datum curvature"
_HELD = (f"held to 1 + {FACTOR_SHARE:g} N_i/N_−i times the prior's and the other clients' curvature in some "
         "direction")


def _held(why: dict[int, str], clients) -> None:
    """Add the leave-one-out rule to ``why`` for each of ``clients`` (after the per-datum cap's reason, if any)."""
    for i in clients:
        why[i] = (why[i] + ", then " if i in why else "") + _HELD


def metric_from_kronecker(reports: dict[int, dict], n_data, prior_curv: np.ndarray, d: int) -> tuple[Metric, dict]:
    """K-FAC's ``M = (G ⊗ Ā + λ_0 I)^{-1}`` (:class:`Kron`) from the valid reports. The layout
    ``perm`` is the one most reports give (the others are refused, ``curvature_rejected``); each
    report's per-datum scales ``tr G_i / N_i`` and ``tr A_i / N_i`` are capped at
    :data:`REPORT_CAP` times the lower median, as for the diagonal. Then each report is held to the others' by
    the diagonal and dense reports' rule, on the whole ``M⁻¹ = G ⊗ Ā + λ_0 I`` rather than on either factor
    (:func:`~qlsd_flwr.robust.reports.cap_kron_leave_one_out`): one client shrinks ``M`` along any direction by
    at most ``1 + FACTOR_SHARE · N_i/N_{−i}``. ``λ_0`` is the prior's mean curvature (exact for the isotropic
    Gaussian prior)."""
    n_data = np.asarray(n_data)
    info: dict = {"curvature_reports": len(reports), "curvature_scaled": [], "curvature_rejected": {}}
    if not reports:
        raise MetricError("metric = kronecker: no valid curvature report")
    # the layer's shape and layout most reports give (the curvature exchange votes on the reports' heads before it
    # decodes any G, with the same rule: this one is then a no-op)
    keys = {i: (r["G"].shape[0], r["A"].shape[0], r["perm"].tobytes()) for i, r in reports.items()}
    common = common_layout(keys)
    for i in sorted(reports):
        if keys[i] != common:
            info["curvature_rejected"][str(i)] = FOREIGN_LAYOUT
            del reports[i]
    n = clamped_counts(n_data, reports)
    why: dict[int, str] = {}
    for part in ("G", "A"):
        sc = {i: float(np.trace(r[part])) / n[i] for i, r in reports.items()}
        ref = lower_median(sc.values())
        for i in sorted(reports):
            if ref > 0 and sc[i] > REPORT_CAP * ref:
                reports[i] = {**reports[i], part: reports[i][part] * (REPORT_CAP * ref / sc[i])}
                why[i] = _CAPPED
    lam0 = float(np.mean(prior_curv))
    _held(why, cap_kron_leave_one_out(reports, lam0, share_allowance(n_data, reports), n))
    G = sum(reports[i]["G"] for i in sorted(reports))
    A = sum(reports[i]["A"] for i in sorted(reports)) / float(sum(n.values()))
    if not (np.all(np.isfinite(G)) and np.all(np.isfinite(A))):
        raise MetricError("metric = kronecker: the summed factors are not finite")
    lg, qg = np.linalg.eigh(G)
    la, qa = np.linalg.eigh(A)
    den = np.outer(np.maximum(lg, 0.0), np.maximum(la, 0.0)) + lam0
    pos = den[den > 0]
    if pos.size == 0:
        raise MetricError("metric = kronecker: the curvature is zero and the prior flat; give a prior (prior-var)")
    den = np.maximum(den, max(float(pos.max()) * 1e-12, float(pos.min())))
    info["curvature_scaled"], info["curvature_scaled_why"] = sorted(why), why
    perm = reports[min(reports)]["perm"]
    return Kronecker(Kron(perm, qg, qa, den)), info


def metric_from_curvature(kind: str, reports: dict[int, np.ndarray], n_data, prior_curv: np.ndarray,
                          d: int) -> tuple[Metric, dict]:
    """``M = (P_0 + Σ_i H_i)^{-1}`` from the valid reports ``{i: H_i}`` and the prior's curvature
    ``P_0`` (``(d,)``, the diagonal of ``∇²U_0``; zero for a flat prior). Returns the metric and the
    facts for the summary.

    Bounded influence: each report's per-datum scale ``max_j (H_i)_jj / N_i`` is compared with
    the lower median of all reports' scales; a report above :data:`REPORT_CAP` times it is scaled
    down to that cap (``curvature_scaled``). Then each report is held to the others'
    (:func:`~qlsd_flwr.robust.reports.cap_leave_one_out`): ``P_0 + Σ_k H_k`` is at most
    ``1 + FACTOR_SHARE · N_i/N_{−i}`` times ``P_0 + Σ_{k≠i} H_k`` in every direction (every coordinate for
    the diagonal), so one client shrinks ``M`` along any direction by at most that factor (17.7× for one
    client of ten equal ones), whatever its report's form; a dense rank-1 report shrank ``M`` 36× under
    the diagonal-entry cap alone. A report held down slows the chain in those directions and never
    biases it (any SPD ``M`` keeps ``π`` stationary up to ``O(γ)``). A direction no report and no prior
    constrains gets the smallest curvature of the others (``M`` must stay finite).
    """
    why = {i: _CAPPED for i in cap_reports(reports, n_data)}
    _held(why, cap_leave_one_out(reports, prior_curv, share_allowance(n_data, reports)))
    info = {"curvature_reports": len(reports), "curvature_scaled": sorted(why), "curvature_scaled_why": why}
    if kind == "diagonal":
        h = np.array(prior_curv, dtype=np.float64)
        for i in sorted(reports):
            h = h + reports[i]
        pos = h[h > 0]
        if pos.size == 0 or not np.all(np.isfinite(h)):
            raise MetricError("metric-from = curvature: no usable curvature (none reported, or not finite) and the "
                              "prior is flat; give a prior (prior-var) or metric = identity")
        h = np.maximum(h, max(float(pos.min()), 1e-12 * float(pos.max())))
        return Diagonal(1.0 / h), info
    H = np.diag(np.asarray(prior_curv, dtype=np.float64))
    for i in sorted(reports):
        H = H + reports[i]
    if not np.all(np.isfinite(H)):
        raise MetricError("metric-from = curvature: the summed curvature is not finite")
    w, Q = np.linalg.eigh(0.5 * H + 0.5 * H.T)
    pos = w[w > 1e-12 * max(float(w.max()), 0.0)]
    if pos.size == 0:
        raise MetricError("metric-from = curvature: the summed curvature is zero; give a prior (prior-var) or "
                          "metric = identity")
    w = np.maximum(w, float(pos.min()))
    M = (Q / w) @ Q.T
    return Dense(0.5 * (M + M.T)), info
