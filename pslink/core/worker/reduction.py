"""Horovod's reduction operators and scale factors on host arrays (pure: numpy in, numpy out).

The service sums; everything else a reduction means is here, written once for every adapter:

- **Average** is a sum divided by the number of ranks. Floats are averaged on the service (the
  Aggregator divides once per round, ``average=True``); integers are summed there and divided
  here, ``trunc(sum * postscale / size)`` in float64, as Horovod's CPU ops scale an integer
  buffer (one multiplication by ``postscale / size``, truncated toward zero).
- **Scale factors** follow Horovod's CPU rules: integers are scaled in float64 and truncated
  toward zero, float16 in float32 math (one rounding back to half), float32 and float64 in
  their own precision (the factor rounded to the array's dtype first).
- **Min, Max, Product and Adasum** are not sums: every rank's array is gathered in rank order
  (:mod:`pslink.core.worker.session` does that) and each rank reduces the rows alike here, so
  every rank computes the same result.
"""

from __future__ import annotations

import enum

import numpy as np

from pslink.errors import ConfigError


class ReduceOp(enum.Enum):
    AVERAGE = "average"
    SUM = "sum"
    ADASUM = "adasum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    # Not Horovod's: torch.distributed's bitwise reductions (its ``pslink`` backend), of integers.
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Band, Bor, Bxor = ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR
# Reduced from every rank's array gathered in rank order: the service only sums.
GATHERED = frozenset({Min, Max, Product, Adasum, Band, Bor, Bxor})
_BITWISE = {Band: np.bitwise_and, Bor: np.bitwise_or, Bxor: np.bitwise_xor}


def reduce_op(op: ReduceOp | None, average: bool | None = None) -> ReduceOp:
    """Horovod's rules: ``op`` wins, the deprecated ``average`` flag picks Average or Sum."""
    if op is not None and average is not None:
        raise ConfigError("pass op= or the deprecated average=, not both")
    if op is None:
        return Sum if average is False else Average
    if not isinstance(op, ReduceOp):
        raise ConfigError(f"op must be Average, Sum, Min, Max, Product or Adasum, got {op!r}")
    return op


def check_factor(factor, what: str) -> float:
    """A scale factor as a float; ConfigError naming ``what`` unless it is a finite number."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number, got {factor!r}") from None
    if not np.isfinite(value):
        raise ConfigError(f"{what} must be finite, got {factor!r}")
    return value


def scale(array: np.ndarray, factor: float, out: np.ndarray | None = None) -> np.ndarray:
    """``array * factor`` in ``array``'s dtype, by Horovod's CPU rules (see the module), into
    ``out`` (which may be ``array``); returns it."""
    out = array if out is None else out
    if factor == 1.0:
        if out is not array:
            np.copyto(out, array)
        return out
    kind = array.dtype.kind
    if kind in "iu":
        np.copyto(out, np.trunc(array.astype(np.float64) * factor), casting="unsafe")
    elif array.dtype == np.float16:
        np.copyto(out, array.astype(np.float32) * np.float32(factor), casting="unsafe")
    else:
        np.multiply(array, array.dtype.type(factor), out=out)
    return out


def finish_average(array: np.ndarray, size: int, postscale: float, averaged: bool) -> np.ndarray:
    """After the service's sum (``averaged``: it divided already): apply the average's division
    (integers) and ``postscale``, in place."""
    if averaged:
        return scale(array, postscale)
    return scale(array, postscale / size)


def service_averages(op: ReduceOp, dtype: np.dtype) -> bool:
    """Whether the service divides (floats averaged there) or this rank does (integers)."""
    return op is Average and dtype.kind == "f"


def reduce_rows(rows: np.ndarray, op: ReduceOp) -> np.ndarray:
    """Every rank's array (``rows[r]``, in rank order) reduced by ``op``, in ``rows``' dtype."""
    if op is Min:
        return rows.min(axis=0)
    if op is Max:
        return rows.max(axis=0)
    if op is Product:
        return np.prod(rows, axis=0, dtype=rows.dtype)
    if op is Adasum:
        return adasum(rows)
    if op in _BITWISE:
        if rows.dtype.kind not in "iub":
            raise ConfigError(f"op={op.name} reduces integer tensors, got {rows.dtype}")
        return _BITWISE[op].reduce(rows, axis=0)
    raise ConfigError(f"reduce_rows takes Min, Max, Product or Adasum, got {op!r}")


def adasum(rows: np.ndarray) -> np.ndarray:
    """Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation"): ranks'
    gradients combined pairwise up a binary tree, in rank order, each pair as
    ``(1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b`` (orthogonal parts add, parallel parts
    average). With a power-of-two number of ranks the tree is Horovod's; an odd one out at
    some level is carried up unchanged. Computed in float64, returned in ``rows``' dtype."""
    if rows.dtype.kind != "f":
        raise ConfigError(f"Adasum reduces floating-point tensors, got {rows.dtype}")
    level = [row.astype(np.float64).reshape(-1) for row in rows]
    while len(level) > 1:
        paired = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0].reshape(rows.shape[1:]).astype(rows.dtype)


def _adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = float(a @ b)
    a2, b2 = float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2 * a2) if a2 else 1.0
    cb = 1.0 - dot / (2 * b2) if b2 else 1.0
    return ca * a + cb * b
