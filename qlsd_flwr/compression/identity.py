"""The identity compressor ``C(v) = v`` (``ω = 0``): the uncompressed LSD*, LSD++ and SGLD."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from qlsd_flwr.compression.format import DecodeError, QuantiseError


@dataclass(frozen=True)
class Identity:
    """The identity compressor ``C(v) = v`` (``ω = 0``): LSD*, LSD++ and SGLD.

    ``dtype = "float64"`` is exact; ``"float32"`` rounds each coordinate (a biased, not a
    stochastic, compression). The wire is the raw little-endian array, no header:
    ``64·d`` or ``32·d`` bits.
    """

    dtype: str = "float64"

    def __post_init__(self):
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"Identity: unknown dtype {self.dtype!r}; allowed: float64, float32")

    @property
    def _wire(self) -> np.dtype:
        return np.dtype("<f8" if self.dtype == "float64" else "<f4")

    def omega(self, d: int) -> float:
        return 0.0

    def quantise(self, v: np.ndarray, u=None) -> np.ndarray:
        """The vector cast through ``dtype`` (returned as float64); ``u`` is ignored."""
        v = np.asarray(v, dtype=np.float64)
        if not np.all(np.isfinite(v)):
            raise ValueError(QuantiseError.IDENTITY_NON_FINITE.message)
        with np.errstate(over="ignore"):
            x = v.astype(self._wire)
        if not np.all(np.isfinite(x)):
            raise ValueError(QuantiseError.IDENTITY_OVERFLOW.message)
        return x.astype(np.float64)

    def quantise_batch(self, V: np.ndarray, U=None) -> np.ndarray:
        return self.quantise(V)

    def dequantise(self, q: np.ndarray) -> np.ndarray:
        return np.array(q, dtype=np.float64)

    def dequantise_batch(self, q: np.ndarray) -> np.ndarray:
        return np.array(q, dtype=np.float64)

    def encode(self, q: np.ndarray) -> bytes:
        return np.ascontiguousarray(q, dtype=self._wire).tobytes()

    def decode(self, payload: bytes, d: int) -> np.ndarray:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise DecodeError(f"payload must be bytes, got {type(payload).__name__}")
        try:
            d = operator.index(d)
        except TypeError:
            raise DecodeError(f"bad dimension {d!r}") from None
        payload = bytes(payload)
        if d < 1 or len(payload) != self._wire.itemsize * d:
            raise DecodeError(f"identity payload must be {self._wire.itemsize * d} bytes, got {len(payload)}")
        x = np.frombuffer(payload, dtype=self._wire).astype(np.float64)
        if not np.all(np.isfinite(x)):
            raise DecodeError("non-finite value in identity payload")
        return x

    def code_length_bits(self, q) -> int:
        return 8 * self._wire.itemsize * int(np.shape(q)[-1])

    def code_length_bits_batch(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X)
        return np.full(X.shape[:-1], 8 * self._wire.itemsize * X.shape[-1], dtype=np.int64)

    def bound_bits(self, d: int) -> float:
        return float(8 * self._wire.itemsize * int(d))
