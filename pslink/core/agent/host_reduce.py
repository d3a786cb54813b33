"""Host-local reduce (BytePS's local reduce): the workers of a job on one host sum their pushes
on the host, and one of them, the host's *leader* (its lowest rank), pushes the host's sum to the
pool for all of them and hands the result back. A host with k workers pushes once per key and
round instead of k times: the wire and the pool's CPU carry 1/k of the pushes.

::

    follower ──PUSH/PUSHPULL (whole key)──▶ leader ──PUSH/PUSHPULL (parts, cov=[ranks])──▶ Aggregators
             ◀──────── REPLY (result) ────────       ◀──────────── REPLY ───────────────

The followers speak the data path's own protocol to the leader, as to an Aggregator that holds
every key whole (their Agent sends through :meth:`HostFollower.part_of`); the connection is a
same-host one, so payloads travel through shared-memory rings. The leader's push names the
ranks it stands for (``cov``): the Aggregator counts each of them as having pushed, so a round
closes, averages and answers exactly as on the flat path, and a rank that pushes again on its own
(after its leader was lost) is answered as a repeat, never added twice.

Rules that keep it exact without any agreement protocol:

- A local round (key, round) waits for the ranks the leader knew when it began: itself and the
  followers connected then. A push that comes after the round went to the pool (a follower that
  connected late) is sent on alone, for its own rank.
- The sum is taken in rank order, so it does not depend on arrival order.
- A follower that is lost is not waited for (the pool waits for it as on the flat path, until
  pMaster removes it); a leader that is lost: each follower sends what it had at the leader
  itself, at the same rounds (:meth:`HostFollower.leader_lost`), and the host's next rank leads
  from the next push on (a survivor that cannot reach it within the connect timeout pushes on
  its own).
- Pulls and inits go straight to the pool; ``ssp``/``asp`` jobs do not reduce on the host (their
  rounds do not line up across workers).
"""

from __future__ import annotations

import functools
import hmac
import logging
import threading
from typing import Any

import numpy as np

from pslink.core.agent.keys import KeyInfo, PartInfo

from pslink.core.agent.seat import Seat
from pslink.core.memory import BufferPool
from pslink.core.transport import DISCARD
from pslink.core.transport.fused import Unfused, fused_header, fused_message
from pslink.core.wire.protocol import DTYPES, Limits, Op, decode, encode, encode_error
from pslink.errors import (AuthError, ClosedError, ConfigError, MembershipError, PslinkError, PslinkTimeoutError,
                           ProtocolError, ShapeMismatchError)

log = logging.getLogger("pslink.core.agent")
LOCAL_OPS = frozenset({Op.PUSH, Op.PUSHPULL})  # what goes through the leader; pulls and inits do not


def local_group(rank: int, local_rank: int, local_size: int) -> list[int]:
    """The ranks on this worker's host, as launchers number them (torchrun, ``pslink launch``,
    horovodrun: a host's workers have consecutive ranks); the first one leads."""
    if not 0 <= local_rank < local_size or rank < local_rank:
        raise ConfigError(f"local rank {local_rank} of {local_size} does not fit rank {rank} (PSLINK_LOCAL_RANK, "
                          "PSLINK_LOCAL_SIZE)")
    first = rank - local_rank
    return list(range(first, first + local_size))


def leader_name(job: str, leader: int) -> str:
    return f"host-leader {job}/{leader}"


class _LocalRound:
    """One (key, round) at the leader: the pushes of the host's ranks, and who waits for what."""

    __slots__ = ("key", "round", "expected", "given", "waiting")

    def __init__(self, key, round_: int, expected: set[int]):
        self.key, self.round, self.expected = key, round_, expected
        self.given: dict[int, np.ndarray] = {}
        # (rank, conn or None for the leader, request id or the leader's handle, out, op, average)
        self.waiting: list[tuple] = []

    def ready(self) -> bool:
        return self.expected <= self.given.keys()


