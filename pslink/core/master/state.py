"""pMaster's state and decisions: jobs, tokens, workers, keys, placements, Aggregators. No I/O.

The process shell (``pslink.core.master.master``) turns messages into calls on :class:`MasterState`,
carries out what they decide (send assignments, persist records) and answers. Tests call the same
methods directly.

Credentials. A job is registered explicitly (``register_job``: the caller gets the token and hands
it to its workers) or implicitly by its first worker. For an implicit job, each rank may join once
without the token (trust on first use); every later registration of that rank, and every data
message, must carry the token. A pre-registered job always needs the token.
"""

from __future__ import annotations

import hmac
import math
import secrets
import time
from typing import Any, Callable

from pslink.core.master.control import ControlPlane
from pslink.core.master.failover_plan import Promote, Recreate, holdings, pick_replicas, plan_failover, plan_replica_moves
from pslink.core.master.records import (
    AggregatorRecord,
    JobRecord,
    KeySpec,
    PartSpec,
    WorkerInfo,
    check_quota,
    checked_quota,
    quota_of,
    validate_settings,
)
from pslink.core.names import check_job_name
from pslink.core.optim import make_optimizer
from pslink.core.partition import partition_spans
from pslink.core.tables import table_options
from pslink.core.wire.protocol import DTYPES, MAX_NDIM
from pslink.errors import (
    AuthError,
    ConfigError,
    KeyStateError,
    MembershipError,
    ProtocolError,
    ServiceError,
    ShapeMismatchError,
    UnknownJobError,
)

