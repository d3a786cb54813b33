"""The Agent: the worker-side library that pushes and pulls tensors through the service.

::

    agent = pslink.connect(job="mnist", rank=0, num_workers=2, master="tcp://127.0.0.1:7770")
    agent.init("w", w).wait()                  # rank 0's value becomes the master copy
    g = agent.pushpull("w", grad, average=True) # returns at once: a Handle
    g.wait()                                   # grad now holds the average over the workers

The Agent asks pMaster once where each key lives (its parts may sit on different Aggregators),
then talks to the Aggregators directly. Requests are asynchronous; any number may be in flight.
Payloads are sent from the caller's array and received straight into the ``out`` array, so the
arrays must stay untouched until their handle is done.

Threads: whoever waits drives the I/O. ``Handle.wait`` reads the sockets on the calling thread
(spinning briefly before it blocks), because handing a reply from an I/O thread to a waiting
thread costs more than a whole round trip on a virtual machine. A background thread drives only
when nobody waits: for handles with callbacks, heartbeats and liveness probes.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Any, Sequence

import numpy as np

from pslink.config import (
    DEFAULT_MASTER,
    DEFAULT_TIMEOUT,
    ENV_JOB,
    ENV_MASTER,
    ENV_MAX_WORKERS,
    ENV_NUM_WORKERS,
    ENV_PARTITION_BYTES,
    ENV_RANK,
    ENV_TIMEOUT,
    resolve_float,
    resolve_int,
    resolve_str,
    resolve_token,
)
from pslink.core import hosts
from pslink.core.agent.keys import MAX_MOVES, WIRE_NAMES, KeyInfo, Link, PartInfo, PartRequest, as_array, check_key
from pslink.core.agent.driving import Driving
from pslink.core.agent.failover import Failover
from pslink.core.agent.master_link import MasterLink
from pslink.core.agent.task_requests import TaskRequests
from pslink.core.faults import Faults
from pslink.core.agent.handle import Handle
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, FLOAT_DTYPES, STATE_OPS, HeaderTemplate, Limits, Op, decode, encode
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.transport import DISCARD, Connection, Lent, Transports
from pslink.errors import (
    ClosedError,
    ConfigError,
    MovedError,
    PeerError,
    ProtocolError,
    PslinkError,
    ShapeMismatchError,
    error_from_code,
)

log = logging.getLogger(__name__)
_AVERAGE = {"avg": True}  # a pull's header field: the Aggregator may answer the average
_OP_NAMES = {op: op.name.lower() for op in Op}  # an enum's name is a property: slow on every request
_REPLY, _ERROR, _PONG, _STATE_GET = Op.REPLY, Op.ERROR, Op.PONG, Op.STATE_GET  # (and so is a member's lookup)


class Agent(TaskRequests, Failover, MasterLink, Driving):
    """A worker's connection to the parameter service. See :func:`pslink.connect`."""

    def __init__(
        self,
        job: str,
        rank: int,
        num_workers: int,
        master: str = DEFAULT_MASTER,
        *,
        token: bytes | str | None = None,
        mode: str | None = None,
        optimizer: dict | None = None,
        partition_bytes: int | None = None,
        sync: str | None = None,
        servers: int | None = None,
        max_workers: int | None = None,
        staleness: int | None = None,
        straggler_timeout: float | None = None,
        replication: int | None = None,
        checkpoint: str | None = None,
        checkpoint_every: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        resend_timeout: float | None = None,
        failover: bool = True,
        faults: Faults | None = None,
        peer_timeout: float = 10.0,
        probe_interval: float = 0.5,
        heartbeat_interval: float = 2.0,
        connect_timeout: float = 10.0,
        rejoin: bool = False,
        spin: float = 100e-6,
        idle_poll: float = 0.002,
        transports: Transports | None = None,
        limits: Limits = DEFAULT_LIMITS,
        clock=time.monotonic,
    ):
        self.job, self.rank, self.num_workers, self.master_address = job, rank, num_workers, master
        self.timeout = timeout
        self.faults = faults if faults is not None else Faults.from_env()
        if self.faults is not None:
            self.faults.bind(f"{job}/{rank}")
        # A request unanswered this long is sent again (same id; Aggregators apply it once).
        # Messages over TCP are not lost, so it is off unless faults are injected.
        self.resend_timeout = resend_timeout if resend_timeout is not None else (1.0 if self.faults else None)
        self.failover = failover  # requests on a lost Aggregator go where pMaster moved its parts
        self.peer_timeout = peer_timeout
        self.probe_interval = probe_interval
        self.heartbeat_interval = heartbeat_interval
        self.connect_timeout = connect_timeout
        self.spin = spin
        self.idle_poll = idle_poll
        self.limits = limits
        self.clock = clock
        self.transports = transports or Transports()
        self._own_transports = transports is None
        self.host_id = hosts.host_id()  # pMaster places the job's parts and replicas by hosts
        self._reactor = Reactor(f"agent {job}/{rank}", clock)
        self._endpoint = RpcEndpoint(self._reactor, self._on_master_request, limits, on_close=self._on_master_lost)
        self._master: RpcPeer | None = None
        self._master_lock = threading.Lock()
        self._reconnecting = False
        self._links: dict[str, Link] = {}
        self._conn_links: dict[Connection, Link] = {}
        self._link_lock = threading.Lock()
        self._keys: dict[Any, KeyInfo] = {}
        self._pending: dict[int, PartRequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._bg_cv = threading.Condition(self._lock)
        self._waiters = 0
        self._async = 0
        self._activity = clock()  # last submit or wait by a user thread
        # Iteration timing for pMaster's profiler: the first key this worker pushes is pushed once
        # per iteration, so the time between its pushes is the iteration duration.
        self._reference_key: Any = None
        self._reference_time: float | None = None
        self._iterations: list[float] = []
        self._closed = False
        self.token: bytes = resolve_token(token) or b""
        config = {}
        if mode is not None:
            config["mode"] = mode
        if optimizer is not None:
            config["optimizer"] = optimizer
            config.setdefault("mode", "optimizer")
        if partition_bytes is None and os.environ.get(ENV_PARTITION_BYTES, "").strip():
            # Smaller parts pipeline better across a slow link (a part's answer crosses back only
            # once it crossed); the job's first worker sets it for every worker.
            partition_bytes = resolve_int(None, "partition_bytes", ENV_PARTITION_BYTES, 8)
        if partition_bytes is not None:
            config["partition_bytes"] = partition_bytes
        if sync is not None:
            config["sync"] = sync
        elif staleness:
            config["sync"] = "ssp"
        for name, value in (("max_workers", max_workers), ("staleness", staleness),
                            ("straggler_timeout", straggler_timeout), ("replication", replication),
                            ("checkpoint", checkpoint), ("checkpoint_every", checkpoint_every)):
            if value is not None:
                config[name] = value
        if servers is not None:
            config["servers"] = servers
        try:
            self.settings = self._register(config, token=self.token or None, rejoin=rejoin)
        except BaseException:
            self._release_io()  # a refused or failed registration leaves nothing open behind
            raise
        self.token = self.settings["token"]
        # Elastic membership: a worker registered while its job ran joins each key before use.
        self._late = bool(self.settings.get("late"))
        self._joined: set = set()
        self._members: dict = dict(self.settings.get("membership") or {})
        self.epoch = self._members.get("epoch", 0)  # the job's membership epoch, as replies last said
        self.dropped_pushes = 0  # pushes that came after their round closed without them (stragglers')
        # key -> (rounds of updates lost, checkpoint round) when it restarted from a checkpoint (no replica)
        self.rounds_lost: dict = {}
        self.mode: str = self.settings["mode"]
        self.sync: str = self.settings["sync"]
        self.partition_bytes: int = self.settings["partition_bytes"]
        self._reactor.call_later(heartbeat_interval, self._heartbeat)
        self._reactor.call_later(probe_interval, self._probe)
        self._bg = threading.Thread(target=self._background, name=f"pslink-agent-{rank}", daemon=True)
        self._bg.start()

    def __repr__(self) -> str:
        return f"<Agent job={self.job!r} rank={self.rank}/{self.num_workers} master={self.master_address}>"

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- public API -----------------------------------------------------------------------------

    def init(self, key, array) -> Handle:
        """Declare ``key`` and, on rank 0, set its initial value. Call it on every worker: other
        ranks' values only check the shape, and their handles complete once rank 0's value is in."""
        return self._submit(Op.INIT, [key], [array], None, False)

    def push(self, key, array) -> Handle:
        """Contribute ``array`` to this worker's next round of ``key``."""
        return self._submit(Op.PUSH, [key], [array], None, False)

    def pull(self, key, out=None, average: bool = False) -> Handle:
        """Fetch the result of this worker's latest round of ``key`` (its initial value before
        any push) into ``out`` (allocated if None); ``average`` divides a sum by the number of
        workers that pushed."""
        return self._submit(Op.PULL, [key], None, [out], average)

    def pushpull(self, key, array, out=None, average: bool = False) -> Handle:
        """Push ``array`` and pull that round's result into ``out`` (may be ``array`` itself)."""
        return self._submit(Op.PUSHPULL, [key], [array], [out], average)

    def init_many(self, keys: Sequence, arrays: Sequence) -> Handle:
        return self._submit(Op.INIT, list(keys), list(arrays), None, False)

    def push_many(self, keys: Sequence, arrays: Sequence) -> Handle:
        return self._submit(Op.PUSH, list(keys), list(arrays), None, False)

    def pull_many(self, keys: Sequence, outs: Sequence | None = None, average: bool = False) -> Handle:
        keys = list(keys)
        return self._submit(Op.PULL, keys, None, list(outs) if outs is not None else [None] * len(keys), average)

    def pushpull_many(self, keys: Sequence, arrays: Sequence, outs: Sequence | None = None, average: bool = False) -> Handle:
        keys = list(keys)
        return self._submit(Op.PUSHPULL, keys, list(arrays), list(outs) if outs is not None else [None] * len(keys), average)

    def set_optimizer(self, optimizer: dict) -> None:
        """Have the Aggregators apply ``optimizer`` (plain data, see pslink.core.optim)."""
        body = self._master_call(Op.SET_OPTIMIZER, optimizer=optimizer)
        self.settings = body
        self.mode = body["mode"]

    def barrier(self, name: str = "barrier", timeout: float | None = None) -> dict:
        """Wait until every member of the job reached the barrier of this name (a member that
        leaves meanwhile is not waited for). Returns the members it released: ``{"ranks", "epoch"}``."""
        body = self._master_call(Op.BARRIER, timeout=timeout, name=name)
        self._update_membership(body)
        return body

    def close(self, leave: bool = True) -> None:
        """Leave the job (the job ends once every worker left) and release everything. With
        ``leave=False`` only release: for an Agent whose rank a new Agent of this process
        registered again (``rejoin``), which is the member now."""
        if self._closed:
            return
        if leave:
            try:
                self._master_call(Op.LEAVE, timeout=min(5.0, self.timeout))
            except PslinkError as exc:
                log.debug("agent %s/%s: leave failed: %s", self.job, self.rank, exc)
        with self._lock:
            self._closed = True
            self._bg_cv.notify_all()
        self._bg.join(5.0)
        self._fail_requests(list(self._pending), ClosedError(f"agent of job {self.job!r} rank {self.rank} closed"))
        self._release_io()

    def _release_io(self) -> None:
        with self._link_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.conn.close()
        if self._master is not None:
            self._master.conn.close()
        self._reactor.drain()  # carry out the connections' teardown
        self._reactor.close()
        if self._own_transports:
            self.transports.close()

    @property
    def late(self) -> bool:
        """True when this worker registered while its job was running (it joins keys under way)."""
        return self._late

    @property
    def closed(self) -> bool:
        return self._closed

    def key_info(self, key) -> dict | None:
        """Where a key lives, as pMaster placed it (None if this Agent has not used it)."""
        info = self._keys.get(key)
        if info is None:
            return None
        return {
            "shape": info.shape,
            "dtype": info.dtype_name,
            "round": info.round,
            "parts": [(p.index, p.start, p.stop, p.aggregator, p.address) for p in info.parts],
        }

    # -- submitting -----------------------------------------------------------------------------

    def _submit(self, op: Op, keys: list, arrays: list | None, outs: list | None, average: bool) -> Handle:
        if self._closed:
            raise ClosedError(f"agent of job {self.job!r} rank {self.rank} is closed")
        self._activity = self.clock()
        if len(keys) == 1 and not self._late:
            handle = self._submit_known(op, keys[0], arrays, outs, average)
            if handle is not None:
                return handle
        keys = [check_key(k) for k in keys]
        if len(keys) > 1 and len(set(keys)) != len(keys):
            raise ConfigError(f"keys of one call must be distinct, got {keys}")
        if arrays is not None and len(arrays) != len(keys):
            raise ConfigError(f"{len(keys)} keys but {len(arrays)} arrays")
        if outs is not None and len(outs) != len(keys):
            raise ConfigError(f"{len(keys)} keys but {len(outs)} outs")
        typed = [as_array(a, k) for k, a in zip(keys, arrays)] if arrays is not None else None
        infos = self._resolve(op, keys, typed, outs)
        if self._late:
            self._join(infos)
        flats = results = None
        if typed is not None:
            flats = [(a if a.flags.c_contiguous else np.ascontiguousarray(a)).reshape(-1) for a, _ in typed]
        if outs is not None:
            results = [self._out_array(info, out, average) for info, out in zip(infos, outs)]
        return self._issue(op, keys, infos, flats, results, average)

    def _submit_known(self, op: Op, key, arrays: list | None, outs: list | None, average: bool) -> Handle | None:
        """One key this Agent already knows, given numpy arrays of its shape and dtype: the common
        case of a training step (and of every ps-lite request), without the lists, lookups and
        conversions of the batched path. None for anything else: the batched path takes it, and
        names what is wrong."""
        info = self._keys.get(key) if type(key) is int or type(key) is str else None
        if info is None:
            return None
        flats = results = None
        if arrays is not None:
            array = arrays[0]
            if (type(array) is not np.ndarray or array.shape != info.shape or not array.flags.c_contiguous
                    or WIRE_NAMES.get(array.dtype) != info.dtype_name):
                return None
            flats = [array if array.ndim == 1 else array.reshape(-1)]
        if outs is not None:
            out = outs[0]
            if (type(out) is not np.ndarray or out.shape != info.shape or not out.flags.c_contiguous
                    or not out.flags.writeable or WIRE_NAMES.get(out.dtype) != info.dtype_name
                    or (average and info.dtype_name not in FLOAT_DTYPES)):
                return None
            results = [out]
        return self._issue(op, [key], [info], flats, results, average)

    def _issue(self, op: Op, keys: list, infos: list[KeyInfo], flats: list | None, results: list | None,
               average: bool) -> Handle:
        """Count the round, make the handle and send every part: where both submit paths end."""
        with self._lock:
            if op == Op.PUSH or op == Op.PUSHPULL:
                for info in infos:
                    info.round += 1
                self._time_iteration(keys)
            rounds = [info.round for info in infos]
        single = len(keys) == 1
        total_parts = len(infos[0].parts) if single else sum(len(info.parts) for info in infos)
        result = None if results is None else (results[0] if single else results)
        handle = Handle(self, _OP_NAMES[op], keys, result, total_parts, rounds[0] if single else 0)
        # An init's value comes from the job's first rank (rank 0, or the lowest left if it has gone).
        send_payload = flats is not None and (op != Op.INIT or self.rank == 0 or (
            not self._late and self.rank == min(self._members.get("ranks") or [0])))
        for i, info in enumerate(infos):
            flat_out = None
            if results is not None:
                flat_out = results[i]
                if flat_out.ndim != 1:
                    flat_out = flat_out.reshape(-1)
            payload = flats[i] if send_payload else None
            for part in info.parts:
                self._send_part(handle, op, info, part, rounds[i], payload, flat_out, average)
        return handle

    def _time_iteration(self, keys: list) -> None:
        """Called under the lock for every push: note an iteration each time the reference key comes
        round again."""
        if self._reference_key is None:
            self._reference_key = keys[0]
        if self._reference_key in keys:
            now = self.clock()
            if self._reference_time is not None:
                self._iterations.append(now - self._reference_time)
                del self._iterations[:-1000]  # pMaster missed a heartbeat or two: keep the latest
            self._reference_time = now

    def _send_part(self, handle, op, info: KeyInfo, part: PartInfo, round_: int, payload, flat_out, average,
                   moves: int = 0) -> None:
        nbytes = (part.stop - part.start) * info.dtype.itemsize
        aggregator, address = part.where  # once: another thread may move the part meanwhile
        handle._waiting_on[aggregator] = address
        try:
            link = self._link(aggregator, address)
        except PslinkError as exc:
            if not self.failover:
                self._complete(handle, exc)
                return
            log.warning("agent %s/%s: cannot connect to aggregator %s at %s: %s", self.job, self.rank,
                        aggregator, address, exc.message)
            # Gone (see _transmit): named after the Aggregator tried, not where the part may be by now.
            link = Link(aggregator, address, None, self.clock(), exc.message)
        rid = next(self._ids)
        dest = array = None
        whole = part.start == 0 and part.stop == info.numel
        if flat_out is not None:
            array = flat_out if whole else flat_out[part.start : part.stop]
            dest = memoryview(array).cast("B")
        request = self._pending[rid] = PartRequest(handle, link, nbytes, dest, array, average, op, info, part, round_,
                                                    payload, flat_out, moves)
        link.pending.add(rid)
        template = part.headers.get((op, average))
        if template is None:
            template = part.headers[(op, average)] = HeaderTemplate(
                op, job=self.job, tok=self.token, rank=self.rank, key=info.key, part=part.index,
                dtype=info.dtype_name, shape=list(info.shape), span=[part.start, part.stop],
                **_AVERAGE if average else {},
            )
        header = template.make(rid, round_)
        if payload is None:
            self._transmit(rid, request, [header])
        else:
            self._transmit(rid, request, [header, payload if whole else payload[part.start : part.stop]])

    def _transmit(self, rid: int, request: PartRequest, frames: list) -> None:
        request.frames, request.sent = frames, self.clock()
        link = request.link
        try:
            if link.conn is None:
                raise PeerError(link.error or "not connected")
            if self.faults is not None:
                self.faults.send(link.conn, frames)
            else:
                link.conn.send(frames)
        except PslinkError as exc:
            # The Aggregator is gone (maybe not noticed yet): ask where the part went.
            self._link_lost(link, PeerError(f"cannot reach aggregator {link.name} at {link.address}: {exc.message}"),
                            [rid])

    def _out_array(self, info: KeyInfo, out, average: bool) -> np.ndarray:
        if average and info.dtype_name not in FLOAT_DTYPES:
            raise ConfigError(f"key {info.key!r}: average needs a floating dtype, the key is {info.dtype_name}")
        if out is None:
            return np.empty(info.shape, info.dtype)
        array, name = as_array(out, info.key)
        if array.shape != info.shape or name != info.dtype_name:
            raise ShapeMismatchError(
                f"key {info.key!r}: out has shape {array.shape} {name}, but the key has {info.describe()}",
                key=info.key,
            )
        if not array.flags.c_contiguous or not array.flags.writeable:
            raise ConfigError(f"key {info.key!r}: out must be a writable C-contiguous array")
        return array

    def _resolve(self, op: Op, keys: list, typed: list | None, outs: list | None) -> list[KeyInfo]:
        """Key infos for ``keys``, asking pMaster (one batched LOOKUP) for those not known yet."""
        infos: list[KeyInfo | None] = []
        missing = []
        intent = {Op.INIT: "init", Op.PULL: "pull"}.get(op, "push")
        for i, key in enumerate(keys):
            shape = dtype = None
            if typed is not None:
                shape, dtype = typed[i][0].shape, typed[i][1]
            elif outs is not None and outs[i] is not None:
                out, dtype = as_array(outs[i], key)
                shape = out.shape
            info = self._keys.get(key)
            if info is not None and shape is not None and (tuple(shape) != info.shape or dtype != info.dtype_name):
                error = ShapeMismatchError(
                    f"key {key!r} of job {self.job!r}: rank {self.rank} uses shape {tuple(shape)} {dtype}, "
                    f"but rank {info.declared_by} declared it as {info.describe()}",
                    key=key, shapes=[list(shape), list(info.shape)], ranks=[self.rank, info.declared_by],
                )
                self._abort_key(info, error)
                raise error
            infos.append(info)
            if info is None:
                item = {"key": key, "intent": intent}
                if shape is not None:
                    item.update(shape=[int(d) for d in shape], dtype=dtype)
                missing.append(item)
        if missing:
            body = self._master_call(Op.LOOKUP, items=missing)
            for spec in body["keys"]:
                self._keys.setdefault(spec["key"], KeyInfo(spec))
            infos = [self._keys[k] for k in keys]
        return infos  # type: ignore[return-value]

    def _abort_key(self, info: KeyInfo, error: PslinkError) -> None:
        """Tell the key's Aggregators, so the other workers waiting on it fail now, not later."""
        for part in info.parts:
            try:
                link = self._link(part.aggregator, part.address)
                link.conn.send([encode(Op.ABORT, id=0, job=self.job, tok=self.token, rank=self.rank,
                                       key=info.key, part=part.index, msg=error.message, code=error.code)])
            except PslinkError:
                pass

    # -- connections ------------------------------------------------------------------------------

    def _link(self, name: str, address: str) -> Link:
        link = self._links.get(name)
        if link is not None and not link.conn.closed:
            return link
        with self._link_lock:
            link = self._links.get(name)
            if link is None or link.conn.closed or link.address != address:
                conn = self.transports.connect(address, self._reactor, self, self.limits, self.connect_timeout)
                link = Link(name, address, conn, self.clock())
                self._links[name] = link
                self._conn_links[conn] = link
            return link

    # -- receiving (on the driving thread) --------------------------------------------------------

    def on_accept(self, conn) -> None:  # pragma: no cover - an Agent listens nowhere
        conn.close()

    def on_header(self, conn, raw, sizes):
        try:
            header = decode(raw, sizes, self.limits)
        except ProtocolError as exc:
            log.warning("agent %s/%s: bad message from %s: %s", self.job, self.rank, conn.peer, exc)
            return (None, exc, None), DISCARD
        if header["op"] is _REPLY and sizes:
            pending = self._pending.get(header["id"])
            if pending is not None and pending.op is _STATE_GET:
                if any(size != pending.nbytes for size in sizes):
                    return (header, ProtocolError(f"state from {conn.peer} carries frames of {list(sizes)} bytes; "
                                                  f"{pending.nbytes} each were expected"), None), DISCARD
                return (header, None, None), None  # the transport allocates
            if pending is None or pending.dest is None:
                return (header, None, None), DISCARD  # a late reply, or a payload nobody asked for
            if sizes[0] != pending.nbytes:
                error = ProtocolError(
                    f"reply from {conn.peer} carries {sizes[0]} bytes; {pending.nbytes} were expected"
                )
                return (header, error, None), DISCARD
            if pending.average and not header.get("avg") and header.get("n", 0) > 1:
                # A sum to divide: read it where it lies (a shared-memory ring) and divide it on
                # the way into ``out``, instead of copying it there and dividing it in place.
                lend = Lent([pending.dest])
                return (header, None, lend), lend
            return (header, None, None), [pending.dest]
        return (header, None, None), None

    def on_message(self, conn, state, payloads) -> None:
        header, error, lend = state
        link = self._conn_links.get(conn)
        if link is not None:
            link.last_heard = self.clock()
            link.ping_sent = None
        if header is None or header["op"] is _PONG:
            return
        rid = header["id"]
        request = self._pending.pop(rid, None)
        if request is None:
            return
        request.link.pending.discard(rid)
        if error is None and header["op"] is _ERROR:
            error = error_from_code(header["code"], header["msg"], header.get("details"))
        if isinstance(error, MovedError) and request.moves < MAX_MOVES:
            # The task migrated before this request got there: follow it, same round, same data.
            self._moved(request.part, error.details)
            if request.op in STATE_OPS:
                self._send_state(request.handle, request.op, request.info, request.part, request.array,
                                 request.moves + 1)
                return
            self._send_part(request.handle, request.op, request.info, request.part, request.round,
                            request.payload, request.flat_out, request.average, request.moves + 1)
            return
        if error is None:
            if request.op in STATE_OPS:
                self._state_arrived(request, header, payloads)
            get = header.get
            epoch = get("ep")
            if epoch is not None and epoch > request.handle.epoch:
                request.handle.epoch = epoch
                if epoch > self.epoch:
                    self.epoch = epoch
            if get("dropped"):
                self.dropped_pushes += 1
            if get("lost"):
                self._rounds_lost(request.info.key, header["lost"])
            moved = get("moved")
            if moved:
                self._moved(request.part, {"agg": moved[0], "address": moved[1]})
            if request.average and not get("avg"):
                # An Aggregator averages a synchronous sum itself, once for every worker, unless
                # the sum comes through shared memory: then it is divided on its way in.
                n = get("n", 0)
                if lend is not None and lend.lent[0]:
                    np.divide(np.frombuffer(payloads[0], request.array.dtype), n, out=request.array)
                elif n > 1:
                    np.divide(request.array, n, out=request.array)
        self._complete(request.handle, error)

    @staticmethod
    def _moved(part: PartInfo, where: dict) -> None:
        """A part's task lives elsewhere now (the pull that closed its last round here said so)."""
        agg, address = where.get("agg"), where.get("address")
        if isinstance(agg, str) and isinstance(address, str):
            part.move(agg, address)

    def on_close(self, conn, exc) -> None:
        link = self._conn_links.pop(conn, None)
        if link is None:
            return
        with self._link_lock:
            if self._links.get(link.name) is link:
                del self._links[link.name]
        if link.pending:
            self._link_lost(link, exc)

    def _complete(self, handle: Handle, error: PslinkError | None) -> None:
        with self._lock:
            callbacks = handle._part_done(error)
            if callbacks:
                self._async -= 1
        for callback in callbacks:
            try:
                callback(handle)
            except Exception:
                log.exception("callback of %r failed", handle)

    def _fail_requests(self, rids: list[int], error: PslinkError) -> None:
        for rid in rids:
            request = self._pending.pop(rid, None)
            if request is not None:
                request.link.pending.discard(rid)
                self._complete(request.handle, error)

    def _add_callback(self, handle: Handle, fn) -> bool:
        with self._lock:
            if handle.done():
                return False
            if handle._callbacks is None:
                handle._callbacks = []
                self._async += 1
                self._bg_cv.notify()
            handle._callbacks.append(fn)
            return True

def connect(
    job: str | None = None,
    rank: int | None = None,
    num_workers: int | None = None,
    master: str | None = None,
    **options,
) -> Agent:
    """Join a job on the parameter service and return its :class:`Agent`.

    Each argument falls back to an environment variable (as ``pslink launch`` sets them):
    ``PSLINK_JOB``, ``PSLINK_RANK``, ``PSLINK_NUM_WORKERS``, ``PSLINK_MASTER`` (default
    tcp://127.0.0.1:7770), ``PSLINK_TOKEN`` and ``PSLINK_TIMEOUT``. Options: ``token``, ``mode``
    (``"sum"`` or ``"optimizer"``), ``optimizer`` (e.g. ``{"type": "sgd", "lr": 0.1}``),
    ``sync`` (``"bsp"``, the default; ``"ssp"`` with ``staleness`` s: a pull of round r is
    answered once round r - s closed; or ``"asp"``: pushes apply at once, pulls never wait),
    ``straggler_timeout`` (seconds a round may wait for its last pushes before it closes with
    those it has), ``max_workers`` (ranks up to it may join the running job; default
    ``num_workers``, also ``PSLINK_MAX_WORKERS``), ``replication`` (0, 1 or 2 replicas of every
    part on other Aggregators: the job survives losing that many without losing an update;
    bsp/ssp only), ``servers`` (how many parameter servers the
    job would ask for: it is profiled alone on that many Aggregators before pMaster packs it with
    others; default one per worker), ``rejoin`` (register a rank again as a newcomer: pMaster
    takes it out of the job and back in, in one step; an Agent of this process that held the
    rank is then closed with ``close(leave=False)``), ``partition_bytes``, ``timeout``,
    ``peer_timeout`` and the other :class:`Agent` settings. Job settings are fixed by the worker that creates the job.
    """
    job = resolve_str(job, "job", ENV_JOB)
    rank = resolve_int(rank, "rank", ENV_RANK, minimum=0)
    num_workers = resolve_int(num_workers, "num_workers", ENV_NUM_WORKERS, minimum=1)
    max_workers = options.get("max_workers")
    if max_workers is None and os.environ.get(ENV_MAX_WORKERS):
        max_workers = options["max_workers"] = resolve_int(None, "max_workers", ENV_MAX_WORKERS, minimum=1)
    if rank >= max(num_workers, max_workers or 0):
        raise ConfigError(f"rank {rank} is out of range for {max(num_workers, max_workers or 0)} workers")
    master = resolve_str(master, "master", ENV_MASTER, default=DEFAULT_MASTER)
    options["timeout"] = resolve_float(options.get("timeout"), "timeout", ENV_TIMEOUT, DEFAULT_TIMEOUT)
    return Agent(job, rank, num_workers, master, **options)
