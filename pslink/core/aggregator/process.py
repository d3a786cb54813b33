"""The Aggregator process: serves push/pull of any number of jobs and takes orders from pMaster.

A thin shell around :class:`~pslink.core.aggregator.core.AggregatorCore`: it validates each message
(:func:`pslink.core.wire.protocol.decode`), admits it (credential, shape), receives the payload
straight into the buffer the core names, and sends what the core answers. A malformed message gets
an error reply and is counted; a peer that breaks the framing is disconnected and counted; either
way everyone else keeps being served.

It composes :class:`~pslink.core.aggregator.copies.Copies` (task state to and from other
Aggregators) and :class:`~pslink.core.aggregator.master_link.MasterLink` (registration,
heartbeats). Run one with ``python -m pslink.core.aggregator --master tcp://host:port``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np

from pslink.core import hosts
from pslink.core.aggregator.core import AggregatorCore
from pslink.core.ratelog import Throttled
from pslink.core.aggregator.tasks import (Checkpoint, CloseLater, CopyOut, Follow, Replicate, Reply, Request, Summer, Task,
                                          WorkerDone)
from pslink.core.checkpoints import CheckpointWriter, part_path, read as read_checkpoint
from pslink.core.faults import Faults
from pslink.core.wire.loop import Reactor, ReactorThread
from pslink.core.memory import release_freed_memory
from pslink.core.compression import dequantize
from pslink.core.tables import ID_DTYPE
from pslink.core.wire.protocol import (DATA_OPS, DEFAULT_LIMITS, STATE_OPS, TABLE_OPS, Limits, Op, decode, encode,
                                        encode_error, peek_id)
from pslink.core.transport.rpc import RpcPeer
from pslink.core.transport.fused import MAX_FUSED_ITEMS, Cork, Unfused, fused_header, fused_message
from pslink.core.aggregator import failures
from pslink.core.aggregator.copies import Arriving, Copies, Rejected
from pslink.core.aggregator.master_link import DEFAULT_LEASE, MasterLink
from pslink.core.master_addresses import MasterAddresses
from pslink.core.aggregator.stalls import StallInspector, stall_threshold
from pslink.core.transport import DISCARD, Connection, Lent, Transports
from pslink.errors import (AbortedError, ConfigError, KeyStateError, PeerError, ProtocolError, PslinkError, ShapeMismatchError,
                           error_from_code)

log = logging.getLogger(__name__)
_TABLE_AS_DATA = {Op.TABLE_PUSH: Op.PUSH, Op.TABLE_PULL: Op.PULL, Op.TABLE_PUSHPULL: Op.PUSHPULL,  # rounds as for tensors
                  Op.TABLE_INIT: Op.INIT}
MAX_STALL_LINES = 8  # per scan: a whole job stalling is one story, not a line per key
FENCED_OPS = DATA_OPS | TABLE_OPS | STATE_OPS  # refused past the lease (MasterLink)


class Aggregator:
    """One Aggregator. ``start()`` runs it on a thread; ``serve_forever()`` on this one."""

    def __init__(
        self,
        master: str | None,
        listen: str = "tcp://127.0.0.1:0",
        *,
        name: str | None = None,
        transports: Transports | None = None,
        limits: Limits = DEFAULT_LIMITS,
        heartbeat_interval: float = 1.0,
        reconnect_interval: float = 0.5,
        orphan_timeout: float | None = 60.0,
        spin: float = 2e-3,
        summer: Summer | None = None,
        faults: Faults | None = None,
        advertise: str | None = None,
        interface: str | None = None,
        keep: bool = False,
        credential: str | None = None,
        stall_seconds: float | None = None,
        lease: float = DEFAULT_LEASE,
        clock=time.monotonic,
    ):
        self.name = name
        self.credential = credential  # the service's aggregator credential (pslink.core.credentials)
        self._bad_log = Throttled(log)  # bad input: one line per peer host and kind per interval
        self.keep = keep  # an operator's own: pMaster's scaling never stops it
        self.faults = faults if faults is not None else Faults.from_env()
        if self.faults is not None:
            self.faults.bind(name)
        self.reactor = Reactor(f"aggregator {name or ''}".strip(), clock)
        self.transports = transports or Transports()
        self._own_transports = transports is None
        self.limits = limits
        self.core = AggregatorCore(name or "aggregator", summer=summer, clock=clock)
        self.checkpoints = CheckpointWriter(name or "aggregator")
        self.master_address = master
        self.spin = spin
        self.clock = clock
        advertise, interface = hosts.settings(advertise, interface)
        # A bad pMaster list is refused before anything is bound (nothing to leak); the first
        # address tells which local address routes toward the service.
        toward = MasterAddresses.parse(master, "--master").current if master else None
        self.listener = self.transports.listen(listen, self.reactor, self, limits)
        try:
            # What workers and other Aggregators dial: never a wildcard, never loopback to
            # another host (pMaster refuses that at registration, naming the fix).
            self.address = hosts.advertised_address(self.listener.address, advertise=advertise, interface=interface,
                                                    toward=toward)
        except BaseException:
            self.listener.close()
            raise
        self.host_id = hosts.host_id()
        self.errors = 0  # bad messages and broken peers, reported to pMaster
        self.requests = 0
        self.fused = 0  # requests that came in FUSED messages (counted in ``requests`` too)
        self.busy = 0.0  # CPU seconds spent on tasks: the load pMaster sees (spinning is not work)
        self._slowdown: tuple[float, bool] = (0.0, False)
        self._cork: Cork | None = None  # while a FUSED request is handled: the replies to send fused
        self._busy_reported = (0.0, clock())
        self.connections: set[Connection] = set()
        self._last_message = clock()  # when the last message arrived: a copy waits for a quiet spell
        self._thread: ReactorThread | None = None
        self._stopped = False
        self.exit_code: int | None = None
        self.copies = Copies(self.core, self.transports, self.reactor, limits, name=lambda: self.name, clock=clock,
                             faults=self.faults, last_message=lambda: self._last_message,
                             replies_leaving=lambda: any(conn.sending() for conn in list(self.connections)),
                             reply=self._send,
                             carry_out=self._send_all, tell_master=self._tell_master)
        self.master = MasterLink(master or "", self.transports, self.reactor, limits, registration=self._registration,
                                 on_request=self._on_control, stats=self._stats, on_named=self._named,
                                 stop=self._stop, stopping=lambda: self.exit_code is not None, name=lambda: self.name,
                                 on_fenced=self._fence,
                                 clock=clock, heartbeat_interval=heartbeat_interval,
                                 reconnect_interval=reconnect_interval, orphan_timeout=orphan_timeout, lease=lease)
        # The stall inspector: rounds waiting longer than this for some rank are logged and reported.
        self.stalls = StallInspector(stall_threshold(stall_seconds))
        if self.stalls.threshold > 0:
            self.reactor.call_later(self.stalls.period, self._inspect)
        if master is not None:
            self.master.start()

    # -- what pMaster hears -----------------------------------------------------------------------

    @property
    def registered(self) -> threading.Event:
        """Set once pMaster answered this Aggregator's registration (either way)."""
        return self.master.registered

    @property
    def registration_error(self) -> ConfigError | None:
        """pMaster refused this Aggregator (it then stopped)."""
        return self.master.refusal

    @property
    def master_error(self) -> PslinkError | None:
        """Why pMaster was last unreachable."""
        return self.master.error

    def _registration(self) -> dict:
        """What pMaster hears at each (re)registration: the parts held, and the moves it may not
        have stored (it restarted in between): ``moved``, parts handed over (or about to be) to
        another Aggregator (and whether the copy landed); ``arrived``, parts that came here by a move,
        with their source."""
        tasks, moved, arrived = [], [], []
        for ident, task in self.core.tasks.items():
            target = task.migrate_to or (task.follower.target if task.follower is not None else None)
            if target is not None:  # (its copy has not landed; or its target still follows it)
                moved.append([*ident, target[0], False])
            else:
                tasks.append(list(ident))
                if task.arrived_from:
                    arrived.append([*ident, task.arrived_from])
        moved += [[*ident, where[0], True] for ident, where in self.core.moved.items() if ident not in self.core.tasks]
        return dict(address=self.address, pid=os.getpid(), host=hosts.host_name(), host_id=self.host_id, tasks=tasks,
                    moved=moved, arrived=arrived,
                    **({"agg": self.name} if self.name else {}), **({"keep": True} if self.keep else {}),
                    **({"cred": self.credential} if self.credential else {}))

    def _fence(self, parts: list) -> set:
        idents, replies = failures.fence(self.core.tasks, parts, self.name)
        self._send_all(replies)
        return idents

    def _named(self, name: str) -> None:
        self.name = name
        self.core.name = name
        self.reactor.name = f"aggregator {name}"
        log.info("aggregator %s serving at %s", name, self.address)

    def _stats(self) -> dict:
        busy, since = self._busy_reported
        now = self.clock()
        load = (self.busy - busy) / (now - since) if now > since else 0.0
        self._busy_reported = (self.busy, now)
        jobs = self.core.stats()
        for job, count in self.stalls.counts.items():
            if job in jobs:
                jobs[job]["stalls"] = count
        return {"jobs": jobs, "errors": self.errors, "requests": self.requests, "fused": self.fused,
                "costs": self.core.costs(),
                "load": round(min(1.0, load), 4), "cycle": self.core.budget.describe() if self.core.budget else None,
                "stalled": self.stalls.report(now),
                "dropped_replicas": self.core.moves.dropped_report(),
                "replicas_with_state": self.core.moves.replicas_with_state()}

    def _inspect(self) -> None:
        """Log each round that newly waits longer than the threshold, naming the missing ranks."""
        try:
            now = self.clock()
            new = self.stalls.scan(self.core.tasks.values(), now)
            for stall in new[:MAX_STALL_LINES]:
                log.warning("aggregator %s: stalled: %s", self.name, stall.describe(now))
            if len(new) > MAX_STALL_LINES:
                log.warning("aggregator %s: %d more rounds stalled (pslink service status lists them)", self.name,
                            len(new) - MAX_STALL_LINES)
        finally:
            self.reactor.call_later(self.stalls.period, self._inspect)

    def _stop(self, status: int) -> None:
        self.exit_code = status
        self.reactor.stop()

    def _tell_master(self, op: Op, task: Task) -> None:
        self.master.notify(op, agg=self.name, job=task.job.job, key=task.key, part=task.part)

    # -- running ------------------------------------------------------------------------------

    def start(self) -> "Aggregator":
        self._thread = ReactorThread(self.reactor, self.spin).start()
        return self

    def serve_forever(self) -> None:
        self.reactor.run_forever(self.spin)

    def stop(self) -> None:
        """Stop serving and close every socket (for ``start()``-ed Aggregators). Once."""
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._thread.stop()
        else:
            self.reactor.stop()
        # The loop no longer runs: close on this thread and carry out the posted teardowns.
        self.listener.close()
        for conn in list(self.connections):
            conn.close()
        self.master.close()
        self.reactor.drain()
        self.checkpoints.flush()
        self.core.summer.close()
        self.reactor.close()
        if self._own_transports:
            self.transports.close()

    def _restore(self, task: Task) -> None:
        """pMaster restarts ``task`` here from its checkpoint (its Aggregator died, no replica)."""
        job = task.job
        path = part_path(job.checkpoint, job.job, task.key, task.part)
        try:
            state, arrays = read_checkpoint(path)
            self.core.moves.restore(task, state, arrays)
        except (PslinkError, KeyError, ValueError) as exc:
            reason = exc.message if isinstance(exc, PslinkError) else f"unreadable: {exc!r}"
            error = KeyStateError(f"{task.name}: its Aggregator is gone with no replica, and its checkpoint could "
                                  f"not be restored ({reason})", job=job.job, key=task.key)
            log.error("aggregator %s: %s", self.name, error.message)
            self._send_all(self.core.abort(task, error))
            return
        log.error("aggregator %s: %s restarted from its checkpoint of round %d; the rounds since are lost",
                  self.name, task.name, task.restored)

    def slowdown(self, seconds: float, busy: bool = False) -> None:
        """Chaos hook: after every data request, stall ``seconds`` (``busy``: burning CPU, as a
        CPU-starved host; otherwise sleeping, as a congested network). 0 ends it."""
        self._slowdown = (max(0.0, seconds), busy)

    def _stall(self, task: Task) -> None:
        seconds, busy = self._slowdown
        if not seconds:
            return
        if busy:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(seconds)

    def freeze(self) -> None:
        """Stop driving the loop while keeping every socket open: to its peers the Aggregator
        hangs (as under SIGSTOP). For tests of timeouts; only for ``start()``-ed Aggregators."""
        if self._thread is not None:
            self._thread.stop()

    # -- data path: transport handler -----------------------------------------------------------

    def on_accept(self, conn: Connection) -> None:
        self.connections.add(conn)

    def on_close(self, conn: Connection, exc: BaseException | None) -> None:
        self.connections.discard(conn)
        self.core.fail_origin(conn)
        if isinstance(exc, ProtocolError):
            self.errors += 1
            self._bad_log.warning(conn.peer, "dropped", "aggregator %s dropped %s: %s", self.name, conn.peer, exc)

    def on_header(self, conn: Connection, raw: bytes, sizes: tuple[int, ...]):
        self.requests += 1
        self._last_message = self.clock()
        try:
            header = decode(raw, sizes, self.limits)
        except ProtocolError as exc:
            self.errors += 1
            self._bad_log.warning(conn.peer, "bad", "aggregator %s: bad message from %s: %s", self.name, conn.peer, exc)
            return Rejected(peek_id(raw), exc), DISCARD
        if header["op"] is Op.FUSED:
            return self._fused_header(conn, header, sizes)
        return self._header(conn, header, sizes)

    def _fused_header(self, conn: Connection, header: dict, sizes: tuple[int, ...]):
        """A FUSED message's items, each admitted as a message of its own: only data requests, and
        all of one job (an Agent fuses only its own requests; anything else is refused item by item)."""
        jobs: list[str] = []

        def item(conn: Connection, raw: bytes, item_sizes: tuple[int, ...]):
            try:
                header = decode(raw, item_sizes, self.limits)
            except ProtocolError as exc:
                self.errors += 1
                return Rejected(peek_id(raw), exc), DISCARD
            if header["op"] not in DATA_OPS:
                return Rejected(header.get("id", 0), ProtocolError(
                    f"{header['op'].name} cannot travel in a FUSED message (data requests only)")), DISCARD
            if not jobs:
                jobs.append(header["job"])
            elif header["job"] != jobs[0]:
                return Rejected(header["id"], ProtocolError(
                    f"a FUSED message carries requests of jobs {jobs[0]!r} and {header['job']!r}; one job per "
                    "message")), DISCARD
            return self._header(conn, header, item_sizes)

        try:
            unfused = fused_header(conn, header, sizes, item)
            self.fused += len(unfused[0].items)
            self.requests += len(unfused[0].items) - 1
            return unfused
        except ProtocolError as exc:
            self.errors += 1
            self._bad_log.warning(conn.peer, "bad", "aggregator %s: bad message from %s: %s", self.name, conn.peer, exc)
            raws = [raw for raw in header["items"] if type(raw) is bytes][:MAX_FUSED_ITEMS]
            return Unfused([(Rejected(peek_id(raw), exc), 0) for raw in raws]), DISCARD

    def _header(self, conn: Connection, header: dict, sizes: tuple[int, ...]):
        op = header["op"]
        if op in FENCED_OPS and (fenced := self.master.fenced(self.clock(), header)) is not None:
            return Rejected(header["id"], fenced), DISCARD  # past its lease: the Agent asks pMaster
        if op in DATA_OPS:
            try:
                task = self.core.admit(header)
            except ShapeMismatchError as exc:
                # Both sides of a mismatch must hear of it: poison the key for every waiter.
                task = self.core.find(header)
                if task is not None:
                    self._send_all(self.core.abort(task, exc))
                return Rejected(header["id"], exc), DISCARD
            except PslinkError as exc:
                return Rejected(header["id"], exc), DISCARD
            started = time.thread_time()  # the task's CPU time counts from its header
            if header["rnd"] > task.heard_round and (op is Op.PUSH or op is Op.PUSHPULL):
                # A round's first header: its push's bytes may queue behind other keys' on the
                # workers' link for a good part of the exchange; its header comes near its start.
                task.heard_round, task.heard_at = header["rnd"], self._last_message
            if sizes and header.get("cmp") is not None:  # 2-bit: received as is, dequantized in on_message
                packed = np.empty(sizes[0], np.uint8)
                return (header, task, packed, started, None), [memoryview(packed)]
            if sizes:
                buffer = self.core.receive_buffer(task)
                dest = memoryview(buffer).cast("B")
                if op is Op.PUSH or op is Op.PUSHPULL:  # may only be added: read it where it lies
                    lend = Lent([dest])
                    return (header, task, buffer, started, lend), lend
                return (header, task, buffer, started, None), [dest]
            return (header, task, None, started, None), None
        if op in TABLE_OPS:
            try:
                task = self.core.admit(header)
            except PslinkError as exc:
                return Rejected(header["id"], exc), DISCARD
            # Fresh arrays: a round keeps its pushes until it closes, a pull's ids until it is answered.
            n = header["n"]
            arrays = [np.empty(n, ID_DTYPE)] + ([np.empty(n * task.width, task.dtype)] if len(sizes) == 2 else [])
            return (header, task, arrays, time.thread_time(), None), [memoryview(a).cast("B") for a in arrays]
        if op in STATE_OPS:
            try:
                task = self.core.admit(header)
            except PslinkError as exc:
                return Rejected(header["id"], exc), DISCARD
            # A state's arrays are kept: fresh buffers, never the pool's.
            buffers = [np.empty(task.span[1] - task.span[0], task.dtype) for _ in sizes]
            return (header, task, buffers, time.thread_time(), None), [memoryview(b).cast("B") for b in buffers] or None
        if op in (Op.PING, Op.ABORT):
            return header, None
        if op == Op.TENSOR_COPY or op == Op.REPLICATE:
            return self.copies.header(header, sizes)
        error = ProtocolError(f"{op.name} is not served on an Aggregator's data port")
        return Rejected(header["id"], error), DISCARD

    def on_message(self, conn: Connection, state: Any, payloads: list) -> None:
        if type(state) is Unfused:
            # Replies made while handling the items go back fused too (those small enough).
            cork = self._cork = Cork()
            try:
                fused_message(conn, state, payloads, self._message)
            finally:
                self._cork = None
                cork.release_all(self._send)
            return
        self._message(conn, state, payloads)

    def _message(self, conn: Connection, state: Any, payloads: list) -> None:
        if isinstance(state, Rejected):
            self._send(conn, [encode_error(state.request_id, state.error)])
            return
        if isinstance(state, dict):  # PING or ABORT
            if state["op"] == Op.PING:
                if state.get("warm"):
                    conn.warm()  # this worker's parts come here soon: its replies' ring is ready then
                if state.get("pmd"):  # the Agent cannot reach pMaster either: serve on (see the lease)
                    self.master.master_down(self.clock())
                self._send(conn, [encode(Op.PONG, id=state["id"])])
            else:
                self._abort(conn, state)
            return
        if isinstance(state, Arriving):
            self.copies.install(conn, state)
            return
        header, task, buffer, started, lend = state
        if header["op"] in TABLE_OPS:
            request = Request(conn, header["id"], _TABLE_AS_DATA[header["op"]], header["rank"], header["rnd"],
                              (buffer[0], buffer[1].reshape(-1, task.width)) if len(buffer) == 2 else buffer[0])
            self._send_all(self.core.handle(task, request))
            self._account(task, started)
            return
        payload = buffer
        if header.get("cmp") is not None and buffer is not None:  # a 2-bit push: back to +-threshold and 0
            payload = dequantize(buffer, header["cmp"], self.core.receive_buffer(task))
        elif lend is not None and lend.lent[0]:  # the push lies in the sender's shared-memory ring
            payload = np.frombuffer(payloads[0], task.dtype)
            if "cov" in header or not self.core.adds_in_place(task, header["op"], header["rank"], header["rnd"]):
                np.copyto(buffer, payload)  # it may become the round's sum, or be kept: copy it
                payload = buffer
        # A sum that reaches its worker through a ring is divided there, on the copy the worker
        # makes anyway, instead of in a pass of its own here.
        average = bool(header.get("avg")) and not conn.payload_in_place(task.numel * task.dtype.itemsize)
        request = Request(conn, header["id"], header["op"], header["rank"], header["rnd"], payload, average=average,
                          covers=header.get("cov"), idle=header.get("idl"))
        if header["op"] == Op.STATE_SET:
            request.header = header
        self._send_all(self.core.handle(task, request))
        if payload is not buffer:
            request.payload = None  # the ring's bytes are the sender's again once this returns
        self._account(task, started)

    def _account(self, task: Task, started: float) -> None:
        self._stall(task)
        spent = time.thread_time() - started
        task.cpu += spent
        self.busy += spent

    def _abort(self, conn: Connection | None, header: dict) -> None:
        try:
            self.core.authorize(header)
        except PslinkError as exc:
            if conn is not None:
                self._send(conn, [encode_error(header["id"], exc)])
            return
        # Keep the original error's class (a shape mismatch stays one for every waiter).
        error = error_from_code(header.get("code", AbortedError.code), header["msg"], header.get("details"))
        if "rnd" in header:  # a rank's refused request: its round fails, the key goes on
            task = self.core.tasks.get((header["job"], header["key"], header.get("part", 0)))
            self._send_all(self.core.fail_rounds(task, error, header["rnd"]) if task is not None else [])
        else:
            self._send_all(self.core.abort_key(header["job"], header["key"], error))
        if conn is not None and header["id"]:
            self._send(conn, [encode(Op.REPLY, id=header["id"])])

    def _send_all(self, outputs: list) -> None:
        for out in outputs:
            if isinstance(out, Reply):
                if out.error is not None:
                    frames = [encode_error(out.id, out.error)]
                elif out.body is not None:  # STATE_GET or JOIN: names and numbers (and an array a frame)
                    frames = [encode(Op.REPLY, id=out.id, rnd=out.round, body=out.body), *(out.arrays or ())]
                else:
                    fields = {"moved": list(out.moved)} if out.moved is not None else {}
                    if out.dropped:
                        fields["dropped"] = True
                    if out.lost is not None:
                        fields["lost"] = list(out.lost)
                    if out.averaged:
                        fields["avg"] = True
                    if out.next is not None:
                        fields["next"] = list(out.next)
                    header = encode(Op.REPLY, id=out.id, rnd=out.round, n=out.n, ep=out.epoch, **fields)
                    frames = [header, out.payload] if out.payload is not None else [header]
                self._send(out.origin, frames)
            elif isinstance(out, CopyOut):
                self.copies.when_idle(out)
            elif isinstance(out, Follow):
                self.copies.follow(out)
            elif isinstance(out, Replicate):
                self.copies.replicate(out)
            elif isinstance(out, Checkpoint):
                job = out.task.job
                self.checkpoints.submit(part_path(job.checkpoint, job.job, out.task.key, out.task.part), out.state,
                                        out.arrays)
            elif isinstance(out, WorkerDone):
                self._tell_master(Op.WORKER_DONE, out.task)
            elif isinstance(out, CloseLater):
                self.reactor.call_later(max(0.0, out.when - self.clock()), self._close_due, out.task, out.round)

    def _close_due(self, task: Task, round_: int | None = None) -> None:
        self._send_all(self.core.close_due(task, round_))

    def _send(self, conn: Connection, frames) -> None:
        cork = self._cork
        if cork is not None:
            if cork.add(conn, frames):
                return
            cork.release(conn, self._send)  # what is held for conn goes first
        try:
            if self.faults is not None:
                self.faults.send(conn, frames)
            else:
                conn.send(frames)
        except PeerError:
            pass  # that peer is gone; on_close forgets its requests

    # -- pMaster's requests --------------------------------------------------------------------

    def _on_control(self, peer: RpcPeer, req: dict) -> None:
        op = req["op"]
        if op == Op.ASSIGN:
            job = req["jobinfo"]["job"]
            self._send_all(failures.end_moves_given_up(self.core.tasks, job, req["tasks"], self.name))
            for ident in failures.replicas_ordered(job, req["tasks"]):  # (pMaster re-sends: Replicas.unreached)
                task = self.core.tasks.get(ident)
                if task is not None and task.moved_to is None:
                    log.warning("aggregator %s: pMaster gives it a replica of %s, which it serves; kept serving",
                                self.name, task.name)
            self._send_all(self.core.moves.promote_placed(job, req["tasks"]))
            for task in self.core.assign(req["jobinfo"], req["tasks"]):
                self.master.fenced_parts.discard((task.job.job, task.key, task.part))  # placed here again
                if task.poisoned is not None:
                    self._send_all(self.core.abort(task, task.poisoned))  # the key was aborted: fail its waiters
                elif task.restore and task.restored is None:
                    self._restore(task)
                else:
                    self._send_all(self.core.moves.catch_up(task))  # a new replica gets the state now
            peer.reply(req)
        elif op == Op.JOB_INFO:
            outputs = self.core.set_job(req["jobinfo"])
            peer.reply(req)
            self._send_all(outputs)
        elif op == Op.DROP_JOB or op == Op.DROP_KEYS:
            self._send_all(self.core.drop_job(req["job"]) if op == Op.DROP_JOB else
                           self.core.drop_keys(req["job"], req["keys"]))
            release_freed_memory()  # the kept heap (keep_freed_memory) goes back: the memory returns
            if req["id"]:
                peer.reply(req)
        elif op == Op.ABORT:
            self._abort(None, req)
        elif op == Op.SCHEDULE:
            budgets = {(job, key, part): (int(runs), float(cost)) for job, key, part, runs, cost in req["tasks"]}
            self.core.set_schedule(float(req["cycle"]), budgets)
            if req["id"]:
                peer.reply(req)
        elif op == Op.MIGRATE:
            self._migrate(peer, req)
        elif op == Op.PROMOTE:
            outputs = self.core.moves.promote((req["job"], req["key"], req["part"]), req["replicas"])
            peer.reply(req)
            self._send_all(outputs)
        elif op == Op.COPY_REPLICA:
            self.copies.from_replica(peer, req)
        elif op == Op.FENCE:  # placed elsewhere (a move pMaster learned never happened): refused from now on
            self.master.fenced_parts |= self._fence(req["parts"])
            peer.reply(req)
        elif op == Op.PING:  # pMaster: is this Aggregator alive (an Agent could not reach it)?
            peer.reply(req)
        elif op == Op.SHUTDOWN:
            log.info("aggregator %s: shutdown requested by pMaster", self.name)
            self._stop(0)
        else:
            raise ProtocolError(f"{op.name} is not a request an Aggregator serves")

    def _migrate(self, peer, req: dict) -> None:
        """MIGRATE: hand one part over (``key``, ``part``), or a batch of one job's parts bound
        for one target (``parts``: one migration; the reply names those that could not go)."""
        outputs, failed = self.core.moves.begin_migrations(req)
        peer.reply(req, body={"failed": failed})
        self._send_all(outputs)