class MasterState:
    """Jobs, workers, keys and Aggregators, plus the control plane that places tasks.

    Decisions that need action (start or stop an Aggregator, migrate a task) collect in
    :attr:`outbox`; the pMaster shell takes them after each call."""

    def __init__(self, clock: Callable[[], float] = time.time, plane_options: dict | None = None):
        self.clock = clock
        # The control plane's scaling keeps the Aggregators holding replicas, which only this
        # state knows. Without a provider given, the pool is what registers: nothing is started
        # or stopped (plane_options' elastic).
        self.control = ControlPlane(clock=clock, replica_holders=self.replica_holders,
                                    **{"elastic": False, **(plane_options or {})})
        self.jobs: dict[str, JobRecord] = {}
        self.membership_changed: list[JobRecord] = []  # jobs whose Aggregators must hear of it
        self.aggregators: dict[str, AggregatorRecord] = {}
        # (job, key, part) -> (holder, source): a part an Aggregator holds from a move whose
        # hand-over pMaster never stored (it restarted), until the source says (Joining).
        self.move_claims: dict[tuple, tuple[str, str]] = {}
        self._agg_serial = 0
        self.outbox: list = []
        self.default_quota: dict = {}  # max_bytes / max_keys for jobs without their own (the operator's)

    def take_actions(self) -> list:
        actions, self.outbox = self.outbox, []
        return actions

    # -- jobs and workers ---------------------------------------------------------------------

    def register_job(self, job: str, num_workers: int, config: dict | None = None, token: bytes | None = None,
                     operator: bool = True, quota: dict | None = None) -> JobRecord:
        """Explicit registration: a fresh token that every worker of the job must present.

        A job that exists is re-created (its state dropped, a new token made) only when no worker
        of it is live, and only for the operator or whoever holds its token: else a stranger who
        knew the name would own the job and the weights the service holds for it."""
        check_job_name(job)
        quota = checked_quota(quota)
        if quota and not operator:
            raise AuthError(f"setting job {job!r}'s quota needs the operator credential", job=job)
        existing = self.jobs.get(job)
        if existing is not None and existing.live_workers():
            raise MembershipError(
                f"job {job!r} is already running with workers {existing.live_workers()}", job=job
            )
        if existing is not None:
            if not operator and (token is None or not hmac.compare_digest(token, existing.token)):
                raise AuthError(f"job {job!r} exists (the service holds its state); re-creating it needs its token "
                                f"or the operator credential; {'no' if token is None else 'a wrong'} token was given",
                                job=job)
            self.remove_job(job)
        elif not operator:
            raise AuthError(f"creating job {job!r} needs the operator credential", job=job)
        record = self._new_job(job, num_workers, config, preregistered=True)
        record.quota = quota
        return record

    def remove_job(self, job: str) -> JobRecord | None:
        """Forget a job and release its placements."""
        record = self.jobs.pop(job, None)
        if record is not None:
            # The record keeps its keys, so the caller still sees which Aggregators served it.
            self.outbox += self.control.job_ended(job)
        return record

    def _new_job(self, job: str, num_workers: int, config: dict | None, preregistered: bool) -> JobRecord:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"job {job!r}: num_workers must be >= 1, got {num_workers!r}")
        settings = validate_settings(config)
        if settings["max_workers"] is not None and settings["max_workers"] < num_workers:
            raise ConfigError(f"job {job!r}: max_workers {settings['max_workers']} is below its {num_workers} workers")
        record = JobRecord(
            job=job,
            token=secrets.token_bytes(16),
            num_workers=num_workers,
            preregistered=preregistered,
            created=self.clock(),
            **settings,
        )
        self.jobs[job] = record
        self.outbox += self.control.job_arrived(job, num_workers, record.servers, record.slo, record.priority)
        return record

    def register_worker(
        self,
        job: str,
        rank: int,
        num_workers: int,
        token: bytes | None,
        config: dict | None = None,
        pid: int = 0,
        host: str = "",
        host_id: str = "",
        first_join: bool = True,
        agent: str = "",
    ) -> JobRecord:
        """Add a worker to its job, creating the job on first use (see the module's notes).
        ``first_join``: whether a rank may join without the token once (trust on first use); a
        service exposed beyond its host allows it only to workers on its host, or if told to."""
        check_job_name(job)
        record = self.jobs.get(job)
        if record is None:
            if token is None and not first_join:
                raise AuthError(f"job {job!r} is not registered, and this service lets a worker create a job by "
                                "joining only from its own host: create it with `pslink job create` (which prints "
                                "its token for PSLINK_TOKEN), or start the service with --allow-first-join", job=job)
            if token is not None:
                raise UnknownJobError(
                    f"job {job!r} is not registered with this pMaster (a token was given, so it was "
                    "expected to exist)",
                    job=job,
                )
            record = self._new_job(job, num_workers, config, preregistered=False)
        else:
            record.check_credential(token, rank, first_join, agent)
            if num_workers != record.num_workers and record.max_workers == record.num_workers:
                raise MembershipError(
                    f"job {job!r} has {record.num_workers} workers; rank {rank} says {num_workers}", job=job
                )
            if config:
                wanted = validate_settings(config)
                for setting in ("mode", "sync"):
                    if setting in config and wanted[setting] != getattr(record, setting):
                        raise ConfigError(
                            f"job {job!r} runs with {setting} {getattr(record, setting)!r}; rank {rank} "
                            f"asked for {wanted[setting]!r}"
                        )
        if not 0 <= rank < record.max_workers:
            raise MembershipError(f"rank {rank} is out of range for job {job!r} of {record.max_workers} workers "
                                  f"at most", job=job)
        current = record.workers.get(rank)
        host_id = host_id or host
        reconnect = current is not None and (current.restored or (pid and (current.pid, current.host_id) == (pid, host_id)))
        if current is not None and current.connected and not current.left and not reconnect:
            raise MembershipError(
                f"rank {rank} of job {job!r} is already connected (pid {current.pid} on {current.host or '?'})",
                job=job, reason="connected",  # a replacement may retry: pMaster may not have seen the old go yet
            )
        record.workers[rank] = WorkerInfo(rank, pid=pid, host=host, host_id=host_id, last_seen=self.clock(), agent=agent)
        record.joined.add(rank)
        record.idle_since = None
        record.late = False
        if rank not in record.membership:
            # A worker added to a running job (elastic, or a replacement for one that left).
            record.late = record.started
            record.removed.pop(rank, None)
            record.membership = record.membership.with_rank(rank)
            record.num_workers = len(record.membership)
            self.membership_changed.append(record)
        return record

    def take_out_to_rejoin(self, job: str, rank: int, token: bytes | None, pid: int = 0, host: str = "",
                           host_id: str = "") -> bool:
        """The first half of a registration with ``rejoin``: a worker process that registers its
        rank again as a newcomer (``pslink.torch.elastic`` does, to stop being taken for a worker
        that died, or after a failed collective). Its rank leaves the membership here and comes
        back (late) in :meth:`register_worker`, within the same request: no barrier and no
        round ever sees the job without it. (Leaving first and registering after, as two
        requests, let the others settle a world without it in between, then create fresh keys
        that wait for it while it waited for them in a barrier.) True if it was a member; the
        caller announces that removal before the registration adds the rank back."""
        record = self.jobs.get(job)
        if record is None or token is None:
            return False  # register_worker refuses or creates the job, saying why
        record.check_credential(token, rank)
        if rank not in record.membership:
            return False
        current = record.workers.get(rank)
        same_process = current is not None and pid and (current.pid, current.host_id) == (pid, host_id or host)
        if current is not None and current.connected and not current.left and not same_process:
            return False  # another live process holds the rank: register_worker refuses it
        return self.remove_worker(record, rank, "it registered anew")

    def remove_worker(self, record: JobRecord, rank: int, why: str, since: float | None = None) -> bool:
        """Take a rank out of its job's membership (it left, or went silent ``since``); the rounds
        under way stop waiting for it. True if it was a member."""
        worker = record.workers.setdefault(rank, WorkerInfo(rank))
        worker.connected = False
        if rank not in record.membership:
            return False
        record.membership = record.membership.without(rank)
        record.removed[rank] = why
        self.membership_changed.append(record)
        self._maybe_idle(record, since)
        return True

    def authorize(self, job: str, token: bytes, rank: int) -> JobRecord:
        record = self.jobs.get(job)
        if record is None:
            raise UnknownJobError(f"job {job!r} is not registered with this pMaster", job=job)
        if not hmac.compare_digest(token, record.token):
            raise AuthError(f"wrong token for job {job!r} (rank {rank}); refused", job=job)
        if rank not in record.membership:
            why = record.removed.get(rank)
            raise MembershipError(f"rank {rank} is not a member of job {job!r}"
                                  + (f" (removed: {why}; register again to rejoin)" if why else ""), job=job)
        worker = record.workers.get(rank)
        if worker is not None:
            worker.token_used = True
        return record

    def heartbeat(self, record: JobRecord, rank: int, iterations: list[float] | None = None,
                  work: list[float] | None = None) -> None:
        worker = record.workers.get(rank)
        if worker is None:
            worker = record.workers[rank] = WorkerInfo(rank)
        worker.last_seen = self.clock()
        worker.connected = True
        worker.disconnected_at = None
        record.idle_since = None
        if iterations and rank == min(record.membership.ranks):
            # Workers of a job step together; one rank's clock is the job's.
            self.outbox += self.control.iterations_reported(record.job, [float(d) for d in iterations if d > 0],
                                                            [float(w) for w in work or ()])

    def worker_disconnected(self, job: str, rank: int) -> None:
        """Its connection closed (a crash, or the network): removed after the grace period
        unless it reconnects (:meth:`sweep`)."""
        record = self.jobs.get(job)
        if record is not None and rank in record.workers:
            worker = record.workers[rank]
            worker.connected = False
            worker.disconnected_at = self.clock()
            self._maybe_idle(record)

    def _maybe_idle(self, record: JobRecord, since: float | None = None) -> None:
        if record.idle_since is None and not record.live_workers():
            record.idle_since = self.clock() if since is None else since

    def leave(self, record: JobRecord, rank: int) -> bool:
        """A worker left cleanly (it is no longer a member); True when no worker is left and the
        job has ended."""
        self.remove_worker(record, rank, "it left")
        record.workers[rank].left = True
        if not record.membership.ranks and all(w.left for w in record.workers.values()):
            self.remove_job(record.job)
            return True
        return False

    def set_optimizer(self, record: JobRecord, optimizer: dict, pushed: list | None = None) -> None:
        """The job's optimizer from now on. A job that sums switches to it, as MXNet's dist_sync
        store does when set_optimizer comes after init: each key's value so far (its init, or
        its last round's sum) is the weights the optimizer steps, from the round after
        ``pushed``'s for that key (``[[key, rounds the caller pushed], ...]``: every worker calls
        set_optimizer after the same pushes, or one calls it between barriers)."""
        make_optimizer(optimizer)
        if record.mode != "optimizer":
            record.mode = "optimizer"
            record.sum_through = [[key, int(r)] for key, r in pushed or () if key in record.keys and int(r) > 0]
        record.optimizer = dict(optimizer)

    # -- keys and placement -------------------------------------------------------------------

    def declare(self, record: JobRecord, rank: int, item: dict) -> tuple[KeySpec, bool]:
        """The key's spec, creating and placing it on first use. Returns (spec, created)."""
        key, shape, dtype, intent = _parse_item(record, item)
        table = table_of(key, item, shape)
        spec = record.keys.get(key)
        if spec is not None and (table is not None or spec.table is not None) and table != spec.table \
                and item.get("intent") != "pull":
            raise ConfigError(f"table {key!r} of job {record.job!r}: rank {rank} declares it as {table}, but rank "
                              f"{spec.declared_by} declared it as {spec.table}", job=record.job, key=key)
        if spec is not None:
            if spec.shape != shape or spec.dtype != dtype:
                raise ShapeMismatchError(
                    f"key {key!r} of job {record.job!r}: rank {rank} uses shape {shape} {dtype}, "
                    f"but rank {spec.declared_by} declared it as {spec.describe()}",
                    job=record.job,
                    key=key,
                    shapes=[list(shape), list(spec.shape)],
                    dtypes=[dtype, spec.dtype],
                    ranks=[rank, spec.declared_by],
                )
            return spec, False
        itemsize = DTYPES[dtype].itemsize
        check_quota(record, self.default_quota, key, f"shape {shape} {dtype}",
                    math.prod(shape) * itemsize * (1 + record.replication))
        # A table's parts are its shards, a row's width each (its rows come as they are touched).
        spans = partition_spans(math.prod(shape), itemsize, record.partition_bytes) if table is None else [
            (s * shape[1], (s + 1) * shape[1]) for s in range(shape[0])]
        if not self.control.pool.cluster_of:
            raise ServiceError(
                f"no Aggregator can take key {key!r} of job {record.job!r}: none is registered and alive"
            )
        parts = []
        for index, span in enumerate(spans):
            target, actions = self.control.place_part(record.job, key, index, (span[1] - span[0]) * itemsize)
            self.outbox += actions
            parts.append(PartSpec(index, span, target))
        if record.replication:
            load = holdings(self.jobs)
            for part in parts:
                part.replicas = pick_replicas(self.replica_candidates(), load, record.replication,
                                              exclude={part.aggregator}, hosts=self.control.pool.host_of,
                                              away_from=[part.aggregator])
        needs_init = intent == "init" or record.mode == "optimizer"
        spec = KeySpec(key, shape, dtype, rank, needs_init and table is None, parts, table=table)
        record.keys[key] = spec
        return spec, True

    def quota_of(self, record: JobRecord) -> dict:
        """The job's limits: its own (set by the operator), else the service's defaults."""
        return quota_of(record, self.default_quota)

    def forget_key(self, record: JobRecord, key: Any) -> None:
        spec = record.keys.pop(key, None)
        if spec is not None:
            self.control.forget_parts(record.job, key, len(spec.parts))

    def adopt_key(self, record: JobRecord, spec: KeySpec) -> None:
        """Put back a key placed before (state reloaded after a restart)."""
        record.keys[spec.key] = spec
        for p in spec.parts:
            nbytes = (p.span[1] - p.span[0]) * DTYPES[spec.dtype].itemsize
            self.control.adopt_part(record.job, record.num_workers, record.servers, spec.key, p.part, nbytes, p.aggregator)

    # -- aggregators --------------------------------------------------------------------------

    def register_aggregator(self, address: str, name: str | None = None, pid: int = 0, host: str = "",
                            host_id: str = "", taken=()) -> AggregatorRecord:
        """``taken``: names the provider uses or will use (a nameless Aggregator gets another)."""
        if name is None:
            while f"agg-{self._agg_serial}" in self.aggregators or f"agg-{self._agg_serial}" in taken:
                self._agg_serial += 1
            name = f"agg-{self._agg_serial}"
        record = AggregatorRecord(name, address, pid=pid, host=host, host_id=host_id or host, alive=True,
                                  last_seen=self.clock())
        self.control.aggregator_host(name, record.host_id)
        previous = self.aggregators.get(name)
        if previous is not None:
            record.stats = previous.stats
        self.aggregators[name] = record
        return record

    def aggregator_joined(self, name: str, placeholder: str | None = None) -> None:
        """A registered Aggregator joins the control plane's pool (binding the placeholder it was
        started for, if the control plane asked for it)."""
        if placeholder is not None and placeholder in self.control.pool.cluster_of:
            self.outbox += self.control.bind(placeholder, name)
            for record in self.jobs.values():
                for spec in record.keys.values():
                    for p in spec.parts:
                        if p.aggregator == placeholder:
                            p.aggregator = name
        else:
            self.control.aggregator_added(name)

    def replica_holders(self) -> set[str]:
        """Aggregators that hold a replica of some part (scaling must keep them)."""
        return {name for record in self.jobs.values() for spec in record.keys.values()
                for part in spec.parts for name in part.replicas}

    def remove_aggregator(self, name: str) -> None:
        self.aggregators.pop(name, None)
        self.control.released(name)

    def remove_from_pool(self, name: str, incoming: dict[tuple, str] | None = None) -> tuple[dict[tuple, str], list]:
        """An operator removes the Aggregator ``name``: the control plane plans the moves of the
        tasks it serves (its actions go to the outbox), the replicas it holds go elsewhere at once
        (not to the target of a part's running move, ``incoming``).
        Returns (task -> where it moves, the replica changes to carry out)."""
        if name not in self.aggregators:
            raise ServiceError(f"aggregator {name!r} is not registered with this pMaster (it has: "
                               f"{', '.join(sorted(self.aggregators)) or 'none'})")
        actions, moves = self.control.remove_aggregator(name)
        self.outbox += actions
        return moves, plan_replica_moves(self.jobs, name, self.replica_candidates(), self.control.pool.host_of, incoming)

    def aggregator_heartbeat(self, name: str, stats: dict) -> None:
        record = self.aggregators.get(name)
        if record is None:
            return
        now = self.clock()
        old, old_time = record.stats.get("_jobs"), record.last_seen
        jobs = stats.get("jobs", {})
        if old is not None and now > old_time:
            dt = now - old_time
            record.rates = {
                job: (entry.get("task_rounds", 0) - old.get(job, {}).get("task_rounds", 0)) / dt
                for job, entry in jobs.items()
            }
            record.rates["_job_rounds"] = {
                job: (entry.get("round", 0) - old.get(job, {}).get("round", 0)) / dt for job, entry in jobs.items()
            }
        record.stats["_jobs"] = jobs
        for job, entries in stats.get("costs", {}).items():
            self.control.costs_measured(job, {(job, k, p): c for k, p, c in entries})
        if "load" in stats:
            record.stats["load"] = stats["load"]
            self.control.load_measured(name, float(stats["load"]))
        # "fused": of the requests, those that came in FUSED messages.
        for field in ("errors", "requests", "fused"):
            record.stats[field] = stats.get(field, 0)
        record.stats["replicas_with_state"] = {tuple(e) for e in stats.get("replicas_with_state") or ()
                                               if self._part_entry(e)}
        record.stats["stalled"] = stats.get("stalled") or []
        record.last_seen = now
        record.alive = True
        for job, entry in jobs.items():
            if job in self.jobs:
                self.jobs[job].rounds[name] = entry.get("round", 0)

    def aggregator_lost(self, name: str) -> None:
        record = self.aggregators.get(name)
        if record is not None:
            record.alive = False

    def _address(self, name: str) -> str:
        record = self.aggregators.get(name)
        return record.address if record is not None else ""

    @staticmethod
    def _part_entry(entry) -> bool:
        """``[job, key, part, ...]`` as an Aggregator reports a part, well formed."""
        return isinstance(entry, list) and len(entry) >= 3 \
            and all(isinstance(v, t) for v, t in zip(entry, (str, (str, int), int)))

    def reported_part(self, entry) -> tuple | None:
        """(record, spec, part index) of a part an Aggregator reports as ``[job, key, part, ...]``,
        if the table has it; None for anything else (an unknown part, a malformed entry)."""
        if not self._part_entry(entry):
            return None
        record = self.jobs.get(entry[0])
        spec = record.keys.get(entry[1]) if record is not None else None
        return (record, spec, entry[2]) if spec is not None and 0 <= entry[2] < len(spec.parts) else None

    def forgotten_part(self, entry) -> bool:
        """A reported part of a job pMaster serves, of a key it does not have: a placement that
        failed or was never answered (placed again since, or to be); the copy is stale."""
        record = self.jobs.get(entry[0]) if self._part_entry(entry) else None
        return record is not None and entry[1] not in record.keys

    def live_aggregators(self) -> list[str]:
        return sorted(n for n, a in self.aggregators.items() if a.alive)

    def replica_candidates(self) -> list[str]:
        """Live Aggregators that may take a part or a replica: not one being removed, nor one the
        control plane released whose release waits for moves off it (found by the chaos run: a
        pack released its profiling Aggregators, the pack's own moves then gave them replicas,
        and the release took the replicas with it)."""
        return [n for n in self.live_aggregators() if n not in self.control.pool.draining and n in self.control.pool.cluster_of]

    def fail_over(self, name: str, stays: dict[tuple, str] | None = None, incoming: dict[tuple, str] | None = None
                  ) -> list:
        """The Aggregator ``name`` is gone for good: re-home its parts and replicas
        (:mod:`pslink.core.master.failover_plan`) and forget it. ``stays``: parts whose migration onto it
        had not landed, and their sources; ``incoming``: the other moves' parts and targets.
        Returns what pMaster must carry out."""
        self.aggregator_lost(name)
        actions = plan_failover(self.jobs, name, self.replica_candidates(), stays, self.control.pool.host_of, incoming)
        for action in actions:
            if isinstance(action, (Promote, Recreate)):
                ident = (action.record.job, action.spec.key, action.part.part)
                self.control.task_recovered(ident, action.part.aggregator)
        self.control.aggregator_lost(name)
        self.aggregators.pop(name, None)
        # The pool's floor is the operator's: a new Aggregator replaces the lost one.
        self.outbox += self.control.scaling.refill(f"replacing {name}, which failed")
        return actions

    def tick(self) -> None:
        self.outbox += self.control.tick()

    def tasks_on(self, name: str) -> list[tuple[JobRecord, list[dict]]]:
        """Every (job, task specs) placed on one Aggregator (to re-send after a reconnect)."""
        out = []
        for record in self.jobs.values():
            specs = [t for spec in record.keys.values() if spec.ready for t in spec.task_specs(name, self._address)]
            if specs:
                out.append((record, specs))
        return out

    # -- liveness -----------------------------------------------------------------------------

    def sweep(self, worker_timeout: float, aggregator_timeout: float,
              disconnect_grace: float | None = None) -> tuple[list[JobRecord], list[str]]:
        """Remove workers silent for ``worker_timeout`` (or disconnected for ``disconnect_grace``)
        from their jobs, mark silent Aggregators. Returns the jobs that ended (no worker for
        ``worker_timeout``) and the Aggregators that just went silent."""
        now = self.clock()
        grace = worker_timeout if disconnect_grace is None else disconnect_grace
        ended = []
        for record in list(self.jobs.values()):
            for worker in record.workers.values():
                if worker.connected and now - worker.last_seen > worker_timeout:
                    self.remove_worker(record, worker.rank, f"silent for {now - worker.last_seen:.0f} s",
                                       since=worker.last_seen)
                elif (not worker.connected and not worker.left and worker.rank in record.membership
                      and worker.disconnected_at is not None and now - worker.disconnected_at > grace):
                    self.remove_worker(record, worker.rank, f"disconnected for {now - worker.disconnected_at:.0f} s",
                                       since=worker.disconnected_at)
            # Silent workers went away when they were last heard from, not when we noticed.
            self._maybe_idle(record, max((w.last_seen for w in record.workers.values()), default=now))
            never_joined = record.preregistered and not record.joined
            if record.idle_since is not None and now - record.idle_since > worker_timeout and not never_joined:
                ended.append(self.remove_job(record.job))
        silent = []
        for agg in self.aggregators.values():
            # Silent while connected, or gone and not back (also one known from before a restart).
            if now - agg.last_seen > aggregator_timeout:
                agg.alive = False
                silent.append(agg.name)
        return ended, silent

    # -- reporting ----------------------------------------------------------------------------


