"""The Aggregator's core: master copies keyed by (job, key, part), BSP rounds, no I/O.

The process shell (``pslink.core.aggregator.process``) decodes a message, asks :meth:`AggregatorCore.admit`
whether the request fits the task (credential, shape, dtype, span), receives the payload into the
buffer :meth:`AggregatorCore.receive_buffer` gives, and then calls :meth:`AggregatorCore.handle`,
which returns the replies to send. Tests drive the same object with no sockets.

Rounds. Every worker numbers its pushes of a key 1, 2, 3, ...; round ``r`` of a task closes when
every rank the task's members expect for ``r`` (:mod:`pslink.core.membership`) has pushed its
``r``-th push, and rounds close in order. A pull names the round whose result it wants (the
puller's own last push) and is answered once that round closed (``ssp``: once round
``r - staleness`` closed, with the latest value). In ``sum`` mode the result is the round's sum; in
``optimizer`` mode the round's gradient steps the master weights, and a pull returns the weights.
With a straggler timeout, a round open that long closes with the pushes it has; a push that comes
after its round closed is dropped (answered, marked ``dropped``, not added to a later round).

Retries. A request may arrive twice (an Agent resending after a lost reply, or a duplicated
message): a push for a round the rank already pushed, or one that closed, is answered and not
added again; a second init from the rank whose init set the value is answered.

Buffers. A push is received straight into a pooled array; the first push of a round *becomes*
the round's accumulator (no copy), later ones are added into it. Arrays return to their pool when
nothing references them any more, which includes replies still queued on a socket, so a buffer
is never overwritten while a zero-copy send may still read it.
"""

from __future__ import annotations

import hmac
from typing import Any

import numpy as np

from pslink.core.aggregator.cycle import CycleBudget
from pslink.core.aggregator.stalls import waiting_for
from pslink.core.aggregator.table_task import new_task
from pslink.core.optim.rules import step_through_float32
from pslink.core.wire.protocol import DATA_OPS, TABLE_OPS, Op
from pslink.core.aggregator.moves import Moves
from pslink.core.aggregator import failures, reports
from pslink.core.aggregator.tasks import (
    DEFAULT_MAX_AHEAD,
    MAX_BEFORE_INIT,
    WARM_BUFFERS,
    CloseLater,
    JobState,
    Reply,
    Request,
    Summer,
    Task,
    WorkerDone,
    _Round,
    moved_error,
    whole_tensor_error,
)
from pslink.errors import (AuthError, ClosedError, KeyStateError, MembershipError, ProtocolError, PslinkError,
                           ShapeMismatchError, UnknownJobError, error_from_code, error_to_wire)

MAX_MISSED = 8  # straggler-closed rounds remembered per task, to mark their late pushes as dropped