class HostLeader:
    """The leader's side: a listener its followers connect to (a Handler on the Agent's reactor),
    and the local rounds. ``sender`` is the Agent's :class:`~pslink.core.agent.sending.Sender`:
    the host's sums go to the pool through it, with ``covers``."""

    def __init__(self, seat: Seat, group: list[int], transports, reactor, limits: Limits, sender, handles):
        self.seat, self.group, self.limits = seat, frozenset(group), limits
        self.sender, self.handles = sender, handles
        self.followers: dict[Any, int] = {}  # connection -> rank, once it said hello
        self.rounds: dict[tuple, _LocalRound] = {}  # (key, round) -> the local round under way
        self.own_rounds: dict[Any, int] = {}  # key -> the leader's last push of it
        self.pools: dict[tuple, BufferPool] = {}
        self.lock = threading.Lock()
        self.listener = transports.listen("tcp://127.0.0.1:0", reactor, self, limits)
        self.address = self.listener.address

    @property
    def leads(self) -> bool:
        return True

    def close(self) -> None:
        """The leader leaves: its followers push to the pool themselves from now on, and what it
        had not sent for itself fails here as its other requests do."""
        self.listener.close()
        for conn in list(self.followers):
            conn.close()
        with self.lock:
            waiting, self.rounds = list(self.rounds.values()), {}
        error = ClosedError(f"agent of job {self.seat.job!r} rank {self.seat.rank} closed")
        for lr in waiting:
            for w in lr.waiting:
                if w[1] is None:
                    self.handles.complete(w[2], error)

    def forget(self, keys) -> None:
        """Keys deleted: their buffers go, and a key declared again counts its rounds afresh."""
        with self.lock:
            for ident in [i for i in self.pools if i[0] in keys]:
                del self.pools[ident]
            for key in keys:
                self.own_rounds.pop(key, None)

    # -- the leader's own pushes ----------------------------------------------------------------

    def own(self, op: Op, keys: list, infos: list[KeyInfo], flats: list, results: list | None,
            average: bool, rounds: list[int]):
        """The leader's push of ``keys`` (at ``rounds``, counted by the Sender): into the local rounds."""
        single = len(keys) == 1
        result = None if results is None else (results[0] if single else results)
        handle = self.handles.new(op.name.lower(), keys, result, len(keys), rounds[0] if single else 0)
        for i, info in enumerate(infos):
            out = None
            if results is not None:
                out = results[i] if results[i].ndim == 1 else results[i].reshape(-1)
            self._contribute(self.seat.rank, None, handle, op, info.key, rounds[i], flats[i], out, average)
        return handle

    # -- local rounds ---------------------------------------------------------------------------

    def _contribute(self, rank: int, conn, ident, op: Op, key, round_: int, array, out, average: bool) -> None:
        with self.lock:
            lr = self.rounds.get((key, round_))
            own = rank == self.seat.rank
            if own:
                self.own_rounds[key] = round_
            # The round began before this follower was known, and went without it: on alone.
            late = lr is None and not own and round_ <= self.own_rounds.get(key, 0)
            if late:
                lr = _LocalRound(key, round_, {rank})
            elif lr is None:
                known = set(self.followers.values()) | {self.seat.rank}
                lr = self.rounds[(key, round_)] = _LocalRound(key, round_, known)
            lr.given[rank] = array
            lr.waiting.append((rank, conn, ident, out, op, average))
            send = lr if late else self._take_ready(lr)
        if send is not None:
            self._send(send)

    def _take_ready(self, lr: _LocalRound) -> _LocalRound | None:
        """``lr`` if it may go to the pool now (the leader's own push is in: the leader knows the
        key then), no longer under way. Called with the lock held."""
        if not lr.ready() or self.seat.rank not in lr.given:
            return None
        del self.rounds[(lr.key, lr.round)]
        return lr

    def _send(self, lr: _LocalRound) -> None:
        info = self.sender.keys[lr.key]
        try:
            self._check(lr, info)
            averages = {w[5] for w in lr.waiting if w[4] is Op.PUSHPULL}
            if len(averages) > 1:
                raise ConfigError(f"key {lr.key!r} round {lr.round}: the workers of this host asked for its "
                                  "result both summed and averaged; every worker must ask alike")
        except PslinkError as exc:
            self._answer(lr, exc, None, None)
            return
        with self.lock:
            pool = self._pool(info.key, info.dtype, info.numel)
            total = pool.acquire()
            result = pool.acquire() if averages else None
        ranks = sorted(lr.given)
        arrays = [lr.given[rank] for rank in ranks]  # in rank order: the same sum whatever order they came in
        if len(arrays) == 1:
            np.copyto(total, arrays[0])
        else:
            np.add(arrays[0], arrays[1], out=total)
            for array in arrays[2:]:
                np.add(total, array, out=total)
        op = Op.PUSHPULL if averages else Op.PUSH
        handle = self.sender.issue(op, [lr.key], [info], [total], None if result is None else [result],
                                   bool(averages and averages.pop()), covers=ranks, at_round=lr.round)
        handle.add_done_callback(lambda h: self._answer(lr, h.exception(), result, total))

    def _check(self, lr: _LocalRound, info: KeyInfo) -> None:
        for rank, array in lr.given.items():
            if array.size != info.numel or array.dtype != info.dtype:
                raise ShapeMismatchError(
                    f"key {lr.key!r} of job {self.seat.job!r}: rank {rank} pushed {array.size} values of "
                    f"{array.dtype} to its host's leader, rank {self.seat.rank}, which has {info.describe()}",
                    key=lr.key, ranks=[rank, self.seat.rank])

    def _pool(self, key, dtype: np.dtype, numel: int, rank: int | None = None) -> BufferPool:
        """Arrays for a key's sums and results (``rank`` None), or for a follower's pushes of it,
        reused once nothing holds them (a reply still queued on a socket holds its result)."""
        ident = (key, dtype.str, numel, rank)
        pool = self.pools.get(ident)
        if pool is None:
            pool = self.pools[ident] = BufferPool(dtype, numel, keep=2)  # a round's, and the next one's
        return pool

    def _answer(self, lr: _LocalRound, error: PslinkError | None, result, total) -> None:
        """The pool answered (on the driving thread): every waiting rank gets the round's result."""
        for rank, conn, ident, out, op, average in lr.waiting:
            if conn is None:  # the leader's own handle, one part per key
                if error is None and out is not None and result is not None:
                    np.copyto(out, result)
                self.handles.complete(ident, error)
                continue
            if error is not None:
                frames = [encode_error(ident, error)]
            elif op is Op.PUSHPULL:
                frames = [encode(Op.REPLY, id=ident, rnd=lr.round, **({"avg": True} if average else {})), result]
            else:
                frames = [encode(Op.REPLY, id=ident, rnd=lr.round)]
            try:
                conn.send(frames)
            except PslinkError as exc:  # it is gone: on_close forgets it
                log.debug("agent %s: cannot answer rank %d: %s", self.seat, rank, exc)

    # -- the listener (driving thread) ----------------------------------------------------------

    def on_accept(self, conn) -> None:
        pass  # a follower until its hello names it

    def on_header(self, conn, raw, sizes):
        try:
            header = decode(raw, sizes, self.limits)
            if header["op"] is Op.FUSED:
                return fused_header(conn, header, sizes, self._item_header)
            return self._item_header(conn, raw, sizes, header)
        except PslinkError as exc:
            return (None, exc, None), DISCARD

    def _item_header(self, conn, raw, sizes, header: dict | None = None):
        try:
            if header is None:
                header = decode(raw, sizes, self.limits)
            op = header["op"]
            if op is Op.PING:
                return (header, None, None), None
            if op not in LOCAL_OPS:
                raise ProtocolError(f"{op.name} does not go through a host's leader")
            if header["job"] != self.seat.job or not hmac.compare_digest(header["tok"], self.seat.token):
                raise AuthError(f"rank {header['rank']} is not of job {self.seat.job!r} (or its token is wrong)")
            if self.followers.get(conn) != header["rank"]:
                raise ProtocolError(f"rank {header['rank']} pushed to the leader of host ranks "
                                    f"{sorted(self.group)} without saying hello first")
            with self.lock:
                array = self._pool(header["key"], DTYPES[header["dtype"]], header["span"][1] - header["span"][0],
                                   header["rank"]).acquire()
            return (header, None, array), [memoryview(array).cast("B")]
        except PslinkError as exc:
            return (header, exc, None), DISCARD

    def on_message(self, conn, state, payloads) -> None:
        if type(state) is Unfused:
            fused_message(conn, state, payloads, self._message)
        else:
            self._message(conn, state, payloads)

    def _message(self, conn, state, payloads) -> None:
        header, error, array = state
        if header is None:
            log.warning("agent %s: bad message from a follower: %s", self.seat, error)
            return
        if error is not None:
            conn.send([encode_error(header.get("id", 0), error)])
            return
        if header["op"] is Op.PING:
            self._hello(conn, header)
            return
        self._contribute(header["rank"], conn, header["id"], header["op"], header["key"], header["rnd"], array,
                         None, bool(header.get("avg")))

    def _hello(self, conn, header: dict) -> None:
        rank, token = header.get("rank"), header.get("tok")
        if rank is not None and header.get("job") == self.seat.job and token is not None \
                and hmac.compare_digest(token, self.seat.token) and rank in self.group and rank != self.seat.rank:
            with self.lock:
                self.followers[conn] = rank
        elif rank is not None:
            log.warning("agent %s: refused a hello from rank %s (not of this host's ranks %s, or a wrong job or "
                        "token)", self.seat, rank, sorted(self.group))
            conn.close()
            return
        conn.send([encode(Op.PONG, id=header["id"])])

    def on_close(self, conn, exc) -> None:
        """A follower is gone: the local rounds stop waiting for it (the pool's rounds wait as on
        the flat path, until pMaster removes it from the job)."""
        ready = []
        with self.lock:
            rank = self.followers.pop(conn, None)
            if rank is None:
                return
            for lr in list(self.rounds.values()):
                lr.expected.discard(rank)
                lr.waiting = [w for w in lr.waiting if w[1] is not conn]
                taken = self._take_ready(lr)
                if taken is not None:
                    ready.append(taken)
        log.info("agent %s: rank %d of this host left (%s); this host's pushes go without it", self.seat, rank,
                    exc)
        for lr in ready:
            self._send(lr)