def table_of(key, item: dict, shape: tuple) -> dict | None:
    """The table options a LOOKUP entry declares (checked; its shape is [shards, width]), or None."""
    options = item.get("table")
    if options is None:
        return None
    table = table_options(options, f"table {key!r}")
    if list(shape) != [table["shards"], table["width"]]:
        raise ProtocolError(f"table {key!r}: shape {list(shape)} must be [shards, width] = "
                            f"{[table['shards'], table['width']]}")
    return table


def _parse_item(record: JobRecord, item: dict) -> tuple[Any, tuple[int, ...], str, str]:
    """Validate one LOOKUP entry ``{key, shape, dtype, intent}``; a pull may omit shape and dtype."""
    if not isinstance(item, dict):
        raise ProtocolError("LOOKUP items must be maps")
    key = item.get("key")
    if not ((isinstance(key, int) and not isinstance(key, bool) and 0 <= key < 1 << 64) or (isinstance(key, str) and 0 < len(key) <= 256)):
        raise ProtocolError(f"job {record.job!r}: key {key!r} must be an int in [0, 2**64) or a non-empty string")
    intent = item.get("intent", "push")
    if intent not in ("init", "push", "pull"):
        raise ProtocolError(f"key {key!r}: intent {intent!r} must be init, push or pull")
    if intent == "pull":
        spec = record.keys.get(key)
        if spec is None:
            raise KeyStateError(
                f"key {key!r} of job {record.job!r} was never initialized or pushed; a pull needs init first",
                job=record.job,
                key=key,
            )
        if item.get("shape") is None and item.get("dtype") is None:
            return key, spec.shape, spec.dtype, intent
    shape = item.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in shape
    ):
        raise ProtocolError(f"key {key!r}: shape {shape!r} must be a list of non-negative ints")
    dtype = item.get("dtype")
    if dtype not in DTYPES:
        raise ProtocolError(f"key {key!r}: dtype {dtype!r} is not supported; supported: {', '.join(DTYPES)}")
    return key, tuple(shape), dtype, intent
