"""The ``pslink`` kvstore: MXNet's KVStore interface over a pslink Agent, with dist_sync semantics.

::

    import mxnet as mx
    import pslink.mxnet  # registers 'pslink' and 'pslink_async'

    kv = mx.kv.create("pslink")          # job, rank, ... from PSLINK_* (as `pslink launch` sets)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)

Semantics follow MXNet's ``dist_sync`` (``dist_async`` with ``pslink_async``): ``push`` adds a
worker's value (summed over its devices first) to the key's current round, ``pull`` returns that
round's sum over all workers (the initial value before any push), or with an optimizer set the
weights the service stepped with the summed gradient. Every call has finished when it returns,
except ``push``, which returns once sent and is settled by the next call (and ``pushpull`` inside
``deferred()``, settled when it ends).

A dense CPU value of its key's dtype moves without copies on the worker's side: the Agent sends
it from the NDArray's own memory and receives the round's result straight into the output
NDArray's (``_view``), once MXNet's engine has finished with both (``PSLINK_MXNET_ZERO_COPY=0``:
copied out and back in through numpy, as before). gluon.Trainer's gradient exchange
(pslink.mxnet.trainer) issues every key's pushpull as its gradient becomes ready, last layer
first, and waits once for all of them (``deferred``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import warnings
import weakref
from typing import Any

import mxnet as mx
import numpy as np
from mxnet.kvstore import KVStore, KVStoreBase

from pslink.core.agent.agent import Agent
from pslink.core.worker.connect import connect
from pslink.core.worker.groups import GroupAgent
from pslink.errors import AuthError, MembershipError, PslinkError
from pslink.mxnet import sparse
from pslink.mxnet.errors import KVStoreError, translate
from pslink.mxnet.optimizer import check_key, service_config, to_mxnet_state, to_service_state


class _Key:
    """What this worker initialized: the key's shape and dtype, and a buffer to receive into."""

    __slots__ = ("shape", "dtype", "buffer", "checked")

    def __init__(self, shape: tuple, dtype: np.dtype):
        self.shape = shape
        self.dtype = dtype
        self.buffer: np.ndarray | None = None  # reused by pulls: calls are synchronous
        self.checked = False  # against the optimizer's per-key settings


def _check_key(key: Any) -> Any:
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        return int(key)
    if isinstance(key, str):
        return key
    raise KVStoreError(f"pslink kvstore: a key is an int or a str, got {key!r} ({type(key).__name__})", key=key)


def _batch(key, value, what: str) -> tuple[list, list]:
    """Keys and per-key values of a call on one key or on a list of keys."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            got = f"{len(value)} values" if isinstance(value, (list, tuple)) else type(value).__name__
            raise KVStoreError(f"pslink kvstore: {what} of {len(key)} keys needs one value per key, got {got}")
        keys = [_check_key(k) for k in key]
        if len(set(keys)) != len(keys):
            raise KVStoreError(f"pslink kvstore: {what}: the keys of one call must be distinct, got {keys}")
        return keys, list(value)
    return [_check_key(key)], [value]


def _split(keys: list, values: list, chosen) -> tuple[list, list]:
    """The keys (and their values) of a call that ``chosen(key, value)`` picks."""
    picked = [(k, v) for k, v in zip(keys, values) if chosen(k, v)]
    return [k for k, _ in picked], [v for _, v in picked]


def _arrays(value, key, what: str) -> list:
    """The NDArrays of one key's value: one array, or one per device. A dense key's row_sparse
    gradient (an Embedding with ``sparse_grad``) is pushed dense: every row is stepped, the
    absent ones with a zero gradient (MXNet's lazy update needs a row-sparse weight)."""
    arrays = list(value) if isinstance(value, (list, tuple)) else [value]
    if not arrays:
        raise KVStoreError(f"pslink kvstore: {what} of key {key!r} got an empty list of arrays", key=key)
    for array in arrays:
        if not isinstance(array, mx.nd.NDArray):
            raise KVStoreError(
                f"pslink kvstore: {what} of key {key!r} needs NDArrays, got {type(array).__name__}", key=key
            )
        if array.stype == "row_sparse" and what in ("push", "pushpull", "pull"):
            continue
        if array.stype != "default":
            raise KVStoreError(
                f"pslink kvstore: {what} of key {key!r}: {array.stype} arrays are not supported, only dense ones",
                key=key,
            )
    return arrays


class _Lent:
    """What ``np.from_dlpack`` takes: an NDArray's DLPack capsule on the CPU."""

    __slots__ = ("capsule",)

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, stream=None):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU, device 0


