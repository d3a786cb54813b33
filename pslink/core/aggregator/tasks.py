"""What an Aggregator holds (no I/O): tasks, their rounds and buffers, jobs as it knows them, and
the requests and outputs that pass between the core (:mod:`pslink.core.aggregator.core`) and its
process shell."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from typing import Any

import numpy as np

from pslink.core.memory import BufferPool
from pslink.core.membership import Membership, TaskMembers
from pslink.core.optim import make_optimizer
from pslink.core.optim.rules import Optimizer
from pslink.core.wire.protocol import Op, dtype_of
from pslink.errors import KeyStateError, MovedError, ProtocolError, PslinkError, error_from_code

MODES = ("sum", "optimizer")
SYNCS = ("bsp", "ssp", "asp")
DEFAULT_MAX_AHEAD = 64
WARM_BUFFERS = 2  # a task's pool in steady state: a round's sum and the push being added to it
MAX_BEFORE_INIT = 4096  # requests one task may hold while it waits for rank 0's init


class Summer:
    """Adds arrays in place, splitting large ones across threads (numpy releases the GIL).

    Below ``threshold_bytes`` one thread is faster: an addition that fits in cache is over before
    a pool thread wakes. benchmarks/summation.py measured the split paying only from 64 MiB on a
    2-core machine (docs/benchmarks.md); with the default 4 MiB partitions, the parts of a large
    tensor are summed in parallel by different Aggregators instead.
    """

    def __init__(self, threads: int | None = None, threshold_bytes: int = 48 << 20):
        self.threads = max(1, threads if threads is not None else min(4, os.cpu_count() or 1))
        self.threshold_bytes = threshold_bytes
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="pslink-sum")
            if self.threads > 1
            else None
        )

    def add(self, acc: np.ndarray, other: np.ndarray) -> None:
        if self._pool is None or acc.nbytes < self.threshold_bytes:
            np.add(acc, other, out=acc)
            return
        bounds = np.linspace(0, acc.size, self.threads + 1).astype(int)
        futures = [
            self._pool.submit(np.add, acc[a:b], other[a:b], out=acc[a:b])
            for a, b in zip(bounds[:-1], bounds[1:])
            if b > a
        ]
        for future in futures:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


@dataclasses.dataclass
class JobState:
    """What an Aggregator knows of a job: credential, membership, mode and optimizer."""

    job: str
    token: bytes
    membership: Membership
    mode: str = "sum"
    optimizer: Optimizer | None = None
    sync: str = "bsp"  # "asp": every push is applied at once and pulls never wait
    staleness: int = 0  # "ssp": a pull of round r is answered once round r - staleness closed
    straggler_timeout: float | None = None  # a round open this long closes with who came
    checkpoint: str | None = None  # parts are written there at init and every checkpoint_every rounds
    checkpoint_every: int = 0
    # A job switched from summing to the optimizer (set_optimizer after keys existed): each key's
    # rounds up to this one still close as sums, the later ones step the weights (pMaster's map).
    sum_through: dict = dataclasses.field(default_factory=dict)
    pushed_bytes: int = 0  # counted here, for pMaster's metrics
    pulled_bytes: int = 0

    @classmethod
    def from_wire(cls, info: dict) -> "JobState":
        mode = info.get("mode", "sum")
        if mode not in MODES:
            raise ProtocolError(f"job {info.get('job')!r}: unknown mode {mode!r}")
        sync = info.get("sync", "bsp")
        if sync not in SYNCS:
            raise ProtocolError(f"job {info.get('job')!r}: unknown sync {sync!r}")
        return cls(
            job=info["job"],
            token=info["token"],
            membership=Membership.from_wire(info["membership"]),
            mode=mode,
            optimizer=make_optimizer(info.get("optimizer")),
            sync=sync,
            staleness=int(info.get("staleness") or 0),
            straggler_timeout=info.get("straggler_timeout"),
            checkpoint=info.get("checkpoint"),
            checkpoint_every=int(info.get("checkpoint_every") or 0),
            sum_through=_key_rounds(info.get("sum_through")),
        )

    def optimizes(self, key, round_: int) -> bool:
        """Whether round ``round_`` of ``key`` steps the weights (else it closes as a sum)."""
        return self.mode == "optimizer" and round_ > self.sum_through.get(key, 0)

    def update(self, other: "JobState") -> bool:
        """Take ``other``'s settings; True if the optimizer's type changed (its state is void)."""
        changed = type(other.optimizer) is not type(self.optimizer)
        self.token = other.token
        self.membership = other.membership
        self.mode = other.mode
        self.optimizer = other.optimizer
        self.sync = other.sync
        self.staleness = other.staleness
        self.straggler_timeout = other.straggler_timeout
        self.sum_through = other.sum_through
        return changed


def _key_rounds(pairs) -> dict:
    """``[[key, round], ...]`` as a dict (pairs on the wire: a key is an int or a string, and a
    JSON or msgpack map would make every key a string)."""
    return {k: int(r) for k, r in pairs or ()}


@dataclasses.dataclass(slots=True)
class Request:
    """A decoded, admitted data-path request. ``origin`` is opaque to the core (a connection)."""

    origin: Any
    id: int
    op: Op
    rank: int
    round: int
    payload: np.ndarray | None = None
    header: dict | None = None  # STATE_SET: the header's names and scalars (payload: a list of arrays)
    average: bool = False  # a pull that wants the round's sum divided by its contributors
    covers: list | None = None  # a push that stands for these ranks (a host's sum: host-local reduce)
    idle: int | None = None  # a push: ms its worker had no request in flight before this exchange (its compute)


@dataclasses.dataclass(slots=True)
class Reply:
    """What the shell must send: a result (``payload`` may be None) or an error. ``moved`` tells
    the worker where the task lives from now on (a migration's redirect, carried by a pull)."""

    origin: Any
    id: int
    round: int = 0
    n: int = 0
    payload: np.ndarray | None = None
    error: PslinkError | None = None
    moved: tuple[str, str] | None = None
    epoch: int = 0  # the job's membership epoch when the round answered closed
    dropped: bool = False  # a push that came after its round closed without it (a straggler's)
    lost: tuple[int, int] | None = None  # (rounds lost, checkpoint round): the part restarted from a checkpoint
    body: dict | None = None  # STATE_GET, JOIN: names and numbers
    arrays: list[np.ndarray] | None = None  # STATE_GET: the state's arrays, a frame each
    averaged: bool = False  # the payload is the sum divided by ``n`` already
    next: tuple[str, str] | None = None  # the part is about to move there: the worker may connect ahead


@dataclasses.dataclass(slots=True)
class CopyOut:
    """Send a migrating task's state to its new Aggregator (TENSOR_COPY)."""

    task: "Task"
    target: tuple[str, str]
    state: dict
    arrays: list[np.ndarray]
    from_replica: bool = False  # a replica's state, for a migration whose source died
    # Up to this many seconds the copy may wait for its Aggregator to fall idle (0: send now).
    idle_wait: float = 0.0
    # A hand-over to a follower (see :class:`Follow`): ``arrays`` carry only the open rounds' sums;
    # the state's own arrays are these, which the target holds already. The shell sends their
    # checksum, and the whole copy should the target find its own differ.
    held: list[np.ndarray] | None = None
    held_names: list[str] | None = None
    whole: tuple[dict, list[np.ndarray]] | None = None  # the copy with every array (see ``held``)


@dataclasses.dataclass(slots=True)
class Follow:
    """Send a migration's target what makes it follow the part before the hand-over, in order
    and once this Aggregator falls quiet: the state of a closed round (``kind`` "seed", made
    when sent: :meth:`~pslink.core.aggregator.moves.Moves.seed`), or a closed round's sum
    (``kind`` "round": ``state`` names its round and contributors, ``arrays`` the sum)."""

    task: "Task"
    target: tuple[str, str]
    kind: str
    round: int = 0
    state: dict | None = None
    arrays: list[np.ndarray] | None = None


@dataclasses.dataclass(slots=True)
class CloseLater:
    """Call :meth:`AggregatorCore.close_due` at ``when``: cyclic execution (the task's complete
    round waits for its slot), or the straggler timeout of round ``round`` (then it closes with
    whoever pushed)."""

    task: "Task"
    when: float
    round: int | None = None


@dataclasses.dataclass(slots=True)
class Checkpoint:
    """Write round ``round``'s state of the task (copies: the task goes on) to its job's checkpoint."""

    task: "Task"
    round: int
    state: dict
    arrays: list[np.ndarray]


@dataclasses.dataclass
class Replicate:
    """Send round ``round``'s state to the task's replicas (REPLICATE); then call
    :meth:`AggregatorCore.replicated`."""

    task: "Task"
    round: int
    state: dict
    arrays: list[np.ndarray]


@dataclasses.dataclass(slots=True)
class WorkerDone:
    """Every worker has reached a migrated task at its new place (tell pMaster)."""

    task: "Task"


class _Round:
    __slots__ = ("contributors", "acc", "opened", "idle")

    def __init__(self, opened: float = 0.0):
        self.contributors: set[int] = set()
        self.acc: np.ndarray | None = None
        self.opened = opened  # when its first push arrived (the straggler timeout counts from it)
        self.idle: int | None = None  # the shortest compute (ms) its pushes' workers told before it


def moved_error(key, part: int, where: tuple[str, str]) -> MovedError:
    return MovedError(f"key {key!r} part {part} moved to aggregator {where[0]} at {where[1]}",
                      agg=where[0], address=where[1], key=key, part=part)


def whole_tensor_error(task: "Task") -> PslinkError | None:
    """Why ``task`` cannot be stepped by its job's optimizer, if that optimizer needs the whole
    key (LAMB's norms) and the task is one part of several."""
    optimizer = task.job.optimizer
    if optimizer is None or not optimizer.whole_tensor:
        return None
    if task.table is not None:
        if task.table.optimizer["name"] != "job":
            return None  # the table's own row optimizer steps it
        return KeyStateError(f"{task.name}: optimizer {optimizer.name!r} needs the whole key at once (norms over "
                             "it), and a table's rows are stepped a few at a time", job=task.job.job, key=task.key)
    if task.numel == math.prod(task.shape):
        return None
    return KeyStateError(f"{task.name}: optimizer {optimizer.name!r} needs the whole key at once (norms over it), "
                         f"but the key is split into parts of {task.numel} of its {math.prod(task.shape)} elements; "
                         "raise the job's partition_bytes above the key's size", job=task.job.job, key=task.key)


class Task:
    """One model aggregation task: a part of one key of one job."""

    table = None  # a shard of a sparse table: pslink.core.aggregator.table_task.TableTask

    def __init__(self, job: JobState, spec: dict, summer: Summer, max_ahead: int = DEFAULT_MAX_AHEAD):
        self.job = job
        self.key = spec["key"]
        self.part = spec["part"]
        self.shape = tuple(spec["shape"])
        self.dtype_name = spec["dtype"]
        self.dtype = dtype_of(self.dtype_name)
        self.span = tuple(spec["span"])
        self.numel = self.span[1] - self.span[0]
        self.declared_by = spec.get("declared_by", 0)
        # A sum-mode part started afresh after its Aggregator was lost: it takes up the rounds
        # where the workers' pushes are (the sums of earlier rounds went with the Aggregator).
        self.rebase = bool(spec.get("rebase"))
        self.lost_upto = 0
        # Started from a checkpoint (an optimizer-mode part without replicas): the round it holds;
        # the rounds between it and where the workers are were lost, and the workers are told.
        self.restored: int | None = None
        self.restore = bool(spec.get("restore"))
        self.lost_pushes: dict[int, set[int]] = {}  # while rebasing: pushes that went with the old Aggregator  # the shell reads the checkpoint when it is assigned
        self.needs_init = not self.rebase and (bool(spec.get("needs_init", True)) or job.mode == "optimizer")
        self.summer = summer
        self.max_ahead = max_ahead
        self.pool = BufferPool(self.dtype, self.numel)
        self.value: np.ndarray | None = None
        self.closed = 0  # last closed round; round 0 is the initial value
        self.last_n = 0  # contributors of the last closed round
        self.rounds: dict[int, _Round] = {}
        self.pulls: dict[int, list[Request]] = {}
        self.before_init: list[Request] = []
        # Promoted from a replica that never received a round (why, in words): a request of a
        # round past the init finds the key's state lost (AggregatorCore), instead of waiting
        # for an init that will not come.
        self.stateless: str | None = None
        # A key pMaster aborted before it assigned this part (see KeySpec.task_specs) starts failed.
        self.poisoned: PslinkError | None = error_from_code(*spec["aborted"]) if spec.get("aborted") else None
        if spec.get("table") is None:  # a table's shard is checked once its table exists (TableTask)
            self.poisoned = self.poisoned or whole_tensor_error(self)
        # Rounds a refused request failed (a rank's shape mismatch): their requests get the error,
        # later rounds go on (AggregatorCore.fail_rounds). The most recent few are kept.
        self.failed_rounds: dict[int, PslinkError] = {}
        self.opt_state: dict = {}
        self.rounds_closed = 0
        # elastic membership: who each round waits for, the epoch its last round closed in
        self.members = TaskMembers(job.membership.ranks)
        self.closed_epoch = job.membership.epoch
        self.init_rank: int | None = None  # whose init set the value (a resent init is not an error)
        self.missed: dict[int, frozenset[int]] = {}  # recent rounds closed without some ranks
        self.overdue = 0  # rounds up to this one are past the straggler timeout
        # replication: where each closed round goes before it is answered
        self.replicas: list[tuple[str, str]] = [tuple(r) for r in spec.get("replicas", ())]
        self.replicating: int | None = None  # the round on its way to the replicas
        self.catch_up = False  # a replica joined that has no state yet: send it the last closed round
        self.acks: dict[int, list[Request]] = {}  # pushes answered once their round is replicated
        # migration (AutoPS Appendix B)
        self.incoming = bool(spec.get("incoming", False))  # waiting for its state to be copied here
        self.arrived_from: str | None = spec.get("from")  # the source of the move that brought it here
        self.waiting_copy: list[Request] = []
        self.migrate_to: tuple[str, str] | None = None  # move once the current round closes
        self.moved_to: tuple[str, str] | None = None  # moved: redirect every request
        # A move's target being brought up to date before the hand-over (source side: Follower),
        # and, on the target, the last round its incoming state follows (None: no seed yet).
        self.follower = None
        self.following: int | None = None
        # when the last closed round opened, and the time between the last two: how long the
        # workers take to come round again (a migration's copy fits in before they do)
        self.last_opened: float | None = None
        self.round_gap: float | None = None
        # the latest round a push header was heard for, and when (the shell sets them): a round
        # "opens" then, for the gap above (its first push complete jitters by how long its bytes
        # queued behind other keys', up to most of an exchange on a slow link)
        self.heard_round, self.heard_at = -1, 0.0
        # the workers' compute before the last closed round (seconds, as their pushes told it):
        # the job's exchange (every Aggregator's part of it) ends about that long before the next
        # round is due, which this Aggregator's own traffic does not show
        self.compute_gap: float | None = None
        # (round, array): the last closed round's sum divided by its contributors, made once
        # for every worker that pulls with average=True (each used to divide its own copy)
        self.averaged: tuple[int, np.ndarray] | None = None
        self.seen: set[int] | None = None  # ranks heard from since the state arrived here
        # profiling: CPU seconds spent on this task, and what was last reported
        self.cpu = 0.0
        self.reported = (0.0, 0)
        self.cost: float | None = None  # e_t: CPU seconds per round (an average)
        self.close_at: float | None = None  # a complete round waits for its slot until then
        if not self.needs_init and not self.incoming:
            self.value = np.zeros(self.numel, self.dtype)

    @property
    def name(self) -> str:
        return f"key {self.key!r} of job {self.job.job!r}" + (f" (part {self.part})" if self.part else "")

    @property
    def initialized(self) -> bool:
        return self.value is not None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        return f"shape {self.shape} {self.dtype_name}"

    @property
    def keeps_state(self) -> bool:
        """Whether the task holds state between rounds (optimizer mode; a table's rows): what a
        checkpoint writes. A sum-mode part's value is only its last round's sum."""
        return self.job.mode == "optimizer"

    def sums_widened(self, round_: int) -> bool:
        """Whether round ``round_``'s pushes are summed in float32: a float16 key stepped by a
        multi_precision optimizer, as MXNet's dist_sync servers sum it (each push widened
        first; a float16 sum would round every addition to float16 before the float32 step)."""
        optimizer = self.job.optimizer
        return (self.dtype == np.float16 and optimizer is not None and optimizer.multi_precision
                and self.job.optimizes(self.key, round_))

    def count_push(self, req: Request) -> None:
        """Count a push's bytes for the job's metrics."""
        self.job.pushed_bytes += self.nbytes

    def average(self) -> np.ndarray:
        """The last closed round's sum divided by its contributors, once per round: the same
        division each worker's Agent made of its own copy, so the same numbers."""
        if self.averaged is None or self.averaged[0] != self.closed:
            self.averaged = None  # the last round's array may be free again (its replies went out)
            array = self.pool.acquire()
            np.divide(self.value, self.last_n, out=array)
            self.averaged = (self.closed, array)
        return self.averaged[1]

    def export_state(self, open_rounds: bool) -> tuple[list, list, dict, list, dict]:
        """``(names, arrays, scalars, open rounds, extra)``: the arrays a copy, replica or
        checkpoint carries (a frame each), the optimizer's scalars, the open rounds'
        contributors and what else the state needs (:meth:`import_state` reads them back)."""
        names, arrays, scalars = [], [], {}
        if self.value is not None:
            names.append("value")
            arrays.append(self.value)
        for name, value in self.opt_state.items():
            if isinstance(value, np.ndarray):
                names.append(f"opt:{name}")
                arrays.append(value)
            else:
                scalars[name] = value
        rounds = []
        for r in sorted(self.rounds) if open_rounds else ():
            round_ = self.rounds[r]
            rounds.append([r, sorted(round_.contributors)])
            if round_.acc is not None:
                names.append(f"round:{r}")
                arrays.append(round_.acc)
        if any(a.dtype != self.dtype or a.size != self.numel for a in arrays):  # a float32 master copy
            return names, arrays, scalars, rounds, {"layout": [[a.dtype.name, int(a.size)] for a in arrays]}
        return names, arrays, scalars, rounds, {}

    def import_state(self, named: dict, state: dict, now: float) -> None:
        self.value = named.get("value")
        self.opt_state = dict(state.get("scalars", {}))
        self.opt_state.update({n[4:]: a for n, a in named.items() if n.startswith("opt:")})
        self.rounds = {}
        for r, ranks in state["open"]:
            round_ = self.rounds[r] = _Round(now)
            round_.contributors = set(ranks)
            round_.acc = named.get(f"round:{r}")
