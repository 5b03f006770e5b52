"""The metric ``M`` (a constant preconditioner) of the Langevin step: one class per kind.

With a metric the server's step is (ALGORITHMS.md, "Metric")

    θ_{k+1} = θ_k − γ M g_{k+1} + √(2γT) M^{1/2} Z_{k+1},

everything else (clients, compression, memory, participation, anchors) unchanged. For a fixed
symmetric positive-definite ``M`` this is the unadjusted Langevin algorithm for ``π^{1/T}`` in the
whitened coordinates ``φ = M^{-1/2} θ``: there ``U_M(φ) = U(M^{1/2} φ)`` has gradient
``M^{1/2} ∇U(θ)``, and ``φ_{k+1} = φ_k − γ ∇U_M(φ_k) + √(2γT) Z`` is the paper's chain for the
target ``exp(−U_M/T)``. Multiplying by ``M^{1/2}`` gives the step above; the unbiased, compressed
``g`` stays unbiased after the linear map, so the paper's analysis (its bias of order ``γ``) holds
in ``φ`` with the constants of ``∇²U_M = M^{1/2} ∇²U M^{1/2}``. A good ``M`` (close to the inverse
Hessian) makes that matrix's eigenvalues alike, so one ``γ`` serves every direction.

The kinds (Stan's ``diag_e`` and ``dense_e`` are two of them):

* :class:`Identity`; :class:`Diagonal` (``d`` positive numbers); :class:`Dense` (SPD ``d × d``, its lower
  Cholesky factor ``L`` giving ``M^{1/2} Z`` as ``L Z``); :class:`Kronecker` (one dense layer's K-FAC,
  :class:`~qlsd_flwr.core.kron.Kron`); :class:`~qlsd_flwr.core.kron_block.Blocked` (K-FAC made exact on a block,
  ``metric-block``); :class:`Corrected` (a low-rank correction of any of them,
  ``metric-rank``, :mod:`qlsd_flwr.core.lowrank`).
* Each has ``apply`` (``M g``), ``apply_root`` (``M^{1/2} z``), ``apply_root_t``, ``spread``, ``largest``,
  ``to_json`` (``summary.json``) and ``to_bytes``; :func:`qlsd_flwr.core.metric_codec.from_bytes` reads the
  tagged encoding the wire and the checkpoints share (a kind code and its named arrays, each with its shape: no sentinel
  value, no layout guessed from a length), validating every number before a metric is built.

How the metric is chosen (the clients' curvature, ``gamma = auto``): :mod:`qlsd_flwr.core.curvature`.
"""

from __future__ import annotations

import struct

import numpy as np

from qlsd_flwr.core.kron import Kron
from qlsd_flwr.core.lowrank import LowRank
from qlsd_flwr.errors import ConfigError


class MetricError(ConfigError):
    """A metric that cannot be used (not positive-definite, wrong size, not finite)."""


def _rows(f, x: np.ndarray) -> np.ndarray:
    """``f`` row by row: chain ``c`` of a ``(C, d)`` step is the very computation of a one-chain step (one
    BLAS call shape on every engine; a ``(C, d) @ (d, d)`` product could sum in another order)."""
    if x.ndim == 1:
        return f(x)
    return np.stack([f(r) for r in x])


def encode(code: int, parts: dict) -> bytes:
    """The tagged encoding of kind ``code`` with its named arrays (:meth:`Metric.to_bytes`)."""
    out = [_MAGIC, struct.pack("<BB", code, len(parts))]
    for name, a in parts.items():
        a = np.ascontiguousarray(a, dtype="<f8")
        key = name.encode()
        out += [struct.pack("<BB", len(key), a.ndim), key, struct.pack(f"<{a.ndim}I", *a.shape), a.tobytes()]
    return b"".join(out)


