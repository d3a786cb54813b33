"""pMaster's durable state: jobs and tokens, key placements, Aggregators.

A restarted pMaster loads this back and resumes: workers and Aggregators reconnect and find their
jobs, tokens and assignments as they left them. Workers themselves are not stored (they register
again); Aggregators come back as not-yet-alive until they reconnect.

:class:`MasterStore` is what pMaster writes through; its rows are the same whatever keeps them.
:class:`SqliteStore` keeps them in a file on pMaster's host (``--state DIR``, the default);
:class:`~pslink.core.master.store_redis.RedisStore` in a Redis server (``--state redis://...``), which
outlives pMaster's host and lets a standby take over (:mod:`pslink.core.master.leadership`).
"""

from __future__ import annotations

import abc
import json
import os
import sqlite3

import msgpack

from pslink.core.checkpoints import DEFAULT_EVERY
from pslink.core.master.records import AggregatorRecord, JobRecord, KeySpec, PartSpec, WorkerInfo
from pslink.core.master.state import MasterState
from pslink.core.membership import Membership
from pslink.errors import error_from_code, error_to_wire

SCHEMA_VERSION = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job TEXT PRIMARY KEY, token BLOB NOT NULL, num_workers INTEGER NOT NULL, mode TEXT NOT NULL,
    optimizer TEXT, partition_bytes INTEGER NOT NULL, preregistered INTEGER NOT NULL,
    created REAL NOT NULL, joined TEXT NOT NULL, sync TEXT NOT NULL, extra TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS keys (
    job TEXT NOT NULL, key BLOB NOT NULL, shape TEXT NOT NULL, dtype TEXT NOT NULL,
    declared_by INTEGER NOT NULL, needs_init INTEGER NOT NULL, parts TEXT NOT NULL,
    PRIMARY KEY (job, key)
);
CREATE TABLE IF NOT EXISTS aggregators (
    name TEXT PRIMARY KEY, address TEXT NOT NULL, pid INTEGER NOT NULL, host TEXT NOT NULL,
    host_id TEXT NOT NULL DEFAULT ''
);
"""

# How a state file of an older schema becomes the current one, step by step.
_MIGRATIONS = {
    2: "ALTER TABLE aggregators ADD COLUMN host_id TEXT NOT NULL DEFAULT ''",  # hosts (several machines)
}


class MasterStore(abc.ABC):
    """Write-through persistence of pMaster's state, as rows (tuples in the columns of ``_SCHEMA``).

    A backend implements ``_put`` (a row of ``jobs``, ``aggregators`` or ``meta`` by its name),
    ``_put_key`` / ``_delete_key`` (a row of ``keys``), ``_delete``, ``_delete_job`` (the job and
    its keys), ``_rows`` (everything, to load), ``_meta`` and ``close``. ``path`` says where the
    state is (status, logs); None keeps nothing (an embedded, throwaway service). ``written`` and
    ``pending_writes`` count the writes taken and those waiting (a store off the host may be away)."""

    written = 0
    path: str | None = None

    @property
    def pending_writes(self) -> int:
        return 0

    def save_job(self, record: JobRecord) -> None:
        self._put("jobs", record.job, (
            record.job,
            record.token,
            record.num_workers,
            record.mode,
            json.dumps(record.optimizer) if record.optimizer is not None else None,
            record.partition_bytes,
            int(record.preregistered),
            record.created,
            json.dumps(sorted(record.joined)),
            record.sync,
            json.dumps(record.extra()),
        ))

    def delete_job(self, job: str) -> None:
        self._delete_job(job)

    def save_key(self, job: str, spec: KeySpec) -> None:
        packed = msgpack.packb(spec.key)
        self._put_key(job, packed, (job, packed, json.dumps(list(spec.shape)), spec.dtype, spec.declared_by,
                                    int(spec.needs_init), json.dumps(_parts_to_json(spec))))

    def delete_key(self, job: str, key) -> None:
        self._delete_key(job, msgpack.packb(key))

    def save_removing(self, names) -> None:
        """The Aggregators an operator is removing (draining): a restarted pMaster goes on with it."""
        self._put("meta", "removing", ("removing", json.dumps(sorted(names))))

    def load_removing(self) -> list[str]:
        row = self._meta().get("removing")
        return list(json.loads(row)) if row else []

    def delete_aggregator(self, name: str) -> None:
        self._delete("aggregators", name)

    def save_aggregator(self, record: AggregatorRecord) -> None:
        self._put("aggregators", record.name, (record.name, record.address, record.pid, record.host, record.host_id))

    def load(self, state: MasterState) -> None:
        """Fill ``state`` with what was saved."""
        aggregators, jobs, keys, _ = self._rows()
        restore(state, aggregators, jobs, keys)

    # -- what a backend implements ------------------------------------------------------------

    @abc.abstractmethod
    def _put(self, table: str, name: str, row: tuple) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def _put_key(self, job: str, key: bytes, row: tuple) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def _delete(self, table: str, name: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def _delete_key(self, job: str, key: bytes) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def _delete_job(self, job: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def _rows(self) -> tuple[list, list, list, dict]:
        """(aggregators, jobs, keys) rows and the ``meta`` values by name."""
        raise NotImplementedError

    @abc.abstractmethod
    def _meta(self) -> dict:
        """The ``meta`` values by name (without reading every row)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class SqliteStore(MasterStore):
    """The state in an SQLite file on pMaster's host; ``path=None`` keeps nothing."""

    def __init__(self, path: str | None):
        self.path = path
        if path is None:
            self.db = None
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        row = self.db.execute("SELECT value FROM meta WHERE name='schema'").fetchone()
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        else:
            version = int(row[0])
            while version in _MIGRATIONS and version < SCHEMA_VERSION:
                self.db.execute(_MIGRATIONS[version])
                version += 1
                self.db.execute("UPDATE meta SET value=? WHERE name='schema'", (str(version),))
            if version != SCHEMA_VERSION:
                raise RuntimeError(
                    f"state file {path} has schema {row[0]}; this pslink reads schema {SCHEMA_VERSION}"
                )

    def _exec(self, sql: str, args: tuple = ()) -> None:
        if self.db is not None:
            self.db.execute(sql, args)

    def _put(self, table: str, name: str, row: tuple) -> None:
        self._exec(f"INSERT OR REPLACE INTO {table} VALUES ({', '.join('?' * len(row))})", row)

    def _put_key(self, job: str, key: bytes, row: tuple) -> None:
        self._put("keys", "", row)

    def _delete(self, table: str, name: str) -> None:
        column = {"jobs": "job", "aggregators": "name", "meta": "name"}[table]
        self._exec(f"DELETE FROM {table} WHERE {column}=?", (name,))

    def _delete_key(self, job: str, key: bytes) -> None:
        self._exec("DELETE FROM keys WHERE job=? AND key=?", (job, key))

    def _delete_job(self, job: str) -> None:
        self._exec("DELETE FROM keys WHERE job=?", (job,))
        self._exec("DELETE FROM jobs WHERE job=?", (job,))

    def _rows(self) -> tuple[list, list, list, dict]:
        if self.db is None:
            return [], [], [], {}
        select = self.db.execute
        return (list(select("SELECT name, address, pid, host, host_id FROM aggregators")),
                list(select("SELECT * FROM jobs")), list(select("SELECT * FROM keys")),
                dict(select("SELECT name, value FROM meta")))

    def _meta(self) -> dict:
        return {} if self.db is None else dict(self.db.execute("SELECT name, value FROM meta"))

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None


