"""Task state crossing between Aggregators: a migration's TENSOR_COPY (sent once the source
falls quiet, received straight into place, retried), a closed round's REPLICATE to every replica
(its answers go out once all replicas have it), and the copy a replica sends for a migration
whose source died (COPY_REPLICA). The core decides what moves (:mod:`pslink.core.aggregator.moves`);
this object carries it over the network for the process shell.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

import numpy as np

from pslink.core.aggregator.core import AggregatorCore
from pslink.core.aggregator.tasks import CopyOut, Follow, Replicate, Task
from pslink.core.aggregator.moves import copy_delay, exchange_end, idle_wait_of, seed_delay, state_checksum
from pslink.core.aggregator.table_task import check_layout
from pslink.core.faults import Faults
from pslink.core.transport import DISCARD, Connection, Transports
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Limits, Op, dtype_of, encode, encode_error
from pslink.errors import KeyStateError, ProtocolError, PslinkError, UnknownJobError

log = logging.getLogger("pslink.core.aggregator.process")


def _error(error) -> PslinkError:
    return error if isinstance(error, PslinkError) else KeyStateError(str(error))


class Arriving:
    """A TENSOR_COPY or REPLICATE being received: where its arrays land."""

    __slots__ = ("header", "task", "arrays")

    def __init__(self, header: dict, task: Task, arrays: list):
        self.header = header
        self.task = task
        self.arrays = arrays


class Rejected:
    """A message refused at its header: it is answered with ``error``."""

    __slots__ = ("request_id", "error")

    def __init__(self, request_id: int, error: PslinkError):
        self.request_id = request_id
        self.error = error


class FollowStream:
    """What goes to one part's follower, in order, once the Aggregator falls quiet: its seed,
    each round's sum, and last the hand-over (a TENSOR_COPY each, on one connection)."""

    __slots__ = ("items", "due", "seeding")

    def __init__(self):
        self.items: list[Follow | CopyOut] = []
        self.due = False  # a flush is waiting for the Aggregator to fall quiet
        self.seeding = False  # its seed waits its turn, or is on its way: the rest waits behind it


LEAVING_POLL = 0.005  # seconds between looks at whether the replies to the workers have left
SEED_BYTES_PER_SECOND = 100e6  # what a seed's pace is taken to be before one was measured
NOT_READY_RETRIES = 20  # REPLICATEs a replica refuses as "not mine (yet)" before the pause grows
NOT_READY_PAUSE = 0.1  # seconds before the round goes to it again
NOT_READY_SLOW_PAUSE = 1.0  # ... once it refused NOT_READY_RETRIES times (pMaster is slow to tell it)