class Metric:
    """The family's interface; :class:`Identity` is ``M = I``. Subclasses set ``kind`` (what
    ``summary.json`` names) and ``code`` (the encoding's tag)."""

    kind = "identity"
    code = 0
    m: np.ndarray | None = None  # Diagonal: m (d,); Dense: M (d, d)
    root: np.ndarray | None = None  # Diagonal: √m; Dense: its lower Cholesky factor L
    kron: Kron | None = None
    low: LowRank | None = None

    @property
    def is_identity(self) -> bool:
        return False

    @property
    def base(self) -> "Metric":
        """The metric without its low-rank correction."""
        return self

    @property
    def has_correction(self) -> bool:
        """Whether a correction (``metric-rank``'s, ``metric-block``'s) moves the base's eigenbasis."""
        return self.low is not None

    def factored(self) -> tuple["Metric", np.ndarray]:
        """``(base, t)``: the metric without its corrections, and their values ``t`` (none: empty)."""
        return self, np.empty(0)

    def corrected(self, u: np.ndarray, t: np.ndarray) -> "Metric":
        """This metric with the low-rank correction ``(U, t)`` (:mod:`qlsd_flwr.core.lowrank`)."""
        b = self.base
        return Corrected(b, LowRank(u, t, np.stack([b.apply_root(x) for x in u.T], axis=1)))

    def apply(self, g: np.ndarray) -> np.ndarray:
        """``M g`` for ``g`` of shape ``(d,)`` or ``(C, d)``."""
        raise NotImplementedError

    def apply_root(self, z: np.ndarray) -> np.ndarray:
        """``M^{1/2} z`` for ``z`` of shape ``(d,)`` or ``(C, d)``."""
        raise NotImplementedError

    def apply_root_t(self, x: np.ndarray) -> np.ndarray:
        """``(M^{1/2})ᵀ x`` for the root of :meth:`apply_root` (the same for the symmetric roots)."""
        return self.apply_root(x)

    def spread(self) -> float:
        """``λ_max(M) / λ_min(M)``: how far apart the metric's scales are."""
        raise NotImplementedError

    def largest(self) -> float:
        """``λ_max(M)``: the metric's largest scale (a variance, when M comes from the curvature)."""
        raise NotImplementedError

    def diagonal(self, d: int) -> np.ndarray:
        """``diag(M)`` ``(d,)``: from the arrays where they hold it, else ``M`` applied to unit vectors 256 at a
        time (no ``d × d`` identity: ``d`` is 7,850 on the main job)."""
        if self.is_identity:
            return np.ones(d)
        if self.low is None and self.m is not None:  # Diagonal's m, Dense's M (not a corrected metric's base)
            return np.array(self.m if self.m.ndim == 1 else np.diag(self.m), dtype=np.float64)
        out = np.empty(d)
        for lo in range(0, d, 256):
            rows = np.zeros((min(256, d - lo), d))
            rows[np.arange(len(rows)), lo + np.arange(len(rows))] = 1.0
            out[lo:lo + len(rows)] = self.apply(rows)[np.arange(len(rows)), lo + np.arange(len(rows))]
        return out

    def to_json(self):
        """What ``summary.json`` records."""
        raise NotImplementedError

    def arrays(self) -> dict[str, np.ndarray]:
        """The named float64 arrays :meth:`to_bytes` carries."""
        return {}

    def to_bytes(self) -> bytes:
        """The tagged encoding (wire and checkpoints): ``b"QM"``, the kind's code, the number of arrays,
        then for each its name, shape and float64 values (little-endian); a corrected metric's base
        follows its own arrays."""
        out = encode(self.code, self.arrays())
        return out if self.low is None else out + self.base.to_bytes()


class Identity(Metric):
    """``M = I``: the paper's step."""

    @property
    def is_identity(self) -> bool:
        return True

    def apply(self, g):
        return g

    def apply_root(self, z):
        return z

    def spread(self) -> float:
        return 1.0

    def largest(self) -> float:
        return 1.0

    def to_json(self):
        return "identity"


class Diagonal(Metric):
    """``M = diag(m)``, ``m > 0`` (Stan's ``diag_e``)."""

    kind, code = "diagonal", 1

    def __init__(self, m):
        m = np.array(m, dtype=np.float64)
        if m.ndim != 1 or not np.all(np.isfinite(m)) or not np.all(m > 0):
            raise MetricError("metric: a diagonal metric needs finite positive numbers")
        self.m, self.root = m, np.sqrt(m)

    def apply(self, g):
        return self.m * g

    def apply_root(self, z):
        return self.root * z

    def spread(self) -> float:
        return float(self.m.max() / self.m.min())

    def largest(self) -> float:
        return float(self.m.max())

    def to_json(self):
        return self.m.tolist()

    def arrays(self):
        return {"m": self.m}


