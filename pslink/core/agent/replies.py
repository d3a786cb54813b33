"""How an Agent takes its answers: :class:`Replies`, on the driving thread.

Each answer from an Aggregator is matched to its request in flight (:class:`~pslink.core.agent.
requests.Requests`) and read straight into the request's ``out`` array (a sum to average is
divided on its way in); a FUSED answer is taken apart item by item. An answer that says the part
moved sends the request after it (same round, same data); one that says "ask pMaster" (fenced)
waits and asks again; a lost connection hands its requests to the failover (or, for this host's
leader of a host-local reduce, to this worker's follower of it). What the answers say of the job
(its membership epoch, pushes dropped as a straggler's, rounds lost to a restart) is kept here.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from pslink.core.agent.failover import Failover
from pslink.core.agent.handle import Handles
from pslink.core.agent.master_link import MasterLink
from pslink.core.agent.requests import MAX_MOVES, PartRequest, Requests, fenced_pause
from pslink.core.agent.seat import Seat
from pslink.core.agent.sending import Sender
from pslink.core.agent.task_requests import TaskRequests
from pslink.core.observe.timeline import Timeline
from pslink.core.transport import DISCARD, Lent
from pslink.core.transport.fused import Unfused, fused_header, fused_message
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import STATE_OPS, Limits, Op, decode, encode
from pslink.errors import FencedError, MovedError, ProtocolError, PslinkError, error_from_code

log = logging.getLogger("pslink.core.agent")
WARM_AFTER = 0.02  # seconds after a worker's last answer of a round before it connects ahead

_REPLY, _ERROR, _PONG, _STATE_GET, _FUSED = Op.REPLY, Op.ERROR, Op.PONG, Op.STATE_GET, Op.FUSED


class Replies:
    """The answers to the requests ``sender`` and ``tasks`` sent through ``requests``, for the
    worker in ``seat``: each completes its part of a handle (``handles``), or sends the request
    again where its part went. ``epoch``: the job's membership epoch as registration said."""

    def __init__(self, seat: Seat, limits: Limits, reactor: Reactor, requests: Requests, handles: Handles,
                 master: MasterLink, failover: Failover, sender: Sender, tasks: TaskRequests,
                 timeline: Timeline | None, clock: Callable[[], float], *, epoch: int):
        self.seat, self.limits, self.reactor, self.clock = seat, limits, reactor, clock
        self.requests, self.handles, self.master = requests, handles, master
        self.failover, self.sender, self.tasks = failover, sender, tasks
        self.timeline = timeline  # the Agent's, as it starts and stops recording
        self.epoch = epoch  # the job's membership epoch, as replies last said
        self.dropped_pushes = 0  # pushes that came after their round closed without them (stragglers')
        self._warm_due = False  # connecting ahead (Requests.warm) waits for a quiet moment

    def on_header(self, conn, raw, sizes):
        try:
            header = decode(raw, sizes, self.limits)
        except ProtocolError as exc:
            log.warning("agent %s: bad message from %s: %s", self.seat, conn.peer, exc)
            return (None, exc, None), DISCARD
        if header["op"] is _FUSED:
            try:
                return fused_header(conn, header, sizes, self._reply_header)
            except ProtocolError as exc:
                log.warning("agent %s: bad message from %s: %s", self.seat, conn.peer, exc)
                return (None, exc, None), DISCARD
        return self._header(conn, header, sizes)

    def _reply_header(self, conn, raw, sizes):
        """One reply of a FUSED message (anything else in one is refused)."""
        try:
            header = decode(raw, sizes, self.limits)
            if header["op"] is not _REPLY and header["op"] is not _ERROR:
                raise ProtocolError(f"{header['op'].name} cannot travel in a FUSED reply")
        except ProtocolError as exc:
            log.warning("agent %s: bad message from %s: %s", self.seat, conn.peer, exc)
            return (None, exc, None), DISCARD
        return self._header(conn, header, sizes)

    def _header(self, conn, header, sizes):
        if header["op"] is _REPLY and sizes:
            pending = self.requests.pending.get(header["id"])
            if pending is not None and pending.op is _STATE_GET:
                if any(size != pending.nbytes for size in sizes):
                    return (header, ProtocolError(f"state from {conn.peer} carries frames of {list(sizes)} bytes; "
                                                  f"{pending.nbytes} each were expected"), None), DISCARD
                return (header, None, None), None  # the transport allocates
            if pending is None or pending.dest is None or pending.link.conn is not conn:
                # A late reply, a payload nobody asked for, or an answer from where the request
                # no longer is (it went elsewhere: a fenced or lost Aggregator's late answer).
                return (header, None, None), DISCARD
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
        if type(state) is Unfused:
            fused_message(conn, state, payloads, self._message)
        else:
            self._message(conn, state, payloads)
        link = self.requests.by_conn.get(conn)
        if link is not None:
            link.last_heard = self.clock()
            link.ping_sent = None
            if link.outbox:  # an answer came: what waited for one to fuse with goes now
                self.requests.flush_link(link)
        if self.requests.to_warm and not self.requests.pending and not self._warm_due:
            # The worker's round is over: connect ahead while it computes (a moment later: the
            # other workers' last answers of the round may still be on their way).
            self._warm_due = True
            self.reactor.call_later(WARM_AFTER, self._warm_if_quiet)

    def _message(self, conn, state, payloads) -> None:
        header, error, lend = state
        if header is None or header["op"] is _PONG:
            return
        pending = self.requests.pending.get(header["id"])
        if pending is None or pending.link.conn is not conn:
            return  # answered already, or it went elsewhere since (see _header)
        request = self.requests.take(header["id"])
        if error is None and header["op"] is _ERROR:
            error = error_from_code(header["code"], header["msg"], header.get("details"))
        if isinstance(error, FencedError) and request.moves < MAX_MOVES:
            self._fenced(header["id"], request, error)
            return
        if isinstance(error, MovedError) and request.moves < MAX_MOVES:
            # The task migrated before this request got there: follow it, same round, same data.
            self._moved(request, error.details)
            if request.op in STATE_OPS:
                self.tasks.send_state(request.handle, request.op, request.info, request.part, request.array,
                                       request.moves + 1)
                return
            self.sender.send_part(request.handle, request.op, request.info, request.part, request.round,
                                   request.payload, request.flat_out, request.average, request.moves + 1,
                                   request.covers)
            return
        if error is None:
            if request.op in STATE_OPS:
                TaskRequests.state_arrived(request, header, payloads)
            get = header.get
            epoch = get("ep")
            if epoch is not None and epoch > request.handle.epoch:
                request.handle.epoch = epoch
                if epoch > self.epoch:
                    self.epoch = epoch
            if get("dropped"):
                self.dropped_pushes += 1
            if get("lost"):
                self.failover.rounds_lost_at(request.info.key, request.part.index, header["lost"])
            moved = get("moved")
            if moved:
                self._moved(request, {"agg": moved[0], "address": moved[1]})
            coming = moved or get("next")  # the part moves there now, or soon: connect ahead
            if coming and isinstance(coming[0], str) and isinstance(coming[1], str):
                self.requests.warm(coming[0], coming[1])
            if request.average and not get("avg"):
                # An Aggregator averages a synchronous sum itself, once for every worker, unless
                # the sum comes through shared memory: then it is divided on its way in.
                n = get("n", 0)
                if lend is not None and lend.lent[0]:
                    np.divide(np.frombuffer(payloads[0], request.array.dtype), n, out=request.array)
                elif n > 1:
                    np.divide(request.array, n, out=request.array)
        self.handles.complete(request.handle, error)

    def _warm_if_quiet(self) -> None:
        self._warm_due = False
        if not self.requests.pending:
            self.requests.warm_now()
        # else: the next time nothing is in flight

    def _fenced(self, rid: int, request: PartRequest, error: FencedError) -> None:
        """The Aggregator's lease ran out, or it holds only a replica: pMaster says where the
        part is. If pMaster is unreachable and the lease is the reason, pMaster is down (nobody
        fails the Aggregator over): tell the Aggregator so, and send the request there again. A
        replica not promoted never serves: sent back to it, the request used its tries up in
        milliseconds (chaos run, pMaster killed mid-failover); it waits for pMaster instead."""
        request.moves += 1
        self.requests.put_back(rid, request)
        if error.details.get("lease"):
            self.master.lease_ran_out(request.link.name)
        master = self.master.peer
        if master is not None and not master.conn.closed or not error.details.get("lease"):
            # (Again and again: a promotion not done yet; the tries span seconds, not a burst.)
            self.reactor.call_later(fenced_pause(request.moves), self.failover.link_lost, request.link, error, [rid])
            return
        try:
            request.link.conn.send([encode(Op.PING, id=0, pmd=True)])
        except PslinkError as exc:
            self.failover.link_lost(request.link, exc, [rid])
            return
        self.requests.transmit(rid, request, request.frames)

    def _moved(self, request: PartRequest, where: dict) -> None:
        """The Aggregator ``request`` went to says its part lives elsewhere now (a migration: the
        pull that closed its last round there said so, or a request that came after it). Taken
        only while the part is still placed there: a redirect from an Aggregator the part has
        been relocated away from since (failover, a newer redirect) is stale."""
        agg, address = where.get("agg"), where.get("address")
        part = request.part
        if isinstance(agg, str) and isinstance(address, str) and part.aggregator == request.link.name:
            if self.timeline is not None:
                self.timeline.part_moved("migrated", request.info.key, part.index, part.aggregator, agg)
            part.move(agg, address)

    def on_close(self, conn, exc) -> None:
        link = self.requests.closed_link(conn)
        if link is not None and link.pending:
            self.link_lost(link, exc)

    def link_lost(self, link, exc, rids: list[int] | None = None) -> None:
        follower = self.sender.followers.get(link.name)  # (also once it was lost: a late send there)
        if follower is not None:
            follower.leader_lost(link, exc, rids)  # this host's leader: push to the pool directly
        else:
            self.failover.link_lost(link, exc, rids)
