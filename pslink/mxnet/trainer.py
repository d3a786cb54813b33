"""Make ``kvstore='pslink'`` work in gluon.Trainer and Module as it does in ``mx.kv.create``.

MXNet turns a kvstore name into a store in ``mxnet.model._create_kvstore``, which creates none
for one device unless the name contains "dist": ``Trainer(..., kvstore='pslink')`` would then
train alone, silently. For pslink's names we create the store first and hand MXNet the
instance, which it always uses; every other name goes through unchanged.

With groups (``sync="local:T"``, pslink.core.worker.groups) every Trainer's step and update end with the
groups' sync of its parameters: :func:`install_group_sync`.

With a pslink store, gluon.Trainer's gradient exchange issues every key's pushpull as its
gradient becomes ready, last layer first, and waits once for all of them:
:func:`install_overlapped_allreduce`.

Sparse training needs nothing here: gluon's Trainer takes only MXNet's own ``KVStore`` class for
row_sparse weights and sparse gradients, and the pslink store is a subclass of it.
"""

from __future__ import annotations

import functools
import importlib

import mxnet as mx

from pslink.core.worker.groups import GroupAgent
from pslink.mxnet.kvstore import PSLinkKVStore

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


def install_overlapped_allreduce() -> None:
    """gluon.Trainer's ``_allreduce_grads`` (``step`` and ``allreduce_grads`` call it) on a pslink
    store: MXNet's loop, in reverse and inside the store's ``deferred()``. ``loss.backward()``
    returns while MXNet's engine still computes the gradients, last layer's first: each pushpull
    waits for its own gradient and is sent while the engine computes the earlier layers', and
    the results are all in once the loop ends, before the Trainer's update reads them. Every
    other store goes through MXNet's own loop (idempotent)."""
    trainer = mx.gluon.Trainer
    original = trainer._allreduce_grads
    if getattr(original, "pslink_overlapped", False):
        return

    @functools.wraps(original)
    def _allreduce_grads(self):
        store = self._kvstore
        if not isinstance(store, PSLinkKVStore):
            return original(self)
        with store.deferred():
            for i, param in reversed(list(enumerate(self._params))):
                if param.grad_req == "null":
                    continue
                grad_list = param.list_grad()
                if grad_list[0].stype != "default":  # sparse gradients: push and pull, as MXNet does
                    store.push(i, grad_list, priority=-i)
                    if param._stype == "default":
                        pull_list = param.list_data() if self._update_on_kvstore else param.list_grad()
                        store.pull(i, pull_list, priority=-i, ignore_sparse=self._distributed)
                elif self._update_on_kvstore:  # the service steps: the weights come back
                    store.pushpull(i, grad_list, out=param.list_data(), priority=-i)
                else:
                    store.pushpull(i, grad_list, priority=-i)
        return None

    _allreduce_grads.pslink_overlapped = True
    trainer._allreduce_grads = _allreduce_grads


def install_group_sync() -> None:
    """End gluon.Trainer's ``step`` and ``update`` with the groups' sync of the Trainer's
    parameters when its workers form groups (its pslink store's, or the Horovod API's, Agent is
    a :class:`~pslink.core.worker.groups.GroupAgent`); nothing otherwise (idempotent)."""
    trainer = mx.gluon.Trainer
    for name in ("step", "update"):
        original = getattr(trainer, name)
        if getattr(original, "pslink_groups", False):
            continue

        @functools.wraps(original)
        def then_sync(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            agent = _group_agent(self)
            if agent is not None:
                _sync_parameters(agent, self._params)
            return result

        then_sync.pslink_groups = True
        setattr(trainer, name, then_sync)


def _group_agent(trainer):
    store = getattr(trainer, "_kvstore", None)
    agent = getattr(store, "agent", None)
    session = getattr(trainer, "_session", None)  # the Horovod API's DistributedTrainer (None: outside its set)
    if agent is None and session is not None:
        agent = session.agent
    return agent if isinstance(agent, GroupAgent) else None


def _sync_parameters(agent, params) -> None:
    """The parameters (same order on every worker) averaged over the groups when this step syncs."""
    arrays = {}

    def copies():
        arrays.update((f"mxnet/{i}", param.data().asnumpy()) for i, param in enumerate(params))
        return arrays

    if agent.end_step(copies):
        for array, param in zip(arrays.values(), params):
            param.set_data(mx.nd.array(array, dtype=param.dtype))
