"""pMaster carrying out migrations: the I/O around the pure migration core
(:mod:`pslink.core.master.migration_core`).

The target learns the task first (ASSIGN, waiting for its copy), then the source lets it go
(MIGRATE: at its round's end, or at once when forced after ``migration_timeout``); once the
source took the order, new lookups go to the target. Neither order times out: an order
delayed (a partition) may still be carried out, so only its answer or the loss of its
Aggregator decides the move. A batch (one job's tasks between two
Aggregators: one migration) is one ASSIGN and one MIGRATE for all its tasks. The Aggregators report TENSOR_COPY_DONE and
WORKER_DONE. A move that fails to start goes back to its source in the control plane's plan.
"""

from __future__ import annotations

import logging
from typing import Callable

from pslink.core import faults
from pslink.core.master.actions import Migrate
from pslink.core.master.links import AggregatorLinks
from pslink.core.master.migration_core import (Begin, CopyFromReplica, Dropped, Finished, HandOver, Migrated, Migrations,
                                           Move, Routed, Settle, bytes_of)
from pslink.core.master.failover_plan import holdings, pick_replicas
from pslink.core.master.state import MasterState
from pslink.core.master.store import MasterStore
from pslink.core.transport.rpc import RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Op
from pslink.errors import AuthError, ServiceError

log = logging.getLogger("pslink.core.master")


def task_bytes(state: MasterState, task: tuple) -> int:
    """The bytes a migration of ``task`` copies (0 for a part pMaster no longer has)."""
    job, key, part = task
    record = state.jobs.get(job)
    spec = record.keys.get(key) if record is not None else None
    return 0 if spec is None or part >= len(spec.parts) else bytes_of(record, spec, part)


