"""Splitting a tensor into model aggregation tasks (parts) of at most ``partition_bytes``.

Every worker computes the same spans from the same (numel, itemsize, partition_bytes), so parts
need no negotiation. Spans are element ranges of the flattened tensor.
"""

from __future__ import annotations

DEFAULT_PARTITION_BYTES = 4 << 20


def partition_spans(numel: int, itemsize: int, partition_bytes: int = DEFAULT_PARTITION_BYTES) -> list[tuple[int, int]]:
    """Element spans ``[(start, stop), ...]`` covering ``numel`` elements.

    A zero-size tensor still gets one (empty) task, so that it has a place and a round.
    """
    if numel < 0 or itemsize <= 0 or partition_bytes <= 0:
        raise ValueError(f"bad partition request: numel={numel} itemsize={itemsize} partition_bytes={partition_bytes}")
    per_part = max(1, partition_bytes // itemsize)
    if numel == 0:
        return [(0, 0)]
    return [(start, min(start + per_part, numel)) for start in range(0, numel, per_part)]
