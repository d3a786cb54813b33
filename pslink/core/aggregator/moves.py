"""What moves a task's state in or out of an Aggregator (no I/O): live migration (AutoPS
Appendix B), replication to other Aggregators and the promotion of a replica when its part's
Aggregator is gone, the optimizer state for checkpoints (STATE_GET / STATE_SET), and a worker
joining a running job (JOIN). The :class:`~pslink.core.aggregator.core.AggregatorCore` owns one
(``core.moves``) and shares its tables with it."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Callable

import numpy as np

from pslink.core.membership import TaskMembers
from pslink.core.wire.protocol import Op
from pslink.core.aggregator.table_task import new_task
from pslink.core.aggregator.tasks import (Checkpoint, CopyOut, Follow, JobState, Replicate, Reply, Request, Summer,
                                          Task, _Round, moved_error)
from pslink.errors import KeyStateError, MembershipError, ProtocolError, PslinkError, error_from_code, error_to_wire

# A seed keeps this share of the part's iteration (at least SEED_MARGIN seconds) clear of the
# workers' expected return, beyond its own expected time: both are estimates, jittering by
# milliseconds (a seed that ran into the exchange took 10-20 ms from it in the traces).
SEED_MARGIN, SEED_MARGIN_SHARE = 0.01, 0.1


def seed_delay(now: float, last_message: float, last_opened: float | None, round_gap: float | None,
               seed_takes: float, compute_gap: float | None = None) -> float:
    """How long the next seed of a move should still wait; 0: send it now. It goes once the
    Aggregator heard nothing for a quarter of the part's iteration (``round_gap``: the workers
    compute, as :func:`copy_delay` reads it) and the job's whole exchange is over
    (:func:`exchange_end`), and only if it would land (``seed_takes``: how long it should take,
    at the pace of the last ones) before the part's next round is due to open (``last_opened +
    round_gap``); else after that round. A part whose pace is not known yet, or whose workers are
    a quarter iteration late for their round (paused), does not wait for it. Pure, for the
    Aggregator shell."""
    if not round_gap:
        return 0.0
    idle_wait = idle_wait_of(round_gap)
    quiet = copy_delay(now, last_message, float("inf"), idle_wait)
    if quiet > 0:
        return quiet
    if last_opened is None or seed_takes > round_gap / 2:
        return 0.0  # (a seed longer than half an iteration cannot keep clear of the round anyway)
    due = last_opened + round_gap
    if now > due + idle_wait:
        return 0.0  # the workers are late past their round (paused, slower)
    margin = max(SEED_MARGIN, SEED_MARGIN_SHARE * round_gap)
    start = max(now, exchange_end(last_opened, round_gap, compute_gap, seed_takes + margin))
    if start + seed_takes + margin <= due:
        return start - now  # it lands before the round
    return due + idle_wait - now  # after that round's start: quiet is looked for again then


def exchange_end(last_opened: float | None, round_gap: float | None, compute_gap: float | None,
                 needs: float = 0.0) -> float:
    """When the job's exchange of the part's current round should be over: the workers' compute
    (``compute_gap``, as their pushes told it) before the next round is due. An Aggregator sees
    only its own traffic: once its parts are answered the job may still wait for its other
    Aggregators, whose replies a copy sent then would meet on a shared link (traced at 1 Gbit/s)
    or CPU. ``-inf`` (no wait) where that is not known, or where the compute is shorter than
    ``needs`` (a copy that cannot fit in it goes as before: once quiet). Pure."""
    if not round_gap or last_opened is None or not compute_gap:
        return float("-inf")
    margin = max(SEED_MARGIN, SEED_MARGIN_SHARE * round_gap)  # (an exchange may run longer than the last)
    if compute_gap < needs + margin:
        return float("-inf")
    return last_opened + round_gap - compute_gap + margin


def state_checksum(arrays) -> int:
    """A checksum of a part's state arrays (CRC-32 of their bytes, in order): a hand-over that
    leaves them out checks the target holds the very same."""
    crc = 0
    for array in arrays:
        crc = zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"), crc)
    return crc


MAX_COPY_IDLE_WAIT = 1.0  # seconds a migration's copy waits at most for its Aggregator to fall idle
# Rounds a move's target may lag behind the part before the move gives following up and copies
# the whole state at a round's end (a link too slow to carry a round's sum per round).
MAX_FOLLOW_BEHIND = 4
MIN_FOLLOW_BYTES = 256 << 10  # smaller parts move whole at a round's end (their copy is milliseconds)


@dataclasses.dataclass
class Follower:
    """A move's target on its way to holding the part (source side). It gets the state of a
    closed round (the seed, taken when this Aggregator falls quiet), then each later round's
    sum, which it applies as this Aggregator does; the part is handed over at the end of a round
    once the target confirmed the round before, so the hand-over carries no state, only the
    routing (and the target has the round's sum before the workers come round again)."""

    target: tuple[str, str]
    seeded: int | None = None  # the closed round the seed carries (None: not taken yet)
    confirmed: int | None = None  # the last round the target confirmed it holds
    failed: str | None = None  # why the target stopped following: the whole state goes at the hand-over

    def ready(self, closed: int) -> bool:
        """Whether the part may be handed over at the end of round ``closed``: its sum is on the
        way to the target, behind every round the target confirmed."""
        return self.confirmed is not None and self.confirmed >= closed - 1


def idle_wait_of(round_gap: float | None) -> float:
    """How long a copy of a part with this iteration (``round_gap``) may wait for its Aggregator
    to fall quiet: half the time its workers take to come round again, at most
    MAX_COPY_IDLE_WAIT; 0 while that time is not known."""
    return min(MAX_COPY_IDLE_WAIT, round_gap / 2) if round_gap else 0.0


def copy_delay(now: float, last_message: float, deadline: float, idle_wait: float) -> float:
    """How long a migration's copy (``CopyOut.idle_wait``, due by ``deadline``) should still
    wait; 0: send it now. It goes once its Aggregator heard nothing for ``idle_wait / 2`` (a
    quarter of the job's iteration: silences that long come when the workers compute; shorter
    ones happen within an exchange too, while the workers serve keys held elsewhere), and at
    the latest at ``deadline``. Pure, for the Aggregator shell."""
    silent = now - last_message
    quiet = idle_wait / 2
    if silent >= quiet or now >= deadline:
        return 0.0
    return min(quiet - silent, deadline - now)


class Moves:
    """State moving in and out of one Aggregator's tasks. ``tasks``, ``moved``, ``replicas`` and
    ``jobs`` are the core's tables (shared, not copied); ``serve(task, request)`` handles a request
    that waited for a copy, ``release(task, round)`` answers what waited for a round,
    ``close_ready(task)`` closes the rounds that can, ``pull(task, request)`` answers a pull;
    ``name()`` is the Aggregator's name now."""

    def __init__(self, *, tasks: dict[tuple, Task], moved: dict[tuple, tuple[str, str]], replicas: dict[tuple, dict],
                 jobs: dict[str, JobState], summer: Summer, max_ahead: int, clock: Callable[[], float],
                 name: Callable[[], str], serve: Callable[[Task, Request], list],
                 release: Callable[[Task, int], list], close_ready: Callable[[Task], list],
                 pull: Callable[[Task, Request], list], apply: Callable[[Task, _Round, int], None]):
        self.tasks, self.moved, self.replicas, self.jobs = tasks, moved, replicas, jobs
        # part -> the replicas it went on without (unreachable): told to pMaster with every
        # heartbeat until it names the part's replicas again (it counts them until then)
        self.dropped: dict[tuple, set[str]] = {}
        self.summer, self.max_ahead, self.clock = summer, max_ahead, clock
        self._name = name
        self.serve, self.release, self.close_ready, self.pull = serve, release, close_ready, pull
        self.apply = apply  # a round's sum into the part's state (the core's own step)

    @property
    def name(self) -> str:
        return self._name()

    def state(self, task: Task, req: Request) -> list[Reply]:
        """STATE_GET / STATE_SET: a part's optimizer state, for checkpoints and their resumption.
        Between rounds it is exactly the state the next step will use."""
        optimizer = task.job.optimizer
        if task.table is not None:
            raise KeyStateError(f"{task.name}: a table's rows and row-optimizer state travel with its shard "
                                "(migrations, replicas, the job's checkpoint option), not through optimizer_state()",
                                key=task.key)
        if task.job.mode != "optimizer" or optimizer is None:
            why = f"it runs in {task.job.mode} mode" if task.job.mode != "optimizer" else "no optimizer is set"
            raise KeyStateError(f"{task.name}: job {task.job.job!r} keeps no optimizer state on the service ({why})",
                                key=task.key)
        if "weight32" in task.opt_state:
            raise KeyStateError(f"{task.name}: its float32 master copy (multi_precision) travels with migrations, "
                                "replicas and checkpoints, but is not read or set through optimizer_state()",
                                key=task.key)
        if req.op == Op.STATE_GET:
            names, arrays, scalars = [], [], {}
            for name, value in sorted(task.opt_state.items()):
                if isinstance(value, np.ndarray):
                    names.append(name)
                    arrays.append(value.copy())  # the next round updates it in place, maybe before the send
                else:
                    scalars[name] = value
            body = {"names": names, "scalars": scalars}
            return [Reply(req.origin, req.id, round=task.closed, body=body, arrays=arrays)]
        names, scalars = req.header["names"], req.header.get("scalars") or {}
        optimizer.check_state(names, scalars, task.name)
        task.opt_state = {**scalars, **dict(zip(names, req.payload))}
        return [Reply(req.origin, req.id, round=task.closed)]

    def join(self, task: Task, req: Request) -> list[Reply]:
        """JOIN: a worker added to the running job asks where it comes in (round 0: a query) or
        joins the task from round ``req.round``: the first round no worker has started, so the
        rounds under way close without it. A round that closed meanwhile refuses (``ok`` false)
        and the Agent asks again; every part of a key must take the same round."""
        rank = req.rank
        if rank not in task.job.membership:
            raise MembershipError(f"{task.name}: rank {rank} is not a member of job {task.job.job!r}; "
                                  "register the worker first", job=task.job.job)
        started = max([task.closed] + [r for r, round_ in task.rounds.items() if round_.contributors])
        first = task.members.first.get(rank)
        body = {"closed": task.closed, "started": started, "member_from": first}
        if req.round == 0:
            return [Reply(req.origin, req.id, round=task.closed, body=body)]
        wanted = req.round
        if first is not None and (first == wanted or any(rank in r.contributors for r in task.rounds.values())
                                  or first <= task.closed):
            # Already in: asked twice, or from an earlier round it has taken part in.
            body["ok"] = first == wanted
            return [Reply(req.origin, req.id, round=task.closed, body=body)]
        if wanted <= task.closed:
            body["ok"] = False  # too late for that round here: ask again
            return [Reply(req.origin, req.id, round=task.closed, body=body)]
        task.members.join(rank, wanted)
        body.update(ok=True, member_from=wanted)
        return [Reply(req.origin, req.id, round=task.closed, body=body)]

    # -- migration (AutoPS Appendix B) --------------------------------------------------------------

    def begin_migration(self, ident: tuple, target: tuple[str, str], force: bool = False) -> list:
        """MIGRATE_INIT: move the task to ``target`` (name, address). Under BSP it moves when its
        current round closes, so the workers learn the new place from that round's replies; an
        asynchronous job, an uninitialized task or ``force`` moves at once."""
        task = self.tasks.get(ident)
        if task is None:
            gone_to = self.moved.get(ident)
            if gone_to is not None and gone_to[0] == target[0]:
                return []  # already gone there
            if gone_to is not None:  # (a pMaster that restarted may not know; it must not wait for a copy)
                raise KeyStateError(f"{ident[1]!r} part {ident[2]} of job {ident[0]!r} was handed over to "
                                    f"{gone_to[0]} already; it cannot go to {target[0]} from {self.name}")
            raise KeyStateError(f"aggregator {self.name} does not hold {ident[1]!r} part {ident[2]} of job {ident[0]!r}")
        if task.moved_to is not None:
            return []
        if task.incoming:
            raise KeyStateError(f"{task.name} is still arriving here; it cannot move on yet")
        target = tuple(target)
        if force or task.job.sync == "asp" or not task.initialized:
            task.migrate_to = target
            return self.snapshot(task)
        if task.follower is not None and task.follower.target == target:
            return []  # (a repeated order) it follows already
        task.follower = None  # moved again before the hand-over: the new target follows instead
        if target[0] in {name for name, _ in task.replicas}:
            # The target holds a replica, which has every round before its answers: a promotion.
            task.migrate_to = target
        elif task.rebase or task.poisoned is not None or not self.followable(task):
            task.migrate_to = target  # the whole state goes at the round's end
        else:
            task.follower = Follower(target)
            return [Follow(task, target, "seed")]
        return []

    def begin_migrations(self, req: dict) -> tuple[list, list]:
        """MIGRATE of one part (``key``, ``part``: an error fails the request) or of a batch
        (``parts``): the outputs, and the batch's parts that cannot go, each with why."""
        batch = req.get("parts")
        parts = batch if batch is not None else [(req.get("key"), req.get("part"))]
        if any(not isinstance(p, (list, tuple)) or len(p) != 2 or not isinstance(p[1], int) for p in parts) \
                or (batch is None and parts[0][0] is None):
            raise ProtocolError(f"bad MIGRATE from pMaster: it names no part, or a malformed one ({req})")
        outputs, failed = [], []
        for key, part in parts:
            try:
                outputs += self.begin_migration((req["job"], key, part), tuple(req["target"]), req.get("force", False))
            except KeyStateError as exc:
                if batch is None:
                    raise
                failed.append([key, part, exc.message])
        return outputs, failed

    @staticmethod
    def _export(task: Task, open_rounds: bool = True) -> tuple[dict, list[np.ndarray]]:
        """A task's state as plain data plus its arrays (a frame each): for a migration (with the
        open rounds' partial sums) or a replica (closed rounds only)."""
        names, arrays, scalars, rounds, extra = task.export_state(open_rounds)
        state = {
            "closed": task.closed, "last_n": task.last_n, "rounds_closed": task.rounds_closed,
            "arrays": names, "scalars": scalars, "open": rounds,
            "members": task.members.to_wire(), "epoch": task.closed_epoch, "init_rank": task.init_rank, **extra,
        }
        if task.poisoned is not None:  # an aborted key stays aborted where it moves
            state["poisoned"] = error_to_wire(task.poisoned)
        return state, arrays

    def _import(self, task: Task, state: dict, arrays: list[np.ndarray]) -> None:
        named = dict(zip(state["arrays"], arrays))
        task.closed = state["closed"]
        task.last_n = state["last_n"]
        task.rounds_closed = state["rounds_closed"]
        task.import_state(named, state, self.clock())
        if "members" in state:
            task.members = TaskMembers.from_wire(state["members"])
            task.members.keep_only(task.job.membership.ranks)  # who left since the state was taken
            task.closed_epoch = state.get("epoch", task.closed_epoch)
            task.init_rank = state.get("init_rank")
        if state.get("poisoned") and task.poisoned is None:
            task.poisoned = error_from_code(*state["poisoned"])

    # -- a move's target follows the part before the hand-over (source side) ---------------------

    @staticmethod
    def followable(task: Task) -> bool:
        """Whether a move of the part makes its target follow it (source and target agree on it).
        A small part's whole state crosses in a few ms even at 1 Gbit/s (following it would take
        rounds longer). A table's shard cannot be followed from its rounds alone: reads add rows
        and touch them (eviction goes by those times)."""
        return task.table is None and task.nbytes >= MIN_FOLLOW_BYTES

    def seed(self, ident: tuple) -> Follow | None:
        """The state of the last closed round for the part's follower, taken now (copies: the next
        round steps it in place); None if the part no longer has one waiting for its seed."""
        task = self.tasks.get(ident)
        follower = task.follower if task is not None else None
        if follower is None or follower.seeded is not None or follower.failed or task.moved_to is not None:
            return None
        state, arrays = self._export(task, open_rounds=False)
        follower.seeded = task.closed
        # From now on a round's sum is kept for the target while the step works on a scaled copy
        # (AggregatorCore._apply): that buffer is made now, while the job computes.
        task.pool.warm(task.pool.keep)
        return Follow(task, follower.target, "seed", task.closed, dict(state, seed=True), [a.copy() for a in arrays])

    def forward(self, task: Task, round_: _Round, number: int) -> list:
        """Round ``number`` closes here (before it is applied): its sum goes to the follower, which
        applies it as this Aggregator is about to."""
        follower = task.follower
        if follower is None or follower.seeded is None or follower.failed or number <= follower.seeded:
            return []
        confirmed = follower.confirmed if follower.confirmed is not None else follower.seeded
        if number - confirmed > MAX_FOLLOW_BEHIND:
            follower.failed = f"it fell {MAX_FOLLOW_BEHIND} rounds behind"
            return []
        # The sum as it came: the core's step leaves it be while the part has a follower (and a
        # sum-mode round's sum becomes the part's value, replaced, never changed, by the next).
        names, arrays = ["sum"], [round_.acc]
        state = {"follow": number, "contributors": sorted(round_.contributors), "epoch": task.job.membership.epoch,
                 "arrays": names, "layout": [[a.dtype.name, int(a.size)] for a in arrays]}
        return [Follow(task, follower.target, "round", number, state, arrays)]

    def followed(self, ident: tuple, round_: int, error: PslinkError | None) -> None:
        """The follower confirmed it holds round ``round_`` (a seed's or a sum's), or refused it."""
        task = self.tasks.get(ident)
        follower = task.follower if task is not None else None
        if follower is None:
            return
        if error is not None:
            follower.failed = follower.failed or error.message
        else:
            follower.confirmed = max(round_, follower.confirmed if follower.confirmed is not None else round_)

    def hand_over_when_ready(self, task: Task) -> None:
        """Round ``task.closed`` closed: hand the part over at its end if the follower is at most
        this round behind (or it stopped following: then the whole state goes)."""
        follower = task.follower
        if follower is not None and task.migrate_to is None and (follower.failed or follower.ready(task.closed)):
            task.migrate_to = follower.target

    def snapshot(self, task: Task, at_round_end: bool = False) -> list:
        """Hand the task over: its state goes to the target in a copy, and whoever waits here
        is sent there. At the end of a round the copy may wait, up to half the time the workers
        take to come round again, for this Aggregator to fall idle: sent at once it competes for
        the CPU and the sockets with the job's other keys of the same iteration, which the job
        waits for (during compute the copy costs the job nothing). A target that follows the part,
        or holds a replica of it, has its state already: the copy carries only the open rounds'
        sums and what names the state, with a checksum of the arrays it leaves out."""
        state, arrays = self._export(task)
        task.moved_to = task.migrate_to
        # Whoever still waits here must ask the new place (their pushes travel in the copy).
        moved = moved_error(task.key, task.part, task.moved_to)
        waiting = task.before_init + [req for reqs in task.pulls.values() for req in reqs]
        waiting += [req for reqs in task.acks.values() for req in reqs]
        task.before_init, task.pulls, task.acks = [], {}, {}
        idle_wait = idle_wait_of(task.round_gap) if at_round_end else 0.0
        copy = CopyOut(task, task.moved_to, state, arrays, idle_wait=max(0.0, idle_wait))
        holder = self._holder(task)
        if holder is not None:
            sent = [i for i, name in enumerate(state["arrays"]) if name.startswith("round:")]
            held = [i for i in range(len(arrays)) if i not in sent]
            copy.held, copy.held_names = [arrays[i] for i in held], [state["arrays"][i] for i in held]
            copy.state = dict(state, arrays=[state["arrays"][i] for i in sent], follower=holder, held=copy.held_names,
                              layout=[[arrays[i].dtype.name, int(arrays[i].size)] for i in sent])
            copy.arrays = [arrays[i] for i in sent]
            copy.whole = (state, arrays)
        task.follower = None
        return [copy] + [Reply(r.origin, r.id, error=moved) for r in waiting]

    @staticmethod
    def _holder(task: Task) -> str | None:
        """Where the target holds the part's state already: ``"follower"`` (every round up to
        the hand-over is on its way to it, in order), ``"replica"``, or None."""
        follower = task.follower
        if follower is not None and follower.target == task.moved_to and follower.seeded is not None \
                and not follower.failed:
            return "follower"
        if task.moved_to[0] in {name for name, _ in task.replicas} and task.replicating is None:
            return "replica"
        return None

    def copy_done(self, ident: tuple) -> None:
        """The new Aggregator has the state: forget the task, keep a forwarding address."""
        task = self.tasks.pop(ident, None)
        if task is not None and task.moved_to is not None:
            self.moved[ident] = task.moved_to

    def install(self, task: Task, state: dict, arrays: list[np.ndarray]) -> list:
        """TENSOR_COPY arrived: take the state over, then serve what waited for it. A copy that
        names a ``follower`` or ``replica`` holder carries only the open rounds: the rest is what
        this Aggregator holds already, if it is the round the copy names, bit for bit."""
        if not task.incoming:
            raise KeyStateError(f"{task.name} is not waiting for a copy here")
        if state.get("follower") is not None:
            held = self._held_state(task, state)
            state = dict(state, arrays=[*held, *state["arrays"]])
            arrays = [*held.values(), *arrays]
        self._import(task, state, arrays)
        task.following = None
        self.replicas.pop((task.job.job, task.key, task.part), None)  # it serves the part now
        task.incoming = False
        task.seen = set()
        return self._serve_waiting(task)

    def _held_state(self, task: Task, state: dict) -> dict[str, np.ndarray]:
        """The arrays a hand-over leaves out (``state["follower"]``: their names and checksum),
        from what this Aggregator holds of the part: its followed state or its replica. Refused
        (the source then sends every array) unless they are of the hand-over's round and match."""
        ident = (task.job.job, task.key, task.part)
        holder, names = state["follower"], state["held"]
        if holder == "replica":
            held = self.replicas.get(ident) or {}
            closed = held.get("closed")
            named = dict(zip(held["state"]["arrays"], held["arrays"])) if "state" in held else {}
        else:
            closed = task.following
            exported, arrays, *_ = task.export_state(open_rounds=False) if closed is not None else ([], [])
            named = dict(zip(exported, arrays))
        if closed != state["closed"] or set(names) - set(named):
            raise KeyStateError(f"{task.name}: handed over at round {state['closed']}, but the state held here as its "
                                f"{holder} is of round {closed}; the source sends it whole", job=ident[0], key=task.key)
        chosen = {name: named[name] for name in names}
        if state_checksum(chosen.values()) != state["checksum"]:
            raise KeyStateError(f"{task.name}: the state held here as its {holder} differs from the source's at round "
                                f"{closed}; the source sends it whole", job=ident[0], key=task.key)
        return chosen

    # -- a move's target follows the part before the hand-over (target side) ----------------------

    def seeded(self, task: Task, state: dict, arrays: list[np.ndarray]) -> None:
        """A follower's seed: the part's state at a closed round; it stays incoming (requests
        wait) until the hand-over."""
        if not task.incoming:
            raise KeyStateError(f"{task.name} is not waiting for a copy here")
        self._import(task, state, arrays)
        task.following = task.closed
        # Every buffer its rounds will use here, made now while the job computes: a round's sum,
        # the push added to it, and the weights a step writes while a reply still sends the last
        # (made in its first rounds here instead, each cost ~1,000 page faults in the job's exchange).
        task.pool.warm(task.pool.keep)

    def follow(self, task: Task, state: dict, arrays: list[np.ndarray]) -> None:
        """A round's sum for a part this Aggregator follows: applied as its source applied it."""
        number = state["follow"]
        if not task.incoming or task.following is None or number != task.following + 1:
            why = "not incoming" if not task.incoming else "no seed" if task.following is None else "out of order"
            raise KeyStateError(f"{task.name}: round {number} arrived for a follower at round {task.following} ({why})",
                                job=task.job.job, key=task.key)
        round_ = _Round()
        round_.contributors = set(state["contributors"])
        round_.acc = arrays[0]
        self.apply(task, round_, number)
        task.closed = task.following = number
        task.last_n = len(round_.contributors)
        task.rounds_closed += 1
        task.closed_epoch = state["epoch"]

    def replica_copy(self, ident: tuple, target: tuple[str, str]) -> CopyOut:
        """pMaster: the source of the migration of part ``ident`` to ``target`` died before its
        copy landed; this Aggregator holds a replica of the part, with every round the source
        acknowledged (a round reached it before any of its answers): that is the copy."""
        held = self.replicas.get(ident)
        if held is None or "state" not in held:
            raise KeyStateError(f"aggregator {self.name} holds no replicated state of key {ident[1]!r} part "
                                f"{ident[2]} of job {ident[0]!r}", job=ident[0], key=ident[1])
        # A stand-in that names the part in the copy; it is never served here (not in self.tasks).
        part = new_task(self.jobs[ident[0]], dict(held["spec"], incoming=True), self.summer, self.max_ahead, self.clock)
        return CopyOut(part, tuple(target), held["state"], held["arrays"], from_replica=True)

    def install_replica(self, ident: tuple) -> list:
        """As :meth:`replica_copy`, when the target itself holds the replica (the source went on
        replicating to it after the move began): serve the part from it."""
        task = self.tasks.get(ident)
        if task is not None and not task.incoming:
            return []  # the source's own copy landed first: it has at least as much
        held = self.replicas.get(ident)
        if task is None or held is None or "state" not in held:
            raise KeyStateError(f"aggregator {self.name} waits for no copy of key {ident[1]!r} part {ident[2]} of "
                                f"job {ident[0]!r}, or holds no replicated state of it", job=ident[0], key=ident[1])
        return self.install(task, held["state"], held["arrays"])

    def _serve_waiting(self, task: Task) -> list:
        outputs: list = []
        waiting, task.waiting_copy = task.waiting_copy, []
        for req in waiting:
            outputs += self.serve(task, req)
        return outputs + self.close_ready(task)

    # -- a part started afresh: the workers' requests say where its rounds are ----------------------------

    def rebase(self, task: Task, req: Request) -> list:
        """A part started afresh elsewhere (its Aggregator died without a replica) learns where
        the job's rounds are from what the workers resend. Under BSP a request for round r says
        round r - 1 is over for that worker: the rounds up to it are lost here (their waiting pulls
        get the value there is, or in sum mode the loud error). A pull of the next round from a
        rank that did not push it here says its push was acknowledged by the dead Aggregator and
        went with it: the round closes without it, as for a straggler."""
        replies: list = []
        done = req.round - 1
        if done > task.closed:
            task.closed = task.lost_upto = done
            for r in [r for r in task.rounds if r <= done]:
                del task.rounds[r]
            for r in [r for r in task.pulls if r <= done]:
                for waiting in task.pulls.pop(r):
                    replies += self._answer_lost(task, waiting)
        if req.op == Op.PULL and req.round == task.closed + 1 and not task.job.staleness:
            round_ = task.rounds.get(req.round)
            if round_ is None or req.rank not in round_.contributors:
                lost = task.lost_pushes.setdefault(req.round, set())
                lost.add(req.rank)
                if round_ is None and lost >= task.members.expected(req.round):
                    # every push of the round went with the old Aggregator: the round is lost whole
                    task.closed = task.lost_upto = req.round
                    task.lost_pushes.pop(req.round)
                    for waiting in task.pulls.pop(req.round, []):
                        replies += self._answer_lost(task, waiting)
                elif round_ is not None:
                    replies += self.close_ready(task)
        return replies

    def _answer_lost(self, task: Task, req: Request) -> list[Reply]:
        try:
            return self.pull(task, req)
        except PslinkError as exc:
            return [Reply(req.origin, req.id, error=exc)]

    # -- checkpoints (pslink.core.checkpoints writes them) --------------------------------------------

    def checkpoint(self, task: Task) -> list:
        state, arrays = self._export(task, open_rounds=False)
        # Copies: the next round steps the weights and moments in place, maybe before the write.
        return [Checkpoint(task, task.closed, state, [a.copy() for a in arrays])]

    def restore(self, task: Task, state: dict, arrays: list[np.ndarray]) -> None:
        """Start a part afresh from its last checkpoint (its Aggregator and replicas are gone).
        The workers' next pushes say which round they are at; the rounds in between are lost."""
        self._import(task, state, arrays)
        task.restored = task.closed
        task.rebase = True

    # -- replication: a closed round reaches the replicas before any of its answers ---------------

    def replicate(self, task: Task) -> list:
        """The round that just closed goes to every replica; its answers wait for their acks."""
        task.replicating = task.closed
        task.catch_up = False  # every replica, the new ones too, gets this round
        state, arrays = self._export(task, open_rounds=False)
        return [Replicate(task, task.closed, state, arrays)]

    def catch_up(self, task: Task) -> list:
        """A replica that joined the part (pMaster replaced a lost one) gets its last closed round
        at once, not when the next round closes: until then the part would have no replica
        with its state. Waits for a round already on its way to the replicas (sent before the
        new one joined), and for the task to have a value."""
        if not task.catch_up or task.replicating is not None or not task.replicas or task.moved_to is not None \
                or not task.initialized:
            return []
        return self.replicate(task)

    def replicated(self, ident: tuple, round_: int, lost: list | None = None) -> list:
        """Every replica acknowledged ``round_`` (``lost``: replicas that failed instead): answer
        what waited for it, then go on closing rounds."""
        task = self.tasks.get(ident)
        if task is None or task.replicating != round_:
            return []
        if lost:
            task.replicas = [r for r in task.replicas if r[0] not in lost]
            self.dropped.setdefault(ident, set()).update(lost)
        task.replicating = None
        outputs = self.release(task, round_)
        if task.migrate_to is not None and task.moved_to is None:
            return outputs + self.snapshot(task, at_round_end=True)
        outputs += self.close_ready(task)
        return outputs + self.catch_up(task)

    def dropped_report(self) -> list:
        """``[job, key, part, replica]`` of :attr:`dropped`, for pMaster (parts gone from here are forgotten)."""
        for ident in [i for i in self.dropped if i not in self.tasks]:
            del self.dropped[ident]
        return [[*ident, name] for ident, names in self.dropped.items() for name in sorted(names)]

    def replicas_with_state(self) -> list:
        """``[job, key, part]`` of the replicas held here that a round (or a catch-up) reached,
        for pMaster: a replica it counts and does not find here would lose the part's state,
        were it promoted now (its status shows such replicas, so an operator, or the chaos run,
        knows when the service survives another failure)."""
        return [list(ident) for ident, held in self.replicas.items() if "state" in held]

    def replica_update(self, header: dict, state: dict, arrays: list[np.ndarray]) -> None:
        """REPLICATE: keep a closed round's state of a part this Aggregator is a replica of."""
        ident = (header["job"], header["key"], header["part"])
        held = self.replicas.get(ident)
        if held is None:
            raise KeyStateError(f"aggregator {self.name} holds no replica of key {ident[1]!r} part {ident[2]} "
                                f"of job {ident[0]!r}", job=ident[0], key=ident[1])
        if state["closed"] >= held.get("closed", -1):
            held.update(closed=state["closed"], state=state, arrays=arrays)

    def promote(self, ident: tuple, replicas: list) -> list:
        """pMaster: the part's Aggregator is gone; serve it from this replica's last round. Or,
        to the source of a move whose target is gone: keep the part if it never handed it over."""
        task = self.tasks.get(ident)
        if task is not None and task.moved_to is not None:
            # Handed over (frozen for the copy): the target may have answered rounds since, and
            # only the part's replicas have those (it replicates before it answers).
            raise KeyStateError(f"{task.name} was handed over to {task.moved_to[0]} here; a replica has what "
                                "followed", job=ident[0], key=ident[1])
        if task is not None:  # promoted already (a repeated request), or a move's source still serving it
            replicas = [tuple(r) for r in replicas]
            task.catch_up |= bool(set(replicas) - set(task.replicas))  # new by name or by address
            task.replicas = replicas
            task.migrate_to = None  # a move not begun yet is off: its target is gone
            task.follower = None
            return self.catch_up(task)
        held = self.replicas.pop(ident, None)
        if held is None:
            raise KeyStateError(f"aggregator {self.name} holds no replica of key {ident[1]!r} part {ident[2]} "
                                f"of job {ident[0]!r} to promote", job=ident[0], key=ident[1])
        job = self.jobs[ident[0]]
        task = self.tasks[ident] = new_task(job, dict(held["spec"], replicas=replicas), self.summer, self.max_ahead,
                                           self.clock)
        if "state" in held:
            self._import(task, held["state"], held["arrays"])
        elif not task.initialized:
            task.stateless = (f"{task.name} lost its Aggregator, and its replica on {self.name} had not received "
                              "any of its rounds: its state is lost (the job must restart it from a checkpoint)")
        task.catch_up = bool(task.replicas)  # its replicas are new to it: they get its state now
        return self.catch_up(task)

    def promote_placed(self, job_id: str, specs: list[dict]) -> list:
        """pMaster places parts here (an ASSIGN, not a move's) that this holds a replica of: its
        PROMOTE was lost with the connection, or pMaster restarted before sending it (found by
        the chaos run with control faults). The replica's state is the part's, so it is
        promoted; a new task would serve the part from nothing."""
        outputs = []
        for spec in specs:
            ident = (job_id, spec.get("key"), spec.get("part"))
            if not spec.get("replica") and not spec.get("incoming") and ident not in self.tasks \
                    and ident in self.replicas and job_id in self.jobs:
                outputs += self.promote(ident, spec.get("replicas") or [])
        return outputs

    def find_ident(self, ident: tuple) -> Task | None:
        return self.tasks.get(ident)

