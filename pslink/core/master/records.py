"""What pMaster records (no I/O): jobs with their settings, workers and membership, keys and
where their parts live, Aggregators; and the validation of a job's settings."""

from __future__ import annotations

import dataclasses
import hmac
import math
from typing import Any

from pslink.core.membership import Membership
from pslink.core.optim import make_optimizer
from pslink.core.checkpoints import DEFAULT_EVERY, check_url
from pslink.core.partition import DEFAULT_PARTITION_BYTES
from pslink.core.wire.protocol import DTYPES
from pslink.core.master.job_control import check_service_level
from pslink.errors import AuthError, ConfigError, QuotaError, error_to_wire

MODES = ("sum", "optimizer")
SYNCS = ("bsp", "ssp", "asp")
JOB_SETTINGS = {"mode", "optimizer", "partition_bytes", "sync", "servers", "max_workers", "staleness",
                "straggler_timeout", "replication", "checkpoint", "checkpoint_every", "slo", "priority"}
MAX_REPLICATION = 2


QUOTAS = ("max_bytes", "max_keys")  # what the operator may limit per job (bytes held, replicas counted; keys)


def checked_quota(quota) -> dict:
    """A quota as given (``{"max_bytes": n, "max_keys": n}``, any subset; None: no limit), checked."""
    if quota is None:
        return {}
    if not isinstance(quota, dict):
        raise ConfigError(f"a quota must be a mapping of {' and '.join(QUOTAS)}, got {quota!r}")
    unknown = sorted(set(quota) - set(QUOTAS))
    if unknown:
        raise ConfigError(f"unknown quota {unknown[0]!r}; the quotas are {', '.join(QUOTAS)}")
    for name, value in quota.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"quota {name} must be a whole number >= 1 (or none), got {value!r}")
    return {name: value for name, value in quota.items() if value is not None}


def quota_of(record: "JobRecord", default: dict) -> dict:
    """A job's limits: its own (the operator's), else the service's ``default``."""
    return {name: record.quota.get(name, default.get(name)) for name in QUOTAS}


def check_quota(record: "JobRecord", default: dict, key: Any, what: str, nbytes: int) -> None:
    """A new key (``nbytes`` held, replicas counted) must fit the job's quota of keys and bytes."""
    quota = quota_of(record, default)
    if quota["max_keys"] is not None and len(record.keys) + 1 > quota["max_keys"]:
        raise QuotaError(f"job {record.job!r} holds {len(record.keys)} keys, its quota (max_keys "
                         f"{quota['max_keys']}); key {key!r} is refused", job=record.job, key=str(key),
                         limit=quota["max_keys"])
    if quota["max_bytes"] is not None:
        held = sum(s.held_bytes() for s in record.keys.values())
        if held + nbytes > quota["max_bytes"]:
            raise QuotaError(f"job {record.job!r} holds {held} bytes; key {key!r} ({what}, {nbytes} bytes with "
                             f"its replicas) would pass its quota (max_bytes {quota['max_bytes']})",
                             job=record.job, key=str(key), limit=quota["max_bytes"])


@dataclasses.dataclass
class PartSpec:
    part: int
    span: tuple[int, int]
    aggregator: str
    replicas: list[str] = dataclasses.field(default_factory=list)  # hold each closed round's state


@dataclasses.dataclass
class KeySpec:
    key: Any
    shape: tuple[int, ...]
    dtype: str
    declared_by: int
    needs_init: bool
    parts: list[PartSpec]
    ready: bool = False  # every part's Aggregator acknowledged its assignment
    aborted: Any = None  # the PslinkError that poisoned the key (sent again to late Aggregators)
    table: dict | None = None  # a sparse table's options (pslink.core.tables): its parts are its shards

    def task_specs(self, aggregator: str | None = None, address_of=None) -> list[dict]:
        """The ASSIGN entries for this key's parts (on one Aggregator, or all): the parts it
        serves (with their replicas' names and addresses, by ``address_of``), and the parts it
        holds a replica of (``"replica": True``)."""
        entries = []
        for p in self.parts:
            entry = {"key": self.key, "part": p.part, "span": list(p.span), "shape": list(self.shape),
                     "dtype": self.dtype, "declared_by": self.declared_by, "needs_init": self.needs_init}
            if self.table is not None:
                entry["table"] = self.table
            if self.aborted is not None:
                # Aborted before this ASSIGN: the task is created failed. An ABORT sent after it
                # could reach the Aggregator after a worker's first requests (another connection).
                entry["aborted"] = error_to_wire(self.aborted)
            if aggregator is None or p.aggregator == aggregator:
                if p.replicas and address_of is not None:
                    entry["replicas"] = [[r, address_of(r)] for r in p.replicas]
                entries.append(entry)
            elif aggregator in p.replicas:
                entries.append(dict(entry, replica=True))
        return entries

    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def held_bytes(self) -> int:
        """What the service holds for it: its bytes on the primary and on every replica."""
        return self.nbytes() * (1 + max((len(p.replicas) for p in self.parts), default=0))

    def describe(self) -> str:
        return f"shape {self.shape} {self.dtype}"