def restore(state: MasterState, aggregators, jobs, keys) -> None:
    """Fill ``state`` from stored rows (any backend's)."""
    now = state.clock()
    for name, address, pid, host, host_id in aggregators:
        state.aggregators[name] = AggregatorRecord(name, address, pid=pid, host=host, host_id=host_id, alive=False,
                                                   last_seen=now)
        state.control.aggregator_host(name, host_id)
    for job, token, num_workers, mode, optimizer, partition, prereg, created, joined, sync, extra in jobs:
        extra = json.loads(extra)
        state.jobs[job] = record = JobRecord(
            job=job,
            token=bytes(token),
            num_workers=num_workers,
            mode=mode,
            optimizer=json.loads(optimizer) if optimizer else None,
            partition_bytes=partition,
            sync=sync,
            preregistered=bool(prereg),
            created=created,
            joined=set(json.loads(joined)),
            idle_since=now,  # its workers get a heartbeat timeout to reconnect
            membership=Membership.from_wire(extra["membership"]),
            max_workers=extra.get("max_workers"),
            staleness=extra.get("staleness", 0),
            straggler_timeout=extra.get("straggler_timeout"),
            servers=extra.get("servers"),
            slo=extra.get("slo"),
            priority=extra.get("priority", "normal"),
            replication=extra.get("replication", 0),
            checkpoint=extra.get("checkpoint"),
            checkpoint_every=extra.get("checkpoint_every") or DEFAULT_EVERY,
            quota=extra.get("quota") or {},
            sum_through=extra.get("sum_through") or [],
        )
        for rank in record.membership.ranks:  # each gets the heartbeat timeout to reconnect
            record.workers[rank] = WorkerInfo(rank, last_seen=now, restored=True)
        state.control.adopt_job(job, num_workers, record.servers, record.slo, record.priority)
    for job, key, shape, dtype, declared_by, needs_init, parts in keys:
        record = state.jobs.get(job)
        if record is None:
            continue
        parts = json.loads(parts)
        table = parts.get("table") if isinstance(parts, dict) else None
        aborted = parts.get("aborted") if isinstance(parts, dict) else None
        parts = parts["parts"] if isinstance(parts, dict) else parts
        spec = KeySpec(
            table=table,
            key=msgpack.unpackb(key, raw=False),
            shape=tuple(json.loads(shape)),
            dtype=dtype,
            declared_by=declared_by,
            needs_init=bool(needs_init),
            parts=[PartSpec(part, tuple(span), agg, list(replicas)) for part, span, agg, replicas in parts],
            ready=True,
            aborted=error_from_code(*aborted) if aborted else None,  # poisoned before the restart: still so
        )
        state.adopt_key(record, spec)
    # Every Aggregator a key names is accounted for, one deleted from the table too: a failover
    # stores the loss before the parts' new places, and a pMaster that died in between fails it
    # over again at its first sweep (it was lost already), and never gives its name to another.
    named = {name for record in state.jobs.values() for spec in record.keys.values() for part in spec.parts
             for name in (part.aggregator, *part.replicas)}
    for name in sorted(named - set(state.aggregators)):
        state.aggregators[name] = AggregatorRecord(name, "", alive=False, last_seen=float("-inf"))
        state.control.aggregator_host(name, "")


def _parts_to_json(spec: KeySpec):
    """A key's parts as stored: a list; with a table's options or the error that aborted the
    key, ``{"parts": [...], "table": options, "aborted": [code, message, details]}``."""
    parts = [[p.part, list(p.span), p.aggregator, p.replicas] for p in spec.parts]
    if spec.table is None and spec.aborted is None:
        return parts
    stored: dict = {"parts": parts}
    if spec.table is not None:
        stored["table"] = spec.table
    if spec.aborted is not None:
        stored["aborted"] = error_to_wire(spec.aborted)
    return stored