class Copies:
    """Sends and receives task state for one Aggregator. ``reply(conn, frames)`` answers a
    sender; ``carry_out(outputs)`` sends what the core returned; ``tell_master(op, task)``
    reports a landed copy; ``last_message()`` is when the Aggregator last heard from anyone;
    ``name()`` its name now."""

    def __init__(self, core: AggregatorCore, transports: Transports, reactor: Reactor, limits: Limits, *,
                 name: Callable[[], str], clock: Callable[[], float], faults: Faults | None,
                 last_message: Callable[[], float], reply: Callable[[Connection, list], None],
                 replies_leaving: Callable[[], bool] = lambda: False,
                 carry_out: Callable[[list], None], tell_master: Callable[[Op, Task], None], retries: int = 5):
        self.core, self.transports, self.reactor, self.limits = core, transports, reactor, limits
        self.name, self.clock, self.faults, self.last_message = name, clock, faults, last_message
        # Whether replies to the workers are still on their way out: on a slow link the workers'
        # round is not over when the last request came in (their sums still cross it), and a copy
        # sent then shares the link with the sums they wait for.
        self.replies_leaving = replies_leaving
        self.reply, self.carry_out, self.tell_master = reply, carry_out, tell_master
        self.retries = retries
        # Connections to other Aggregators (requests go out on them; none come in).
        self.endpoint = RpcEndpoint(reactor, self._refuse_peer_request, limits, control_faults=False)
        self._peer_by_address: dict[str, RpcPeer] = {}
        self._not_ready: dict[tuple, int] = {}  # (part, replica) -> REPLICATEs it refused as not its yet
        self._catch_up_due: set[tuple] = set()  # parts whose round goes again to such a replica soon
        self._follows: dict[tuple, FollowStream] = {}  # parts whose move's target follows them
        self._seeds: collections.deque = collections.deque()  # parts whose seed waits its turn
        self._seeding: tuple | None = None  # the part whose seed is on its way
        self._seeds_due = False  # the next seed waits for a quiet moment
        # Seconds a seed took to land per byte of state, smoothed; at first a rate that a loaded
        # two-core host reaches (a seed is copied, sent, received and taken in: four passes).
        self._seed_pace = 1 / SEED_BYTES_PER_SECOND
        # Hand-overs sent, by what the target held: "follower", "replica", or nothing ("whole");
        # "refused": one the target found different (then sent whole). For status and tests.
        self.handed_over: collections.Counter = collections.Counter()

    def header(self, header: dict, sizes: tuple[int, ...]):
        """A TENSOR_COPY from the task's old Aggregator: receive its arrays straight into place."""
        try:
            self.core.authorize(header)
            task = self.core.find(header)
            if header["op"] == Op.TENSOR_COPY and (task is None or not task.incoming):
                if task is not None and header.get("from_replica"):
                    # A replica's copy for a source that died, whose own copy landed after all.
                    return Arriving(header, task, []), DISCARD
                raise ProtocolError(f"aggregator {self.name()} expects no copy of key {header['key']!r} "
                                    f"part {header['part']} of job {header['job']!r}")
            if len(sizes) != len(header["state"].get("arrays", [])):
                raise ProtocolError(f"{header['op'].name} of key {header['key']!r} names "
                                    f"{header['state'].get('arrays')} but carries {len(sizes)} arrays")
            layout = header["state"].get("layout")
            why = check_layout(layout, sizes) if layout is not None else None
            if why is not None:
                raise ProtocolError(f"{header['op'].name} of table {header['key']!r}: {why}")
        except PslinkError as exc:
            return Rejected(header["id"], exc), DISCARD
        if layout is not None:  # a table's shard: frames of their own dtypes and sizes
            arrays = [np.empty(count, dtype_of(dtype)) for dtype, count in layout]
            return Arriving(header, task, arrays), [memoryview(a).cast("B") for a in arrays]
        start, stop = header["span"]
        block = np.empty((len(sizes), stop - start), dtype_of(header["dtype"]))  # one allocation for all
        return Arriving(header, task, list(block)), [memoryview(row).cast("B") for row in block]

    def install(self, conn: Connection, copy: "Arriving") -> None:
        try:
            state = copy.header["state"]
            if copy.header["op"] == Op.REPLICATE:
                self.core.moves.replica_update(copy.header, state, copy.arrays)
                outputs = []
            elif state.get("follow") is not None:
                self.core.moves.follow(copy.task, state, copy.arrays)
                outputs = []
            elif state.get("seed"):
                self.core.moves.seeded(copy.task, state, copy.arrays)
                outputs = []
            elif copy.header.get("from_replica") and not copy.task.incoming:
                # The dead source's own copy landed first (it has as much as a replica, or more):
                # done all the same, as far as pMaster is concerned.
                outputs = []
            else:
                outputs = self.core.moves.install(copy.task, copy.header["state"], copy.arrays)
        except PslinkError as exc:
            self.reply(conn, [encode_error(copy.header["id"], exc)])
            return
        self.reply(conn, [encode(Op.REPLY, id=copy.header["id"])])
        self.carry_out(outputs)

    def when_idle(self, out: CopyOut) -> None:
        """Send a migration's copy once this Aggregator fell quiet (the job's workers compute)
        or its ``idle_wait`` is up (:func:`~pslink.core.aggregator.moves.copy_delay`). A job with no
        pause between iterations gets its copy then, before its workers come round to the
        task again. A copy for a target that follows the part goes behind what it still has to
        receive (:meth:`follow`)."""
        task = out.task
        if out.held is not None or (task.job.job, task.key, task.part) in self._follows:
            self.follow(out)
            return
        self._when_quiet(out.idle_wait, lambda: self.send(out, self.retries))

    def _when_quiet(self, idle_wait: float, then: Callable[[], None]) -> None:
        deadline = self.clock() + idle_wait

        def when_quiet():
            now = self.clock()
            wait = copy_delay(now, self.last_message(), deadline, idle_wait)
            if wait <= 0 and now < deadline and self.replies_leaving():
                wait = min(LEAVING_POLL, deadline - now)
            if wait > 0:
                self.reactor.call_later(wait, when_quiet)
            else:
                then()

        when_quiet()

    def follow(self, out: Follow | CopyOut) -> None:
        """Queue what goes to a part's follower. Seeds go one at a time for the whole Aggregator,
        each while it is quiet and the job's workers are not due back before it lands
        (:meth:`_pump_seeds`); what follows a part's seed (its rounds' sums, then the hand-over)
        goes in order once the Aggregator falls quiet, or at its ``idle_wait``."""
        task = out.task
        ident = (task.job.job, task.key, task.part)
        stream = self._follows.get(ident)
        if stream is None:
            stream = self._follows[ident] = FollowStream()
        if isinstance(out, Follow) and out.kind == "seed":
            stream.seeding = True
            self._seeds.append(ident)
            self._pump_seeds()
            return
        stream.items.append(out)
        if isinstance(out, CopyOut) and stream.seeding:
            stream.seeding = False  # handed over before its seed went (forced): the seed is moot
        if not stream.due and not stream.seeding:
            stream.due = True
            self._flush_after_exchange(ident, out)

    def _flush_after_exchange(self, ident: tuple, first: Follow | CopyOut) -> None:
        """Flush a part's follow stream once the job's exchange is over (not only this
        Aggregator's part of it: :func:`~pslink.core.aggregator.moves.exchange_end`), then once
        quiet, or at the first item's idle wait."""
        task = first.task
        wait = first.idle_wait if isinstance(first, CopyOut) else idle_wait_of(task.round_gap)
        after = exchange_end(task.last_opened, task.round_gap, task.compute_gap) - self.clock()
        if after > 0:
            self.reactor.call_later(after, lambda: self._when_quiet(wait, lambda: self._flush(ident)))
        else:
            self._when_quiet(wait, lambda: self._flush(ident))

    def _flush(self, ident: tuple) -> None:
        stream = self._follows.get(ident)
        if stream is None:
            return
        items, stream.items, stream.due = stream.items, [], False
        for out in items:
            if isinstance(out, CopyOut):  # the hand-over: the last of the stream
                del self._follows[ident]
                if out.held is not None:
                    out.state["checksum"] = state_checksum(out.held)
                self.send(out, self.retries)
                return
            self._send_follow(ident, out)
        task = self.core.tasks.get(ident)
        if not stream.seeding and (task is None or task.follower is None and task.migrate_to is None):
            del self._follows[ident]  # the move is off (its target gone, its job ended)

    def _pump_seeds(self) -> None:
        """Send the next seed, if none is on its way and the Aggregator may: a seed is the bulk of
        a move's bytes (a part's whole state), and a decision may move a whole job at once, so
        they go one after another while the workers compute, never into their exchange."""
        if self._seeding is not None or self._seeds_due:
            return
        while self._seeds:
            ident = self._seeds[0]
            task = self.core.tasks.get(ident)
            stream = self._follows.get(ident)
            if task is None or stream is None or not stream.seeding:
                self._seeds.popleft()  # gone, or handed over meanwhile
                continue
            takes = self._seed_pace * task.nbytes * (2 if task.job.optimizer is not None else 1)
            wait = seed_delay(self.clock(), self.last_message(), task.last_opened, task.round_gap, takes,
                              task.compute_gap)
            if wait <= 0 and task.round_gap and self.clock() - self.last_message() < task.round_gap / 2 \
                    and self.replies_leaving():
                wait = LEAVING_POLL  # (past half an iteration of silence: a peer that stopped reading)
            if wait > 0:
                self._seeds_due = True
                self.reactor.call_later(wait, self._seeds_later)
                return
            self._seeds.popleft()
            out = self.core.moves.seed(ident)  # taken now: the state as it is once quiet
            if out is None:
                self._seeded(ident, None)
                continue
            self._seeding = ident
            nbytes = sum(a.nbytes for a in out.arrays)
            self._send_follow(ident, out, then=lambda started=self.clock(): self._seeded(ident, started, nbytes))
            return

    def _seeds_later(self) -> None:
        self._seeds_due = False
        self._pump_seeds()

    def _seeded(self, ident: tuple, started: float | None, nbytes: int = 0) -> None:
        """A part's seed landed (or was not taken): what queued behind it goes, then the next seed."""
        if started is not None and nbytes:
            self._seed_pace = 0.5 * (self._seed_pace + (self.clock() - started) / nbytes)
        if self._seeding == ident:
            self._seeding = None
        stream = self._follows.get(ident)
        if stream is not None:
            stream.seeding = False
            if stream.items and not stream.due:
                stream.due = True
                self._flush_after_exchange(ident, stream.items[0])
            elif not stream.items:
                task = self.core.tasks.get(ident)
                if task is None or task.follower is None and task.migrate_to is None:
                    del self._follows[ident]
        self._pump_seeds()

    def _send_follow(self, ident: tuple, out: Follow, then: Callable[[], None] | None = None) -> None:
        task = out.task

        def confirmed(result, error):
            if error is not None:
                log.warning("aggregator %s: the target %s of %s's move stopped following it (%s); the whole state "
                            "goes at the hand-over", self.name(), out.target[0], task.name, error)
            self.core.moves.followed(ident, out.round, None if error is None else _error(error))
            if then is not None:
                then()

        try:
            peer = self.peer(out.target[1])
        except PslinkError as exc:
            confirmed(None, exc)
            return
        peer.call(Op.TENSOR_COPY, confirmed, timeout=60.0, payloads=out.arrays, job=task.job.job, tok=task.job.token,
                  rank=0, key=task.key, part=task.part, rnd=out.round, dtype=task.dtype_name, shape=list(task.shape),
                  span=list(task.span), state=out.state)

    def send(self, out: CopyOut, retries: int, done=None) -> None:
        """TENSOR_COPY to the migration's target, retried; then tell pMaster, or ``done(error)``
        (a replica's copy, COPY_REPLICA: pMaster waits for the answer instead)."""
        task = out.task
        ident = (task.job.job, task.key, task.part)
        if self.faults is not None and not out.from_replica:
            self.faults.copying()  # kill=NAME@copy: dies having handed the part over

        def copied(result, error):
            if error is None and not out.from_replica:
                self.handed_over[out.state.get("follower") or "whole"] += 1
            if error is not None and out.whole is not None:
                # The target's followed state (or replica) was not the source's: send every array.
                self.handed_over["refused"] += 1
                log.warning("aggregator %s: %s's hand-over to %s without its state was refused (%s); sending the "
                            "whole state", self.name(), task.name, out.target[0], error)
                out.state, out.arrays = out.whole
                out.held = out.held_names = out.whole = None
                self.send(out, retries, done)
            elif error is None and done is not None:
                done(None)
            elif error is None:
                self.core.moves.copy_done(ident)
                self.tell_master(Op.TENSOR_COPY_DONE, task)
            elif retries > 0:
                log.warning("aggregator %s: copying %s to %s failed (%s); retrying", self.name(), task.name,
                            out.target[0], error)
                self.reactor.call_later(0.5, self.send, out, retries - 1, done)
            else:
                log.error("aggregator %s: giving up copying %s to %s: %s", self.name(), task.name, out.target[0], error)
                if done is not None:
                    done(error)

        try:
            peer = self.peer(out.target[1])
        except PslinkError as exc:
            copied(None, exc)
            return
        peer.call(
            Op.TENSOR_COPY, copied, timeout=60.0, payloads=out.arrays,
            job=task.job.job, tok=task.job.token, rank=0, key=task.key, part=task.part, rnd=out.state["closed"],
            dtype=task.dtype_name, shape=list(task.shape), span=list(task.span), state=out.state,
            **({"from_replica": True} if out.from_replica else {}),
        )

    def replicate(self, out: Replicate) -> None:
        """REPLICATE to every replica; when all answered (or failed), the round's answers go out.
        A replica that does not know yet that it holds the part (pMaster told this Aggregator of
        it first; its own ASSIGN is on the way) is never given up: pMaster counts it as one, and
        would promote it, stateless, should this Aggregator go. The round goes again to it
        shortly, then every NOT_READY_SLOW_PAUSE, until it knows (or pMaster names others).
        Found by the chaos run: dropped after 2 s while a restarted pMaster's ASSIGN to the
        replica was late, the part went without one, and a later failover promoted a replica
        with no state (its job hung)."""
        task = out.task
        ident = (task.job.job, task.key, task.part)
        waiting = {"left": len(task.replicas), "lost": [], "later": False}

        def done(name, error):
            if isinstance(error, (UnknownJobError, KeyStateError)):
                refused = self._not_ready[(ident, name)] = self._not_ready.get((ident, name), 0) + 1
                if refused == NOT_READY_RETRIES:
                    log.warning("aggregator %s: replica %s of %s still does not know it holds it (%s); sending "
                                "the round again every %.0f s", self.name(), name, task.name, error,
                                NOT_READY_SLOW_PAUSE)
                waiting["later"] = True
            elif error is not None:
                log.warning("aggregator %s: replica %s of %s failed (%s); going on without it",
                            self.name(), name, task.name, error)
                waiting["lost"].append(name)
            else:
                self._not_ready.pop((ident, name), None)
            waiting["left"] -= 1
            if waiting["left"] == 0:
                self.carry_out(self.core.moves.replicated(ident, out.round, waiting["lost"]))
                if waiting["later"] and ident not in self._catch_up_due:  # one timer per part
                    refused = max((self._not_ready.get((ident, r[0]), 0) for r in task.replicas), default=0)
                    self._catch_up_due.add(ident)
                    self.reactor.call_later(NOT_READY_PAUSE if refused < NOT_READY_RETRIES else NOT_READY_SLOW_PAUSE,
                                            self._catch_up_again, ident)

        for name, address in list(task.replicas):
            try:
                peer = self.peer(address)
            except PslinkError as exc:
                done(name, exc)
                continue
            peer.call(
                Op.REPLICATE, lambda result, error, name=name: done(name, error), timeout=10.0,
                payloads=out.arrays, job=task.job.job, tok=task.job.token, rank=0, key=task.key, part=task.part,
                rnd=out.round, dtype=task.dtype_name, shape=list(task.shape), span=list(task.span), state=out.state,
            )

    def _catch_up_again(self, ident: tuple) -> None:
        self._catch_up_due.discard(ident)
        task = self.core.tasks.get(ident)
        listed = {r[0] for r in task.replicas} if task is not None else set()
        for stale in [k for k in self._not_ready if k[0] == ident and k[1] not in listed]:
            del self._not_ready[stale]  # pMaster named others (or the part went): not waited for
        if task is not None:
            task.catch_up = True
            self.carry_out(self.core.moves.catch_up(task))

    def peer(self, address: str) -> RpcPeer:
        """The connection to the Aggregator at ``address``, made on first use."""
        peer = self._peer_by_address.get(address)
        if peer is None or peer.conn.closed:
            conn = self.transports.connect(address, self.reactor, self.endpoint, self.limits, timeout=5.0)
            peer = self._peer_by_address[address] = self.endpoint.peer(conn)
            peer.info["name"] = f"aggregator at {address}"
        return peer

    @staticmethod
    def _refuse_peer_request(peer: RpcPeer, req: dict) -> None:
        raise ProtocolError(f"{req['op'].name} is not a request between Aggregators")

    def from_replica(self, peer: RpcPeer, req: dict) -> None:
        """COPY_REPLICA: a migration's source died before its copy landed; the replica held here
        is the copy. Answered once it landed (or with why it could not)."""
        ident, target = (req["job"], req["key"], req["part"]), tuple(req["target"])
        if target[0] == self.name():  # the target holds the replica itself
            outputs = self.core.moves.install_replica(ident)
            peer.reply(req)
            self.carry_out(outputs)
            return
        out = self.core.moves.replica_copy(ident, target)
        self.send(out, self.retries, lambda error: peer.error(req, error) if error else peer.reply(req))


