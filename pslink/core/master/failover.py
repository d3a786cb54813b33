"""pMaster's side of an Aggregator failure.

An Aggregator whose connection to pMaster closed, and that has not come back within
``aggregator_grace`` (or that is silent past ``aggregator_timeout``), is gone: its parts are
re-homed (:mod:`pslink.core.master.failover_plan`) and carried out here: PROMOTE a replica, ASSIGN a fresh
part, top up replicas, ABORT keys whose state is lost; a migration off it whose copy had not
landed gets its copy from a replica (COPY_REPLICA). Agents that lost the Aggregator ask
(RELOCATE) where their parts live now; the answer waits until the failover is carried out, so
what they resend lands where it is served. An Aggregator still connected to pMaster is pinged:
answering, it is alive (the Agent's connection broke, not the Aggregator) and the Agent is
answered at once, to connect to it again.
"""

from __future__ import annotations

import logging
from typing import Callable

from pslink.core import faults
from pslink.core.master.records import AggregatorRecord, JobRecord, KeySpec, PartSpec
from pslink.core.master.links import AggregatorLinks
from pslink.core.master.migration_core import Move
from pslink.core.master.migration_io import Mover
from pslink.core.master.failover_plan import Lost, Promote, Recreate, Rereplicate, copy_sources, holdings, pick_replicas
from pslink.core.master.replica_hosts import give_replicas
from pslink.core.master.state import MasterState
from pslink.core.master.store import MasterStore
from pslink.core.transport.rpc import RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Op
from pslink.errors import KeyStateError, PeerError, PslinkError, PslinkTimeoutError

#: How long a closed-connection Aggregator's data port has to answer pMaster's PING.
PROBE_TIMEOUT = 2.0
#: After an Agent asked where a connected Aggregator's parts went: how long its ping may go
#: unanswered before its lease decides, and the margin past the lease (clock rates, delays).
LEASE_PATIENCE = 1.0
LEASE_MARGIN = 0.5

log = logging.getLogger("pslink.core.master")


