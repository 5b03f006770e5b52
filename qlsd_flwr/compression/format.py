"""The constants every part of the QSGD wire format shares, and its error vocabulary.

One set of codes for the whole package: :class:`Encoding` is what ``encoding`` selects (and what
the compiled writer takes), :class:`QuantiseError` what a quantiser reports (the compiled ones
return its value, the Python ones raise ``ValueError`` with its message).
"""

from __future__ import annotations

from enum import IntEnum

HEADER_BYTES = 5  # 1 tag byte + uint32 d: 40 bits per message, not part of code_length_bits
TAG_PACKED = 0x01
TAG_ELIAS = 0x02
TAG_RICE = 0x03  # the compressed broadcast's Rice code until 2026-12-05 (compression.rice)
TAG_ARITH = 0x04  # the compressed broadcast's code (compression.arith)
MAX_S = 2**32  # levels fit the vectorised bit writer (int64 fields, float64-exact bit lengths)
MAX_D = 2**32 - 1  # d is a uint32 in the header
OMEGA_GROUPS = 5  # Elias omega groups for any value < 2^63: n → ⌊log2 n⌋ → ... reaches 1 in ≤ 5 steps


class Encoding(IntEnum):
    """How a message is coded: dense ``packed``, QSGD's sparse ``elias``, the shorter of those two (``auto``), a
    ``rice`` code, an adaptive arithmetic code ``arith``, or the shorter of those two, ``dense`` (the compressed
    broadcast's: :mod:`qlsd_flwr.compression.dense`; not a client's choice)."""

    PACKED = 0
    ELIAS = 1
    AUTO = 2
    RICE = 3
    ARITH = 4
    DENSE = 5

    @classmethod
    def of(cls, name: str) -> "Encoding":
        try:
            return cls[str(name).upper()]
        except KeyError:
            raise ValueError(f"unknown encoding {name!r}; allowed: {', '.join(ENCODINGS)}") from None


ENCODINGS = ("elias", "packed", "auto", "rice", "arith", "dense")
#: the codes the compiled kernels count (numba's, numpy's fast rows, torch's twin); ``arith`` goes by the reference
COMPILED_ENCODINGS = ("auto", "elias", "packed")
KINDS = ("qsgd", "identity")


class QuantiseError(IntEnum):
    """Why a vector cannot be sent (0: it can)."""

    OK = 0
    NON_FINITE = 1
    DITHER = 2
    NORM_OVERFLOW = 3
    IDENTITY_NON_FINITE = 4
    IDENTITY_OVERFLOW = 5

    @property
    def message(self) -> str:
        return _QUANTISE_MESSAGES[self]


_QUANTISE_MESSAGES = {
    QuantiseError.OK: "",
    QuantiseError.NON_FINITE: "QSGD: cannot quantise a non-finite vector",
    QuantiseError.DITHER: "QSGD: the dither u must lie in [0, 1)",
    QuantiseError.NORM_OVERFLOW: "QSGD: a block norm exceeds the float32 range (about 3.4e38)",
    QuantiseError.IDENTITY_NON_FINITE: "Identity: cannot send a non-finite vector",
    QuantiseError.IDENTITY_OVERFLOW: "Identity: vector exceeds the float32 range",
}


class DecodeError(ValueError):
    """A payload that is not a valid code for this compressor and ``d``."""


class DecodeFault(IntEnum):
    """Why a payload is not a valid code (0: it is). The compiled reader returns the value, the
    Python reader raises :class:`DecodeError` with the same message (``ABOVE`` and ``ABOVE_S``
    name the bound in their messages)."""

    OK = 0
    TRUNC_OMEGA = 1
    ABOVE = 2  # an Elias omega value above its field's maximum
    TRUNC_NORM = 3
    TRUNC_SIGN = 4
    TRAILING = 5
    PADDING = 6
    NEG_ZERO = 7
    NONFINITE = 8
    NEG_NORM = 9
    ABOVE_S = 10
    ZERO_NORM = 11
    TRUNC_RICE = 12
    ABOVE_K = 13
    NOT_CANONICAL = 14

    @property
    def message(self) -> str:
        return _DECODE_MESSAGES[self]


_DECODE_MESSAGES = {
    DecodeFault.TRUNC_OMEGA: "truncated Elias omega code", DecodeFault.TRUNC_NORM: "truncated norm",
    DecodeFault.TRUNC_SIGN: "truncated sign bit", DecodeFault.TRAILING: "trailing bytes after the Elias code",
    DecodeFault.PADDING: "nonzero padding", DecodeFault.NEG_ZERO: "negative zero level",
    DecodeFault.NONFINITE: "non-finite norm", DecodeFault.NEG_NORM: "negative norm",
    DecodeFault.ZERO_NORM: "nonzero level in a block with zero norm",
    DecodeFault.TRUNC_RICE: "truncated Rice code", DecodeFault.ABOVE_K: "Rice parameter k above bitlen(s)",
    DecodeFault.NOT_CANONICAL: "not the arithmetic code of the levels it decodes to (trailing bytes, padding or a "
                               "stream the writer does not make)",
}