class AggregatorCore:
    """All tasks of one Aggregator, and the rules that move their rounds. What moves a task's
    state in or out (migration, replicas, checkpoints, joins) is ``self.moves``."""

    def __init__(self, name: str = "aggregator", summer: Summer | None = None, max_ahead: int = DEFAULT_MAX_AHEAD,
                 clock=None):
        self.name, self.summer, self.max_ahead = name, summer or Summer(), max_ahead
        self.clock = clock or (lambda: 0.0)
        self.budget: CycleBudget | None = None  # cyclic execution, once pMaster sent a schedule
        self.jobs: dict[str, JobState] = {}
        self.tasks: dict[tuple[str, Any, int], Task] = {}
        self.moved: dict[tuple[str, Any, int], tuple[str, str]] = {}  # tombstones of migrated tasks
        self.replicas: dict[tuple[str, Any, int], dict] = {}  # parts held for another Aggregator
        self.moves = Moves(tasks=self.tasks, moved=self.moved, replicas=self.replicas, jobs=self.jobs,
                           summer=self.summer, max_ahead=max_ahead, clock=self.clock, name=lambda: self.name,
                           serve=self.handle, release=self._release, close_ready=self._close_ready, pull=self._pull,
                           apply=self._apply)

    # -- control (from pMaster) ---------------------------------------------------------------

    def set_job(self, info: dict) -> list:
        """A job's settings from pMaster (with an assignment, or after a change). A membership of
        a later epoch takes effect at once: the open rounds stop waiting for ranks that left
        (what they pushed stays), and close if nothing else is missing. Returns what to send."""
        incoming = JobState.from_wire(info)
        job = self.jobs.get(incoming.job)
        if job is None:
            self.jobs[incoming.job] = incoming
            return []
        if incoming.membership.epoch < job.membership.epoch:
            incoming.membership = job.membership  # a stale message: keep the newer membership
        left = job.membership.ranks - incoming.membership.ranks
        switched = job.mode == "sum" and incoming.mode == "optimizer"
        outputs: list = []
        if job.update(incoming):
            # New hyperparameters keep momentum and moments; a new optimizer type starts afresh.
            for (job_id, _, _), task in self.tasks.items():
                if job_id == job.job:
                    task.opt_state = {}
                    task.poisoned = task.poisoned or whole_tensor_error(task)
                    if switched and job.checkpoint and task.keeps_state and task.initialized and not task.incoming \
                            and task.moved_to is None:
                        # Its state is worth keeping from now on: a part lost before its first
                        # checkpoint_every round restarts from here, not from nothing.
                        outputs += self.moves.checkpoint(task)
        if left:
            error = MembershipError(f"job {job.job!r}: rank(s) {sorted(left)} left the job "
                                    f"(membership epoch {job.membership.epoch})", job=job.job)
            for (job_id, _, _), task in self.tasks.items():
                if job_id == job.job and not task.incoming and task.moved_to is None:
                    outputs += self._members_left(task, job.membership.ranks, error)
        return outputs

    def _members_left(self, task: Task, ranks, error) -> list:
        if not task.members.keep_only(ranks):
            return []
        outputs: list = []
        for r in list(task.pulls):  # a removed rank's own waiting pulls will never be collected
            mine = [q for q in task.pulls[r] if q.rank not in ranks]
            if mine:
                outputs += [Reply(q.origin, q.id, error=error) for q in mine]
                task.pulls[r] = [q for q in task.pulls[r] if q.rank in ranks]
                if not task.pulls[r]:
                    del task.pulls[r]
        return outputs + (self._close_ready(task) if task.initialized else [])

    def assign(self, info: dict, specs: list[dict]) -> list[Task]:
        """Create (idempotently) the tasks pMaster placed here."""
        self.set_job(info)
        job = self.jobs[info["job"]]
        created = []
        for spec in specs:
            ident = (job.job, spec["key"], spec["part"])
            if spec.get("replica"):
                if spec.get("drop"):
                    self.replicas.pop(ident, None)
                elif ident not in self.tasks or self.tasks[ident].moved_to is not None:  # (or handed over)
                    self.replicas.setdefault(ident, {"spec": {k: v for k, v in spec.items() if k != "replica"}})
                    # A hand-over from here is over (pMaster stored it): not one to report again.
                    self.moved.pop(ident, None)
                continue
            task = self.tasks.get(ident)
            if task is None:
                task = self.tasks[ident] = new_task(job, spec, self.summer, self.max_ahead, self.clock)
                if task.incoming and not self.moves.followable(task):
                    # (a followed part's buffers are warmed when its seed lands, as the job computes)
                    task.pool.warm(WARM_BUFFERS)
            elif "replicas" in spec:
                replicas = [tuple(r) for r in spec["replicas"]]
                # A replica new to the part (by name or address) has nothing yet: it gets the state now.
                task.catch_up |= bool(set(replicas) - set(task.replicas))
                task.replicas = replicas
                self.moves.dropped.pop(ident, None)  # pMaster named them: what it counts again
            elif (tuple(spec["shape"]), spec["dtype"], tuple(spec["span"])) != (task.shape, task.dtype_name, task.span):
                raise ShapeMismatchError(
                    f"{task.name}: reassigned as shape {tuple(spec['shape'])} {spec['dtype']} span "
                    f"{tuple(spec['span'])}, but it holds {task.describe()} span {task.span}"
                )
            if spec.get("aborted") and task.poisoned is None:  # a new task starts poisoned (Task)
                task.poisoned = error_from_code(*spec["aborted"])  # the shell fails what waits on it
            created.append(task)
        return created

    def drop_job(self, job_id: str) -> list[Reply]:
        """Forget a job; anything still waiting is failed."""
        self.jobs.pop(job_id, None)
        return self._drop(job_id, None, lambda task: f"job {job_id!r} ended; {task.name} was released")

    def drop_keys(self, job_id: str, keys: list) -> list[Reply]:
        """Forget keys of a job (deleted); anything waiting on them is failed."""
        return self._drop(job_id, set(keys), lambda task: f"{task.name} was deleted")

    def _drop(self, job_id: str, keys: set | None, why) -> list[Reply]:
        """The tasks, replicas and forwarding addresses of a job (of ``keys`` only, if given) go."""
        def chosen(ident):
            return ident[0] == job_id and (keys is None or ident[1] in keys)

        for table in (self.moved, self.replicas):
            for ident in [i for i in table if chosen(i)]:
                del table[ident]
        replies = []
        for ident in [i for i in self.tasks if chosen(i)]:
            task = self.tasks.pop(ident)
            replies += failures.fail_waiters(task, ClosedError(why(task)))
        return replies

    # -- admission: runs on the header, before any payload byte is read -------------------------

    def authorize(self, header: dict) -> JobState:
        """The job a request names, if its credential is right; else raise."""
        job_id = header["job"]
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJobError(f"aggregator {self.name} serves no job {job_id!r}", job=job_id)
        if not hmac.compare_digest(header["tok"], job.token):
            raise AuthError(
                f"wrong credential for job {job_id!r} from rank {header['rank']}; refused", job=job_id
            )
        return job

    def admit(self, header: dict) -> Task:
        """Return the task a data-path header addresses, or raise the error to send back."""
        job_id = self.authorize(header).job
        key, part = header["key"], header["part"]
        task = self.tasks.get((job_id, key, part))
        if task is None or task.moved_to is not None:
            ident = (job_id, key, part)
            raise failures.not_here(self.name, ident, self.moved.get(ident) or (task and task.moved_to),
                                    ident in self.replicas)
        if header["op"] in (TABLE_OPS if task.table is None else DATA_OPS):
            raise KeyStateError(f"{task.name} is {'a table' if task.table is not None else 'a tensor'}; "
                                f"{header['op'].name} does not apply to it", job=job_id, key=key)
        if tuple(header["shape"]) != task.shape or header["dtype"] != task.dtype_name:
            raise ShapeMismatchError(
                f"key {key!r} of job {job_id!r}: rank {header['rank']} sent shape "
                f"{tuple(header['shape'])} {header['dtype']}, but the key has {task.describe()} "
                f"(declared by rank {task.declared_by})",
                job=job_id,
                key=key,
                shapes=[list(header["shape"]), list(task.shape)],
                dtypes=[header["dtype"], task.dtype_name],
                ranks=[header["rank"], task.declared_by],
            )
        if tuple(header["span"]) != task.span:
            raise ProtocolError(
                f"key {key!r} part {part}: span {tuple(header['span'])} does not match {task.span}; "
                "workers disagree on the partition size"
            )
        return task

    def find(self, header: dict) -> Task | None:
        return self.tasks.get((header["job"], header["key"], header["part"]))

    def receive_buffer(self, task: Task) -> np.ndarray:
        """Where to receive a push's payload: a pooled array that may become the accumulator."""
        return task.pool.acquire()

    def adds_in_place(self, task: Task, op: Op, rank: int, round_no: int) -> bool:
        """Whether this push would only be added into its round's sum: a synchronous push into a
        round that has one already, from a rank not in it. Its payload may then be read where it
        arrived (a shared-memory ring, valid during :meth:`handle`) instead of from a copy."""
        if (task.poisoned is not None or task.table is not None or task.moved_to is not None or task.incoming
                or task.rebase or not task.initialized or task.job.sync == "asp"
                or (op != Op.PUSH and op != Op.PUSHPULL) or round_no <= task.closed):
            return False
        round_ = task.rounds.get(round_no)
        return round_ is not None and round_.acc is not None and rank not in round_.contributors

    # -- requests -----------------------------------------------------------------------------

    def handle(self, task: Task, req: Request) -> list:
        if req.op == Op.WAITING:  # a question about the task, answered whatever state it is in
            return [Reply(req.origin, req.id, body=waiting_for(task, req.round))]
        if task.poisoned is not None:
            return [Reply(req.origin, req.id, error=task.poisoned)]
        if task.failed_rounds and req.round in task.failed_rounds and req.op != Op.INIT:
            return [Reply(req.origin, req.id, error=task.failed_rounds[req.round])]
        if task.moved_to is not None:
            return [Reply(req.origin, req.id, error=moved_error(task.key, task.part, task.moved_to))]
        if task.incoming:
            task.waiting_copy.append(req)  # nothing is applied here before the copy is complete
            return []
        if req.op == Op.STATE_GET or req.op == Op.STATE_SET or req.op == Op.JOIN:
            try:
                return self.moves.join(task, req) if req.op == Op.JOIN else self.moves.state(task, req)
            except PslinkError as exc:
                return [Reply(req.origin, req.id, error=exc)]
        outputs: list = []
        if task.rebase and req.op in (Op.PUSH, Op.PUSHPULL, Op.PULL):
            outputs += self.moves.rebase(task, req)
        if task.seen is not None:
            task.seen.update(req.covers or (req.rank,))
            if task.seen >= task.members.expected(task.closed + 1):
                task.seen = None
                outputs.append(WorkerDone(task))
        return self._handle_here(task, req) + outputs

    def _handle_here(self, task: Task, req: Request) -> list:
        if not task.initialized:
            if req.op == Op.INIT and req.payload is not None:
                return self._initialize(task, req)
            if task.stateless and req.round > 0:  # the job went past its init: its state is lost
                lost = KeyStateError(task.stateless, key=task.key)
                return self.abort(task, lost) + [Reply(req.origin, req.id, error=lost)]
            if len(task.before_init) >= MAX_BEFORE_INIT:
                return [Reply(req.origin, req.id, error=KeyStateError(f"{task.name}: {MAX_BEFORE_INIT} requests "
                              "already wait for rank 0's init; is rank 0 calling init for this key?", key=task.key))]
            task.before_init.append(req)  # ps-lite aborts here; we wait for the init
            return []
        try:
            return self._dispatch(task, req)
        except PslinkError as exc:
            return [Reply(req.origin, req.id, error=exc)]

    def _dispatch(self, task: Task, req: Request) -> list[Reply]:
        op = req.op
        if op == Op.INIT:
            return self._reinit(task, req)
        if op == Op.PULL:
            return self._pull(task, req)
        replies = self._push(task, req)
        durable = task.closed - (task.replicating is not None)  # rounds every replica has
        if op == Op.PUSH and task.replicas and req.round > durable:
            # An acknowledged push is never lost: the ack waits until its round is replicated.
            task.acks.setdefault(req.round, []).append(req)
            return replies or []
        if replies is None:  # not added: a repeat, or too late for its round
            dropped = req.rank in task.missed.get(req.round, ())
            if op == Op.PUSH:
                return [Reply(req.origin, req.id, round=req.round, dropped=dropped)]
            answer = self._pull(task, req)
            for reply in answer:
                reply.dropped = dropped
            return answer
        if op == Op.PUSH:
            replies.insert(0, Reply(req.origin, req.id, round=req.round))
            return replies
        return self._pull(task, req) + replies  # PUSHPULL: push, then wait for that round

    def _initialize(self, task: Task, req: Request) -> list[Reply]:
        task.value = req.payload
        task.init_rank = req.rank
        replies = [Reply(req.origin, req.id, round=0)]
        if task.replicas:  # round 0 is answered once the replicas have it, as a push's round is
            task.acks[0], replies = [req], self.moves.replicate(task)
        if task.job.checkpoint and task.keeps_state:
            replies += self.moves.checkpoint(task)  # round 0: a part lost before its first checkpoint restarts here
        queued, task.before_init = task.before_init, []
        for waiting in queued:
            replies += self.handle(task, waiting)
        return replies

    def _reinit(self, task: Task, req: Request) -> list[Reply]:
        if task.table is not None:  # a table's rows set, whenever (MXNet's init of a row-sparse key)
            task.table.assign(*req.payload)
            return [Reply(req.origin, req.id, round=task.closed)]
        if req.payload is None or task.closed or task.rounds:
            # Another rank's init (the shape check in admit() was the point); the initializer's
            # own init arriving again (a resend); or a value from a rank that only sends one
            # because rank 0 had left when it got there (asynchronous rounds let rank 0 finish
            # first) for a key rank 0 initialized and the job already uses: nothing to change.
            # Like MXNet's servers, which take a value only for a key that has none.
            return [Reply(req.origin, req.id, round=task.closed)]
        task.value = req.payload  # a repeated init before any round: the latest value wins
        task.init_rank = req.rank
        return [Reply(req.origin, req.id, round=0)]

    def _push(self, task: Task, req: Request) -> list[Reply]:
        """Add a push to its round; returns the replies that closing rounds release. A push that
        is not added (a repeat, or one too late) returns None: the caller answers it as done."""
        if task.job.sync == "asp":
            return self._push_async(task, req)
        r, rank = req.round, req.rank
        if r <= task.closed:
            return None  # already in a closed round, or too late for it (dropped): answered as done
        expected = task.members.expected(r)
        ranks = req.covers or (rank,)  # a host's leader pushes its host's sum for the host's ranks
        for member in ranks:
            if member not in expected:
                if member not in task.members:
                    raise MembershipError(
                        f"{task.name}: rank {member} is not a member (members: {sorted(task.members.first)}); a "
                        "worker that left or was removed must register again", job=task.job.job)
                raise KeyStateError(f"{task.name}: rank {member} pushed round {r}, but it joined at round "
                                    f"{task.members.first[member]}", key=task.key)
        if r > task.closed + task.max_ahead:
            raise KeyStateError(f"{task.name}: rank {req.rank} pushed round {r}, more than {task.max_ahead} rounds "
                                f"ahead of round {task.closed} (are the other workers stuck?)", key=task.key)
        round_ = task.rounds.get(r)
        outputs: list = []
        if round_ is None:
            round_ = task.rounds[r] = _Round(self.clock())
            if task.job.straggler_timeout:
                outputs.append(CloseLater(task, round_.opened + task.job.straggler_timeout, r))
        # (a plain push, the hot path, builds no set)
        present = round_.contributors.intersection(ranks) if req.covers else (rank,) * (rank in round_.contributors)
        if present and len(present) == len(ranks):
            return None  # the same push again (a resend or a duplicate): added once
        if present:  # a host's sum for ranks some of which pushed this round already: never counted twice
            raise KeyStateError(f"{task.name}: rank {req.rank} pushed round {r} for ranks {sorted(ranks)}, but "
                                f"ranks {sorted(present)} pushed it already", key=task.key)
        if task.table is not None:
            task.add_push(round_, req)
        elif round_.acc is None:
            round_.acc = req.payload.astype(np.float32) if task.sums_widened(r) else req.payload
        else:
            self.summer.add(round_.acc, req.payload)
        round_.contributors.update(ranks)
        if req.idle is not None and (round_.idle is None or req.idle < round_.idle):
            round_.idle = req.idle
        task.count_push(req)
        return outputs + self._close_ready(task)

    def _push_async(self, task: Task, req: Request) -> list[Reply]:
        """ASP: apply this push alone, now. Sum mode adds it to the value (ps-lite's default
        handle, MXNet's dist_async merge); optimizer mode steps the weights with it."""
        if req.rank not in task.members:
            raise MembershipError(f"{task.name}: rank {req.rank} is not a member of job {task.job.job!r}",
                                  job=task.job.job)
        round_ = _Round()
        round_.contributors.add(req.rank)
        round_.acc = req.payload
        if task.table is not None:
            task.apply_push(req)
        elif not task.job.optimizes(task.key, task.closed + 1):
            value = task.value
            if task.pool.in_use(value, known=2):  # a queued reply still reads it: add into a copy
                fresh = task.pool.acquire()
                np.copyto(fresh, value)
                value = fresh
            self.summer.add(value, req.payload)
            task.value = value
        else:
            self._apply(task, round_, task.closed + 1)
        task.count_push(req)
        task.closed += 1
        task.last_n = 1
        task.rounds_closed += 1
        task.closed_epoch = task.job.membership.epoch
        return []

    def set_schedule(self, cycle: float, budgets: dict[tuple, tuple[int, float]]) -> None:
        """pMaster's plan for this Aggregator: its cycle and each task's runs and cost."""
        self.budget = CycleBudget(cycle, budgets, self.clock()) if cycle > 0 and budgets else None

    def close_due(self, task: Task, round_: int | None = None) -> list:
        """A round that waited for its slot runs now; or round ``round_`` is past its straggler
        timeout and closes (when its turn comes) with whoever pushed."""
        if self.tasks.get((task.job.job, task.key, task.part)) is not task or task.incoming or task.moved_to:
            return []
        if round_ is not None:
            task.overdue = max(task.overdue, round_)
            return self._close_ready(task)
        if task.close_at is None:
            return []
        # Its slot is now: if the round cannot close yet (a replicas' catch-up under way), the next
        # try asks for a slot afresh (kept, it read as still awaited and the round never closed)
        task.close_at = None
        return self._close_ready(task, admitted=True)

    def _close_ready(self, task: Task, admitted: bool = False) -> list:
        replies: list = []
        if task.poisoned is not None:
            # An aborted key never completes a round. handle() refuses its requests and abort()
            # emptied its rounds; this keeps it so for every caller, a membership change above all
            # (the rounds would close for whoever is left).
            return replies
        while True:
            nxt = task.closed + 1
            round_ = task.rounds.get(nxt)
            if round_ is None or task.replicating is not None:
                return replies
            expected = task.members.expected(nxt) - task.lost_pushes.get(nxt, set())
            if not round_.contributors >= expected:
                if nxt > task.overdue or not round_.contributors:
                    return replies
                task.missed[nxt] = frozenset(expected - round_.contributors)
                for old in [r for r in task.missed if r <= nxt - MAX_MISSED]:
                    del task.missed[old]
            if not admitted:
                if task.close_at is not None:
                    return replies  # already waiting for its slot
                if self.budget is not None:
                    now = self.clock()
                    when = self.budget.admit((task.job.job, task.key, task.part), now)
                    if when > now:
                        task.close_at = when
                        return replies + [CloseLater(task, when)]
            admitted = False
            task.close_at = None
            del task.rounds[nxt]
            opened = task.heard_at if task.heard_round == nxt else round_.opened
            if task.last_opened is not None:
                task.round_gap = opened - task.last_opened
            task.last_opened = opened
            task.compute_gap = round_.idle / 1000 if round_.idle is not None else None
            if task.follower is not None:  # a move's target follows: the round's sum goes to it too
                replies += self.moves.forward(task, round_, nxt)
            self._apply(task, round_, nxt)
            task.closed = nxt
            task.rebase = False  # the job's rounds go on here now
            task.lost_pushes.pop(nxt, None)
            task.last_n = len(round_.contributors)
            task.rounds_closed += 1
            task.closed_epoch = task.job.membership.epoch
            if task.job.checkpoint and nxt % task.job.checkpoint_every == 0 and task.keeps_state:
                replies += self.moves.checkpoint(task)
            if task.follower is not None:
                self.moves.hand_over_when_ready(task)  # before the answers: they tell the new place
            if task.replicas:
                # Nothing of this round is answered before its replicas have it (replicated()).
                return replies + self.moves.replicate(task)
            replies += self._release(task, nxt)
            if task.migrate_to is not None:
                # Everything up to this round happened here; what follows happens there.
                return replies + self.moves.snapshot(task, at_round_end=True)

    def _release(self, task: Task, closed: int) -> list:
        """Answer the pulls (and, with replicas, the pushes) that round ``closed`` settles."""
        replies = []
        for r in [r for r in task.pulls if r - task.job.staleness <= closed]:
            for req in task.pulls.pop(r):
                reply = self._result(task, req)
                reply.moved = task.migrate_to  # the paper's step 2: the next pull learns the new place
                replies.append(reply)
        for r in [r for r in task.acks if r <= closed]:
            replies += [Reply(req.origin, req.id, round=r, dropped=req.rank in task.missed.get(r, ()))
                        for req in task.acks.pop(r)]
        return replies

    def _apply(self, task: Task, round_: _Round, number: int) -> None:
        job = task.job
        optimizes = job.optimizes(task.key, number)
        if task.table is not None:
            task.apply_round(round_, optimizes)
            return
        if not optimizes:
            task.value = round_.acc
            return
        if job.optimizer is None:
            raise KeyStateError(f"{task.name}: job {job.job!r} runs in optimizer mode but has no optimizer set")
        optimizer = job.optimizer.for_key(task.key)  # the key's own learning rate and weight decay, if any
        weights = task.value
        if task.pool.in_use(weights, known=2):  # task.value and the local name
            # A reply with the old weights may still be on a socket: step a copy.
            fresh = task.pool.acquire()
            np.copyto(fresh, weights)
            weights = fresh
        grad = round_.acc
        scale = optimizer.grad_scale(len(round_.contributors))
        if optimizer.multi_precision and weights.dtype == np.float16:
            step_through_float32(optimizer, weights, grad, scale, task.opt_state)  # (steps a float32 copy)
        else:
            if task.follower is not None and task.follower.seeded is not None:
                # The sum goes to the move's target as it came (Moves.forward): step a scaled copy,
                # made in the pass the scaling makes anyway (a copy of the sum, made before, was
                # an extra pass over every following part in the middle of the job's exchange).
                scaled = task.pool.acquire()
                if scale != 1.0:
                    np.multiply(grad, scale, out=scaled)
                else:
                    np.copyto(scaled, grad)
                grad = scaled
            elif scale != 1.0:
                grad *= scale
            optimizer.step(weights, grad, task.opt_state)
        task.value = weights

    def _pull(self, task: Task, req: Request) -> list[Reply]:
        r = req.round
        if task.job.sync == "asp":
            return [self._result(task, req)]  # the latest value, whatever round it is at
        if r - task.job.staleness > task.closed - (task.replicating is not None):  # bsp: staleness 0
            if r > task.closed + task.max_ahead:
                raise KeyStateError(
                    f"{task.name}: rank {req.rank} asked for round {r}, more than {task.max_ahead} "
                    f"rounds after the current round {task.closed}",
                    key=task.key,
                )
            task.pulls.setdefault(r, []).append(req)
            return []
        if task.table is not None:  # a table's rows are cumulative: any round at or after r answers
            return [self._result(task, req)]
        if task.lost_upto and r <= task.lost_upto and not task.job.optimizes(task.key, r):
            raise KeyStateError(f"{task.name}: the sum of round {r} was lost with the Aggregator that held it; "
                                f"this part continues from round {task.lost_upto + 1}", key=task.key)
        if r < task.closed and not task.job.optimizes(task.key, task.closed) and not task.job.staleness:
            raise KeyStateError(
                f"{task.name}: rank {req.rank} asked for round {r}, but round {task.closed} has "
                f"closed since and its sum replaced it",
                key=task.key,
            )
        return [self._result(task, req)]

    def _result(self, task: Task, req: Request) -> Reply:
        # After the snapshot (a push-pull whose push closed the round that moved the task),
        # the answer still comes from here but carries the new place.
        reply = Reply(req.origin, req.id, round=task.closed, n=task.last_n, payload=task.value,
                      moved=task.moved_to, epoch=task.closed_epoch)
        if task.follower is not None and task.moved_to is None:
            reply.next = task.follower.target  # (a worker connects ahead while the target follows)
        if task.table is not None:
            reply.payload = task.rows_for(req)
        elif task.value is not None:
            task.job.pulled_bytes += task.nbytes
        if req.average and task.table is None and task.last_n > 1 and not task.job.optimizes(task.key, task.closed) \
                and task.job.sync != "asp" and task.value is not None and task.value.dtype.kind == "f":
            reply.payload, reply.averaged = task.average(), True
        if task.restored is not None and task.restored < task.lost_upto and req.round == task.lost_upto + 1:
            # The first answer after a restart from a checkpoint: what was lost (the Agent says it loudly).
            reply.lost = (task.lost_upto - task.restored, task.restored)
        return reply

    # -- failures (pslink.core.aggregator.failures) ---------------------------------------------

    def abort(self, task: Task, error: PslinkError) -> list[Reply]:
        return failures.poison(task, error)  # every waiting request and every later one gets ``error``

    def fail_rounds(self, task: Task, error: PslinkError, through: int) -> list:
        """A rank's refused request fails the open rounds up to ``through`` (the replicas skip them too)."""
        replies = failures.fail_rounds(task, error, through)
        if replies is None:
            return []
        if task.replicas and task.replicating is None:
            replies += self.moves.replicate(task)
        return replies

    def abort_key(self, job_id: str, key: Any, error: PslinkError) -> list[Reply]:
        for (j, k, _), held in self.replicas.items():
            if j == job_id and k == key:  # promoted later, the part starts poisoned (Task)
                held["spec"]["aborted"] = error_to_wire(error)
        return [r for (j, k, _), task in list(self.tasks.items()) if j == job_id and k == key
                for r in failures.poison(task, error)]

    def fail_origin(self, origin: Any) -> None:
        failures.forget_origin(self.tasks.values(), origin)  # a peer went away: nobody is left to answer

    # -- reporting (pslink.core.aggregator.reports) ---------------------------------------------

    def costs(self, smoothing: float = 0.5) -> dict[str, list]:
        """e_t of every task that closed rounds since the last call: CPU seconds per round,
        smoothed, per job as [key, part, seconds]."""
        return reports.task_costs(self.tasks, smoothing)

    def stats(self) -> dict:
        """Per job: tasks held, bytes, rounds closed over all tasks, the furthest round, and the bytes
        pushed here and pulled from here (since this Aggregator knew the job)."""
        return reports.job_stats(self.tasks, self.jobs)