class Dense(Metric):
    """A symmetric positive-definite ``M`` and its lower Cholesky factor ``L`` (Stan's ``dense_e``)."""

    kind, code = "dense", 2

    def __init__(self, M):
        M = np.array(M, dtype=np.float64)
        if M.ndim != 2 or M.shape[0] != M.shape[1] or not np.all(np.isfinite(M)):
            raise MetricError("metric: a dense metric needs a finite square matrix")
        if not np.allclose(M, M.T, rtol=1e-10, atol=1e-12 * float(np.max(np.abs(M)))):
            raise MetricError("metric: a dense metric must be symmetric")
        M = 0.5 * (M + M.T)
        try:
            L = np.linalg.cholesky(M)
        except np.linalg.LinAlgError:
            raise MetricError("metric: a dense metric must be positive-definite") from None
        if not (np.all(np.isfinite(M)) and np.all(np.isfinite(L))):  # entries near the largest float overflow above
            raise MetricError("metric: a dense metric's entries are too large to use")
        self.m, self.root = M, L

    def apply(self, g):
        return _rows(lambda r: self.m @ r, g)

    def apply_root(self, z):
        return _rows(lambda r: self.root @ r, z)

    def apply_root_t(self, x):
        return _rows(lambda r: self.root.T @ r, x)

    def spread(self) -> float:
        w = np.linalg.eigvalsh(self.m)
        return float(w.max() / w.min())

    def largest(self) -> float:
        return float(np.linalg.eigvalsh(self.m)[-1])

    def to_json(self):
        return self.m.tolist()

    def arrays(self):
        return {"M": self.m}


class Kronecker(Metric):
    """One dense layer's K-FAC metric, ``M^t`` applied through its factors' eigenbases (:class:`Kron`)."""

    kind, code = "kronecker", 3

    def __init__(self, kron: Kron):
        self.kron = kron

    def apply(self, g):
        return _rows(lambda r: self.kron.apply(r, -1.0), g)

    def apply_root(self, z):
        return _rows(lambda r: self.kron.apply(r, -0.5), z)

    def spread(self) -> float:
        return float(self.kron.den.max() / self.kron.den.min())

    def largest(self) -> float:
        return float(1.0 / self.kron.den.min())

    def to_json(self):
        return self.kron.describe()

    def arrays(self):
        k = self.kron
        return {"qg": k.qg, "qa": k.qa, "den": k.den, "perm": k.perm.astype(np.float64)}


class FromFactors:
    """``spread``, ``largest`` and ``summary.json``'s entry of a corrected metric (:class:`Corrected`,
    :class:`~qlsd_flwr.core.kron_block.Blocked`), from its base and its corrections' values (``factored``)."""

    def spread(self) -> float:
        """The base's spread times the corrections' (an upper bound)."""
        base, t = self.factored()
        return base.spread() * max(float((1.0 / t).max()), 1.0) / min(float((1.0 / t).min()), 1.0)

    def largest(self) -> float:
        """An upper bound."""
        base, t = self.factored()
        return base.largest() * max(float((1.0 / t).max()), 1.0)

    def to_json(self):
        base, t = self.factored()
        return {"base": base.to_json(), "lowrank": {"rank": int(t.size), "t": [float(x) for x in t]}}


class Corrected(FromFactors, Metric):
    """A base metric with a low-rank correction: the root ``R (I + U diag(t^{−1/2} − 1) Uᵀ)`` for the
    base's root ``R`` (:class:`~qlsd_flwr.core.lowrank.LowRank`)."""

    code = 4

    def __init__(self, base: Metric, low: LowRank):
        if base.low is not None:
            raise MetricError("metric: a low-rank correction corrects a base metric, not another correction")
        self._base, self.low = base, low
        self.kind, self.m, self.root, self.kron = base.kind, base.m, base.root, base.kron

    @property
    def base(self) -> Metric:
        return self._base

    def apply(self, g):  # M g + W (1/t − 1) Wᵀ g
        lo, b = self.low, self._base
        return _rows(lambda r: lo.add(b.apply(r), lo.w, lo.w, r, -1.0), g)

    def apply_root(self, z):  # R z + W (t^{−1/2} − 1) Uᵀ z
        lo, b = self.low, self._base
        return _rows(lambda r: lo.add(b.apply_root(r), lo.w, lo.u, r, -0.5), z)

    def apply_root_t(self, x):  # Rᵀ x + U (t^{−1/2} − 1) Wᵀ x
        lo, b = self.low, self._base
        return _rows(lambda r: lo.add(b.apply_root_t(r), lo.u, lo.w, r, -0.5), x)

    def factored(self):
        base, t = self._base.factored()  # metric-block's values, then these
        return base, np.concatenate([t, self.low.t])

    def arrays(self):
        return {"u": self.low.u, "t": self.low.t}


_MAGIC = b"QM"