def _view(array, dtype: np.dtype, writable: bool) -> np.ndarray | None:
    """A numpy array over ``array``'s own memory (no copy), or None where that cannot be: not a
    dense CPU array of ``dtype``, or empty. MXNet computes asynchronously: taking the view waits
    until the engine's writes to ``array`` are done (``writable``: its reads too), so the caller
    may read it (write it) until it next hands ``array`` to MXNet. The view keeps the memory alive
    (the DLPack capsule holds a reference to MXNet's storage)."""
    if (array.stype != "default" or array.context.device_type != "cpu" or array.size == 0
            or np.dtype(array.dtype) != dtype):
        return None
    try:
        view = np.from_dlpack(_Lent(array.to_dlpack_for_write() if writable else array.to_dlpack_for_read()))
    except (BufferError, TypeError, ValueError, RuntimeError):  # a dtype DLPack or numpy has no name for
        return None
    if view.dtype != dtype or not view.flags.c_contiguous:
        return None
    if not writable:
        return view
    # numpy 1.23 makes every DLPack import read-only; the same memory as a writable ctypes
    # buffer, which holds the read-only view (and through it MXNet's storage) while in use.
    memory = (ctypes.c_char * view.nbytes).from_address(view.ctypes.data)
    memory.owner = view
    return np.frombuffer(memory, dtype=dtype).reshape(view.shape)


def _zero_copy_default() -> bool:
    # PSLINK_MXNET_ZERO_COPY=0: every value copied through numpy as before (for comparing the two)
    return os.environ.get("PSLINK_MXNET_ZERO_COPY", "1").strip().lower() not in ("0", "false", "no", "off")


