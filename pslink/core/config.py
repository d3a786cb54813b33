"""Settings that come from the environment (what ``pslink launch`` and ``pslink demo`` set).

Every value can also be passed as an argument; the argument wins. A missing or malformed value
raises :class:`~pslink.errors.ConfigError` naming both the argument and the variable. A shared
leaf of the core: it imports nothing of the roles or the transports (the transports' own variables
are read beside their options, :func:`pslink.core.transport.options.transport_options`).
"""

from __future__ import annotations

import logging
import os

from pslink.core.master_addresses import MasterAddresses
from pslink.errors import ConfigError

log = logging.getLogger(__name__)

ENV_JOB = "PSLINK_JOB"
ENV_RANK = "PSLINK_RANK"
ENV_NUM_WORKERS = "PSLINK_NUM_WORKERS"
ENV_MAX_WORKERS = "PSLINK_MAX_WORKERS"
ENV_ELASTIC = "PSLINK_ELASTIC"  # set by an elastic pslink launch: the job's members come and go
ENV_MASTER = "PSLINK_MASTER"
ENV_TOKEN = "PSLINK_TOKEN"
ENV_TIMEOUT = "PSLINK_TIMEOUT"
ENV_PARTITION_BYTES = "PSLINK_PARTITION_BYTES"
ENV_FUSION_BYTES = "PSLINK_FUSION_BYTES"
ENV_FUSION_CYCLE_MS = "PSLINK_FUSION_CYCLE_MS"
DEFAULT_FUSION_BYTES = 16 << 20
ENV_LINK_WINDOW = "PSLINK_LINK_WINDOW"
DEFAULT_LINK_WINDOW = 3
DEFAULT_FUSION_CYCLE_MS = 1.0

DEFAULT_MASTER = "tcp://127.0.0.1:7770"
DEFAULT_TIMEOUT = 300.0


def env_value(name: str, environ) -> str | None:
    """An environment variable's value (None if it is not set, or empty)."""
    value = environ.get(name)
    return value if value not in (None, "") else None


def resolve_str(value: str | None, argument: str, variable: str, default: str | None = None, environ=os.environ) -> str:
    if value is None:
        value = env_value(variable, environ) or default
    if value is None:
        raise ConfigError(f"{argument} is not set: pass {argument}= or set {variable}")
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{argument} must be a non-empty string, got {value!r}")
    return value


def resolve_int(value: int | None, argument: str, variable: str, minimum: int, environ=os.environ) -> int:
    source = f"{argument}="
    if value is None:
        raw = env_value(variable, environ)
        if raw is None:
            raise ConfigError(f"{argument} is not set: pass {argument}= or set {variable}")
        source = variable
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError(f"{variable}={raw!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{source} must be an integer >= {minimum}, got {value!r}")
    return value


