"""2-bit gradient compression with MXNet's semantics (no I/O; the Agent quantizes, the
Aggregator dequantizes).

Each worker keeps a **residual** per key part, of the gradient's dtype. A push adds its gradient
to the residual; every value of the residual at or above ``threshold`` is sent as ``+threshold``
(and ``threshold`` is taken off it), at or below ``-threshold`` as ``-threshold`` (and added back),
anything else as 0 and stays in the residual for the next push: what is not sent now is sent
later, as MXNet's ``2bit`` compression does (src/kvstore/gradient_compression). On the wire each
value is 2 bits, four to a byte (first value in the top bits): 16x fewer bytes than float32.
The Aggregator turns a push back into ``+-threshold`` and 0 and sums as for any push, so every
sum is exact, and the same as MXNet's for the same gradients.
"""

from __future__ import annotations

import math

import numpy as np

from pslink.errors import ConfigError

TYPES = ("2bit",)
_POSITIVE, _NEGATIVE = 3, 2  # MXNet's codes: 0b11 for +threshold, 0b10 for -threshold, 0 for nothing
_SHIFTS = np.array([6, 4, 2, 0], np.uint8)


def check(params) -> float | None:
    """The threshold of a compression setting (``{"type": "2bit", "threshold": 0.5}``, MXNet's
    form), or None for ``{"type": "none"}`` / None; a ConfigError names what is wrong."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ConfigError(f"gradient compression must be a map like {{'type': '2bit', 'threshold': 0.5}}, got "
                          f"{params!r}")
    kind = params.get("type")
    if kind == "none":
        return None
    if kind not in TYPES:
        raise ConfigError(f"gradient compression type {kind!r} is not supported; supported: {', '.join(TYPES)} "
                          "(or 'none')")
    unknown = sorted(set(params) - {"type", "threshold"})
    if unknown:
        raise ConfigError(f"gradient compression takes 'type' and 'threshold', not {unknown}")
    threshold = params.get("threshold", 0.5)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
            or threshold <= 0:
        raise ConfigError(f"gradient compression threshold must be a positive number, got {threshold!r}")
    return float(threshold)


def packed_size(count: int) -> int:
    """Bytes of ``count`` values at 2 bits each."""
    return (count + 3) // 4


def quantize(values: np.ndarray, residual: np.ndarray, threshold: float) -> np.ndarray:
    """Add ``values`` to ``residual`` (in place), take out what is sent, and return it packed."""
    residual += values
    step = residual.dtype.type(threshold)
    positive = residual >= step
    negative = residual <= -step
    residual[positive] -= step
    residual[negative] += step
    codes = np.zeros(packed_size(values.size) * 4, np.uint8)
    codes[: values.size] = positive * np.uint8(_POSITIVE) + negative * np.uint8(_NEGATIVE)
    quads = codes.reshape(-1, 4)
    return (quads[:, 0] << 6) | (quads[:, 1] << 4) | (quads[:, 2] << 2) | quads[:, 3]


def dequantize(packed: np.ndarray, threshold: float, out: np.ndarray) -> np.ndarray:
    """Write the values ``packed`` holds (``+-threshold`` or 0) into ``out`` (its size says how many)."""
    codes = ((packed[:, None] >> _SHIFTS) & np.uint8(3)).reshape(-1)[: out.size]
    step = out.dtype.type(threshold)
    table = np.array([0, 0, -step, step], out.dtype)
    np.take(table, codes, out=out)
    return out


class Quantized:
    """A part's push, quantized once (resending it sends the same bytes: its residual moved once)."""

    __slots__ = ("packed", "threshold")

    def __init__(self, packed: np.ndarray, threshold: float):
        self.packed, self.threshold = packed, threshold


class Residuals:
    """A worker's residuals, one per (key, part), made at the first compressed push."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self._residuals: dict[tuple, np.ndarray] = {}

    def quantize(self, key, part: int, values: np.ndarray) -> Quantized:
        residual = self._residuals.get((key, part))
        if residual is None:
            residual = self._residuals[(key, part)] = np.zeros(values.size, values.dtype)
        return Quantized(quantize(values, residual, self.threshold), self.threshold)
