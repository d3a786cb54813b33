"""How an Agent sends: a request's keys checked and looked up (one batched LOOKUP for the new
ones), its round counted, its handle made, and each part sent to the Aggregator it lives on (a
tensor's span, or a table's shard: pslink.core.agent.tables). Also what a request that met a
moved task, or a lost Aggregator, is sent again through (``send_part``)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import numpy as np

from pslink.core.agent.handle import Handle, Handles
from pslink.core.agent.iterations import Iterations
from pslink.core.agent.keys import WIRE_NAMES, KeyInfo, PartInfo, as_array, check_key, out_array
from pslink.core.agent.requests import Link, PartRequest, Requests
from pslink.core.agent.seat import Seat
from pslink.core.agent.failover import Failover
from pslink.core.agent.lookup import KeyLookup
from pslink.core.agent.tables import table_frames
from pslink.core.agent.task_requests import TaskRequests
from pslink.core.compression import Quantized, Residuals
from pslink.core.compression import check as check_compression
from pslink.core.wire.protocol import FLOAT_DTYPES, TABLE_OPS, HeaderTemplate, Op
from pslink.errors import ConfigError, PslinkError, ShapeMismatchError

log = logging.getLogger("pslink.core.agent")
_AVERAGE = {"avg": True}  # a pull's header field: the Aggregator may answer the average
_PUSHES = (Op.PUSH, Op.PUSHPULL)  # requests that tell the Aggregator the worker's compute before them
_OP_NAMES = {op: op.name.lower() for op in Op}  # an enum's name is a property: slow on every request


class Sender:
    """An Agent's outgoing requests. ``keys`` is the Agent's table of keys (new ones learnt through
    ``lookup``), ``lock`` guards their rounds; ``tasks`` joins the keys of a worker that came late
    and aborts a key pushed with the wrong shape; ``failover`` says whether a part whose
    Aggregator cannot be reached waits for its relocation (else it fails). ``compression``: the
    job's gradient compression (pslink.core.compression), or None."""

    def __init__(self, seat: Seat, keys: dict[Any, KeyInfo], lock: threading.Lock, iterations: Iterations,
                 handles: Handles, requests: Requests, lookup: KeyLookup, tasks: TaskRequests, failover: Failover,
                 clock: Callable[[], float], compression=None):
        self.seat, self.keys, self.lock, self.iterations = seat, keys, lock, iterations
        self.handles, self.requests, self.lookup, self.clock = handles, requests, lookup, clock
        self.tasks, self.failover = tasks, failover
        self.residuals: Residuals | None = None  # 2-bit gradient compression, when set (pslink.core.compression)
        self.payload_bytes = 0  # payload bytes sent (pushes), for measuring compression
        # Host-local reduce (pslink.core.agent.host_reduce): this worker's part in its host's sum,
        # the leader's or a follower's; None pushes to the pool directly.
        self.host = None
        self.elect = None  # after a leader was lost: starts this worker's part under the next one
        self.followers: dict = {}  # a leader's link name -> this worker's follower of it (its loss is handled there)
        self.set_compression(compression)

    def set_compression(self, params) -> None:
        threshold = check_compression(params)
        self.residuals = Residuals(threshold) if threshold is not None else None

    def submit(self, op: Op, keys: list, arrays: list | None, outs: list | None, average: bool) -> Handle:
        """A request of ``keys`` (checked, looked up with pMaster where new), sent part by part."""
        late = self.tasks.late
        if len(keys) == 1 and not late:
            handle = self.submit_known(op, keys[0], arrays, outs, average)
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
        infos = self.resolve(op, keys, typed, outs)
        if late:
            self.tasks.join(infos)
        flats = results = None
        if typed is not None:
            flats = [(a if a.flags.c_contiguous else np.ascontiguousarray(a)).reshape(-1) for a, _ in typed]
        if outs is not None:
            results = [out_array(info, out, average) for info, out in zip(infos, outs)]
        return self.issue(op, keys, infos, flats, results, average)

    def submit_known(self, op: Op, key, arrays: list | None, outs: list | None, average: bool) -> Handle | None:
        """One key this Agent already knows, given numpy arrays of its shape and dtype: the common
        case of a training step (and of every ps-lite request), without the lists, lookups and
        conversions of the batched path. None for anything else: the batched path takes it, and
        names what is wrong."""
        info = self.keys.get(key) if type(key) is int or type(key) is str else None
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
        return self.issue(op, [key], [info], flats, results, average)

    def issue(self, op: Op, keys: list, infos: list[KeyInfo], flats: list | None, results: list | None,
              average: bool, covers: list | None = None, at_round: int | None = None) -> Handle:
        """Count the round, make the handle and send every part: where both submit paths end.
        A host's leader sends its host's sums with ``covers`` (the ranks they stand for) at the
        round ``at_round`` of its local round, counted already."""
        if self.elect is not None and covers is None:  # (on the caller's thread: it may ask pMaster)
            elect, self.elect = self.elect, None
            self.host = elect()
        host = self.host
        if host is not None and (covers is not None or (op != Op.PUSH and op != Op.PUSHPULL)
                                 or self.residuals is not None):
            host = None  # not through the host's leader (pslink.core.agent.host_reduce)
        with self.lock:
            if at_round is not None:
                rounds = [at_round] * len(infos)
            else:
                if op == Op.PUSH or op == Op.PUSHPULL:
                    for info in infos:
                        info.round += 1
                    self.iterations.pushed(keys)
                rounds = [info.round for info in infos]
        if host is not None and host.leads:
            return host.own(op, keys, infos, flats, results, average, rounds)
        whole = None if host is None else host.part_of  # a follower sends a push whole, to its leader
        single = len(keys) == 1
        if whole is not None:
            total_parts = len(infos)
        else:
            total_parts = len(infos[0].parts) if single else sum(len(info.parts) for info in infos)
        result = None if results is None else (results[0] if single else results)
        handle = self.handles.new(_OP_NAMES[op], keys, result, total_parts, rounds[0] if single else 0,
                                  traced=covers is None)
        # An init's value comes from the job's first rank (rank 0, or the lowest left if it has gone).
        send_payload = flats is not None and (op != Op.INIT or self.seat.rank == 0 or (
            not self.tasks.late and self.seat.rank == min(self.seat.members.get("ranks") or [0])))
        for i, info in enumerate(infos):
            flat_out = None
            if results is not None:
                flat_out = results[i]
                if flat_out.ndim != 1:
                    flat_out = flat_out.reshape(-1)
            payload = flats[i] if send_payload else None
            residuals = self.residuals if payload is not None and (op == Op.PUSH or op == Op.PUSHPULL) \
                and info.dtype_name in FLOAT_DTYPES else None
            for part in info.parts if whole is None else (whole(info),):
                if residuals is not None:  # quantized once: a resend sends the same bytes
                    self.send_part(handle, op, info, part, rounds[i],
                                   residuals.quantize(info.key, part.index, payload[part.start:part.stop]), flat_out,
                                   average)
                    continue
                self.send_part(handle, op, info, part, rounds[i], payload, flat_out, average, covers=covers)
        return handle

    def send_part(self, handle, op, info: KeyInfo, part: PartInfo, round_: int, payload, flat_out, average,
                  moves: int = 0, covers: list | None = None) -> None:
        table = op in TABLE_OPS  # a table's shard (pslink.core.agent.tables): ids (and rows) in, rows out
        ids = (payload if op is Op.TABLE_PULL else payload[0]) if table else None
        nbytes = (part.stop - part.start if not table else ids.size * info.shape[1]) * info.dtype.itemsize
        aggregator, address = part.where  # once: another thread may move the part meanwhile
        handle._waiting_on[aggregator] = address
        try:
            link = self.requests.link(aggregator, address)
        except PslinkError as exc:
            if not self.failover.enabled:
                self.handles.complete(handle, exc)
                return
            log.warning("agent %s: cannot connect to aggregator %s at %s: %s", self.seat, aggregator, address,
                        exc.message)
            # Gone (see Requests.transmit): named after the Aggregator tried, not where the part may be by now.
            link = Link(aggregator, address, None, self.clock(), exc.message)
        dest = array = None
        whole = table or part.start == 0 and part.stop == info.numel
        if flat_out is not None:
            array = flat_out if whole else flat_out[part.start : part.stop]
            dest = memoryview(array).cast("B")
        request = PartRequest(handle, link, nbytes, dest, array, average, op, info, part, round_, payload, flat_out,
                              moves, covers)
        rid = self.requests.add(request)
        if table:
            self.requests.transmit(rid, request, table_frames(self.seat, op, info, part, rid, round_, payload))
            return
        quantized = type(payload) is Quantized
        threshold = payload.threshold if quantized else None
        form = (op, average, threshold) if covers is None else (op, average, threshold, tuple(covers))
        template = part.headers.get(form)
        if template is None:
            template = part.headers[form] = HeaderTemplate(
                op, **self.seat.fields(), key=info.key, part=part.index,
                dtype=info.dtype_name, shape=list(info.shape), span=[part.start, part.stop],
                **_AVERAGE if average else {}, **{"cmp": payload.threshold} if quantized else {},
                **{"cov": list(covers)} if covers is not None else {},
            )
        header = template.make(rid, round_, self.requests.burst_idle_ms if op in _PUSHES else None)
        if quantized:
            self.payload_bytes += payload.packed.nbytes
            self.requests.transmit(rid, request, [header, payload.packed])
            return
        if payload is not None:
            self.payload_bytes += (part.stop - part.start) * info.dtype.itemsize
        if payload is None:
            self.requests.transmit(rid, request, [header])
        else:
            self.requests.transmit(rid, request, [header, payload if whole else payload[part.start : part.stop]])

    def resolve(self, op: Op, keys: list, typed: list | None, outs: list | None) -> list[KeyInfo]:
        """Key infos for ``keys``, checked against the arrays given and asking pMaster (one batched
        LOOKUP) for those not known yet."""
        shapes: list = []
        for i, key in enumerate(keys):
            shape = dtype = None
            if typed is not None:
                shape, dtype = typed[i][0].shape, typed[i][1]
            elif outs is not None and outs[i] is not None:
                out, dtype = as_array(outs[i], key)
                shape = out.shape
            info = self.keys.get(key)
            if info is not None and shape is not None and (tuple(shape) != info.shape or dtype != info.dtype_name):
                error = ShapeMismatchError(
                    f"key {key!r} of job {self.seat.job!r}: rank {self.seat.rank} uses shape {tuple(shape)} {dtype}, "
                    f"but rank {info.declared_by} declared it as {info.describe()}",
                    key=key, shapes=[list(shape), list(info.shape)], dtypes=[dtype, info.dtype_name],
                    ranks=[self.seat.rank, info.declared_by],
                )
                if op == Op.PUSH or op == Op.PUSHPULL:
                    # Its round fails for every rank (they would wait for this one's push), and
                    # this rank counts it as pushed: the key goes on from the next round for all.
                    with self.lock:
                        info.round += 1
                        failed = info.round
                    self.tasks.abort_key(info, error, failed)
                raise error  # a pull or init joins no round: refused here, and nothing else changes
            shapes.append(None if shape is None else (shape, dtype))
        return self.lookup.infos(op, keys, shapes)