class Mover:
    """Carries out the migration core's actions for pMaster (``core``, which the pool and the
    replicas read too). ``settled(names)``: moves involving these Aggregators ended (the pool
    releases what waited); ``removal_failed(source, task, target, error)``: a move off an
    Aggregator being removed failed; ``moved(task)``: a move is done (its replicas may need
    another host); ``copy_from_replica(move, lost)``: the failover has a replica send a move's
    copy."""

    def __init__(self, state: MasterState, store: MasterStore, reactor: Reactor, links: AggregatorLinks,
                 core: Migrations, *, migration_timeout: float, settled: Callable[[list], None],
                 removal_failed: Callable, moved: Callable[[tuple], None],
                 copy_from_replica: Callable[[Move, str], None]):
        self.state, self.store, self.reactor, self.links = state, store, reactor, links
        self.core = core
        self.refused = 0  # reports on moves from peers not entitled to them
        self.migration_timeout = migration_timeout
        self.settled, self.removal_failed, self.moved = settled, removal_failed, moved
        self.copy_from_replica = copy_from_replica
        self._timers: dict[tuple, object] = {}  # task -> its deadline (forcing the hand-over)
        # The control plane's guard does not judge a job whose tasks move.
        state.control.moving_jobs = lambda: self.core.moving_jobs() | state.control.jobs_waiting_to_move()

    # -- events in ----------------------------------------------------------------------------------

    def migrate(self, actions: list[Migrate]) -> None:
        """One decision's moves (the core makes batches of them)."""
        self.carry(self.core.request_many(actions, self.state.clock()))

    def progress(self, peer: RpcPeer, req: dict) -> None:
        """TENSOR_COPY_DONE or WORKER_DONE from an Aggregator: only from the move's source, over
        the connection it registered on (a forged report would end a move whose copy never
        landed, and the job would be sent to an Aggregator without its state)."""
        task = (req["job"], req["key"], req["part"])
        move = self.core.running.get(task)
        sender = peer.info.get("name") if peer.info.get("role") == "aggregator" else None
        # The source reports its copy landed; the target, that every worker reached it.
        entitled = None if move is None else (move.source if req["op"] == Op.TENSOR_COPY_DONE else move.target)
        if sender is None or (move is not None and sender != entitled):
            self.refused += 1
            raise AuthError(f"{req['op'].name} for job {req['job']!r} key {req['key']!r} part {req['part']} from "
                            f"{peer.conn.peer} refused: only the move's own Aggregator reports on it"
                            + (f" ({entitled}, not {sender})" if sender else " (this is no registered Aggregator)"),
                            job=req["job"])
        now = self.state.clock()
        if req["op"] == Op.TENSOR_COPY_DONE:
            faults.reached("pmaster", "copy-landed")
            self.carry(self.core.copy_done(task, now))
        else:
            self.carry(self.core.workers_done(task, now))

    def copy_landed(self, task: tuple) -> None:
        """A replica's copy of a move whose source is lost landed (the failover asked for it)."""
        self.carry(self.core.copy_done(task, self.state.clock()))

    def give_up(self, task: tuple) -> None:
        """A move ends undone because its source is gone (the failover places the task)."""
        self.carry(self.core.abandon(task, self.state.clock(), why="abandoned"))

    def aggregator_lost(self, name: str) -> dict[tuple, str]:
        stays, actions = self.core.aggregator_lost(name, self.state.clock())
        for action in actions:
            if isinstance(action, Finished) and action.move.target == name and not action.move.copied:
                # A removal draining the source fails: it keeps the task (and the pool, it).
                self.removal_failed(action.move.source, action.move.task, name, ServiceError(f"{name} is gone"))
        self.carry(actions)
        return stays

    def resume(self, source: str, entries: list) -> None:
        """Hand-overs ``source`` reports at its registration that pMaster has no move of
        (``[job, key, part, target, landed]``: pMaster restarted after the source took the
        MIGRATE): the Agents were sent to the target, so the parts are the target's; the moves
        go on (:meth:`Migrations.resume`), and a drain of ``source`` waits for their copies."""
        resumed = []
        for job, key, part, target, landed in entries:
            if (job, key, part) in self.core.running or (job, key, part) in self.core.throttled:
                continue  # a move of this pMaster's (the source reconnected): it goes on as it was
            record = self.state.jobs.get(job)
            placed = record.keys[key].parts[part]
            if target in placed.replicas:  # it serves the part now; the move's end tops the replicas up
                placed.replicas.remove(target)
            if target not in self.state.control.pool.cluster_of:
                self.state.control.aggregator_added(target)  # (registers later: as at a restart's load)
            try:  # the plan follows (its Migrate is what already happened: not carried out)
                self.state.control.move_task((job, key, part), target, "resumed")
            except KeyError:
                pass
            log.warning("pMaster: %s had handed %s over to %s (copy %s) before pMaster restarted; the move goes on",
                        source, (job, key, part), target, "landed" if landed else "in flight")
            resumed.append(((job, key, part), target, bool(landed)))
        self.carry(self.core.resume(source, resumed, self.state.clock()))

    def job_ended(self, job: str) -> None:
        self.carry(self.core.job_ended(job, self.state.clock()))

    # -- actions out --------------------------------------------------------------------------------

    def carry(self, actions: list) -> None:
        settle: list = []
        begins: dict[int, list[Move]] = {}  # by batch: one ASSIGN, then one MIGRATE, for each
        hand_overs: dict[int, list[Move]] = {}
        for action in actions:
            try:
                if isinstance(action, Begin):
                    begins.setdefault(action.move.batch, []).append(action.move)
                elif isinstance(action, HandOver):
                    hand_overs.setdefault(-1 if action.force else action.move.batch, []).append(action.move)
                elif isinstance(action, Routed):
                    self._routed(action.move)
                elif isinstance(action, Finished):
                    self._finished(action.move, action.why)
                elif isinstance(action, Migrated):
                    batch = action.batch
                    log.info("pMaster: migrated %d part(s) of job %r to %s (%s, %d bytes)", batch.moved,
                             batch.job, batch.target, batch.reason, batch.bytes)
                elif isinstance(action, Dropped):
                    self._dropped(action.action, action.why)
                elif isinstance(action, CopyFromReplica):
                    self.copy_from_replica(action.move, action.lost)
                elif isinstance(action, Settle):
                    settle += action.names
            except Exception:
                log.exception("pMaster: carrying out %r failed", action)
        for moves in begins.values():
            self._guarded(self._begin, moves)
        for batch, moves in hand_overs.items():
            if batch == -1:
                for move in moves:
                    self._guarded(self._force, move)
            else:
                self._guarded(self._hand_over, moves)
        if settle:
            self.settled(list(dict.fromkeys(settle)))

    @staticmethod
    def _guarded(step: Callable, what) -> None:
        try:
            step(what)
        except Exception:
            log.exception("pMaster: carrying out %r failed", what)

    def _begin(self, moves: list[Move]) -> None:
        """The new place first learns the batch's tasks (waiting for their copies), then the old
        one lets them go."""
        now = self.state.clock()
        target = moves[0].target
        tasks, ready, refused = [], [], []
        record = self.state.jobs.get(moves[0].task[0])
        for move in moves:
            job, key, part = move.task
            spec = record.keys.get(key) if record is not None else None
            if spec is None or move.source not in self.links.peers or target not in self.links.peers:
                why = "unknown task" if spec is None else "Aggregator not connected"
                log.warning("pMaster: cannot migrate %s from %s to %s (%s)", move.task, move.source, target, why)
                # Failed (a removal waiting for this move keeps its Aggregator; the plan goes back).
                refused.append(move)
                continue
            placed = spec.parts[part]
            # Should the source die before its copy lands, the target may hold the only replica with
            # the part's state (the source keeps replicating to it: see Failover.copy_from_replica).
            move.held_replica = target in placed.replicas
            if move.held_replica:
                self._replica_off(record, spec, part, target, move.source)
            tasks += [dict(t, incoming=True, **{"from": move.source})
                      for t in spec.task_specs(None, self.links.address_of) if t["part"] == part]
            ready.append(move)
        actions: list = []
        for move in refused:
            actions += self.core.target_ready(move.task, False, now)
        self.carry(actions)
        if not ready:
            return

        def assigned(result, error):
            if error is not None:
                log.warning("pMaster: migration of %d part(s) of job %r to %s failed to start: %s", len(ready),
                            ready[0].task[0], target, error)
            done: list = []
            for move in ready:
                done += self.core.target_ready(move.task, error is None, self.state.clock())
            self.carry(done)

        self.links.call(target, Op.ASSIGN, assigned, until_lost=True, jobinfo=record.jobinfo(), tasks=tasks)

    def _replica_off(self, record, spec, part: int, target: str, source: str) -> None:
        """``target`` held a replica of the part; now it serves it: another Aggregator holds the
        replica (told at once: ASSIGN)."""
        placed = spec.parts[part]
        placed.replicas.remove(target)
        added = pick_replicas(self.state.replica_candidates(), holdings(self.state.jobs),
                              record.replication - len(placed.replicas), exclude={target, source, *placed.replicas},
                              hosts=self.state.control.pool.host_of, away_from=[target, *placed.replicas])
        placed.replicas += added
        for name in added:
            self.links.tell(name, Op.ASSIGN, f"giving {name} a replica of {(record.job, spec.key, part)}",
                            jobinfo=record.jobinfo(), tasks=[e for e in spec.task_specs(name) if e["part"] == part])

    def _force(self, move: Move) -> None:
        """No round of a routed move closed in time: its source hands the task over now."""
        job, key, part = move.task
        log.info("pMaster: no round of %s closed within %.0f s; moving it now", move.task, self.migration_timeout)
        if not self.links.call(move.source, Op.MIGRATE, self.links.log_failure(f"forcing the migration of {move.task}"),
                               job=job, key=key, part=part, target=[move.target, self.links.address_of(move.target)],
                               force=True):
            self.give_up(move.task)  # its source is gone: nothing will end it

    def _hand_over(self, moves: list[Move]) -> None:
        """Each source hands its tasks of the batch over at their round's end (one MIGRATE each)."""
        by_source: dict[str, list[Move]] = {}
        for move in moves:
            by_source.setdefault(move.source, []).append(move)
        for some in by_source.values():
            self._guarded(self._hand_over_from, some)

    def _hand_over_from(self, moves: list[Move]) -> None:
        source, job = moves[0].source, moves[0].task[0]
        target = [moves[0].target, self.links.address_of(moves[0].target)]

        def started(result, error):
            faults.reached("pmaster", "hand-over")
            failed = {(key, part): why for key, part, why in ((result or {}).get("body") or {}).get("failed") or ()}
            if error is not None:
                log.warning("pMaster: migration of %d part(s) of job %r to %s failed to start: %s", len(moves), job,
                            target[0], error)
            for (key, part), why in failed.items():
                log.warning("pMaster: migration of %s to %s failed to start: %s", (job, key, part), target[0], why)
            done: list = []
            for move in moves:
                ok = error is None and move.task[1:] not in failed
                done += self.core.handed_over(move.task, source, ok, self.state.clock())
            self.carry(done)

        # From here on the source may hand the parts over (and send workers to the target)
        # at any time, before pMaster hears that it took the MIGRATE. So no timeout: a MIGRATE
        # held up by a partition reaches the source when the link heals, and a move given up
        # meanwhile would leave the parts half-moved (workers sent to a target pMaster does not
        # route to). The answer, or the source's loss (the failover ends its moves), ends it.
        if not self.links.call(source, Op.MIGRATE, started, until_lost=True, job=job, target=target,
                               parts=[[move.task[1], move.task[2]] for move in moves]):
            started(None, ServiceError(f"aggregator {source} is not connected"))

    def _routed(self, move: Move) -> None:
        job, key, part = move.task
        record = self.state.jobs.get(job)
        spec = record.keys.get(key) if record is not None else None
        if spec is not None:
            spec.parts[part].aggregator = move.target  # new lookups go there already
            self.store.save_key(job, spec)
        self._timers[move.task] = self.reactor.call_later(self.migration_timeout, self._deadline, move.task)

    def stop_deadline(self, task: tuple) -> None:
        timer = self._timers.pop(task, None)
        if timer is not None:
            timer.cancel()

    def _deadline(self, task: tuple) -> None:
        self._timers.pop(task, None)
        self.carry(self.core.deadline(task))

    def _finished(self, move: Move, why: str) -> None:
        self.stop_deadline(move.task)
        if why == "done":
            log.debug("pMaster: migrated %s from %s to %s in %.3f s (%s)", move.task, move.source, move.target,
                      self.state.clock() - move.started, move.reason)
            self.moved(move.task)
        elif why == "failed":
            self.removal_failed(move.source, move.task, move.target, ServiceError("the move failed to start"))
            self._plan_back(move.task, move.source)

    def _dropped(self, action: Migrate, why: str) -> None:
        if why not in ("failed", "preceded"):
            return
        log.warning("pMaster: %s stays where it is: its move from %s to %s is off (%s)", action.task, action.source,
                    action.target, "the move before it did not finish" if why == "preceded" else "an Aggregator of it "
                    "is gone")
        self.removal_failed(action.source, action.task, action.target,
                            ServiceError(f"the move of {action.task} before it failed"))
        if why == "failed":
            self._plan_back(action.task, action.source)  # (after a move that failed, its own ending did)

    def _plan_back(self, task: tuple, source: str) -> None:
        if source in self.state.control.pool.cluster_of:
            try:
                self.state.control.move_task(task, source, "migration failed")  # the plan goes back
            except KeyError:
                pass  # the plan no longer places it (its job ended, or a failover re-placed it)
