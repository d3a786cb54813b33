"""pMaster: the registry of jobs, workers and Aggregators, and the placement of tasks.

pMaster is off the data path: Agents ask it where a key lives once (LOOKUP), then talk to
Aggregators directly. Decisions are made by :class:`~pslink.core.master.state.MasterState`; this
shell receives control messages, sends assignments to Aggregators (and waits for their
acknowledgement before telling an Agent where to go, so no data request can reach an Aggregator
before the task exists there), and writes state through to SQLite.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from pslink.core import hosts
from pslink.core.master.control import Allocate, ControlPlane, Migrate, Release
from pslink.core.wire.loop import Reactor, ReactorThread
from pslink.core.master.joining import MasterHosts
from pslink.core.master.pool import MasterPool
from pslink.core.master.failover import MasterRecovery
from pslink.core.master.throttle import MasterThrottle
from pslink.core.master.state import JobRecord, KeySpec, MasterState
from pslink.core.master.recovery import holdings, pick_replicas
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits, Op
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.master.store import MasterStore
from pslink.core.transport import Transports
from pslink.errors import (
    ClosedError,
    MembershipError,
    ProtocolError,
    PslinkError,
    ServiceError,
    ShapeMismatchError,
)

log = logging.getLogger(__name__)

DEFAULT_MASTER = "tcp://127.0.0.1:7770"
STATE_FILE = "pmaster.sqlite"


class _LookupWait:
    """A LOOKUP that waits for some of its keys' assignments to be acknowledged."""

    __slots__ = ("peer", "request", "record", "specs", "missing")

    def __init__(self, peer: RpcPeer, request: dict, record: JobRecord, specs: list[KeySpec]):
        self.peer = peer
        self.request = request
        self.record = record
        self.specs = specs
        self.missing = {s.key for s in specs if not s.ready}


def spec_to_wire(spec: KeySpec, aggregators: dict) -> dict:
    return {
        "key": spec.key,
        "shape": list(spec.shape),
        "dtype": spec.dtype,
        "declared_by": spec.declared_by,
        "parts": [
            [p.part, p.span[0], p.span[1], p.aggregator, _address(aggregators, p.aggregator)] for p in spec.parts
        ],
    }


def _address(aggregators: dict, name: str) -> str:
    record = aggregators.get(name)
    return record.address if record is not None else ""  # a lost Aggregator's (the key failed with it)


def _plain_details(error: PslinkError) -> dict:
    return {k: v for k, v in error.details.items() if isinstance(v, (int, str, list))}