@dataclasses.dataclass
class WorkerInfo:
    rank: int
    pid: int = 0
    host: str = ""  # its host's name, for messages
    host_id: str = ""  # its host's identity (pslink.core.hosts.host_id): who shares a host with whom
    last_seen: float = 0.0
    connected: bool = True
    left: bool = False
    disconnected_at: float | None = None  # its connection closed then (removed after a grace period)
    restored: bool = False  # loaded after a pMaster restart: its worker re-registers to claim it
    agent: str = ""  # the registering Agent's incarnation (one of several Agents of a process)
    # It sent the job's token since it registered, so it got pMaster's answer. Until then the
    # same Agent may register again without it: the answer (the token) may have been lost with
    # its connection (found by the chaos run with control faults).
    token_used: bool = False


@dataclasses.dataclass
class JobRecord:
    job: str
    token: bytes
    num_workers: int
    mode: str = "sum"
    optimizer: dict | None = None
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    sync: str = "bsp"
    servers: int | None = None  # what it would ask ps-lite for (default: one per worker)
    slo: float | None = None  # the slowdown it accepts from sharing (None: the service's loss limit)
    priority: str = "normal"  # "high": scaling never moves its tasks to free an Aggregator
    max_workers: int | None = None  # ranks 0 .. max_workers - 1 may join (default: num_workers)
    staleness: int = 0  # ssp
    straggler_timeout: float | None = None
    replication: int = 0  # replicas of every part, on other Aggregators (failover without loss)
    checkpoint: str | None = None  # where parts are written every checkpoint_every rounds (failover with loss)
    checkpoint_every: int = DEFAULT_EVERY
    preregistered: bool = False
    created: float = 0.0
    membership: Membership = dataclasses.field(default=None)  # type: ignore[assignment]
    keys: dict[Any, KeySpec] = dataclasses.field(default_factory=dict)
    workers: dict[int, WorkerInfo] = dataclasses.field(default_factory=dict)
    joined: set[int] = dataclasses.field(default_factory=set)  # ranks that ever registered
    rounds: dict[str, int] = dataclasses.field(default_factory=dict)  # aggregator -> max round
    idle_since: float | None = None  # when the last connected worker went away (None: some is here)
    removed: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> why it left
    late: bool = False  # the worker that registered last joined rounds under way (told in settings)
    quota: dict = dataclasses.field(default_factory=dict)  # max_bytes / max_keys the operator set (None: none)
    # Switched from summing to the optimizer after keys existed: [[key, last sum round], ...], the
    # rounds the first set_optimizer's caller had pushed of each key (later rounds step the weights).
    sum_through: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.membership is None:
            self.membership = Membership.fixed(self.num_workers)
        if self.max_workers is None:
            self.max_workers = self.num_workers

    @property
    def started(self) -> bool:
        """Keys exist: a rank added now joins rounds already under way."""
        return bool(self.keys)

    def check_credential(self, token: bytes | None, rank: int, first_join: bool = True, agent: str = "") -> None:
        """A worker's registration: with the job's token, or without it for a rank's first join
        (trust on first use, where the service allows it), or for the same Agent (``agent``, its
        incarnation) again while it never used the token (its registration's answer was lost
        with the connection)."""
        if token is None:
            current = self.workers.get(rank)
            answer_lost = (current is not None and not current.token_used and bool(agent)
                           and current.agent == agent and not self.preregistered)
            if (self.preregistered or rank in self.joined or not first_join) and not answer_lost:
                raise AuthError(
                    f"job {self.job!r} needs its token to register rank {rank} (set PSLINK_TOKEN or "
                    "pass token=); if an earlier run of the job crashed, it ends once its workers have "
                    "been silent for the heartbeat timeout",
                    job=self.job,
                )
            return
        if not hmac.compare_digest(token, self.token):
            raise AuthError(f"wrong token for job {self.job!r} (rank {rank}); refused", job=self.job)

    def extra(self) -> dict:
        """Settings and membership beyond the stored columns (persisted as JSON)."""
        return {"membership": self.membership.to_wire(), "max_workers": self.max_workers,
                "staleness": self.staleness, "straggler_timeout": self.straggler_timeout,
                "servers": self.servers, "slo": self.slo, "priority": self.priority,
                "replication": self.replication, "checkpoint": self.checkpoint,
                "checkpoint_every": self.checkpoint_every, "quota": self.quota, "sum_through": self.sum_through}

    def jobinfo(self) -> dict:
        """What Aggregators need to serve the job (sent with assignments)."""
        return {
            "job": self.job,
            "token": self.token,
            "membership": self.membership.to_wire(),
            "mode": self.mode,
            "optimizer": self.optimizer,
            "sync": self.sync,
            "staleness": self.staleness,
            "straggler_timeout": self.straggler_timeout,
            "checkpoint": self.checkpoint,
            "checkpoint_every": self.checkpoint_every,
            "sum_through": self.sum_through,
        }

    def settings(self) -> dict:
        """What an Agent needs (returned at registration)."""
        return {
            "job": self.job,
            "token": self.token,
            "num_workers": self.num_workers,
            "membership": self.membership.to_wire(),
            "mode": self.mode,
            "optimizer": self.optimizer,
            "partition_bytes": self.partition_bytes,
            "sync": self.sync,
            "staleness": self.staleness,
            "straggler_timeout": self.straggler_timeout,
            "max_workers": self.max_workers,
            "replication": self.replication,
            "checkpoint": self.checkpoint,
            "checkpoint_every": self.checkpoint_every,
            "late": self.late,
        }

    def aggregators(self) -> set[str]:
        return {p.aggregator for spec in self.keys.values() for p in spec.parts}

    def live_workers(self) -> list[int]:
        return sorted(r for r, w in self.workers.items() if w.connected and not w.left)