def resolve_float(value: float | None, argument: str, variable: str, default: float, environ=os.environ) -> float:
    if value is None:
        raw = env_value(variable, environ)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{variable}={raw!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{argument} must be a positive number of seconds, got {value!r}")
    return float(value)


def resolve_token(value: bytes | str | None, environ=os.environ) -> bytes | None:
    """A job token as bytes; the environment carries it as hex."""
    if value is None:
        value = env_value(ENV_TOKEN, environ)
        if value is None:
            return None
    if isinstance(value, bytes):
        return value
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ConfigError(f"{ENV_TOKEN} must be the job token in hex, got {value[:12]!r}...") from None


def resolve_master(master: str | None, environ=os.environ) -> str:
    """pMaster's address, or a comma list of them (a leader and its standby: whichever answers,
    :mod:`pslink.core.master_addresses`), from ``master=`` or ``PSLINK_MASTER``, checked: a
    ConfigError names the bad entry and where it came from. Spaces around entries are dropped."""
    setting = ENV_MASTER if master is None and env_value(ENV_MASTER, environ) else "master"
    master = resolve_str(master, "master", ENV_MASTER, default=DEFAULT_MASTER, environ=environ)
    return str(MasterAddresses.parse(master, setting))


# Names users reach for that mean one of connect()'s: the error says which (Horovod, torchrun and
# ps-lite words for the same things).
CONNECT_ALIASES = {
    "size": "num_workers", "world_size": "num_workers", "workers": "num_workers", "nworkers": "num_workers",
    "job_id": "job", "name": "job", "job_name": "job",
    "master_address": "master", "address": "master", "service": "master", "server": "master",
    "local_rank": "rank", "worker_rank": "rank",
    "partition": "partition_bytes", "partition_size": "partition_bytes",
}


def resolve_connect(job, rank, num_workers, master, options: dict, known, environ=os.environ):
    """``connect()``'s arguments, each falling back to its environment variable, and its options
    checked against ``known`` (a wrong name is a ConfigError naming the one meant). This is the
    edge where the environment is read: the Agent itself takes everything as arguments."""
    import difflib

    from pslink.core.names import check_job_name

    unknown = sorted(set(options) - set(known))
    if unknown:
        name = unknown[0]
        meant = CONNECT_ALIASES.get(name) or next(iter(difflib.get_close_matches(name, sorted(known) + [
            "job", "rank", "num_workers", "master"], n=1)), None)
        hint = f"; did you mean {meant!r}?" if meant else f"; known options: {', '.join(sorted(known))}"
        raise ConfigError(f"connect() got an unknown option {name!r}{hint}")
    options = dict(options)
    job = check_job_name(resolve_str(job, "job", ENV_JOB, environ=environ))
    rank = resolve_int(rank, "rank", ENV_RANK, minimum=0, environ=environ)
    num_workers = resolve_int(num_workers, "num_workers", ENV_NUM_WORKERS, minimum=1, environ=environ)
    max_workers = options.get("max_workers")
    if max_workers is None and env_value(ENV_MAX_WORKERS, environ):
        max_workers = options["max_workers"] = resolve_int(None, "max_workers", ENV_MAX_WORKERS, minimum=1,
                                                           environ=environ)
    if rank >= max(num_workers, max_workers or 0):
        raise ConfigError(f"rank {rank} is out of range for {max(num_workers, max_workers or 0)} workers")
    if options.get("partition_bytes") is None and env_value(ENV_PARTITION_BYTES, environ):
        # Smaller parts pipeline better across a slow link (a part's answer crosses back only once
        # it crossed); the job's first worker sets it for every worker.
        options["partition_bytes"] = resolve_int(None, "partition_bytes", ENV_PARTITION_BYTES, 8, environ=environ)
    master = resolve_master(master, environ)
    options["timeout"] = resolve_float(options.get("timeout"), "timeout", ENV_TIMEOUT, DEFAULT_TIMEOUT,
                                       environ=environ)
    return job, rank, num_workers, master, options


def link_window(environ=os.environ) -> int:
    """How many large requests (of FUSE_BELOW bytes or more) an Agent keeps in flight on one
    network link to an Aggregator (``PSLINK_LINK_WINDOW``, default 3; 0: no limit); the rest wait
    for answers, in order (pslink.core.agent.requests). Same-host links are never limited."""
    value = env_number(ENV_LINK_WINDOW, int, "a whole number of requests", 0, 1 << 20, environ)
    return DEFAULT_LINK_WINDOW if value is None else value


def fusion_settings(fusion_bytes: int | None = None, cycle_ms: float | None = None,
                    environ=os.environ) -> tuple[int, float]:
    """An Agent's fusion (pslink.core.agent.requests): the most payload bytes one fused message
    holds (``PSLINK_FUSION_BYTES``, default 16 MiB; 0 turns fusion off) and the longest a small
    request waits for others to travel with (``PSLINK_FUSION_CYCLE_MS``, default 1 ms), as
    Horovod's fusion threshold and cycle time. Returns (bytes, seconds)."""
    if fusion_bytes is None:
        raw = env_value(ENV_FUSION_BYTES, environ)
        fusion_bytes = DEFAULT_FUSION_BYTES if raw is None else resolve_int(None, "fusion_bytes", ENV_FUSION_BYTES, 0,
                                                                            environ=environ)
    elif isinstance(fusion_bytes, bool) or not isinstance(fusion_bytes, int) or fusion_bytes < 0:
        raise ConfigError(f"fusion_bytes must be an integer >= 0 (0: no fusion), got {fusion_bytes!r}")
    if cycle_ms is None:
        cycle_ms = env_number(ENV_FUSION_CYCLE_MS, float, "a number of milliseconds", 0, 10_000, environ)
        cycle_ms = DEFAULT_FUSION_CYCLE_MS if cycle_ms is None else cycle_ms
    elif isinstance(cycle_ms, bool) or not isinstance(cycle_ms, (int, float)) or not 0 <= cycle_ms <= 10_000:
        raise ConfigError(f"fusion_cycle_ms must be a number of milliseconds in [0, 10000], got {cycle_ms!r}")
    return fusion_bytes, cycle_ms / 1000


ENV_HOST_REDUCE = "PSLINK_HOST_REDUCE"
ENV_LOCAL_RANK = "PSLINK_LOCAL_RANK"
ENV_LOCAL_SIZE = "PSLINK_LOCAL_SIZE"


def local_place(environ=os.environ) -> tuple[int | None, int | None]:
    """This worker's (local rank, local size) on its host, as the launcher said (``pslink
    launch``: PSLINK_LOCAL_RANK and PSLINK_LOCAL_SIZE; torchrun: LOCAL_RANK and
    LOCAL_WORLD_SIZE), or (None, None): nothing said (every worker on one host), or numbers
    that do not fit."""
    place = []
    for ours, alias in ((ENV_LOCAL_RANK, "LOCAL_RANK"), (ENV_LOCAL_SIZE, "LOCAL_WORLD_SIZE")):
        variable = ours if env_value(ours, environ) is not None else alias
        place.append(env_number(variable, int, "an integer", 0, 1 << 20, environ) if env_value(variable, environ) else None)
    if None in place or not 0 <= place[0] < place[1]:
        # Nothing said; or numbers that do not fit: an elastic job's newcomer, started past the
        # launcher's first count (whose world, and place in it, the job's resets tell).
        return None, None
    return place[0], place[1]


def host_reduce_settings(host_reduce: bool | None, local_rank: int | None, local_size: int | None,
                         job: str | None = None, rank: int | None = None, num_workers: int | None = None,
                         elastic: bool = False, environ=os.environ) -> tuple[int, int] | None:
    """Host-local reduce (pslink.core.agent.host_reduce): ``(local_rank, local_size)`` of this
    worker's host when it is on, else None. On by default when the host has more than one of the
    job's workers and the job spans more hosts than this one, as the launcher says (``pslink
    launch`` sets PSLINK_LOCAL_RANK and PSLINK_LOCAL_SIZE; torchrun LOCAL_RANK and
    LOCAL_WORLD_SIZE): a job on one host crosses no network, and its pool's saving would be paid
    by the leader's copies on the same CPUs (docs/hierarchy.md); nor in an ``elastic`` job (its
    workers come and go, renumbered). ``host_reduce=True`` or PSLINK_HOST_REDUCE=1 turns it on
    there too; ``host_reduce=False`` or PSLINK_HOST_REDUCE=0 off. The launcher's numbers are for the job and rank it
    launched (PSLINK_JOB / PSLINK_RANK, or RANK): another job of the same process (a Horovod
    process set's, say) does not reduce on the host unless given its own."""
    if host_reduce is None and env_value(ENV_HOST_REDUCE, environ) is not None:
        raw = env_value(ENV_HOST_REDUCE, environ).strip().lower()
        if raw not in ("0", "1", "true", "false", "on", "off"):
            raise ConfigError(f"{ENV_HOST_REDUCE}={raw!r} must be 1 or 0")
        host_reduce = raw in ("1", "true", "on")
    elif host_reduce is not None and not isinstance(host_reduce, bool):
        raise ConfigError(f"host_reduce must be True or False, got {host_reduce!r}")
    if host_reduce is False or (host_reduce is None and elastic):
        return None
    local: list[int] = []
    for value, name, alias in ((local_rank, ENV_LOCAL_RANK, "LOCAL_RANK"), (local_size, ENV_LOCAL_SIZE,
                                                                             "LOCAL_WORLD_SIZE")):
        if value is None:
            ours = env_value(name, environ) is not None
            variable = name if ours else alias
            value = env_number(variable, int, "an integer", 0, 1 << 20, environ) if env_value(variable, environ) else None
            launched = (env_value(ENV_RANK, environ), env_value(ENV_JOB, environ)) if ours else (env_value("RANK", environ), None)
            if value is not None and rank is not None and (launched[0] not in (None, str(rank))
                                                           or launched[1] not in (None, job)):
                return None  # not the launched worker's own job and rank
        if value is None:
            return None  # no launcher said: every worker pushes for itself
        local.append(value)
    if local[1] < 2 or (host_reduce is None and num_workers is not None and num_workers <= local[1]):
        return None  # one worker here, or (unless asked) a job on this host alone
    if not 0 <= local[0] < local[1]:
        if local_rank is None or local_size is None:
            return None  # a launcher's numbers that do not fit (an elastic job's newcomer): no host reduce
        raise ConfigError(f"local rank {local[0]} is not in [0, {local[1]})")
    return local[0], local[1]


ENV_SYNC = "PSLINK_SYNC"
ENV_GROUPS = "PSLINK_GROUPS"
ENV_SYNC_STORE = "PSLINK_SYNC_STORE"
ENV_SYNC_GROUP = "PSLINK_SYNC_GROUP"


def parse_local_sync(sync: str) -> int:
    """``"local:T"`` -> T (the local steps between global syncs)."""
    kind, _, every = sync.partition(":")
    try:
        value = int(every)
    except ValueError:
        value = 0
    if kind != "local" or value < 1:
        raise ConfigError(f"sync {sync!r}: groups with delayed global sync are written 'local:T', T >= 1 local "
                          "steps between global syncs")
    return value


def local_sync_settings(sync: str | None, groups: int | None, store: str | None, job: str, rank: int,
                        num_workers: int, environ=os.environ,
                        label: str | None = None) -> tuple[int, int | str, str | None] | None:
    """Groups with delayed global sync (pslink.core.worker.groups): ``(every, groups, store)`` when the
    job asks for them (``sync="local:T"``, or PSLINK_SYNC=local:T for the launched job and rank),
    else None. ``groups`` (PSLINK_GROUPS) splits the ranks into that many groups of consecutive
    ranks; by default one per host, as the launcher numbers them (``pslink launch --nnodes``:
    PSLINK_LOCAL_SIZE workers a host). ``label`` (PSLINK_SYNC_GROUP): this worker's group by
    name instead (the workers of one label form a group, of any size); it is then returned in
    ``groups``' place. ``store`` (PSLINK_SYNC_STORE): a directory or fsspec URL the groups meet
    in instead of the pool."""
    launched = env_value(ENV_JOB, environ) in (None, job) and env_value(ENV_RANK, environ) in (None, str(rank))
    if sync is None and launched and env_value(ENV_SYNC, environ):
        sync = env_value(ENV_SYNC, environ)  # only groups come from the environment: checked as local:T
    elif not isinstance(sync, str) or not sync.startswith("local"):
        return None  # bsp, ssp, asp: the Agent checks them
    try:
        every = parse_local_sync(sync)
    except ConfigError as exc:
        raise ConfigError(f"{ENV_SYNC}: {exc.message}" if sync == env_value(ENV_SYNC, environ) else exc.message) from None
    if store is None and launched:
        store = env_value(ENV_SYNC_STORE, environ)
    if label is None and groups is None and launched:
        label = env_value(ENV_SYNC_GROUP, environ)
    if label is not None:
        if groups is not None:
            raise ConfigError(f"sync={sync!r}: a group by label (sync_group={label!r}) or groups={groups!r} of "
                              "consecutive ranks, not both")
        if not isinstance(label, str) or not label.strip() or len(label.encode()) > 200:
            raise ConfigError(f"sync={sync!r}: sync_group={label!r} must name this worker's group: a non-empty "
                              "string of at most 200 bytes")
        return every, label, store
    if groups is None and launched and env_value(ENV_GROUPS, environ):
        groups = resolve_int(None, "groups", ENV_GROUPS, 1, environ=environ)
    if groups is None:
        local_size = env_value(ENV_LOCAL_SIZE, environ) or env_value("LOCAL_WORLD_SIZE", environ)
        if not launched or local_size is None or not local_size.isdigit() or int(local_size) < 1:
            raise ConfigError(f"sync={sync!r}: say how the {num_workers} workers form groups: groups=N (or "
                              f"{ENV_GROUPS}), sync_group=LABEL (or {ENV_SYNC_GROUP}), or launch one group a host "
                              "with `pslink launch --nnodes`")
        groups = max(1, num_workers // int(local_size))
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or num_workers % groups:
        raise ConfigError(f"sync={sync!r}: {num_workers} workers do not split into {groups!r} groups of "
                          "equal size (groups of consecutive ranks)")
    if groups == 1 and rank == 0:
        log.warning("sync=%r with one group (%d workers, all on one host or groups=1): every step is already "
                    "synchronous; give groups=N (pslink launch --groups N) for groups that sync every %d steps",
                    sync, num_workers, every)
    return every, groups, store


ENV_AGGREGATOR_SPIN_MS = "PSLINK_AGGREGATOR_SPIN_MS"


def aggregator_spin(environ=os.environ) -> float:
    """How long an Aggregator's process keeps polling its sockets after a message before it
    sleeps in the kernel (``PSLINK_AGGREGATOR_SPIN_MS``, default 2): a round's next push is
    taken without a wake-up, for CPU spent waiting; 0 never spins (its CPU is then its work)."""
    spin = env_number(ENV_AGGREGATOR_SPIN_MS, float, "a number of milliseconds", 0, 1000, environ)
    return 2e-3 if spin is None else spin / 1000


def env_number(name: str, kind, what: str, low, high, environ):
    """An environment variable's number, checked (None if it is not set)."""
    raw = (env_value(name, environ) or "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} must be {what}") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={value:g} must be between {low} and {high}")
    return value
