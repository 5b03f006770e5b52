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
  :class:`~qlsd_flwr.core.kron.Kron`); :class:`Corrected` (a low-rank correction of any of them,
  ``metric-rank``, :mod:`qlsd_flwr.core.lowrank`).
* Each has ``apply`` (``M g``), ``apply_root`` (``M^{1/2} z``), ``apply_root_t``, ``spread``, ``largest``,
  ``to_json`` (``summary.json``) and ``to_bytes``; :func:`from_bytes` reads the tagged encoding the
  wire and the checkpoints share (a kind code and its named arrays, each with its shape: no sentinel
  value, no layout guessed from a length), validating every number before a metric is built.

How the metric is chosen (the clients' curvature, ``gamma = auto``): :mod:`qlsd_flwr.core.curvature`.
"""

from __future__ import annotations

import math
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

    def corrected(self, u: np.ndarray, t: np.ndarray) -> "Corrected":
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
        parts = self.arrays()
        out = [_MAGIC, struct.pack("<BB", self.code, len(parts))]
        for name, a in parts.items():
            a = np.ascontiguousarray(a, dtype="<f8")
            key = name.encode()
            out += [struct.pack("<BB", len(key), a.ndim), key, struct.pack(f"<{a.ndim}I", *a.shape), a.tobytes()]
        if self.low is not None:
            out.append(self.base.to_bytes())
        return b"".join(out)


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


class Corrected(Metric):
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

    def spread(self) -> float:
        """The base's spread times the correction's (an upper bound)."""
        f = 1.0 / self.low.t
        return self._base.spread() * max(float(f.max()), 1.0) / min(float(f.min()), 1.0)

    def largest(self) -> float:
        """An upper bound."""
        return self._base.largest() * max(float((1.0 / self.low.t).max()), 1.0)

    def to_json(self):
        return {"base": self._base.to_json(), "lowrank": {"rank": int(self.low.t.size),
                                                           "t": [float(x) for x in self.low.t]}}

    def arrays(self):
        return {"u": self.low.u, "t": self.low.t}


_MAGIC = b"QM"
_KINDS = {1: ("m",), 2: ("M",), 3: ("qg", "qa", "den", "perm"), 4: ("u", "t")}


def max_bytes(d: int) -> int:
    """The longest encoding of a metric of dimension ``d`` (a dense base and a correction of rank ``d``)."""
    return 4 * len(_MAGIC) + 64 * 8 + 8 * (2 * d * d + 3 * d + 8)


def from_bytes(x, d: int) -> Metric:
    """The metric :meth:`Metric.to_bytes` encoded, for dimension ``d``; :class:`MetricError` saying what is
    wrong (the tag, a kind, a name, a shape, the length, a value) before anything is built. Empty bytes
    are the identity (a metric the server sends when ``metric-rank``'s correction found no direction)."""
    if not isinstance(x, (bytes, bytearray, memoryview)):
        raise MetricError(f"metric: expected bytes, got {type(x).__name__}")
    x = bytes(x)
    if not x:
        return Identity()
    if len(x) > max_bytes(d):
        raise MetricError(f"metric: {len(x)} bytes, more than any metric of d = {d} takes")
    metric, end = _read(x, 0, d, nested=False)
    if end != len(x):
        raise MetricError(f"metric: {len(x) - end} bytes after the metric's end")
    return metric


def _read(x: bytes, at: int, d: int, nested: bool) -> tuple[Metric, int]:
    def take(n: int) -> bytes:
        nonlocal at
        if at + n > len(x):
            raise MetricError("metric: the encoding ends early")
        at += n
        return x[at - n:at]

    if take(2) != _MAGIC:
        raise MetricError("metric: not a metric's encoding (no 'QM' tag)")
    code, count = struct.unpack("<BB", take(2))
    if code == 0 and count == 0:
        return Identity(), at
    names = _KINDS.get(code)
    if names is None or (nested and code == 4):
        raise MetricError(f"metric: unknown kind code {code}; allowed: 0 to 4 (a correction's base: 0 to 3)")
    if count != len(names):
        raise MetricError(f"metric: kind {code} carries {len(names)} arrays, not {count}")
    parts = {}
    for want in names:
        n, ndim = struct.unpack("<BB", take(2))
        name = take(n).decode("ascii", "replace")
        if name != want or not 1 <= ndim <= 2:
            raise MetricError(f"metric: array {name!r} of {ndim} dimensions where {want!r} was expected")
        shape = struct.unpack(f"<{ndim}I", take(4 * ndim))
        size = math.prod(shape)  # Python integers: a product of crafted dimensions cannot wrap around
        if size > 2 * d * d + 8:
            raise MetricError(f"metric: array {name!r} of shape {shape} is larger than d = {d} allows")
        a = np.frombuffer(take(8 * size), dtype="<f8").reshape(shape)
        if not np.all(np.isfinite(a)):
            raise MetricError(f"metric: array {name!r} holds a value that is not finite")
        parts[name] = a.copy()
    if code == 4:
        base, at = _read(x, at, d, nested=True)
        u, t = parts["u"], parts["t"]
        k = t.size
        if t.ndim != 1 or u.shape != (d, k) or k < 1 or not np.all(t > 0) \
                or not np.allclose(u.T @ u, np.eye(k), atol=1e-8):
            raise MetricError("metric: a low-rank correction needs positive values and orthonormal directions "
                              f"of d = {d}")
        return base.corrected(u, t), at
    if code == 1:
        if parts["m"].shape != (d,):
            raise MetricError(f"metric: a diagonal metric of d = {d} needs {d} numbers, got {parts['m'].shape}")
        return Diagonal(parts["m"]), at
    if code == 2:
        if parts["M"].shape != (d, d):
            raise MetricError(f"metric: a dense metric of d = {d} needs {d} × {d} numbers, got {parts['M'].shape}")
        return Dense(parts["M"]), at
    try:
        return Kronecker(Kron.checked(parts["perm"], parts["qg"], parts["qa"], parts["den"], d)), at
    except ValueError as exc:
        raise MetricError(str(exc)) from None


def to_array(metric: Metric) -> np.ndarray:
    """The metric as a checkpoint holds it: its tagged encoding as a ``uint8`` array."""
    return np.frombuffer(metric.to_bytes(), dtype=np.uint8).copy()


def from_array(a, d: int) -> Metric:
    """The inverse of :func:`to_array` (a checkpoint's ``metric``); :class:`MetricError` saying what is wrong."""
    a = np.asarray(a)
    if a.dtype != np.uint8 or a.ndim != 1:
        raise MetricError(f"metric: expected the metric's encoding as bytes (uint8), got {a.dtype} of shape {a.shape}")
    return from_bytes(a.tobytes(), d)