class Failover:
    """Fails lost Aggregators over. ``abort_key(record, key, error)`` fails a key everywhere;
    ``spec_wire(spec)`` is a key's placement as Agents read it; ``carry_out()`` carries out what
    the control plane decided meanwhile. An Aggregator whose connection closed may come back
    within ``grace`` seconds; one silent past ``silent`` is gone."""

    def __init__(self, state: MasterState, store: MasterStore, reactor: Reactor, links: AggregatorLinks,
                 mover: Mover, *, grace: float, silent: float, migration_timeout: float,
                 abort_key: Callable[[JobRecord, object, PslinkError], None], spec_wire: Callable[[KeySpec], dict],
                 carry_out: Callable[[], None], forget: Callable[[str], None] = lambda name: None,
                 probe: Callable[[str, float, Callable[[str | None], None]], None] | None = None):
        self.state, self.store, self.reactor, self.links, self.mover = state, store, reactor, links, mover
        self.forget = forget  # a failed Aggregator's process is reaped (the pool refills itself)
        self.probe = probe  # liveness.Prober.probe: does a process answer at this address?
        self.grace, self.silent_after, self.migration_timeout = grace, silent, migration_timeout
        self.abort_key, self.spec_wire, self.carry_out = abort_key, spec_wire, carry_out
        self._relocations: dict[str, list[tuple[RpcPeer, dict]]] = {}  # lost Aggregator -> who asked
        self.failing: dict[str, int] = {}  # Aggregator being failed over -> steps still under way
        self.done = 0  # failovers carried out
        self.by_lease = 0  # of Aggregators still connected, silent past their lease
        self.alive_but_away = 0  # Aggregators whose connection closed but whose process answered
        self.copies_resourced = 0  # copies asked of a replica because a migration's source died
        self._promotes_owed: dict[str, list[tuple[str, Promote]]] = {}  # holder away -> its PROMOTEs to send again

    # -- detection ----------------------------------------------------------------------------------

    def connection_lost(self, name: str) -> None:
        """Its connection closed: unless it comes back within the grace period, or its process
        answers at its data port (:mod:`pslink.core.master.aggregator_probe`), fail it over."""
        self.reactor.call_later(self.grace, self._probe_unless_back, name)

    def _away(self, name: str, record: AggregatorRecord | None = None) -> bool:
        """``name`` is still away: not back, not failed over (nor being), the same registration."""
        now = self.state.aggregators.get(name)
        return (name not in self.links.peers and now is not None and not now.alive and name not in self.failing
                and (record is None or now is record))

    def _probe_unless_back(self, name: str) -> None:
        if not self._away(name):
            return
        record = self.state.aggregators[name]
        if not record.lease or self.probe is None:
            self.fail_over(name)  # nothing fences it while it serves on: no waiting for it
            return
        self.probe(record.address, PROBE_TIMEOUT, lambda problem: self._probed(name, record, problem))

    def _probed(self, name: str, record: AggregatorRecord, problem: str | None) -> None:
        if not self._away(name, record):
            return
        if problem is not None:
            log.warning("pMaster: aggregator %s does not answer at %s (%s)", name, record.address, problem)
            self.fail_over(name)
            return
        # Alive and serving under its lease, and dialling pMaster again: it has until its lease
        # runs out to register; by then it refuses the jobs' requests, and its parts may move.
        self.alive_but_away += 1
        log.warning("pMaster: aggregator %s lost its connection but answers at %s: waiting for it until its "
                    "lease runs out", name, record.address)
        self._fail_over_past_lease(name, record)

    def _fail_over_past_lease(self, name: str, record: AggregatorRecord) -> None:
        if not self._away(name, record):
            return
        wait = self._lease_left(record)
        if wait > 0:
            self.reactor.call_later(wait, self._fail_over_past_lease, name, record)
            return
        log.warning("pMaster: aggregator %s did not come back within its lease: failing it over", name)
        self.fail_over(name)

    def _lease_left(self, record: AggregatorRecord) -> float:
        """Seconds until ``record``'s lease (from the last heartbeat pMaster heard), and a margin, ran out."""
        return record.last_seen + record.lease + LEASE_MARGIN - self.state.clock()

    def silent(self, name: str) -> None:
        """Not heard from for ``silent`` seconds (connected or not): gone."""
        log.warning("aggregator %s silent for %.0f s: failing it over", name, self.silent_after)
        peer = self.links.peers.pop(name, None)
        if peer is not None:
            peer.conn.close()
        if name not in self.failing:
            self.fail_over(name)

    def fail_over(self, name: str) -> None:
        log.warning("pMaster: aggregator %s is gone; failing its parts over", name)
        self.failing[name] = 1  # released below, once every step is under way
        # Migrations off or onto it never end by themselves. First, while the plan still has
        # it: a queued move onto it goes back to its source in the plan before the plan forgets it.
        stays = self.mover.aggregator_lost(name)
        actions = self.state.fail_over(name, stays, self.mover.core.incoming())
        # Stored before ``name`` is forgotten: a pMaster killed from here on resumes from where
        # the parts go, and its re-sent ASSIGNs promote the replicas (Moves.promote_placed). (Not
        # stored, a restart found the parts on an Aggregator it no longer knew, and answered the
        # Agents with no address for them.)
        for record, spec in {id(a.spec): (a.record, a.spec) for a in actions if not isinstance(a, Lost)}.values():
            self.store.save_key(record.job, spec)
        self.store.delete_aggregator(name)
        faults.reached("pmaster", "failover")  # (tests: a pMaster killed here restarts from the store)
        self.forget(name)
        for action in actions:
            if isinstance(action, Promote):
                self._promote(name, action)
            elif isinstance(action, Recreate):
                self._assign_part(name, action.record, action.spec, action.part)
            elif isinstance(action, Rereplicate):
                self._rereplicate(action)
            elif isinstance(action, Lost):
                log.error("pMaster: %s", action.error.message)
                self.abort_key(action.record, action.spec.key, action.error)
        self._drop_claims_from(name)
        for waiting, _ in self._promotes_owed.pop(name, []):
            self._step_done(waiting)  # its parts were failed over again just now
        self._step_done(name)
        self.carry_out()

    def _drop_claims_from(self, name: str) -> None:
        """Copies of ``name``'s parts from a move pMaster never stored (Joining): with ``name``
        gone nobody can say it happened; the failover placed its parts (from their replicas,
        which hold every answered round), and the claimed copies go."""
        for ident, (holder, source) in list(self.state.move_claims.items()):
            if source != name:
                continue
            del self.state.move_claims[ident]
            found = self.state.reported_part(list(ident))
            if found is None or found[1].parts[ident[2]].aggregator != holder:
                self.links.fence(holder, ident, f"{name}, the source of its move, is gone")

    def _promote(self, lost: str, action: Promote) -> None:
        if self.links.get(action.part.aggregator) is not None:
            self.failing[lost] += 1
            self._send_promote(lost, action)

    def _send_promote(self, lost: str, action: Promote) -> None:
        part, peer = action.part, self.links.get(action.part.aggregator)

        def promoted(result, error):
            if isinstance(error, PeerError) and part.aggregator in self.state.aggregators:
                # Lost with the holder's connection (it may have promoted or not): sent again
                # when it registers again; the Agents asking where the parts went wait for it.
                log.warning("pMaster: promoting %s's replica of key %r part %d: %s; again once it is back",
                            part.aggregator, action.spec.key, part.part, error)
                self._promotes_owed.setdefault(part.aggregator, []).append((lost, action))
                return
            if error is not None and action.moving:
                self._promote_replica_instead(lost, action)  # before the step below is done
            elif error is not None:
                log.error("pMaster: promoting %s's replica of key %r part %d failed: %s", part.aggregator,
                          action.spec.key, part.part, error)
            else:
                log.info("pMaster: key %r part %d of job %s now served by %s (was %s)", action.spec.key, part.part,
                         action.record.job, part.aggregator, lost)
                faults.reached("pmaster", "promoted")
                self.store.save_key(action.record.job, action.spec)
            self._step_done(lost)

        peer.call(Op.PROMOTE, promoted, timeout=self.links.timeout, job=action.record.job, key=action.spec.key,
                  part=part.part, replicas=[[r, self.links.address_of(r)] for r in part.replicas])

    def _promote_replica_instead(self, lost: str, action: Promote) -> None:
        """The source of a move onto ``lost`` had handed the part over (frozen for its copy, or
        let go once the copy landed): the target may have answered rounds since, which only the
        part's replicas have. Promote one, and top the replicas up again."""
        record, spec, part, source = action.record, action.spec, action.part, action.part.aggregator
        live = [r for r in part.replicas if r in self.links.peers]
        if not live:
            error = KeyStateError(f"key {spec.key!r} of job {record.job!r}: aggregator {lost} is gone while part "
                                  f"{part.part} moved onto it, and no replica is left", job=record.job, key=spec.key)
            log.error("pMaster: %s", error.message)
            self.abort_key(record, spec.key, error)
            return
        log.info("pMaster: %s had handed key %r part %d over to %s; promoting its replica on %s", source,
                 spec.key, part.part, lost, live[0])
        part.aggregator, part.replicas = live[0], live[1:]
        self.state.control.task_recovered((record.job, spec.key, part.part), part.aggregator)
        added = pick_replicas(self.state.replica_candidates(), holdings(self.state.jobs),
                              record.replication - len(part.replicas),
                              exclude={part.aggregator, source, lost, *part.replicas},
                              hosts=self.state.control.pool.host_of, away_from=[part.aggregator, *part.replicas])
        part.replicas += added
        self._promote(lost, Promote(record, spec, part, lost))
        if added:
            self._rereplicate(Rereplicate(record, spec, part, added))

    def copy_from_replica(self, move: Move, lost: str) -> None:
        """``lost`` was the source of ``move``, told to hand the part over (MIGRATE) and gone
        before its copy was known to land. It may have handed the part over (pMaster's lookups,
        and the workers it answered, point at the target, which holds their requests until the
        copy comes), so failing the part over to a replica would leave them waiting for ever.
        The move goes on instead: a replica, which has every round the source acknowledged, sends
        its state to the target as the copy. Without a replica able to, the key fails loudly. A
        failover step: Agents that lost ``lost`` are answered after it."""
        task = move.task
        job, key, part = task
        record = self.state.jobs.get(job)
        spec = record.keys.get(key) if record is not None else None
        if spec is None or part >= len(spec.parts):
            self.mover.give_up(task)
            return
        self.mover.stop_deadline(task)  # it would force the dead source's MIGRATE
        placed = spec.parts[part]
        if placed.aggregator != move.target:
            # The MIGRATE's answer never came; the source may have taken it: as if it had.
            placed.aggregator = move.target
            self.store.save_key(job, spec)
        sources = copy_sources(placed.replicas, move.target, move.held_replica, self.links.peers, lost)
        log.warning("pMaster: %s is gone before its copy of %s landed on %s; copying it from a replica (%s)",
                    lost, task, move.target, ", ".join(sources) or "none left")
        self.failing[lost] += 1
        self._copy_from(lost, move, sources)

    def _copy_from(self, lost: str, move: Move, sources: list[str]) -> None:
        """Ask the first of ``sources`` still connected for the copy (COPY_REPLICA, answered once
        the copy landed); on failure the next one; when none is left, fail the key."""
        task = move.task
        job, key, part = task
        target = move.target
        while sources:
            name, sources = sources[0], sources[1:]
            peer = self.links.get(name)
            if peer is None:
                continue
            self.mover.core.resourced(task, name)  # the move's source now (status, releases, its failover)
            self.copies_resourced += 1

            def copied(result, error, name=name):
                if self.mover.core.running.get(task) is not move or move.source != name:
                    self._step_done(lost)  # ended meanwhile (its job ended, or its target is gone)
                elif error is None:
                    log.info("pMaster: %s's replica on %s is now on %s (its source %s is gone)", task, name,
                             target, lost)
                    self.mover.copy_landed(task)
                    self._step_done(lost)
                else:
                    log.warning("pMaster: copying %s from %s's replica to %s failed: %s", task, name, target, error)
                    self._copy_from(lost, move, sources)

            # Bounded: a replica that never answers must not leave the target waiting for ever.
            peer.call(Op.COPY_REPLICA, copied, timeout=self.links.timeout + self.migration_timeout, job=job,
                      key=key, part=part, target=[target, self.links.address_of(target)])
            return
        record = self.state.jobs.get(job)
        if record is not None and key in record.keys:
            why = ("the job keeps no replica (replication 0)" if not record.replication
                   else "no live replica holds its state")
            error = KeyStateError(
                f"key {key!r} part {part} of job {job!r}: aggregator {lost} is gone after it handed the part over to "
                f"{target} and before its copy landed, and {why}; set replication=1 to survive this",
                job=job, key=key)
            log.error("pMaster: %s", error.message)
            self.abort_key(record, key, error)  # the target fails what waits for the copy
        self.mover.give_up(task)
        self._step_done(lost)

    def _assign_part(self, lost: str, record: JobRecord, spec: KeySpec, part: PartSpec) -> None:
        peer = self.links.get(part.aggregator)
        if peer is None:
            return
        self.failing[lost] += 1
        # It starts afresh and takes up the round the workers are at (their resent pushes say).
        # In optimizer mode, or a table's shard, it starts from the part's last checkpoint
        # (recovery lets none other here).
        restore = record.mode == "optimizer" or spec.table is not None
        entries = [dict(e, rebase=True, restore=restore) for e in spec.task_specs(part.aggregator, self.links.address_of)
                   if e["part"] == part.part]

        def assigned(result, error):
            if error is not None:
                log.error("pMaster: re-creating key %r part %d on %s failed: %s", spec.key, part.part,
                          part.aggregator, error)
            else:
                self.store.save_key(record.job, spec)
            self._step_done(lost)

        peer.call(Op.ASSIGN, assigned, timeout=self.links.timeout, jobinfo=record.jobinfo(), tasks=entries)

    def _rereplicate(self, action: Rereplicate) -> None:
        """Tell the new replicas what they hold, then the part's Aggregator its replicas."""
        self.store.save_key(action.record.job, action.spec)
        give_replicas(self.links, action.record, action.spec, action.part, action.added)

    def _step_done(self, lost: str) -> None:
        self.failing[lost] -= 1
        if self.failing[lost] == 0:
            del self.failing[lost]
            self.done += 1
            self._answer_relocations(lost)

    # -- Agents asking where their parts went -----------------------------------------------------------

    def relocate(self, peer: RpcPeer, req: dict) -> None:
        """RELOCATE: ``parts`` = [[key, part, aggregator it lost], ...]. Answered once pMaster has
        failed that Aggregator over (or at once, if it already has, or once it answers a ping)."""
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        lost = {str(entry[2]) for entry in req["parts"] if isinstance(entry, list) and len(entry) == 3}
        # An Agent may see the connection break before pMaster does (or alone, a glitch between
        # the two): the answer waits for the failover, or for the Aggregator to prove alive.
        pending = [n for n in lost if n in self.failing or n in self.state.aggregators]
        if pending:
            name = pending[0]
            self._relocations.setdefault(name, []).append((peer, req))
            # An Aggregator that never fails over (it came back, or pMaster cannot decide): answer anyway.
            wait = self.grace + self.silent_after
            self.reactor.call_later(wait, self._answer_one, name, peer, req)
            connected = self.links.get(name)
            if name not in self.failing and connected is not None:
                # Connected to pMaster: whether it is alive, one round trip tells. Dead, its
                # connection closes and the failover answers; silent, the timer above does.
                def alive(result, error):
                    if error is None or not isinstance(error, (PeerError, PslinkTimeoutError)):
                        if name not in self.failing and self.links.get(name) is connected:
                            self._answer_one(name, peer, req)

                connected.call(Op.PING, alive, timeout=wait)
                # If it says nothing (frozen, or cut off from pMaster only), its lease is what
                # fences it: once that ran out it serves nobody, and its parts may go elsewhere.
                self.reactor.call_later(LEASE_PATIENCE, self._silent_past_lease, name, connected)
            return
        self._answer_relocation(record, peer, req)

    def _silent_past_lease(self, name: str, connected: RpcPeer) -> None:
        """An Agent asked where ``name``'s parts went and ``name`` has not answered pMaster's
        ping: fail it over once its lease (counted from the last heartbeat pMaster heard) is
        over, instead of after ``aggregator_timeout``: it refuses data requests by then."""
        record = self.state.aggregators.get(name)
        if (record is None or not record.lease or not self._relocations.get(name) or name in self.failing
                or self.links.get(name) is not connected):
            return  # no lease to rely on, nobody waits, it answered (or went) meanwhile
        wait = self._lease_left(record)
        if wait > 0:
            self.reactor.call_later(wait, self._silent_past_lease, name, connected)
            return
        log.warning("pMaster: aggregator %s does not answer and its lease ran out %.1f s ago: failing it over",
                    name, -wait)
        self.links.peers.pop(name, None)
        connected.conn.close()  # should it come back, it registers again and is told what to drop
        record.alive = False
        self.by_lease += 1
        self.fail_over(name)

    def aggregator_back(self, name: str) -> None:
        """``name`` registered (again, or for the first time since a pMaster restart): it is
        alive, so the Agents that asked where its parts went are answered now, to go back to it
        (they waited ``grace + silent`` for that before: 15.5 s after every pMaster restart)."""
        for lost, action in self._promotes_owed.pop(name, []):
            self._send_promote(lost, action)
        if name not in self.failing:
            self._answer_relocations(name)

    def _answer_relocations(self, name: str) -> None:
        for peer, req in self._relocations.pop(name, []):
            record = self.state.jobs.get(req["job"])
            if record is not None:
                self._answer_relocation(record, peer, req)

    def _answer_one(self, name: str, peer: RpcPeer, req: dict) -> None:
        waiting = self._relocations.get(name, [])
        if (peer, req) in waiting:
            waiting.remove((peer, req))
            record = self.state.jobs.get(req["job"])
            if record is not None:
                self._answer_relocation(record, peer, req)

    def _answer_relocation(self, record: JobRecord, peer: RpcPeer, req: dict) -> None:
        keys = {entry[0] for entry in req["parts"] if isinstance(entry, list) and entry}
        specs = [record.keys[k] for k in keys if k in record.keys]
        lost = [[s.key, s.aborted.message] for s in specs if s.aborted is not None]
        peer.reply(req, body={"keys": [self.spec_wire(s) for s in specs], "lost": lost})