class PSLinkKVStore(KVStore):
    """A kvstore whose values live on the pslink parameter service.

    Create it with ``mx.kv.create('pslink')`` (or ``'pslink_async'``), which reads the job, rank,
    number of workers and service address from the environment, or directly with the arguments
    of :func:`pslink.connect` (``job``, ``rank``, ``num_workers``, ``master`` and its options), or
    around an existing ``agent``. Use one per worker process, for every Trainer of the job.

    It subclasses MXNet's own ``KVStore`` (every method of it overridden; there is no C store
    underneath), because that is what gluon's Trainer and ``mxnet.model`` check for where a store
    serves row-sparse weights or sparse gradients.
    """

    #: "asp" for the asynchronous store; None joins the job with whatever it runs (BSP by default)
    sync: str | None = None

    def __init__(self, job=None, rank=None, num_workers=None, master=None, *, agent: Agent | None = None,
                 **options):
        if agent is None:
            if self.sync is not None:
                options.setdefault("sync", self.sync)
            try:
                agent = connect(job, rank, num_workers, master, **options)
            except (AuthError, MembershipError) as exc:
                hint = "a worker process uses one pslink kvstore: create it once and pass it to every Trainer"
                raise translate(exc, "joining the parameter service", hint) from exc
            except PslinkError as exc:
                raise translate(exc, "joining the parameter service") from exc
            # Leave the job when the store goes away or the process exits.
            self._finalizer = weakref.finalize(self, agent.close)
        else:
            self._finalizer = None
            if self.sync is not None and agent.sync != self.sync:
                raise KVStoreError(f"pslink kvstore: the agent's job runs sync {agent.sync!r}, not {self.sync!r}")
        self._agent = agent
        self.handle = None  # MXNet's C store: none (KVStore's attribute, read by nothing here)
        self._keys: dict[Any, _Key] = {}
        self._sparse: dict[Any, sparse.RowSparseKey] = {}  # row-sparse keys: tables on the service
        self._pushes: list = []  # handles of pushes not yet confirmed
        self._pending: list = []  # handles of deferred pushpulls, writing into NDArrays' memory
        self._pending_keys: set = set()
        self._deferring = 0  # inside deferred(): pushpull returns once sent
        #: False: every value is copied out of MXNet and back in (``PSLINK_MXNET_ZERO_COPY=0``)
        self.zero_copy = _zero_copy_default()
        self._optimizer = None
        self._sent: dict | None = None  # the optimizer settings the service has
        self._updater = None  # gluon.Trainer.load_states reads kv._updater.optimizer
        self._barriers = itertools.count(1)
        self._init_barriers = itertools.count(1)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.type} job={self._agent.job!r} rank={self.rank}/{self.num_workers}>"

    def __del__(self):
        pass  # KVStore's frees its C store; the Agent is closed by the finalizer

    def _set_updater(self, updater):
        # MXNet documents _set_updater as its local store's alone ("When running on multiple
        # machines one must use set_optimizer"); its dist stores' workers never run it, and their
        # pulls then return the servers' sums: refused here rather than silently ignored.
        raise KVStoreError("pslink kvstore: _set_updater (a Python function applied to each push) is MXNet's local "
                           "store's alone, as with its dist stores: the service applies set_optimizer's optimizer, "
                           "or the Trainer updates on the workers after pushpull")

    def _send_command_to_servers(self, head, body):
        raise KVStoreError("pslink kvstore: there are no servers to send commands to; the service's Aggregators "
                           "are configured through set_optimizer and the job's settings")

    # -- identity -------------------------------------------------------------------------------

    @property
    def type(self) -> str:
        """``pslink_dist_sync`` or ``pslink_dist_async``: MXNet's Trainer and Module look for
        'dist', '_sync' and '_async' in it."""
        return "pslink_dist_async" if self._agent.sync == "asp" else "pslink_dist_sync"

    @property
    def rank(self) -> int:
        return self._agent.rank

    @property
    def num_workers(self) -> int:
        return self._agent.num_workers

    @property
    def agent(self) -> Agent:
        """The pslink Agent underneath (its job, mode, sync, key placement)."""
        return self._agent

    def is_capable(self, capability: str) -> bool:
        if capability.lower() == KVStoreBase.OPTIMIZER:
            # The service applies SGD and Adam (update_on_kvstore); not for groups (sync="local:T"),
            # whose workers step, so that the groups can average their weights.
            return not isinstance(self._agent, GroupAgent)
        raise ValueError(f"Unknown capability: {capability}")

    # -- data path --------------------------------------------------------------------------------

    def init(self, key, value) -> None:
        """Declare keys; rank 0's values become their initial values. Call on every worker. A
        row_sparse value makes a row-sparse key (a table on the service: pslink.mxnet.sparse)."""
        keys, values = _batch(key, value, "init")
        if any(sparse.is_row_sparse(v) for v in values):  # those keys are tables; the others as below
            self._init_row_sparse(*_split(keys, values, lambda k, v: sparse.is_row_sparse(v)))
            keys, values = _split(keys, values, lambda k, v: not sparse.is_row_sparse(v))
            if not keys:
                return
        arrays = []
        for k, v in zip(keys, values):
            if k in self._keys or k in self._sparse:
                raise KVStoreError(f"pslink kvstore: duplicate init of key {k!r}", key=k)
            if isinstance(v, (list, tuple)) and len(v) > 1:
                # MXNet reads [a, b] for one key as two inits of that key, and refuses the second.
                raise KVStoreError(f"pslink kvstore: duplicate init of key {k!r} ({len(v)} values in one list)",
                                   key=k)
            arrays.append(_arrays(v, k, "init")[0].asnumpy())  # one NDArray, or a list holding one
        self._settle()
        self._call("init", keys, lambda: self._agent.init_many(keys, arrays).wait())
        self._after_init(keys)
        for k, array in zip(keys, arrays):
            self._keys[k] = _Key(array.shape, array.dtype)

    def broadcast(self, key, value, out, priority=0) -> None:
        """Set keys to rank 0's ``value`` and write it to ``out`` on every worker (init + pull)."""
        keys, values = _batch(key, value, "broadcast")
        _, outs = _batch(key, out, "broadcast")
        arrays = []
        for k, v in zip(keys, values):
            if k in self._keys:
                raise KVStoreError(f"pslink kvstore: duplicate init of key {k!r} (broadcast)", key=k)
            arrays.append(_arrays(v, k, "broadcast")[0].asnumpy())
        infos = [_Key(a.shape, a.dtype) for a in arrays]
        targets = [self._targets(k, info, o, "broadcast", ignore_sparse=True) for k, info, o in zip(keys, infos, outs)]
        buffers = [self._buffer(info) for info in infos]
        self._settle()

        def init_then_pull():
            # Sent back to back: an Aggregator serves the pull once rank 0's value is in.
            inited = self._agent.init_many(keys, arrays)
            pulled = self._agent.pull_many(keys, outs=buffers)
            inited.wait()
            pulled.wait()

        self._call("broadcast", keys, init_then_pull)
        self._after_init(keys)
        for k, info, buffer, target in zip(keys, infos, buffers, targets):
            self._keys[k] = info
            self._write(buffer, target)

    def push(self, key, value, priority=0) -> None:
        """Add ``value`` (summed over its devices) to this worker's next round of each key."""
        keys, values = _batch(key, value, "push")
        if any(k in self._sparse for k in keys):  # row-sparse keys go to their tables; the others as below
            self._push_row_sparse(*_split(keys, values, lambda k, v: k in self._sparse))
            keys, values = _split(keys, values, lambda k, v: k not in self._sparse)
            if not keys:
                return
        arrays = [self._read(k, v, "push") for k, v in zip(keys, values)]
        self._before_push(keys)
        try:
            self._pushes.append(self._agent.push_many(keys, arrays))
        except PslinkError as exc:
            raise translate(exc, f"push of key {keys[0]!r}" if len(keys) == 1 else f"push of keys {keys}") from exc

    def pull(self, key, out=None, priority=0, ignore_sparse=True) -> None:
        """Write each key's latest round (this worker's) into ``out``."""
        if out is None:
            raise KVStoreError("pslink kvstore: pull needs out= (the NDArrays to write the value to)")
        keys, outs = _batch(key, out, "pull")
        rows = [k for k in keys if k in self._sparse]
        if rows and not ignore_sparse:
            raise KVStoreError(f"pslink kvstore: pull of row-sparse key(s) {rows} with ignore_sparse=False: a "
                               "row-sparse key is read with row_sparse_pull(key, out, row_ids=...)", key=rows[0])
        if rows:  # MXNet skips them (ignore_sparse)
            outs = [o for k, o in zip(keys, outs) if k not in self._sparse]
            keys = [k for k in keys if k not in self._sparse]
        infos = [self._initialized(k, "pull") for k in keys]
        targets = [self._targets(k, info, o, "pull", ignore_sparse) for k, info, o in zip(keys, infos, outs)]
        read = [i for i, t in enumerate(targets) if t]  # not a key whose outputs were all ignored
        keys, infos, targets = [keys[i] for i in read], [infos[i] for i in read], [targets[i] for i in read]
        self._settle()
        # Received straight into a single dense CPU output; else into a buffer, copied to each output.
        views = [self._single_view(info, target, writable=True) for info, target in zip(infos, targets)]
        buffers = [self._buffer(info) if view is None else view for info, view in zip(infos, views)]
        if keys:
            self._call("pull", keys, lambda: self._agent.pull_many(keys, outs=buffers).wait())
        for buffer, view, target in zip(buffers, views, targets):
            if view is None:
                self._write(buffer, target)

    def pushpull(self, key, value, out=None, priority=0) -> None:
        """Push ``value`` and write the round's result to ``out`` (to ``value`` if None). Inside
        ``deferred()`` a dense CPU key returns once sent, its result written when the deferral
        (or any other call of the store) settles it."""
        keys, values = _batch(key, value, "pushpull")
        _, outs = _batch(key, value if out is None else out, "pushpull")
        values = [self._checked(k, v, "pushpull") for k, v in zip(keys, values)]
        targets = [self._targets(k, self._keys[k], o, "pushpull") for k, o in zip(keys, outs)]
        self._before_push(keys)
        if self._deferring and self._pending_keys.isdisjoint(keys):
            self._settle_pushes()
        else:  # (a key twice in one deferral: its next round is sent once the last one is in)
            self._settle()
        lent = [self._lent(self._keys[k], v, t) for k, v, t in zip(keys, values, targets)]
        fast = [i for i, pair in enumerate(lent) if pair is not None]
        if fast:
            fast_keys = [keys[i] for i in fast]
            handle = self._call("pushpull", fast_keys, lambda: self._agent.pushpull_many(
                fast_keys, [lent[i][0] for i in fast], outs=[lent[i][1] for i in fast]))
            self._pending.append((handle, [lent[i] for i in fast]))  # the views live until settled
            self._pending_keys.update(fast_keys)
        slow = [i for i, pair in enumerate(lent) if pair is None]
        if slow:
            slow_keys = [keys[i] for i in slow]
            arrays = [self._summed(self._keys[keys[i]], values[i]) for i in slow]
            # The result is received into the array just pushed: it is ours, a copy of the value.
            self._call("pushpull", slow_keys, lambda: self._agent.pushpull_many(slow_keys, arrays, outs=arrays).wait())
            for array, i in zip(arrays, slow):
                self._write(array, targets[i])
        if not self._deferring:
            self._settle()

    @contextlib.contextmanager
    def deferred(self):
        """Within it, ``pushpull`` of a dense CPU key returns once sent, writing its result into
        the output's memory behind MXNet's engine: nothing may read or write those arrays (nor
        push them as another key's value) until the deferral ends, which waits for every one of
        them, as does any other call of the store. gluon.Trainer's gradient exchange runs in one
        (pslink.mxnet.trainer)."""
        self._deferring += 1
        try:
            yield self
        finally:
            self._deferring -= 1
            if not self._deferring:
                self._settle()

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """Write the rows ``row_ids`` names of each row-sparse key into ``out`` (a row_sparse
        array, or a list: one per device, with a ``row_ids`` each), as of this worker's last push."""
        if out is None or row_ids is None:
            raise KVStoreError("pslink kvstore: row_sparse_pull needs out= and row_ids=")
        keys, outs = _batch(key, out, "row_sparse_pull")
        _, ids = _batch(key, row_ids, "row_sparse_pull")
        self._settle()
        for k, o, r in zip(keys, outs, ids):
            info = self._sparse.get(k)
            if info is None:
                raise KVStoreError(f"pslink kvstore: row_sparse_pull of key {k!r}, which is not a row-sparse key "
                                   "(init it with a row_sparse array)", key=k)
            targets = list(o) if isinstance(o, (list, tuple)) else [o]
            rids = list(r) if isinstance(r, (list, tuple)) else [r] * len(targets)
            if len(rids) != len(targets):
                raise KVStoreError(f"pslink kvstore: row_sparse_pull of key {k!r}: {len(targets)} outputs but "
                                   f"{len(rids)} row_ids", key=k)
            self._call("row_sparse_pull", [k], lambda: sparse.pull_rows(info, k, targets, rids))

    def set_gradient_compression(self, compression_params):
        """MXNet's 2-bit compression (``{'type': '2bit', 'threshold': 0.5}``): each worker's pushes
        of dense keys are quantized to +-threshold or 0 (2 bits a value on the wire), the rest kept
        in a residual per key on the worker for its next push; the service sums the dequantized
        values. Row-sparse keys are sent as they are, as MXNet does."""
        if not isinstance(compression_params, dict) or "type" not in compression_params:
            raise KVStoreError("pslink kvstore: set_gradient_compression takes a dict with 'type' ('2bit') and "
                               f"optionally 'threshold', got {compression_params!r}")
        self._settle()
        try:
            self._agent.set_gradient_compression(compression_params)
        except PslinkError as exc:
            raise translate(exc, "set_gradient_compression") from exc

    def barrier(self) -> None:
        """Wait until every worker of the job got here (pushes before it are applied)."""
        self._settle()
        self._call("barrier", [], lambda: self._agent.barrier(f"mxnet-{next(self._barriers)}"))

    _barrier = barrier  # the name MXNet's own KVStore uses

    def close(self) -> None:
        """Leave the job (also done when the store is collected or the process exits)."""
        try:
            self._settle()
        finally:
            if self._finalizer is not None:
                self._finalizer()

    # -- optimizer on the service ------------------------------------------------------------------

    def set_optimizer(self, optimizer) -> None:
        """Have the service apply ``optimizer`` (its type and hyperparameters, sent as plain data)
        to every push from now on: pulls then return weights. As with MXNet's dist_sync, any time:
        after init, the keys' values so far are the weights it steps from the next push on."""
        if isinstance(self._agent, GroupAgent):
            raise KVStoreError(f"pslink kvstore: job {self._agent.world_job!r} trains as groups (sync='local:T'): the "
                               "workers update their weights, so that the groups can average them: train with "
                               "gluon.Trainer (it updates on the workers with this store), not Module")
        config = service_config(optimizer, list(self._keys))
        for key, info in self._keys.items():
            check_key(optimizer, key, info.dtype.name)
            info.checked = True
        self._settle()
        self._send_optimizer(config)
        self._optimizer = optimizer
        self._updater = mx.optimizer.get_updater(optimizer)

    def save_optimizer_states(self, fname, dump_optimizer=False) -> None:
        """Write the optimizer state as MXNet's updater does (the optimizer too with
        ``dump_optimizer``): the momentum or Adam moments of every key, read from the service.
        The file loads back with ``load_optimizer_states``, here or into MXNet's own kvstores."""
        self._require_optimizer("save_optimizer_states")
        self._settle()
        keys = list(self._keys)
        service = self._call("save_optimizer_states", keys, lambda: self._agent.optimizer_state(keys))
        updater = self._updater
        updater.states = {k: to_mxnet_state(self._optimizer, state) for k, state in service.items()}
        updater.states_synced = dict.fromkeys(updater.states, True)
        try:
            with open(fname, "wb") as fout:
                fout.write(updater.get_states(dump_optimizer))
        finally:
            updater.states, updater.states_synced = {}, {}  # the service's copy is the live one

    def load_optimizer_states(self, fname) -> None:
        """Load a file written by ``save_optimizer_states`` (or by MXNet's local updater): its
        optimizer, if it holds one, is sent to the service, and its per-key state is installed
        there for the keys this store initialized (init before loading, as gluon's Trainer does)."""
        self._require_optimizer("load_optimizer_states")
        with open(fname, "rb") as fin:
            self._updater.set_states(fin.read())
        loaded, self._updater.states, self._updater.states_synced = self._updater.states, {}, {}
        self._optimizer = self._updater.optimizer
        unknown = [k for k in loaded if k not in self._keys]
        if unknown:
            raise KVStoreError(f"pslink kvstore: {fname} holds optimizer state for key(s) {unknown} that this store "
                               "has not initialized; init every key before load_optimizer_states")
        states = {k: to_service_state(self._optimizer, k, state) for k, state in loaded.items()}
        self._settle()
        self._send_optimizer(service_config(self._optimizer, list(self._keys)))
        if states:
            self._call("load_optimizer_states", list(states), lambda: self._agent.set_optimizer_state(states))

    def _require_optimizer(self, what: str) -> None:
        if self._updater is None:
            raise KVStoreError(f"pslink kvstore: {what} needs an optimizer: call set_optimizer first")

    def _send_optimizer(self, config: dict) -> None:
        self._call("set_optimizer", [], lambda: self._agent.set_optimizer(config))
        self._sent = config

    def _before_push(self, keys: list) -> None:
        """Keep the service's optimizer in step with the local one: MXNet advances its update
        count (and so an lr_scheduler) per key update, and set_learning_rate changes lr."""
        opt = self._optimizer
        if opt is None:
            return
        for key in keys:
            info = self._keys[key]
            if not info.checked:
                check_key(opt, key, info.dtype.name)
                info.checked = True
        opt._update_count(keys)
        config = service_config(opt, list(self._keys))
        if config != self._sent:
            self._settle()
            self._send_optimizer(config)

    # -- helpers ----------------------------------------------------------------------------------

    def _init_row_sparse(self, keys: list, values: list) -> None:
        for k, v in zip(keys, values):
            if k in self._keys or k in self._sparse:
                raise KVStoreError(f"pslink kvstore: duplicate init of key {k!r}", key=k)
        self._settle()
        for k, v in zip(keys, values):
            array = v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v  # one array, or a list of one
            if not isinstance(array, mx.nd.NDArray):
                raise KVStoreError(f"pslink kvstore: init of key {k!r} needs one NDArray, got {type(array).__name__}",
                                   key=k)
            self._sparse[k] = self._call("init", [k], lambda: sparse.declare(self._agent, k, array))
        self._after_init(keys)

    def _push_row_sparse(self, keys: list, values: list) -> None:
        if self._optimizer is not None:
            self._optimizer._update_count(keys)
        for k, v in zip(keys, values):
            arrays = list(v) if isinstance(v, (list, tuple)) else [v]
            self._pushes.append(self._call("push", [k], lambda: sparse.push(self._sparse[k], k, arrays)))

    def _initialized(self, key, what: str) -> _Key:
        info = self._keys.get(key)
        if info is None and key in self._sparse:
            raise KVStoreError(f"pslink kvstore: {what} of row-sparse key {key!r}: use push and row_sparse_pull",
                               key=key)
        if info is None:
            raise KVStoreError(
                f"pslink kvstore: key {key!r} has not been initialized; call init({key!r}, value) (or "
                f"broadcast) on every worker before {what}",
                key=key,
            )
        return info

    def _read(self, key, value, what: str) -> np.ndarray:
        """One worker's value of ``key`` as a new numpy array: the sum over its devices."""
        arrays = self._checked(key, value, what)
        return self._summed(self._keys[key], arrays)

    def _checked(self, key, value, what: str) -> list:
        """The NDArrays of one worker's value of ``key`` (one per device), of the key's shape."""
        info = self._initialized(key, what)
        arrays = _arrays(value, key, what)
        for array in arrays:
            if array.shape != info.shape:
                raise KVStoreError(
                    f"pslink kvstore: {what} of key {key!r} with shape {array.shape}, but the key was "
                    f"initialized with shape {info.shape}",
                    key=key, shapes=[list(array.shape), list(info.shape)],
                )
        return arrays

    @staticmethod
    def _summed(info: _Key, arrays: list) -> np.ndarray:
        """A copy of the arrays' sum over devices, in the key's dtype."""
        dense = [a.tostype("default") if a.stype != "default" else a for a in arrays]
        total = dense[0].asnumpy()
        for array in dense[1:]:
            total += array.asnumpy()
        if total.dtype != info.dtype:
            total = total.astype(info.dtype)  # as MXNet's copies between dtypes do
        return total

    def _single_view(self, info: _Key, arrays: list, writable: bool) -> np.ndarray | None:
        """A view of the one array of ``arrays`` (see ``_view``), or None: several devices, sparse,
        another context or dtype, or zero_copy off."""
        if not self.zero_copy or len(arrays) != 1:
            return None
        return _view(arrays[0], info.dtype, writable)

    def _lent(self, info: _Key, values: list, targets: list) -> tuple | None:
        """The pushpull of a key without copies: (the value's memory to send, the target's memory
        to receive into), or None for the copying path. The target's view waits for MXNet's reads
        of it too (a weight still read by the backward pass, with the optimizer on the service)."""
        if not self.zero_copy or len(values) != 1 or len(targets) != 1:
            return None
        value, target = values[0], targets[0]
        if value.handle.value == target.handle.value:  # the usual: a gradient reduced in place
            view = _view(value, info.dtype, writable=True)
            return None if view is None else (view, view)
        sent = _view(value, info.dtype, writable=False)
        received = _view(target, info.dtype, writable=True) if sent is not None else None
        if received is None or np.may_share_memory(sent, received):  # partly the same memory: copied
            return None
        return sent, received

    def _targets(self, key, info: _Key, out, what: str, ignore_sparse: bool = False) -> list:
        """The arrays of ``out`` to write ``key`` into. With ``ignore_sparse`` (pull's default, and
        broadcast's) row_sparse ones are left alone, as MXNet's stores leave them (with a warning)
        for row_sparse_pull to fill; without it they get the whole value, as MXNet's local store
        writes it (its dist stores refuse ignore_sparse=False)."""
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if ignore_sparse and outs:
            sparse = [isinstance(o, mx.nd.NDArray) and o.stype != "default" for o in outs]
            skipped = [o for o, is_sparse in zip(outs, sparse) if is_sparse]
            kept = [o for o, is_sparse in zip(outs, sparse) if not is_sparse]
            if skipped:
                warnings.warn(f"pslink kvstore: {what} of key {key!r} into {len(skipped)} {skipped[0].stype} "
                              "array(s) ignored (ignore_sparse=True), as MXNet's stores ignore it: read them with "
                              "row_sparse_pull(key, out, row_ids=...)", stacklevel=3)
                if not kept:
                    return []
            outs = kept
        targets = _arrays(outs, key, what)
        for target in targets:
            if target.shape != info.shape:
                raise KVStoreError(
                    f"pslink kvstore: {what} of key {key!r} into an array of shape {target.shape}, but the "
                    f"key has shape {info.shape}",
                    key=key, shapes=[list(target.shape), list(info.shape)],
                )
        return targets

    @staticmethod
    def _buffer(info: _Key) -> np.ndarray:
        if info.buffer is None:
            info.buffer = np.empty(info.shape, info.dtype)
        return info.buffer

    @staticmethod
    def _write(array: np.ndarray, targets: list) -> None:
        # MXNet's own stores write through the engine, which autograd never sees: a pull into a
        # Parameter's data inside ``autograd.record()`` is allowed there, and would be refused
        # here as an in-place op on an array in the graph if this copy were recorded.
        with mx.autograd.pause():
            for target in targets:
                if target.stype != "default":  # pull(..., ignore_sparse=False) into a row_sparse array
                    mx.nd.array(array, dtype=target.dtype).tostype(target.stype).copyto(target)
                else:
                    target[:] = array  # a synchronous copy; casts to the target's dtype

    def _after_init(self, keys: list) -> None:
        """Wait for every worker's init, as MXNet's dist stores do (a Barrier ends each init):
        with asynchronous rounds rank 0 could otherwise train, even finish, before another
        worker took its initial value. Not a worker that joined the job while it ran (the
        replacement of one that died, say): the others passed that barrier long ago, and their
        rounds now wait for it (found by a test: the two waited for each other)."""
        name = f"mxnet-init-{next(self._init_barriers)}"
        if self._agent.late:
            return
        self._call("init", keys, lambda: self._agent.barrier(name))

    def _settle(self) -> None:
        """Wait for the pushes and deferred pushpulls still in flight; raise the first one's error."""
        self._settle_pushes()
        pending, self._pending = self._pending, []
        self._pending_keys.clear()
        failed = None
        for handle, _views in pending:  # every one waited for: none may write into an array later
            try:
                handle.wait()
            except PslinkError as exc:
                failed = failed or (handle, exc)
        if failed is not None:
            handle, exc = failed
            raise translate(exc, f"pushpull of key {', '.join(map(repr, handle.keys))}") from exc

    def _settle_pushes(self) -> None:
        pushes, self._pushes = self._pushes, []
        for handle in pushes:
            try:
                handle.wait()
            except PslinkError as exc:
                raise translate(exc, f"push of key {', '.join(map(repr, handle.keys))}") from exc

    def _call(self, what: str, keys: list, fn):
        try:
            return fn()
        except PslinkError as exc:
            named = f"{what} of key {keys[0]!r}" if len(keys) == 1 else (f"{what} of keys {keys}" if keys else what)
            raise translate(exc, named) from exc


@KVStoreBase.register
class PSLink(PSLinkKVStore):
    """``mx.kv.create('pslink')``: BSP rounds, as ``dist_sync`` (unless the job runs ASP)."""


@KVStoreBase.register
class PSLink_Async(PSLinkKVStore):  # noqa: N801 - the registry files a class under its name, lower-cased
    """``mx.kv.create('pslink_async')``: every push applied at once, as ``dist_async``."""

    sync = "asp"


#: the names users give ``mx.kv.create`` and ``kvstore=``
NAMES = ("pslink", "pslink_async")
