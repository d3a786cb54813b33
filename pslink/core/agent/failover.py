"""What an Agent does when it loses an Aggregator.

The requests waiting on the lost Aggregator are not failed at once: the Agent asks pMaster where
the parts live now (RELOCATE; pMaster answers once it has promoted a replica or started the part
afresh elsewhere) and sends the same requests, unchanged, to the new place. A job with replicas
sees a pause and nothing else: the new place has every round a worker was answered for, and a
round it gets twice it applies once. When the key's state is lost with the Aggregator (no
replica in optimizer mode) the requests fail with pMaster's explanation; when pMaster knows no
better place, with the lost connection's error, as before. When the Aggregator is alive (it
answers pMaster: the connection broke, not the Aggregator) pMaster says so at once and the Agent
connects to it again, asking again (``RELOCATE_ATTEMPTS`` in all) while connecting fails.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from pslink.core.agent.keys import KeyInfo

from pslink.core.agent.requests import Link, Requests

from pslink.core.agent.seat import Seat
from pslink.core.agent.master_link import MasterLink
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Op
from pslink.errors import KeyStateError, PeerError, PslinkError

log = logging.getLogger("pslink.core.agent.agent")

#: How often an Agent asks pMaster where a lost Aggregator's parts are when pMaster keeps
#: answering "still there" and connecting there keeps failing, and the pause before asking again
#: (times the attempt): then the requests fail with the connection's error.
RELOCATE_ATTEMPTS = 3
RELOCATE_BACKOFF = 0.2
#: Asking pMaster while it is down (restarting): the pause before asking again. Nobody fails the
#: Aggregator over meanwhile; the requests wait, up to the job's timeout, for pMaster to say.
MASTER_DOWN_PAUSE = 0.5


class Failover:
    """Moves the requests of a lost Aggregator to where pMaster says their parts are now.
    ``keys``: the Agent's key table (parts move in place); ``enabled``: False fails them at once
    (``failover=False``); ``closed()``: the Agent closed."""

    def __init__(self, seat: Seat, keys: dict[object, KeyInfo], requests: Requests, master: MasterLink,
                 reactor: Reactor, *, enabled: bool, closed: Callable[[], bool]):
        self.seat, self.keys, self.requests, self.master, self.reactor = seat, keys, requests, master, reactor
        self.enabled = enabled
        self.closed = closed
        self.rounds_lost: dict = {}  # key -> (rounds of updates lost, checkpoint round) after a restart
        self.rounds_lost_by_part: dict = {}  # (key, part) -> the same: parts may restart from different rounds

    def link_lost(self, link: Link, exc, rids: list[int] | None = None) -> None:
        """``rids`` (default: every request waiting on ``link``) lost their Aggregator."""
        reason = exc.message if isinstance(exc, PslinkError) else str(exc)
        error = PeerError(f"lost connection to aggregator {link.name} at {link.address}: {reason}", peer=link.address)
        rids = list(link.pending) if rids is None else rids
        if not self.enabled or self.closed():
            self.requests.fail(rids, error)
            return
        log.warning("agent %s: lost aggregator %s (%s); asking pMaster where its parts went", self.seat, link.name,
                    reason)
        self._ask_where(link.name, rids, error, 1)

    def _ask_where(self, lost: str, rids: list[int], error: PeerError, attempt: int,
                   deadline: float | None = None) -> None:
        if self.closed():
            return
        deadline = time.monotonic() + self.master.timeout if deadline is None else deadline
        # Off the driving thread: asking pMaster waits for an answer, which this thread delivers.
        threading.Thread(target=self._relocate, args=(lost, rids, error, attempt, deadline), daemon=True,
                         name=f"pslink-relocate-{lost}").start()

    def _relocate(self, lost: str, rids: list[int], error: PeerError, attempt: int = 1,
                  deadline: float = float("inf")) -> None:
        if self.closed():
            return
        parts = [[info.key, part.index, lost] for info in list(self.keys.values()) for part in info.parts
                 if part.aggregator == lost]
        try:
            body = self.master.call(Op.RELOCATE, parts=parts)
        except PslinkError as exc:
            # pMaster went away (killed, restarting) before it said: it knows where the parts
            # are once it is back (found by the chaos run: these requests failed instead).
            if isinstance(exc, PeerError) and time.monotonic() + MASTER_DOWN_PAUSE < deadline \
                    and any(r in self.requests.pending for r in rids):
                log.info("agent %s: pMaster is unreachable (%s); asking where aggregator %s's parts went again "
                         "in %.1f s", self.seat, exc.message, lost, MASTER_DOWN_PAUSE)
                self.reactor.call_later(MASTER_DOWN_PAUSE, self._ask_where, lost, rids, error, attempt, deadline)
                return
            log.error("agent %s: pMaster could not say where aggregator %s's parts went: %s", self.seat, lost, exc)
            self.reactor.post(self.requests.fail, rids, error)
            return
        for spec in body.get("keys", []):
            info = self.keys.get(spec["key"])
            if info is None:
                continue
            timeline = self.requests.handles.timeline
            for index, _start, _stop, aggregator, address in spec["parts"]:
                if timeline is not None:
                    timeline.part_moved("relocated", info.key, index, info.parts[index].aggregator, aggregator)
                info.parts[index].move(aggregator, address)  # in place: pending requests share it
        lost_keys = {key: message for key, message in body.get("lost", [])}
        self.reactor.post(self._resend, lost, rids, error, lost_keys, attempt)

    def _resend(self, lost: str, rids: list[int], error: PeerError, lost_keys: dict, attempt: int = 1) -> None:
        """On the driving thread: each request goes again, as it was, to where its part is now."""
        again = []
        for rid in rids:
            request = self.requests.pending.get(rid)
            if request is None:
                continue  # answered or failed meanwhile
            key = request.info.key
            if key in lost_keys:
                self.requests.fail([rid], KeyStateError(lost_keys[key], key=key))
                continue
            part = request.part
            aggregator, address = part.where
            try:
                # Where pMaster says the part is; the same Aggregator when it is still alive
                # (the connection broke, not the Aggregator): connect to it again.
                link = self.requests.link(aggregator, address)
            except PslinkError as exc:
                log.warning("agent %s: cannot connect to aggregator %s at %s (where key %r part %d is): %s",
                            self.seat, aggregator, address, key, part.index, exc.message)
                if aggregator == lost and attempt < RELOCATE_ATTEMPTS:
                    again.append(rid)  # pMaster found it alive: ask again (it fails over a dead one)
                elif aggregator == lost:
                    self.requests.fail([rid], PeerError(f"{error.message}; reconnecting failed {attempt} time(s): "
                                                         f"{exc.message}", peer=address))
                else:
                    self.requests.fail([rid], PeerError(f"cannot reach aggregator {aggregator} at {address} "
                                                         f"(where key {key!r} part {part.index} went): {exc.message}",
                                                         peer=address))
                continue
            request.link = link
            link.pending.add(rid)
            self.requests.transmit(rid, request, request.frames)
        if again:
            self.reactor.call_later(RELOCATE_BACKOFF * attempt, self._ask_where, lost, again, error, attempt + 1)
        log.info("agent %s: resent %d request(s) after losing aggregator %s", self.seat, len(rids) - len(again), lost)

    def rounds_lost_at(self, key, part: int, lost: list) -> None:
        """Part ``part`` of ``key`` restarted from its checkpoint: ``lost`` = [rounds lost,
        checkpoint round]. Said once per key and restart, as an error: training goes on, but not
        from where it was."""
        rounds, restored = int(lost[0]), int(lost[1])
        self.rounds_lost_by_part[(key, part)] = (rounds, restored)
        if self.rounds_lost.get(key, (0, -1)) == (rounds, restored):
            return  # the other parts of the key, or the pull after a push, say the same
        self.rounds_lost[key] = (rounds, restored)
        log.error("agent %s: key %r lost its Aggregator with no replica and restarted from its checkpoint of "
                  "round %d: %d round(s) of updates are lost (set replication=1 to lose none)", self.seat, key,
                  restored, rounds)