@dataclasses.dataclass
class AggregatorRecord:
    name: str
    address: str
    pid: int = 0
    host: str = ""
    host_id: str = ""
    alive: bool = True
    last_seen: float = 0.0
    stats: dict = dataclasses.field(default_factory=dict)
    rates: dict = dataclasses.field(default_factory=dict)
    lease: float = 0.0  # how long it serves past its last heartbeat pMaster answered (0: no lease)


def validate_settings(config: dict | None) -> dict:
    """Check a job's settings (mode, optimizer, partition size); return them normalized."""
    config = dict(config or {})
    unknown = set(config) - JOB_SETTINGS
    if unknown:
        raise ConfigError(f"unknown job setting(s) {sorted(unknown)}; allowed: {sorted(JOB_SETTINGS)}")
    mode = config.get("mode") or ("optimizer" if config.get("optimizer") else "sum")
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    optimizer = config.get("optimizer")
    make_optimizer(optimizer)  # raises ConfigError naming the bad field
    if mode == "sum" and optimizer is not None:
        raise ConfigError("an optimizer needs mode 'optimizer' (the service applies it)")
    partition = config.get("partition_bytes", DEFAULT_PARTITION_BYTES)
    if not isinstance(partition, int) or isinstance(partition, bool) or partition < 8:
        raise ConfigError(f"partition_bytes must be an int >= 8, got {partition!r}")
    sync = config.get("sync", "bsp")
    if sync not in SYNCS:
        raise ConfigError(f"sync must be one of {SYNCS}, got {sync!r}")
    servers = _optional_int(config, "servers", 1)
    slo, priority = config.get("slo"), config.get("priority", "normal")
    check_service_level(slo, priority)
    max_workers = _optional_int(config, "max_workers", 1)
    staleness = _optional_int(config, "staleness", 0) or 0
    if sync == "ssp" and staleness < 1:
        raise ConfigError("sync 'ssp' needs staleness >= 1 (how many rounds a pull may be behind)")
    if sync != "ssp" and staleness:
        raise ConfigError(f"staleness applies to sync 'ssp', not {sync!r}")
    straggler = config.get("straggler_timeout")
    if straggler is not None:
        if not isinstance(straggler, (int, float)) or isinstance(straggler, bool) or not straggler > 0:
            raise ConfigError(f"straggler_timeout must be a number of seconds > 0, got {straggler!r}")
        if sync == "asp":
            raise ConfigError("straggler_timeout applies to sync 'bsp' or 'ssp'; 'asp' rounds never wait")
        straggler = float(straggler)
    replication = _optional_int(config, "replication", 0) or 0
    if replication > MAX_REPLICATION:
        raise ConfigError(f"replication must be 0 to {MAX_REPLICATION}, got {replication}")
    if replication and sync == "asp":
        raise ConfigError("replication needs sync 'bsp' or 'ssp' (an 'asp' job applies every push at once)")
    checkpoint = config.get("checkpoint")
    every = _optional_int(config, "checkpoint_every", 1)
    if checkpoint is not None:
        check_url(checkpoint)
        # In sum mode only tables are written (a tensor's sum-mode part keeps no state between rounds).
        if sync == "asp":
            raise ConfigError("checkpoint needs sync 'bsp' or 'ssp' (it is taken at round boundaries)")
    elif every is not None:
        raise ConfigError("checkpoint_every needs checkpoint (a directory or an fsspec URL)")
    return {"mode": mode, "optimizer": optimizer, "partition_bytes": partition, "sync": sync, "servers": servers,
            "slo": None if slo is None else float(slo), "priority": priority,
            "max_workers": max_workers, "staleness": staleness, "straggler_timeout": straggler,
            "replication": replication, "checkpoint": checkpoint, "checkpoint_every": every or DEFAULT_EVERY}


def _optional_int(config: dict, name: str, low: int) -> int | None:
    value = config.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class LookupWait:
    """A LOOKUP that waits for some of its keys' assignments to be acknowledged (its
    ``attempts``th: an ASSIGN lost with its connection places the keys again, up to ATTEMPTS)."""

    __slots__ = ("peer", "request", "record", "specs", "missing", "attempts")
    ATTEMPTS = 5

    def __init__(self, peer, request: dict, record: JobRecord, specs: list[KeySpec], attempts: int = 1):
        self.peer, self.request, self.record, self.specs = peer, request, record, specs
        self.missing = {s.key for s in specs if not s.ready}
        self.attempts = attempts