class HostFollower:
    """A follower's side: where its pushes go (the leader, as one whole part per key), and what
    happens when the leader is lost (everything goes to the pool itself, at the same rounds)."""

    def __init__(self, seat: Seat, group: list[int], leader: int, address: str, requests, sender, handles,
                 restart=None):
        self.seat, self.group, self.leader, self.address = seat, group, leader, address
        self.requests, self.sender, self.handles = requests, sender, handles
        self.restart = restart  # start(leader=...) with this worker's settings: a new leader's election
        self.name = leader_name(seat.job, leader)
        self.parts: dict[Any, PartInfo] = {}
        sender.followers[self.name] = self
        link = requests.link(self.name, address)
        link.conn.send([encode(Op.PING, id=0, job=seat.job, tok=seat.token, rank=seat.rank)])

    @property
    def leads(self) -> bool:
        return False

    def forget(self, keys) -> None:
        for key in keys:
            self.parts.pop(key, None)

    def part_of(self, info: KeyInfo) -> PartInfo:
        """The whole key, as a part that lives at the leader."""
        part = self.parts.get(info.key)
        if part is None:
            part = self.parts[info.key] = PartInfo(0, 0, info.numel, self.name, self.address)
        return part

    def leader_lost(self, link, error, rids: list[int] | None) -> None:
        """The leader is gone (or stopped answering): what waited there goes to the pool from
        here, each key's parts to their Aggregators, at the same rounds (a round the leader had
        pushed already answers it as a repeat). The next rank of the host leads from its next
        push on (each survivor's next push starts it or finds it: :meth:`elect`)."""
        if self.sender.host is self:
            self.sender.host = None
            after = [rank for rank in self.group if rank > self.leader]
            if after and self.restart is not None:
                self.sender.elect = lambda: self.restart(leader=after[0])
        log.warning("agent %s: lost rank %d, this host's leader (%s); its pushes go to the pool directly, and rank "
                    "%s leads the host from the next push", self.seat, self.leader, error,
                    next((r for r in self.group if r > self.leader), "none"))
        for rid in list(link.pending) if rids is None else rids:
            request = self.requests.take(rid)
            if request is None or request.handle.done():
                continue
            parts = request.info.parts
            self.handles.expect_more(request.handle, len(parts) - 1)
            for part in parts:
                self.sender.send_part(request.handle, request.op, request.info, part, request.round,
                                      request.payload, request.flat_out, request.average)


