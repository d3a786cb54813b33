"""pslink for TensorFlow: a tf.distribute strategy and Horovod's TensorFlow API, over the service.

One line for ``tf.distribute`` users (Keras ``model.fit`` or a custom loop, unchanged)::

    strategy = pslink.tf.ParameterServiceStrategy()
    with strategy.scope():
        model = ...; model.compile(...)
    model.fit(...)

Horovod users change the import (``import pslink.tf as hvd``): ``init``, ``rank``, ``size``,
``allreduce``, ``broadcast``, ``broadcast_variables``, ``DistributedGradientTape``, and in
``pslink.tf.keras``: ``DistributedOptimizer`` and the callbacks ``BroadcastGlobalVariablesCallback``
and ``MetricAverageCallback``. Run the script with ``pslink launch -n N python train.py``.
Tested with TensorFlow 2.17 and Keras 3 (see docs/tf.md).
"""

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pslink.tf needs TensorFlow: pip install -c constraints.txt 'pslink[tf]' "
        f"(TensorFlow 2.17.1, the version tested) ({_exc})"
    ) from None

from pslink.tf.context import init, is_initialized, local_rank, local_size, rank, shutdown, size
from pslink.tf.ops import DistributedGradientTape, allreduce, broadcast, broadcast_variables
from pslink.tf.strategy import ParameterServiceStrategy

__all__ = [
    "DistributedGradientTape",
    "ParameterServiceStrategy",
    "allreduce",
    "broadcast",
    "broadcast_variables",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
