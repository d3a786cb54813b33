"""Make ``kvstore='pslink'`` work in gluon.Trainer and Module as it does in ``mx.kv.create``.

MXNet turns a kvstore name into a store in ``mxnet.model._create_kvstore``, which creates none
for one device unless the name contains "dist": ``Trainer(..., kvstore='pslink')`` would then
train alone, silently. For pslink's names we create the store first and hand MXNet the
instance, which it always uses; every other name goes through unchanged.

Sparse training: gluon's Trainer takes only MXNet's own ``KVStore`` class for row_sparse
weights (``_create_sparse_kvstore``) and for sparse gradients (an ``isinstance`` check); both
are widened to take a pslink store too, which serves them (pslink.mxnet.sparse).
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
    _accept_pslink_for_sparse(model, ours)


def _accept_pslink_for_sparse(model, ours: set) -> None:
    from mxnet.gluon import trainer as gluon_trainer
    from mxnet.kvstore import KVStore

    from pslink.mxnet.kvstore import PSLinkKVStore

    original = getattr(model._create_sparse_kvstore, "__wrapped__", model._create_sparse_kvstore)

    @functools.wraps(original)
    def create_sparse_kvstore(kvstore):
        if isinstance(kvstore, PSLinkKVStore):
            return kvstore, True  # row_sparse weights: always updated on the store, as MXNet's
        return original(mx.kv.create(kvstore) if isinstance(kvstore, str) and kvstore.lower() in ours else kvstore)

    model._create_sparse_kvstore = create_sparse_kvstore
    gluon_trainer._create_sparse_kvstore = create_sparse_kvstore
    # The Trainer refuses "a custom kvstore" for sparse gradients by isinstance(kvstore, KVStore).
    gluon_trainer.KVStore = (KVStore, PSLinkKVStore)
