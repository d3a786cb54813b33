"""How big a gradient bucket grows before it is sent: the rule every adapter's buckets follow.

A bucket is sent once its last gradient is final, so only the last bucket's exchange waits after
backward: buckets of about a third of the model let two thirds of the exchange overlap backward
with few requests (pslink.torch.fusion's DistributedOptimizer, pslink.tf.strategy's reductions).
"""

from __future__ import annotations

LEAST_SHARE = 1 << 20  # bytes: below this, more buckets cost more in fixed costs than the overlap gains


def bucket_share(threshold: int, total: int) -> int:
    """A bucket closes once it holds this many bytes: a third of the model's ``total``, never
    under :data:`LEAST_SHARE`, nor over the fusion ``threshold`` when there is one (0: none)."""
    share = max(-(-total // 3), LEAST_SHARE)
    return min(threshold, share) if threshold else share