class Master(MasterRecovery, MasterPool, MasterHosts, MasterThrottle):
    """The pMaster daemon. ``start()`` runs it on a thread; ``serve_forever()`` on this one."""

    def __init__(
        self,
        listen: str = DEFAULT_MASTER,
        *,
        state_dir: str | None = None,
        transports: Transports | None = None,
        limits: Limits = DEFAULT_LIMITS,
        worker_timeout: float = 15.0,
        disconnect_grace: float = 5.0,
        aggregator_timeout: float = 15.0,
        aggregator_grace: float = 0.5,
        assign_timeout: float = 10.0,
        sweep_interval: float = 1.0,
        migration_timeout: float = 10.0,
        max_migration_bytes: int | None = None,
        provider=None,
        control: dict | None = None,
        advertise: str | None = None,
        interface: str | None = None,
        dial_back_timeout: float = 3.0,
        clock=time.time,
    ):
        self.reactor = Reactor("pmaster")
        self.transports = transports or Transports()
        self._own_transports = transports is None
        # Without a provider nothing can be started or stopped: the pool stays as it is.
        self.provider = provider
        self.state = MasterState(clock, ControlPlane(clock=clock, elastic=provider is not None, **(control or {})))
        self.store = MasterStore(os.path.join(state_dir, STATE_FILE) if state_dir else None)
        self.store.load(self.state)
        self.limits = limits
        self.worker_timeout = worker_timeout
        self.disconnect_grace = disconnect_grace  # a worker whose connection closed is removed after it
        self.aggregator_timeout = aggregator_timeout
        self.aggregator_grace = aggregator_grace  # a lost Aggregator may come back this soon before failover
        self._init_recovery()
        self._init_pool()
        self.assign_timeout = assign_timeout
        self.sweep_interval = sweep_interval
        self.migration_timeout = migration_timeout
        self._allocating: dict[str, str] = {}  # Aggregator being started -> placeholder it fills
        self._deferred: dict[str, list] = {}  # placeholder -> (record, specs) to assign once it is up
        # task -> {source, target, started, copied, workers, held_replica, assigned, ...}
        self.migrations: dict[tuple, dict] = {}
        self._schedules_sent: dict[str, int] = {}  # Aggregator -> plan version it has
        self._release_after: dict[str, Release] = {}  # released once no migration leaves it
        self._queued_moves: dict[tuple, Migrate] = {}  # task -> its next move, once this one is over
        self.migrations_done = 0
        self._init_throttle(max_migration_bytes)  # task state copied at a time (the rest waits)
        self.endpoint = RpcEndpoint(self.reactor, self._on_request, limits, on_close=self._on_peer_close)
        advertise, interface = hosts.settings(advertise, interface)
        self.listener = self.transports.listen(listen, self.reactor, self.endpoint, limits)
        # Workers and Aggregators on other hosts dial this; a wildcard bind advertises the
        # address of this host's default route (or --advertise / --interface).
        self.address = hosts.advertised_address(self.listener.address, advertise=advertise, interface=interface)
        self.host_id = hosts.host_id()
        self.dial_back_timeout = dial_back_timeout
        self._aggregator_peers: dict[str, RpcPeer] = {}
        self._waits: dict[tuple[str, Any], list[_LookupWait]] = {}
        self._barriers: dict[tuple[str, str], dict[int, tuple[RpcPeer, dict]]] = {}
        self._thread: ReactorThread | None = None
        self._registered = threading.Condition()
        self.reactor.call_later(sweep_interval, self._sweep)
        if self.state.jobs:
            log.info("pMaster resumed %d job(s) from %s", len(self.state.jobs), self.store.path)

    # -- running ------------------------------------------------------------------------------

    def start(self) -> "Master":
        self._thread = ReactorThread(self.reactor).start()
        return self

    def serve_forever(self) -> None:
        self.reactor.run_forever()

    def stop(self, shutdown_aggregators: bool = False) -> None:
        """Stop serving; with ``shutdown_aggregators`` also ask every Aggregator to exit."""
        if shutdown_aggregators:
            self.call_soon(self._shutdown_aggregators)
        self.call_soon(self.listener.close)
        self.call_soon(self._close_peers)
        if self._thread is not None:
            self._thread.stop()
            self.reactor.drain()  # teardowns posted while stopping
        else:
            self.reactor.stop()
        self.store.close()
        self.reactor.close()
        if self._own_transports:
            self.transports.close()

    def call_soon(self, fn, *args) -> None:
        self.reactor.post(fn, *args)

    def migrate(self, tasks: list[tuple], target: str, reason: str = "requested") -> None:
        """Move tasks ((job, key, part), ...) to Aggregator ``target`` while their job runs
        (any thread; the moves happen on pMaster's loop)."""

        def move():
            for task in tasks:
                action = self.state.control.move_task(tuple(task), target, reason)
                if action is not None:
                    self.state.outbox.append(action)
            self._carry_out()

        self.reactor.post(move)

    def tasks_of(self, job: str) -> list[tuple]:
        record = self.state.jobs.get(job)
        return [] if record is None else [(job, s.key, p.part) for s in record.keys.values() for p in s.parts]

    def use_provider(self, provider, min_aggregators: int | None = None) -> None:
        """Let pMaster start and stop Aggregators through ``provider`` (it becomes elastic)."""
        self.provider = provider
        control = self.state.control
        control.elastic = True
        if min_aggregators is not None:
            control.min_aggregators = min_aggregators

    def aggregator_alive(self, name: str) -> bool:
        record = self.state.aggregators.get(name)
        return record is not None and record.alive and name in self._aggregator_peers

    def wait_for_aggregators(self, names: list[str], timeout: float) -> bool:
        """Block (any thread) until every named Aggregator has registered; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._registered:
            while not all(self.aggregator_alive(n) for n in names):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._registered.wait(remaining)
        return True

    def _shutdown_aggregators(self) -> None:
        for peer in list(self._aggregator_peers.values()):
            peer.notify(Op.SHUTDOWN)

    def _close_peers(self) -> None:
        for peer in list(self.endpoint.peers.values()):
            peer.conn.close()

    # -- dispatch -----------------------------------------------------------------------------

    def _on_request(self, peer: RpcPeer, req: dict) -> None:
        handler = self._HANDLERS.get(req["op"])
        if handler is None:
            raise ProtocolError(f"pMaster does not serve {req['op'].name}")
        try:
            handler(self, peer, req)
        finally:
            self._carry_out()

    # -- the control plane's actions ---------------------------------------------------------

    def _carry_out(self) -> None:
        try:
            self._announce_membership()
            self._carry_out_actions()
        finally:
            self._send_schedules()

    def _announce_membership(self) -> None:
        """Jobs whose membership changed: persist it, tell their Aggregators (the open rounds
        stop waiting for ranks that left), and settle barriers that waited for them."""
        changed, self.state.membership_changed = self.state.membership_changed, []
        for record in {id(r): r for r in changed}.values():
            if self.state.jobs.get(record.job) is not record:
                continue  # ended meanwhile
            log.info("job %s: members %s (epoch %d)", record.job, sorted(record.membership.ranks),
                     record.membership.epoch)
            self.store.save_job(record)
            for name in record.aggregators():
                peer = self._aggregator_peers.get(name)
                if peer is not None:
                    peer.call(Op.JOB_INFO, self._log_failure(f"telling {name} of job {record.job}'s members"),
                              timeout=self.assign_timeout, jobinfo=record.jobinfo())
            for ident in [b for b in self._barriers if b[0] == record.job]:
                self._settle_barrier(record, ident)

    def _send_schedules(self) -> None:
        """Cyclic execution: each Aggregator whose plan changed learns its cycle and budgets."""
        for name, (version, cycle, entries) in self.state.control.schedules().items():
            peer = self._aggregator_peers.get(name)
            if peer is None or self._schedules_sent.get(name) == version or not entries:
                continue
            self._schedules_sent[name] = version
            peer.notify(Op.SCHEDULE, cycle=cycle, tasks=entries)

    def _carry_out_actions(self) -> None:
        for action in self.state.take_actions():
            try:
                if isinstance(action, Allocate):
                    self._allocate(action)
                elif isinstance(action, Release):
                    self._release(action)
                elif isinstance(action, Migrate):
                    self._migrate(action)
            except Exception:
                log.exception("pMaster: carrying out %r failed", action)

    def _allocate(self, action: Allocate) -> str | None:
        if self.provider is None:
            log.error("pMaster: %s needs a new Aggregator, but there is no provider", action.reason)
            return None
        (name,) = self.provider.start(1)
        self._allocating[name] = action.placeholder
        log.info("pMaster: starting aggregator %s (%s)", name, action.reason)
        return name

    def _release(self, action: Release) -> None:
        name = action.aggregator
        if self._moving(name) or self._replicas_moving(name):
            # Tasks (or replicas) are still moving off (or onto) it: let it go when they are done.
            self._release_after[name] = action
            return
        log.info("pMaster: releasing aggregator %s (%s)", name, action.reason)
        peer = self._aggregator_peers.pop(name, None)
        if peer is not None:
            peer.notify(Op.SHUTDOWN)
        self.state.remove_aggregator(name)
        self.store.delete_aggregator(name)
        if self.provider is not None:
            # Reaping may take seconds: not on the loop that serves everyone else.
            threading.Thread(target=self.provider.stop, args=(name,), daemon=True).start()
        self._pool_released(name)

    def _start_migration(self, action: Migrate, size: int) -> None:
        """Start a move now (``_migrate``, of the throttle, decides when)."""
        job, key, part = action.task
        record = self.state.jobs.get(job)
        spec = record.keys.get(key) if record is not None else None
        source, target = self._aggregator_peers.get(action.source), self._aggregator_peers.get(action.target)
        if spec is None or source is None or target is None:
            why = "unknown task" if spec is None else "Aggregator not connected"
            log.warning("pMaster: cannot migrate %s from %s to %s (%s)", action.task, action.source, action.target, why)
            if spec is not None:  # a removal waiting for this move keeps its Aggregator
                self._removal_failed(action.source, action.task, action.target, ServiceError(why))
                if action.source in self.state.control.cluster_of:
                    try:
                        self.state.control.move_task(action.task, action.source, "migration failed")
                    except KeyError:
                        pass  # the plan no longer places it (its job ended, or a failover re-placed it)
            return
        address = self.state.aggregators[action.target].address
        placed = spec.parts[part]
        entry = self.migrations[action.task] = {
            "source": action.source, "target": action.target, "reason": action.reason,
            "started": self.state.clock(), "copied": False, "workers": False, "bytes": size,
            # Should the source die before its copy lands, the target may hold the only replica
            # with the part's state (the source keeps replicating to it: see _resource_copy).
            "held_replica": action.target in placed.replicas, "assigned": False,
        }
        if action.target in placed.replicas:
            # The target held a replica; now it serves the part: another Aggregator holds the replica.
            placed.replicas.remove(action.target)
            added = pick_replicas(self.state.replica_candidates(), holdings(self.state.jobs),
                                  record.replication - len(placed.replicas),
                                  exclude={action.target, action.source, *placed.replicas},
                                  hosts=self.state.control.host_of, away_from=[action.target, *placed.replicas])
            placed.replicas += added
            for name in added:
                holder = self._aggregator_peers.get(name)
                if holder is not None:
                    holder.call(Op.ASSIGN, self._log_failure(f"giving {name} a replica of {action.task}"),
                                timeout=self.assign_timeout, jobinfo=record.jobinfo(),
                                tasks=[e for e in spec.task_specs(name) if e["part"] == part])
        tasks = [dict(t, incoming=True) for t in spec.task_specs(None, self._address_of) if t["part"] == part]

        def started(result, error):
            if self.migrations.get(action.task) is not entry or entry["source"] != action.source:
                # Abandoned meanwhile (an Aggregator of it is gone): its failover placed the task.
                # Or its source died and a replica sends the copy instead (_resource_copy).
                return
            if error is not None:
                log.warning("pMaster: migration of %s to %s failed to start: %s", action.task, action.target, error)
                self._removal_failed(action.source, action.task, action.target, error)  # before a release
                self._migration_over(action.task, failed=True)
                self.state.control.move_task(action.task, action.source, "migration failed")  # the plan goes back
                return
            spec.parts[part].aggregator = action.target  # new lookups go there already
            self.store.save_key(job, spec)
            entry["timer"] = self.reactor.call_later(self.migration_timeout, self._force_migration, action.task, address)

        def assigned(result, error):
            if self.migrations.get(action.task) is not entry:
                return  # abandoned meanwhile: the source must not let go of the task now
            if error is not None:
                started(None, error)
                return
            # From here on the source may hand the part over (and send workers to the target)
            # at any time, before pMaster hears that it took the MIGRATE.
            entry["assigned"] = True
            source.call(Op.MIGRATE, started, timeout=self.assign_timeout, job=job, key=key, part=part,
                        target=[action.target, address])

        # The new place first learns the task (waiting for its copy), then the old one lets go.
        target.call(Op.ASSIGN, assigned, timeout=self.assign_timeout, jobinfo=record.jobinfo(), tasks=tasks)

    def _migration_over(self, task: tuple, failed: bool = False) -> None:
        entry = self.migrations.pop(task, None)
        if entry is None:
            return
        if "timer" in entry:
            entry["timer"].cancel()
        queued = self._queued_moves.pop(task, None)
        if queued is not None and not failed:
            self._migrate(queued)  # before the releases below: its source waits for it
        elif queued is not None:
            log.warning("pMaster: %s stays on %s: the move before %r failed", task, entry["source"], queued)
            self._removal_failed(queued.source, task, queued.target, ServiceError(f"the move of {task} before failed"))
        self._start_throttled()  # room for the next queued moves (before the releases: they count)
        self._moves_settled([entry["source"], entry["target"], *((queued.source, queued.target) if queued else ())])

    def _force_migration(self, task: tuple, address: str) -> None:
        entry = self.migrations.get(task)
        if entry is None or entry["copied"]:
            return
        source = self._aggregator_peers.get(entry["source"])
        if source is None:  # its source is gone: nothing will end it
            self._migration_over(task, failed=True)
            return
        log.info("pMaster: no round of %s closed within %.0f s; moving it now", task, self.migration_timeout)
        source.call(Op.MIGRATE, self._log_failure(f"forcing the migration of {task}"), timeout=self.assign_timeout,
                    job=task[0], key=task[1], part=task[2], target=[entry["target"], address], force=True)

    def _migration_progress(self, peer: RpcPeer, req: dict) -> None:
        task = (req["job"], req["key"], req["part"])
        entry = self.migrations.get(task)
        if entry is None:
            return
        if req["op"] == Op.TENSOR_COPY_DONE:
            self._copy_landed(task, entry)
        else:
            entry["workers"] = True
            self._migrated_if_done(task, entry)

    def _copy_landed(self, task: tuple, entry: dict) -> None:
        entry["copied"] = True
        self._start_throttled()  # its bytes are across: room for the next queued move
        self._migrated_if_done(task, entry)

    def _migrated_if_done(self, task: tuple, entry: dict) -> None:
        if entry["copied"] and entry["workers"]:
            self._migration_over(task)
            self.migrations_done += 1
            self._separate_replicas(task)
            log.info("pMaster: migrated %s from %s to %s in %.3f s (%s)", task, entry["source"], entry["target"],
                     self.state.clock() - entry["started"], entry["reason"])

    def _on_peer_close(self, peer: RpcPeer, exc) -> None:
        role = peer.info.get("role")
        if role == "worker":
            self.state.worker_disconnected(peer.info["job"], peer.info["rank"])
        elif role == "aggregator":
            name = peer.info["name"]
            if self._aggregator_peers.get(name) is peer:
                del self._aggregator_peers[name]
                self.state.aggregator_lost(name)
                log.warning("aggregator %s disconnected (%s)", name, exc)
                self._aggregator_gone(name)

    # -- jobs and workers ---------------------------------------------------------------------

    def _register_job(self, peer: RpcPeer, req: dict) -> None:
        record = self.state.register_job(req["job"], req["num_workers"], req.get("config"))
        self.store.save_job(record)
        peer.reply(req, body=record.settings())

    def _register_worker(self, peer: RpcPeer, req: dict) -> None:
        rank, pid, host, host_id = req["rank"], req.get("pid", 0), req.get("host", ""), req.get("host_id", "")
        if req.get("rejoin") and self.state.take_out_to_rejoin(req["job"], rank, req.get("tok"), pid, host, host_id):
            # Out and back in within this request (nothing else runs on this loop meanwhile): the
            # Aggregators drop the old incarnation from the open rounds, barriers stop waiting for
            # it, and the registration below adds the rank back as a newcomer at once.
            self._announce_membership()
        record = self.state.register_worker(
            req["job"], rank, req["num_workers"], req.get("tok"), req.get("config"), pid=pid, host=host, host_id=host_id,
        )
        self.store.save_job(record)
        for other in list(self.endpoint.peers.values()):
            info = other.info
            if other is not peer and info.get("role") == "worker" and (info.get("job"), info.get("rank")) == (
                    record.job, rank):
                # An earlier connection of this rank (the same process's Agent it replaces): its
                # closing or leaving no longer concerns the worker registered now.
                info["role"] = "replaced"
        peer.info.update(role="worker", job=record.job, rank=rank, name=f"{record.job}/rank {rank}")
        peer.reply(req, body=record.settings())

    def _heartbeat(self, peer: RpcPeer, req: dict) -> None:
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        self.state.heartbeat(record, req["rank"], req.get("iters"))
        if not peer.info.get("role"):  # an Agent that reconnected after a pMaster restart
            peer.info.update(role="worker", job=record.job, rank=req["rank"])

    def _leave(self, peer: RpcPeer, req: dict) -> None:
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        if peer.info.get("role") == "replaced":
            peer.reply(req)  # the rank registered again on another connection: that worker stays
            return
        peer.info.pop("role", None)
        if self.state.leave(record, req["rank"]):
            log.info("job %s ended: every worker left", record.job)
            self._end_job(record)
        peer.reply(req)

    def _end_job(self, record: JobRecord) -> None:
        self._drop_job_tasks(record)
        for action in self._drop_throttled(job=record.job):  # never started: nothing to wait for
            self._moves_settled([action.source, action.target])
        for task in [t for t, a in list(self._queued_moves.items()) if t[0] == record.job]:
            del self._queued_moves[task]
        for task in [t for t in self.migrations if t[0] == record.job]:
            # Its workers will never reach the new place: do not hold up a release waiting for them.
            self._migration_over(task)
        self.store.delete_job(record.job)
        for ident in [b for b in self._barriers if b[0] == record.job]:
            for peer, req in self._barriers.pop(ident).values():
                peer.error(req, ClosedError(f"job {record.job!r} ended during barrier {ident[1]!r}"))

    def _drop_job_tasks(self, record: JobRecord) -> None:
        holders = {r for spec in record.keys.values() for part in spec.parts for r in part.replicas}
        for name in record.aggregators() | holders:  # replica holders too, or they keep the replicas
            peer = self._aggregator_peers.get(name)
            if peer is not None:
                peer.notify(Op.DROP_JOB, job=record.job)

    def _set_optimizer(self, peer: RpcPeer, req: dict) -> None:
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        self.state.set_optimizer(record, req["optimizer"])
        self.store.save_job(record)
        targets = [self._aggregator_peers[n] for n in record.aggregators() if n in self._aggregator_peers]
        self._broadcast(targets, Op.JOB_INFO, dict(jobinfo=record.jobinfo()), lambda error: (
            peer.error(req, error) if error else peer.reply(req, body=record.settings())
        ))

    def _barrier(self, peer: RpcPeer, req: dict) -> None:
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        ident = (record.job, req["name"])
        arrived = self._barriers.setdefault(ident, {})
        if req["rank"] in arrived:
            raise MembershipError(f"rank {req['rank']} entered barrier {req['name']!r} of job {record.job!r} twice")
        arrived[req["rank"]] = (peer, req)
        self._settle_barrier(record, ident)

    def _settle_barrier(self, record: JobRecord, ident: tuple) -> None:
        """Release a barrier once every current member arrived; a rank that left gets an error."""
        arrived = self._barriers[ident]
        for rank in [r for r in arrived if r not in record.membership]:
            gone_peer, gone_req = arrived.pop(rank)
            gone_peer.error(gone_req, MembershipError(f"rank {rank} left job {record.job!r} during barrier "
                                                      f"{ident[1]!r}", job=record.job))
        if set(arrived) >= record.membership.ranks:
            body = {"epoch": record.membership.epoch, "ranks": sorted(record.membership.ranks)}
            for waiting_peer, waiting_req in self._barriers.pop(ident).values():
                waiting_peer.reply(waiting_req, body=body)

    def spec_wire(self, spec: KeySpec) -> dict:
        return spec_to_wire(spec, self.state.aggregators)

    def _job_keys(self, peer: RpcPeer, req: dict) -> None:
        """Every key of the job and where its parts live (a worker joining a running job joins them)."""
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        aggs = self.state.aggregators
        keys = [spec_to_wire(s, aggs) for s in record.keys.values() if s.ready] if req.get("keys", True) else []
        peer.reply(req, body={"keys": keys, "membership": record.membership.to_wire()})

    def _status(self, peer: RpcPeer, req: dict) -> None:
        body = self.state.status()
        now = self.state.clock()
        body["migrations"] = self._migration_status(now)  # running, then queued
        body["migrations_done"] = self.migrations_done
        body["master"] = {"address": self.address, "state": self.store.path, "pid": os.getpid()}
        peer.reply(req, body=body)

    # -- keys -----------------------------------------------------------------------------------

    def _lookup(self, peer: RpcPeer, req: dict) -> None:
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        specs, created = [], []
        for item in req["items"]:
            try:
                spec, new = self.state.declare(record, req["rank"], item)
            except ShapeMismatchError as exc:
                # The first declarer may be waiting on this key already: fail it too, now.
                self._abort_key(record, item.get("key"), exc)
                for spec_ in created:
                    self.state.forget_key(record, spec_.key)
                raise
            except PslinkError:
                for spec_ in created:
                    self.state.forget_key(record, spec_.key)
                raise
            specs.append(spec)
            if new:
                created.append(spec)
        wait = _LookupWait(peer, req, record, specs)
        if not wait.missing:
            self._answer_lookup(wait)
            return
        for key in wait.missing:
            self._waits.setdefault((record.job, key), []).append(wait)
        if created:
            self._assign(record, created)

    def _assign(self, record: JobRecord, specs: list[KeySpec]) -> None:
        starting = sorted({p.aggregator for s in specs for p in s.parts if self.state.control.is_placeholder(p.aggregator)})
        if starting:
            # Some parts go to Aggregators still starting: assign once they registered.
            self._deferred.setdefault(starting[0], []).append((record, specs))
            return
        by_aggregator: dict[str, list[dict]] = {}
        for spec in specs:
            for name in {p.aggregator for p in spec.parts} | {r for p in spec.parts for r in p.replicas}:
                by_aggregator.setdefault(name, []).extend(spec.task_specs(name, self._address_of))
        missing = [n for n in by_aggregator if n not in self._aggregator_peers]
        if missing:
            self._assigned(record, specs, ServiceError(f"aggregator(s) {missing} are not connected to pMaster"))
            return
        calls = [(self._aggregator_peers[n], dict(jobinfo=record.jobinfo(), tasks=t)) for n, t in by_aggregator.items()]
        self._broadcast_each(calls, Op.ASSIGN, lambda error: self._assigned(record, specs, error))

    def _assigned(self, record: JobRecord, specs: list[KeySpec], error: PslinkError | None) -> None:
        for spec in specs:
            if error is None:
                spec.ready = True
                self.store.save_key(record.job, spec)
            else:
                self.state.forget_key(record, spec.key)
            # A key aborted while it was being placed (its ASSIGN poisoned the task, or the ABORT
            # followed the ASSIGN on the same connection) fails the lookups waiting for it: a
            # worker that learnt where it lives could init and push before the Aggregator heard.
            failure = ServiceError(f"placing key {spec.key!r} failed: {error}") if error is not None else spec.aborted
            for wait in self._waits.pop((record.job, spec.key), []):
                if failure is not None:
                    if wait.missing:
                        wait.missing.clear()
                        wait.peer.error(wait.request, failure)
                    continue
                wait.missing.discard(spec.key)
                if not wait.missing:
                    self._answer_lookup(wait)
            if error is None and spec.aborted is None:
                for part in spec.parts:  # placed while the host it should replicate to was starting
                    self._separate_part(record, spec, part)

    def _answer_lookup(self, wait: _LookupWait) -> None:
        aggs = self.state.aggregators
        wait.peer.reply(wait.request, body={"keys": [spec_to_wire(s, aggs) for s in wait.specs]})

    def _abort_key(self, record: JobRecord, key: Any, error: PslinkError) -> None:
        """Poison a key on every Aggregator that holds or will hold a part of it.

        The key is remembered as aborted: an Aggregator still starting (its assignment deferred)
        gets the abort in its ASSIGN (KeySpec.task_specs), so the task never exists unpoisoned
        there, and the target of a migration in flight gets it too; else the first declarer
        could use a fresh, unpoisoned task (alone in the job once the other rank left)."""
        spec = record.keys.get(key)
        if spec is None:
            return
        if spec.aborted is None:
            spec.aborted = error
        error = spec.aborted
        names = {p.aggregator for p in spec.parts}
        names |= {e[side] for t, e in self.migrations.items() if t[:2] == (record.job, key) for side in ("source", "target")}
        names |= {m["target"] for m in self._migration_status(0.0) if (m["job"], m["key"]) == (record.job, key)}
        for name in names:
            peer = self._aggregator_peers.get(name)
            if peer is not None:
                peer.notify(Op.ABORT, job=record.job, tok=record.token, rank=error.details.get("ranks", [0])[0],
                            key=key, msg=error.message, code=error.code, details=_plain_details(error))

    # -- aggregators ----------------------------------------------------------------------------

    def _aggregator_heartbeat(self, peer: RpcPeer, req: dict) -> None:
        if peer.info.get("role") == "aggregator":
            self.state.aggregator_heartbeat(peer.info["name"], req["stats"])

    @staticmethod
    def _log_failure(what: str):
        def callback(result, error):
            if error is not None:
                log.warning("%s failed: %s", what, error)
        return callback

    def _broadcast(self, peers: list[RpcPeer], op: Op, fields: dict, done) -> None:
        self._broadcast_each([(p, fields) for p in peers], op, done)

    def _broadcast_each(self, calls: list[tuple[RpcPeer, dict]], op: Op, done) -> None:
        """Send one request per peer; ``done(error_or_None)`` once every answer is in."""
        if not calls:
            done(None)
            return
        outcome = {"left": len(calls), "error": None}

        def answered(result, error):
            if error is not None and outcome["error"] is None:
                outcome["error"] = error
            outcome["left"] -= 1
            if outcome["left"] == 0:
                done(outcome["error"])

        for peer, fields in calls:
            peer.call(op, answered, timeout=self.assign_timeout, **fields)

    # -- liveness -------------------------------------------------------------------------------

    def _sweep(self) -> None:
        try:
            self.state.tick()
            ended, silent = self.state.sweep(self.worker_timeout, self.aggregator_timeout, self.disconnect_grace)
            for record in ended:
                log.info("job %s ended: no worker heard from in %.0f s", record.job, self.worker_timeout)
                self._end_job(record)
            for name in silent:
                log.warning("aggregator %s silent for %.0f s: failing it over", name, self.aggregator_timeout)
                peer = self._aggregator_peers.pop(name, None)
                if peer is not None:
                    peer.conn.close()
                if name not in self._failing:
                    self._fail_over(name)
            self._carry_out()
        finally:
            self.reactor.call_later(self.sweep_interval, self._sweep)

    _HANDLERS = {
        Op.REGISTER_JOB: _register_job,
        Op.REGISTER_WORKER: _register_worker,
        Op.LOOKUP: _lookup,
        Op.SET_OPTIMIZER: _set_optimizer,
        Op.HEARTBEAT: _heartbeat,
        Op.BARRIER: _barrier,
        Op.LEAVE: _leave,
        Op.JOB_KEYS: _job_keys,
        Op.RELOCATE: MasterRecovery._relocate,
        Op.STATUS: _status,
        Op.REGISTER_AGGREGATOR: MasterHosts._register_aggregator,
        Op.AGG_HEARTBEAT: _aggregator_heartbeat,
        Op.TENSOR_COPY_DONE: _migration_progress,
        Op.WORKER_DONE: _migration_progress,
        Op.POOL: MasterPool._pool,
    }
