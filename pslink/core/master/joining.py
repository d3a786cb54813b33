"""Which Aggregators may join pMaster's pool.

An Aggregator joins with the address it advertises and its host's identity
(:mod:`pslink.core.hosts`). It is admitted only if its peers can dial that address: not a
wildcard, not loopback from another host than pMaster's, and answering pMaster when pMaster dials
it (from a thread: the registration goes on when the answer is in). Otherwise the registration
is refused at once, naming the address and the settings that fix it (``--advertise``,
``--interface``), and the Aggregator stops instead of retrying.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

from pslink.core import hosts
from pslink.core.master.records import AggregatorRecord
from pslink.core.master.links import AggregatorLinks
from pslink.core.master.state import MasterState
from pslink.core.master.store import MasterStore
from pslink.core.transport.rpc import RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Op
from pslink.errors import ConfigError, PslinkError

log = logging.getLogger("pslink.core.master")


class Joining:
    """Admits Aggregators for pMaster (its identity: ``host_id``). ``provider()`` names the
    Aggregators it starts (a nameless one that joins gets another name, which it reserves);
    ``joined(peer, record, request)`` takes an admitted Aggregator into the pool; ``carry_out()``
    carries out what the control plane decided meanwhile; ``resume_moves(source, entries)`` goes
    on with hand-overs a restarted pMaster had not stored; ``incoming()``: the parts moving now,
    and their targets."""

    def __init__(self, state: MasterState, store: MasterStore, reactor: Reactor, links: AggregatorLinks, *,
                 host_id: str, dial_back_timeout: float, provider: Callable,
                 joined: Callable[[RpcPeer, AggregatorRecord, dict], None], carry_out: Callable[[], None],
                 resume_moves: Callable[[str, list], None], incoming: Callable[[], dict] = dict):
        self.state, self.store, self.reactor, self.links = state, store, reactor, links
        self.host_id, self.dial_back_timeout = host_id, dial_back_timeout
        self.provider, self.joined, self.carry_out, self.resume_moves = provider, joined, carry_out, resume_moves
        self.incoming = incoming

    def register(self, peer: RpcPeer, req: dict) -> None:
        """Admit an Aggregator under a name no live one has (a second process with a live one's
        name is refused: it would take over its tasks, and the two would replace each other), once
        its advertised address is one peers can dial (see :meth:`_register_named`)."""
        name = req.get("agg")
        old = self.links.peers.get(name) if name else None
        if old is None or old is peer or old.conn.closed:
            self._register_named(peer, req)
            return
        # The old one may be dead with its connection not yet seen closed (a restart under its
        # name): one round trip tells. It answers: the newcomer is refused; else it is replaced.
        def answered(result, error):
            if peer.conn.closed:
                return
            try:
                if error is None and self.links.peers.get(name) is old and not old.conn.closed:
                    peer.error(req, ConfigError(
                        f"aggregator {name} is alive (pid {old.info.get('pid', '?')} at "
                        f"{self.state.aggregators[name].address if name in self.state.aggregators else '?'}); a second "
                        f"one under its name (from {peer.conn.peer}) is refused: give it another --name, or none",
                        agg=name))
                    return
                self._register_named(peer, req)
            except PslinkError as exc:
                peer.error(req, exc)
            finally:
                self.carry_out()

        old.call(Op.PING, answered, timeout=self.dial_back_timeout)

    def _register_named(self, peer: RpcPeer, req: dict) -> None:
        """Admit an Aggregator once its advertised address is one peers can dial: not a wildcard,
        not loopback from another host, and answering pMaster (dialed from a thread; the
        registration goes on when the answer is in). Refused otherwise, naming the address and
        the settings that fix it; the Aggregator stops."""
        address = req["address"]
        who = (f"aggregator {req['agg']}" if req.get("agg") else "an aggregator") + \
            f" (pid {req.get('pid', '?')} on host {req.get('host') or '?'}, connected from {peer.conn.peer})"
        reason = hosts.unreachable_reason(address, req.get("host_id"), self.host_id)
        if reason is not None:
            raise ConfigError(f"{who} is refused: {reason}; {hosts.ADVERTISE_HINT}", address=address)
        if address.split("://", 1)[0] not in ("tcp", "zmq+tcp"):
            self._admit(peer, req)
            return

        def dial_back() -> None:
            host, port = hosts.host_of(address), int(address.rpartition(":")[2])
            try:
                socket.create_connection((host, port), timeout=self.dial_back_timeout).close()
                problem = None
            except OSError as exc:
                problem = exc.strerror or str(exc) or type(exc).__name__
            self.reactor.post(answered, problem)

        def answered(problem: str | None) -> None:
            if peer.conn.closed:
                return
            try:
                if problem is not None:
                    peer.error(req, ConfigError(
                        f"{who} is refused: pMaster cannot reach {address}, the address it advertises ({problem}), "
                        f"so workers could not either; {hosts.ADVERTISE_HINT}", address=address))
                    return
                self._admit(peer, req)
            finally:
                self.carry_out()

        threading.Thread(target=dial_back, name="pmaster-dial-back", daemon=True).start()

    def _fenced(self, name: str, req: dict) -> list:
        """Parts an Aggregator holds that pMaster placed elsewhere meanwhile (it was failed over
        while frozen or cut off, and came back): it must drop them, not serve them. A move that
        pMaster's store does not have (it restarted after the source handed the parts over)
        is settled here instead: the source's report moves the parts to their target, and a
        target's part from a source not registered yet waits for it (:meth:`_settle_claims`)."""
        self._adopt_hand_overs(name, req.get("moved") or [])
        arrived = {tuple(e[:3]): e[3] for e in req.get("arrived") or ()
                   if self.state.reported_part(e) and len(e) == 4 and isinstance(e[3], str)}
        fenced, incoming = [], self.incoming()
        for entry in req.get("tasks") or ():
            found = self.state.reported_part(entry)
            if found is None and self.state.forgotten_part(entry):
                fenced.append(entry[:3])  # (pMaster restarted before its ASSIGN was answered, or it failed)
                continue
            if found is None or found[1].parts[found[2]].aggregator == name:
                continue
            source, ident = found[1].parts[found[2]].aggregator, tuple(entry[:3])
            if incoming.get(ident) == name:
                # A running move's target, back after its connection was cut before the move was
                # routed: it waits for the copy. (Fenced, the copy found no task, the source gave
                # it up, and the workers it sent there found none: the chaos run with control faults.)
                continue
            if arrived.get(ident) == source and source not in self.links.peers and source in self.state.aggregators:
                self.state.move_claims[ident] = (name, source)  # the source will say
                log.info("pMaster: %s holds %s from a move off %s that was not stored; waiting for %s to say",
                         name, ident, source, source)
                continue
            fenced.append(entry)
        self._settle_claims(name)
        return fenced

    def _adopt_hand_overs(self, name: str, moved: list) -> None:
        """Parts ``name`` handed over (or will at its round's end) that pMaster has no move of:
        those the table still places on it are the target's now (the Agents were sent there),
        and those whose copy has not landed are moves again (a drain of ``name`` waits for them)."""
        entries = []
        for entry in moved:
            found = self.state.reported_part(entry)
            if found is None or len(entry) != 5 or not isinstance(entry[3], str) \
                    or entry[3] not in self.state.aggregators:
                continue
            placed_on = found[1].parts[found[2]].aggregator
            if placed_on == name or placed_on == entry[3] and not entry[4]:
                entries.append(entry)
                self.state.move_claims.pop(tuple(entry[:3]), None)
        if entries:
            self.resume_moves(name, entries)

    def _settle_claims(self, source: str) -> None:
        """``source`` registered, and did not hand over the parts others claim from it: those
        copies are not the part's (the move never happened); their holders drop them."""
        for ident, (holder, claimed_from) in list(self.state.move_claims.items()):
            if claimed_from == source:
                del self.state.move_claims[ident]
                self.links.fence(holder, ident, f"{source} kept it")

    def _admit(self, peer: RpcPeer, req: dict) -> None:
        provider = self.provider()
        taken = provider.names() if provider is not None else ()
        record = self.state.register_aggregator(req["address"], req.get("agg"), req.get("pid", 0), req.get("host", ""),
                                                req.get("host_id", ""), taken=taken)
        if provider is not None and record.name not in taken:
            # The provider must not start another under its name: one an operator joined, or one
            # a pMaster killed right after starting it had named (the restarted service's provider
            # did not start it; it named a revert's Aggregator so, and that one never came: the
            # pool stayed below its floor, found by the chaos test with control faults).
            provider.reserve([record.name])
        record.lease = float(req.get("lease") or 0.0)
        old = self.links.peers.get(record.name)
        if old is not None and old is not peer:
            old.conn.close()
        self.links.peers[record.name] = peer
        peer.info.update(role="aggregator", name=record.name, pid=req.get("pid", 0))
        self.store.save_aggregator(record)
        peer.reply(req, body={"agg": record.name, "fenced": self._fenced(record.name, req)})
        log.info("aggregator %s registered at %s", record.name, record.address)
        self.joined(peer, record, req)
