"""MXNet adapter: name the parameter service as your kvstore.

::

    import mxnet as mx
    from mxnet import gluon
    import pslink.mxnet  # registers the kvstores 'pslink' and 'pslink_async'

    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore="pslink")
    # or: kv = mx.kv.create("pslink"); gluon.Trainer(..., kvstore=kv); kv.rank, kv.num_workers

Run the script with ``pslink launch -n 2 python train.py``. The store behaves as MXNet's
``dist_sync`` (``pslink_async``: ``dist_async``); with ``update_on_kvstore`` (the default) the
service's Aggregators apply the optimizer. Details and limits: docs/mxnet.md.
"""

from __future__ import annotations

try:
    import mxnet as _mx  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"pslink.mxnet needs MXNet 1.9.1 (with numpy < 1.24): pip install -c constraints.txt 'pslink[mxnet]' ({exc})"
    ) from exc

from pslink.mxnet.errors import KVStoreError
from pslink.mxnet.kvstore import NAMES, PSLink, PSLink_Async, PSLinkKVStore
from pslink.mxnet.optimizer import service_config
from pslink.mxnet.trainer import install_group_sync, install_kvstore_names, install_overlapped_allreduce

install_kvstore_names(NAMES)
install_group_sync()
install_overlapped_allreduce()

__all__ = ["KVStoreError", "NAMES", "PSLink", "PSLinkKVStore", "PSLink_Async", "service_config"]