def start(seat: Seat, group: list[int], master, transports, reactor, limits: Limits, requests, sender, handles,
          timeout: float, leader: int | None = None) -> HostLeader | HostFollower | None:
    """This worker's part in its host's reduce: the leader listens and says where; a follower
    asks where (waiting up to ``timeout`` for a leader that starts later) and connects. None
    when the leader is not on this host after all (the launcher's numbering was not by host), or
    did not come within ``timeout``: the worker then pushes to the pool itself (its leader, if it
    comes, does not wait for it). ``leader``: the rank that leads (the host's first, or the next
    one after a leader was lost)."""
    leader = group[0] if leader is None else leader
    if seat.rank == leader:
        host = HostLeader(seat, group, transports, reactor, limits, sender, handles)
        master.call(Op.HOST_LEADER, leader=leader, address=host.address, host_id=seat.host_id)
        return host
    try:
        body = master.call(Op.HOST_LEADER, timeout=timeout, leader=leader)
    except (PslinkTimeoutError, MembershipError) as exc:
        log.warning("agent %s: rank %d, which leads this host's ranks %s, is not there (%s); pushing to the pool "
                    "directly", seat, leader, group, exc.message)
        return None
    if body.get("host_id") != seat.host_id:
        log.warning("agent %s: rank %d, which should lead this host's ranks %s, runs on another host (%s, this is "
                    "%s); pushing to the pool directly", seat, leader, group, body.get("host_id"), seat.host_id)
        return None
    restart = functools.partial(start, seat, group, master, transports, reactor, limits, requests, sender, handles,
                                timeout)
    return HostFollower(seat, group, leader, body["address"], requests, sender, handles, restart)

