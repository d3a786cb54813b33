"""Make ``kvstore='pslink'`` work in gluon.Trainer and Module as it does in ``mx.kv.create``.

MXNet turns a kvstore name into a store in ``mxnet.model._create_kvstore``, which creates none
for one device unless the name contains "dist": ``Trainer(..., kvstore='pslink')`` would then
train alone, silently. For pslink's names we create the store first and hand MXNet the
instance, which it always uses; every other name goes through unchanged.

Sparse training needs nothing here: gluon's Trainer takes only MXNet's own ``KVStore`` class for
row_sparse weights and sparse gradients, and the pslink store is a subclass of it.
"""

from __future__ import annotations

import functools
import importlib

import mxnet as mx

# The modules that imported _create_kvstore by name (so each holds its own reference).
_USERS = ("mxnet.model", "mxnet.gluon.trainer", "mxnet.module.module")


def install_kvstore_names(names) -> None:
    """Resolve ``names`` to pslink stores wherever MXNet resolves kvstore names (idempotent)."""
    model = importlib.import_module("mxnet.model")
    original = getattr(model._create_kvstore, "__wrapped__", model._create_kvstore)
    ours = {name.lower() for name in names}

    @functools.wraps(original)
    def create_kvstore(kvstore, num_device, arg_params):
        if isinstance(kvstore, str) and kvstore.lower() in ours:
            kvstore = mx.kv.create(kvstore)
        return original(kvstore, num_device, arg_params)

    for name in _USERS:
        module = importlib.import_module(name)
        current = getattr(module, "_create_kvstore", None)
        if current is original or getattr(current, "__wrapped__", None) is original:
            module._create_kvstore = create_kvstore

