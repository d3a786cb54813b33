"""pMaster: the registry of jobs, workers and Aggregators, and the placement of tasks.

pMaster is off the data path: Agents ask it where a key lives once (LOOKUP), then talk to
Aggregators directly. Decisions are made by :class:`~pslink.core.master.state.MasterState`; this
shell receives control messages, sends assignments to Aggregators (and waits for their
acknowledgement before telling an Agent where to go, so no data request can reach an Aggregator
before the task exists there), and writes state through to SQLite.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from typing import Any

from pslink.core import hosts
from pslink.core.master.actions import Allocate, Migrate, Release, batches_of_moves
from pslink.core.master.barriers import Barriers
from pslink.core.credentials import ServiceCredentials
from pslink.core.master.failover import Failover
from pslink.core.master.gate import Gate
from pslink.core.master.records import AggregatorRecord, JobRecord, KeySpec, checked_quota
from pslink.core.master.joining import Joining
from pslink.core.master.links import AggregatorLinks
from pslink.core.master.aggregator_probe import Prober
from pslink.core.master.migration_core import Migrations
from pslink.core.master.migration_io import Mover, task_bytes
from pslink.core.master.observing import Observing
from pslink.core.master.key_placement import KeyPlacing, holders_of, spec_to_wire
from pslink.core.master.pool import Pool
from pslink.core.master.replica_hosts import Replicas
from pslink.core.master.state import MasterState
from pslink.core.master.store import MasterStore, SqliteStore
from pslink.core.transport import Transports
from pslink.core.transport.rpc import RpcEndpoint, RpcPeer
from pslink.core.wire.loop import Reactor, ReactorThread
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits, Op
from pslink.errors import AuthError, ProtocolError, PslinkError

log = logging.getLogger("pslink.core.master")

DEFAULT_MASTER = "tcp://127.0.0.1:7770"
STATE_FILE = "pmaster.sqlite"


def _plain_details(error: PslinkError) -> dict:
    return {k: v for k, v in error.details.items() if isinstance(v, (int, str, list))}


class Master:
    """The pMaster daemon. ``start()`` runs it on a thread; ``serve_forever()`` on this one.

    It serves jobs, workers and keys itself and composes the rest: :class:`AggregatorLinks` (its
    connections to the Aggregators), :class:`Mover` (migrations, around the pure
    :class:`~pslink.core.master.migration_core.Migrations`), :class:`Pool` (starting, releasing and
    operators' changes), :class:`Failover`, :class:`Joining` (which Aggregators may join) and
    :class:`Replicas` (replicas on other hosts than their primary)."""

    def __init__(
        self,
        listen: str = DEFAULT_MASTER,
        *,
        state_dir: str | None = None,
        store: MasterStore | None = None,
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
        credentials: ServiceCredentials | None = None,
        quota: dict | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        on_stop=None,
        leadership=None,
        clock=time.time,
    ):
        self.reactor = Reactor("pmaster")
        self.gate = Gate(credentials)  # who may do what; None: an open service (see credentials.py)
        self.transports = transports or Transports()
        self._own_transports = transports is None
        # Without a provider nothing can be started or stopped: the pool stays as it is.
        self.provider = provider
        self.state = MasterState(clock, {"elastic": provider is not None, **(control or {})})
        # ``store``: state kept elsewhere than a directory (Redis, opened by the lease's holder).
        self.store = store or SqliteStore(os.path.join(state_dir, STATE_FILE) if state_dir else None)
        self.state.default_quota = checked_quota(quota)  # per job, unless the operator set its own
        self.store.load(self.state)
        self.limits = limits
        self.worker_timeout = worker_timeout
        self.disconnect_grace = disconnect_grace  # a worker whose connection closed is removed after it
        self.aggregator_timeout = aggregator_timeout
        self.sweep_interval = sweep_interval
        self._schedules_sent: dict[str, int] = {}  # Aggregator -> plan version it has
        self.endpoint = RpcEndpoint(self.reactor, self._on_request, limits, on_close=self._on_peer_close)
        advertise, interface = hosts.settings(advertise, interface)
        self.listener = self.transports.listen(listen, self.reactor, self.endpoint, limits)
        # Peers on other hosts dial this: a wildcard bind advertises its default route's address.
        self.address = hosts.advertised_address(self.listener.address, advertise=advertise, interface=interface)
        self.host_id = hosts.host_id()
        self.barriers = Barriers(self.state)
        # The collaborators, each made with what it needs. The migration core comes first: the
        # pool (which Aggregators are moving) and the replicas (which parts are) read it, and
        # the Mover carries it out. The provider is read when used: use_provider() may set it.
        self.links = AggregatorLinks(self.state, assign_timeout)
        migrations = Migrations(functools.partial(task_bytes, self.state), batch_bytes=self.state.control.batch_bytes,
                                **({} if max_migration_bytes is None else {"max_bytes": max_migration_bytes}))
        self.replicas = Replicas(self.state, self.store, self.links, incoming=migrations.incoming)
        self.placing = KeyPlacing(self.state, self.store, self.reactor, self.links, self.replicas, self._abort_key)
        self.pool = Pool(self.state, self.store, self.reactor, self.links, provider=lambda: self.provider,
                         moves=migrations, alive=self.aggregator_alive, carry_out=self._carry_out)
        self.mover = Mover(self.state, self.store, self.reactor, self.links, migrations,
                           migration_timeout=migration_timeout, settled=self.pool.settled,
                           removal_failed=self.pool.removal_failed, moved=self.replicas.after_move,
                           copy_from_replica=self._copy_from_replica)
        self.failover = Failover(self.state, self.store, self.reactor, self.links, self.mover, grace=aggregator_grace,
                                 silent=aggregator_timeout, migration_timeout=migration_timeout,
                                 abort_key=self._abort_key, spec_wire=self.spec_wire, carry_out=self._carry_out,
                                 forget=self.pool.forget, probe=Prober(self.transports, self.reactor, limits).probe)
        self.joining = Joining(self.state, self.store, self.reactor, self.links, host_id=self.host_id,
                               dial_back_timeout=dial_back_timeout, provider=lambda: self.provider,
                               joined=self._aggregator_joined, carry_out=self._carry_out, resume_moves=self.mover.resume,
                               incoming=migrations.incoming)
        self._thread: ReactorThread | None = None
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._registered = threading.Condition()
        self._joined: set[RpcPeer] = set()  # Aggregators' links, once taken into the pool (aggregator_alive)
        self._handlers = {
            Op.REGISTER_JOB: self._register_job,
            Op.REGISTER_WORKER: self._register_worker,
            Op.LOOKUP: self.placing.lookup,
            Op.SET_OPTIMIZER: self._set_optimizer,
            Op.HEARTBEAT: self._heartbeat,
            Op.BARRIER: self.barriers.enter,
            Op.HOST_LEADER: self.barriers.leaders.call,
            Op.LEAVE: self._leave,
            Op.JOB_KEYS: self._job_keys,
            Op.DELETE_KEYS: self.placing.delete_keys,
            Op.STATUS: self._status,
            Op.AGG_HEARTBEAT: self._aggregator_heartbeat,
            Op.RELOCATE: self.failover.relocate,
            Op.REGISTER_AGGREGATOR: self.joining.register,
            Op.TENSOR_COPY_DONE: self.mover.progress,
            Op.WORKER_DONE: self.mover.progress,
            Op.POOL: self._pool_request,
            Op.PING: lambda peer, req: peer.reply(req),  # a worker measuring its RTT to this service (group_choice)
        }
        # Status, /metrics and the page (metrics_port: None serves no HTTP), `pslink service stop`.
        # ``leadership``: the lease's status (a pMaster elected over a shared store), None alone.
        self.observing = Observing(self, metrics_port=metrics_port, metrics_host=metrics_host, on_stop=on_stop,
                                   leadership=leadership)
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
        """Stop serving; with ``shutdown_aggregators`` also ask every Aggregator to exit. Once: a
        leader that stepped down is stopped already when its service stops."""
        with self._stop_lock:  # a deposed leader is stopped by its lease's thread and its term's
            if self._stopped:
                return
            self._stopped = True
        self.observing.close()
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

    def write_state_back(self) -> None:
        """On pMaster's loop: write everything it holds to its store again (the store lost it: a
        Redis restarted without persistence, taken again under this leader's epoch)."""
        for record in self.state.aggregators.values():
            if record.address:
                self.store.save_aggregator(record)
        for record in self.state.jobs.values():
            self.store.save_job(record)
            for spec in record.keys.values():
                if spec.ready:
                    self.store.save_key(record.job, spec)
        self.store.save_removing(self.pool.removing())
        log.warning("pMaster: its state written back to %s (%d job(s), %d Aggregator(s))", self.store.path,
                    len(self.state.jobs), len(self.state.aggregators))

    def tasks_of(self, job: str) -> list[tuple]:
        record = self.state.jobs.get(job)
        return [] if record is None else [(job, s.key, p.part) for s in record.keys.values() for p in s.parts]

    @property
    def failovers_done(self) -> int:
        return self.failover.done

    @property
    def migrations_done(self) -> int:
        return self.mover.core.done

    def use_provider(self, provider, min_aggregators: int | None = None) -> None:
        """Let pMaster start and stop Aggregators through ``provider`` (it becomes elastic)."""
        self.provider = provider
        control = self.state.control
        control.pool.elastic = True
        if min_aggregators is not None:
            control.pool.min_aggregators = min_aggregators

    def aggregator_alive(self, name: str) -> bool:
        record = self.state.aggregators.get(name)
        return record is not None and record.alive and self.links.peers.get(name) in self._joined

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
        for peer in list(self.links.peers.values()):
            peer.notify(Op.SHUTDOWN)

    def _close_peers(self) -> None:
        for peer in list(self.endpoint.peers.values()):
            peer.conn.close()

    # -- dispatch -----------------------------------------------------------------------------

    def _on_request(self, peer: RpcPeer, req: dict) -> None:
        handler = self._handlers.get(req["op"])
        if handler is None:
            raise ProtocolError(f"pMaster does not serve {req['op'].name}")
        self.gate.check(peer, req)
        try:
            handler(peer, req)
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
                peer = self.links.peers.get(name)
                if peer is not None:
                    peer.call(Op.JOB_INFO, self.links.log_failure(f"telling {name} of job {record.job}'s members"),
                              timeout=self.links.timeout, jobinfo=record.jobinfo())
            self.barriers.members_changed(record)

    def _send_schedules(self) -> None:
        """Cyclic execution: each Aggregator whose plan changed learns its cycle and budgets."""
        for name, (version, cycle, entries) in self.state.control.schedules().items():
            peer = self.links.peers.get(name)
            if peer is None or self._schedules_sent.get(name) == version or not entries:
                continue
            self._schedules_sent[name] = version
            peer.notify(Op.SCHEDULE, cycle=cycle, tasks=entries)

    def _carry_out_actions(self) -> None:
        # Moves side by side are one decision's: the mover makes migrations of them (a batch per
        # job, source and target), before what follows them (a release waits for them).
        for group in batches_of_moves(self.state.take_actions()):
            for action in group:
                self.observing.watch.action(action)
            try:
                carry = {Migrate: self.mover.migrate, Allocate: self.pool.allocate, Release: self.pool.release}
                carry[type(group[0])](group if type(group[0]) is Migrate else group[0])
            except Exception:
                log.exception("pMaster: carrying out %r failed", group)

    def _on_peer_close(self, peer: RpcPeer, exc) -> None:
        role = peer.info.get("role")
        if role == "worker":
            self.state.worker_disconnected(peer.info["job"], peer.info["rank"])
        elif role == "aggregator":
            name = peer.info["name"]
            self._joined.discard(peer)
            if self.links.peers.get(name) is peer:
                del self.links.peers[name]
                self.state.aggregator_lost(name)
                log.warning("aggregator %s disconnected (%s)", name, exc)
                self.failover.connection_lost(name)

    # -- jobs and workers ---------------------------------------------------------------------

    def _register_job(self, peer: RpcPeer, req: dict) -> None:
        try:
            record = self.state.register_job(req["job"], req["num_workers"], req.get("config"), token=req.get("tok"),
                                             operator=self.gate.is_operator(req), quota=req.get("quota"))
        except AuthError as exc:
            self.gate.count_refusal(peer, exc)
            raise
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
            first_join=self.gate.first_join(peer), agent=req.get("agent", ""),
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
        self.state.heartbeat(record, req["rank"], req.get("iters"), req.get("work"))
        self.observing.heartbeat(record, req["rank"], req.get("iters"))
        if not peer.info.get("role"):  # an Agent that reconnected after a pMaster restart
            peer.info.update(role="worker", job=record.job, rank=req["rank"])
        if req["id"]:
            peer.reply(req)  # an Agent that asks for an answer tells a silent pMaster from a quiet one

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
        self.observing.watch.job_ended(record.job)
        self._drop_job_tasks(record)
        self.mover.job_ended(record.job)
        self.store.delete_job(record.job)
        self.barriers.job_ended(record)

    def _drop_job_tasks(self, record: JobRecord) -> None:
        for name in _holders(record):  # replica holders too, or they keep the replicas
            peer = self.links.peers.get(name)
            if peer is not None:
                peer.notify(Op.DROP_JOB, job=record.job)

    def _set_optimizer(self, peer: RpcPeer, req: dict) -> None:
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        self.state.set_optimizer(record, req["optimizer"], req.get("pushed"))
        self.store.save_job(record)
        # Every Aggregator that holds a part, a replica, or a part on its way: a replica promoted
        # or a moved part must step the same rounds as the part it stands in for.
        moving = {move.target for task, move in self.mover.core.running.items() if task[0] == record.job}
        targets = [self.links.peers[n] for n in _holders(record) | moving if n in self.links.peers]
        self.links.broadcast_each([(t, dict(jobinfo=record.jobinfo())) for t in targets], Op.JOB_INFO, lambda error: (
            peer.error(req, error) if error else peer.reply(req, body=record.settings())
        ))

    def spec_wire(self, spec: KeySpec) -> dict:
        return spec_to_wire(spec, self.state.aggregators)

    def _job_keys(self, peer: RpcPeer, req: dict) -> None:
        """Every key of the job and where its parts live (a worker joining a running job joins them)."""
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        aggs = self.state.aggregators
        keys = [spec_to_wire(s, aggs) for s in record.keys.values() if s.ready] if req.get("keys", True) else []
        peer.reply(req, body={"keys": keys, "membership": record.membership.to_wire()})

    def _status(self, peer: RpcPeer, req: dict) -> None:
        peer.reply(req, body=self.observing.status())

    def _pool_request(self, peer: RpcPeer, req: dict) -> None:
        if req["action"] == "stop":
            self.observing.stop_requested(peer, req)
        else:
            self.pool.request(peer, req)

    def _copy_from_replica(self, move, lost: str) -> None:
        """The Mover and the Failover need each other: a move whose source died goes on from a
        replica (a failover step, counted there until the Agents that lost the source are
        answered), and a failover ends or reroutes moves. The Mover, made first, gets this
        method, which forwards its event to the Failover."""
        self.failover.copy_from_replica(move, lost)

    # -- keys -----------------------------------------------------------------------------------

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
            self.store.save_key(record.job, spec)  # a restarted pMaster still knows it (and tells late Aggregators)
        error = spec.aborted
        # The replicas' holders too: one promoted after a failure must not serve the key unpoisoned.
        names = holders_of(spec)
        names |= {m[side] for m in self.mover.core.status(0.0) if (m["job"], m["key"]) == (record.job, key)
                  for side in ("source", "target")}
        for name in names:
            peer = self.links.peers.get(name)
            if peer is not None:
                peer.notify(Op.ABORT, job=record.job, tok=record.token, rank=error.details.get("ranks", [0])[0],
                            key=key, msg=error.message, code=error.code, details=_plain_details(error))

    # -- aggregators ----------------------------------------------------------------------------

    def _aggregator_heartbeat(self, peer: RpcPeer, req: dict) -> None:
        if peer.info.get("role") == "aggregator":
            self.state.aggregator_heartbeat(peer.info["name"], req["stats"])
            self.replicas.dropped(peer.info["name"], req["stats"].get("dropped_replicas") or ())
            if req["id"]:
                peer.reply(req)  # renews its lease (pslink.core.aggregator.master_link)

    def _aggregator_joined(self, peer: RpcPeer, record: AggregatorRecord, req: dict) -> None:
        """Admitted (:class:`Joining`): into the plan, its deferred and restored assignments, who waits for it."""
        placeholder = self.pool.allocating.pop(record.name, None)
        self.state.aggregator_joined(record.name, placeholder)
        if req.get("keep"):
            self.state.control.pool.pinned.add(record.name)  # an operator's (`pslink aggregator`): scaling keeps it
        self.placing.registered(record.name)
        if placeholder is not None:
            self.placing.assign_deferred(placeholder)
        # After a pMaster or Aggregator restart: make sure it holds what it was given.
        for job, specs in self.state.tasks_on(record.name):
            self.links.tell(record.name, Op.ASSIGN, f"re-assigning job {job.job} to {record.name}",
                            jobinfo=job.jobinfo(), tasks=specs)
        self.replicas.everywhere()
        # Last: aggregator_alive (wait_for_aggregators, pool additions) holds only once all of the above is done.
        with self._registered:
            self._joined.add(peer)
            self._registered.notify_all()
        self.failover.aggregator_back(record.name)
        self.pool.registered()

    # -- liveness -------------------------------------------------------------------------------

    def _sweep(self) -> None:
        try:
            self.state.tick()
            ended, silent = self.state.sweep(self.worker_timeout, self.aggregator_timeout, self.disconnect_grace)
            for record in ended:
                log.info("job %s ended: no worker heard from in %.0f s", record.job, self.worker_timeout)
                self._end_job(record)
            for name in silent:
                self.failover.silent(name)
            self.replicas.unreached()
            self._carry_out()
            self.observing.tick()
        finally:
            self.reactor.call_later(self.sweep_interval, self._sweep)


def _holders(record: JobRecord) -> set[str]:
    """Every Aggregator that holds a part of the job or a replica of one."""
    return set().union(*(holders_of(spec) for spec in record.keys.values()))
