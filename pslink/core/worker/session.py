"""The Session: what Horovod means, once, for every adapter (numpy arrays in and out).

A Session is one worker's collectives over an :class:`~pslink.core.agent.Agent` of a job in
``sum`` mode. Every collective is push-pulls of named keys (:mod:`pslink.core.worker.collectives`
says how each reduces to sums); the Session owns everything around them that Horovod defines:

- **names**: a call's name keys it on the service, so ranks need not call in the same order,
  only use each name in the same sequence; unnamed calls are numbered per kind (the n-th
  unnamed allreduce of every rank is one operation), within the world's generation (elastic);
- **reductions**: Average, Sum, Min, Max, Product and Adasum, prescale and postscale factors
  (:mod:`pslink.core.worker.reduction`);
- **the collectives**: allreduce, grouped allreduce, broadcast, allgather, reducescatter,
  alltoall, objects, barrier, each asynchronous (a :class:`~pslink.core.worker.pending.Pending`
  with ``done()`` and ``wait()``, Horovod's poll and synchronize);
- **the checks Horovod makes at the call**: a name already in flight is a ConfigError (a
  ValueError) on the calling rank; calls that disagree fail on every rank, naming each rank's
  call (:mod:`pslink.core.worker.board`): a :class:`~pslink.errors.ShapeMismatchError` for
  another dtype or shape (as the service's own check of a key says), a
  :class:`~pslink.errors.MismatchError` for another root rank, reduction or scale factor;
- **join** (uneven data), the world's **rank, size, local rank and size** (and their renumbering
  by elastic resets).

Adapters convert their tensors to host arrays (views of the tensor's memory where they can),
call a Session, and convert back; they add autograd and registration, nothing of this.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pslink.core.wire.protocol import DTYPES
from pslink.core.worker import board as boards
from pslink.core.worker import collectives
from pslink.core.worker.board import Board, Call, Decided, JoinDone
from pslink.core.worker.collectives import Zeros, bits_of, service_key
from pslink.core.worker.pending import Pending, PendingGroup, Progress, reworded
from pslink.core.worker.process_sets import ProcessSets
from pslink.core.worker.reduction import (GATHERED, Adasum, Average, ReduceOp, Sum, check_factor, reduce_op,
                                          reduce_rows, scale, service_averages)
from pslink.errors import ConfigError, MismatchError, PslinkError, ShapeMismatchError

log = logging.getLogger("pslink.core.worker")

UNNAMED_KINDS = ("allreduce", "broadcast", "allgather", "reducescatter", "alltoall", "sparse_allreduce", "call")
BOARD_WINDOW = 32  # board rounds a rank may have in flight (the service refuses pushes 64 rounds ahead)
BOARD_ROWS = 128  # rows a board round carries, of all ranks together (see board_batch)
LATER_SLOTS = 2 * BOARD_WINDOW  # see Session.data_key
# A gather's shapes row: ndim, dtype, the dimensions; a joined rank's row says so instead.
GATHER_WIDTH = 2 + collectives.MAX_GATHER_DIMS
JOINED_ROW = -1
_UNNAMED = re.compile(r"^(\w+)\.noname\.(?:g(\d+)\.)?(\d+)$")
_SIGNATURES = 4096  # named allreduce signatures remembered (a model's gradients, a few times over)
_ENDED = object()  # a call of this rank that ended before the board decided it
_FAILED = object()  # ... and that failed (a verdict against it then has nothing to add)


_DTYPE_NAMES: dict[np.dtype, str] = {}


def board_batch(size: int) -> int:
    """How many calls of each rank a board round carries (see Session._announce): a round's
    fixed cost (a push-pull, its reading) is what a batch shares, and its bytes grow with the
    ranks' rows (each rank's section of the sum), so fewer calls each in a larger world."""
    return max(8, min(64, BOARD_ROWS // max(size, 1)))


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, remembered (numpy works the name out anew on every read: a few
    microseconds per call, which a 4 KiB allreduce notices)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


class Session:
    """One worker's Horovod collectives over ``agent`` (mode ``sum``).

    ``local_rank`` / ``local_size``: this worker's place among the job's workers on its host
    (None: the launcher's environment said nothing, so every worker is on one host: the world's
    rank and size, which then follow elastic resets). ``reconnect(token, rejoin=...)`` makes a
    new Agent for this rank of the same job (elastic recovery; :func:`pslink.core.worker.elastic.register_again`)."""

    def __init__(self, agent, local_rank: int | None = None, local_size: int | None = None,
                 reconnect: Callable | None = None, ordered: bool = False, world_ranks: list[int] | None = None,
                 members: list[int] | None = None, unattended: bool = False):
        self._check_mode(agent)
        self.agent = agent
        self.timeout = agent.timeout
        self._reconnect = reconnect
        # ``ordered``: unnamed calls are numbered in one sequence whatever their kind, so the n-th
        # calls of the ranks are matched (and checked) whatever they are: torch.distributed's
        # rule (every rank makes the same collectives in the same order), not Horovod's.
        self._ordered = ordered
        # ``unattended``: calls may end with nobody waiting on them (torch.distributed's futures),
        # so their answers and the board's are read in the background as they come; otherwise
        # they are read by whoever waits (Horovod's synchronize and poll), which is faster.
        self._unattended = unattended
        # A process set's session: its members' ranks in the world it was made from, the space
        # Horovod's root ranks are given in (``broadcast(..., root_rank, process_set=s)``).
        self._world_ranks = list(world_ranks) if world_ranks is not None else None
        self._zeros = Zeros()
        self._progress = Progress(f"pslink-progress-{agent.job}-{agent.rank}")
        self._lock = threading.RLock()  # the board's order, names in flight, the calls' verdicts
        self._issuing = threading.RLock()  # one call issued at a time (see _issue)
        self._board_sending = threading.Lock()  # the board's rounds go out in order (see _send_board)
        self.steppers: list[Callable[[], None]] = []  # optimizers' zero contributions, in creation order (join)
        self._abandons: list[Callable[[], None]] = []  # optimizers' "forget what is in flight"
        self.process_sets = ProcessSets(self)
        self._local_given = (local_rank, local_size)
        # The world: the members the caller found (Holder.init's rendezvous), else the job's as
        # its registration said.
        members = members or (agent.settings.get("membership") or {}).get("ranks") or list(range(agent.num_workers))
        self.set_world(sorted(set(members) | {agent.rank}), 0)

    @staticmethod
    def _check_mode(agent) -> None:
        if agent.mode != "sum":
            raise ConfigError(f"Horovod's collectives need a job in mode 'sum' (the service sums, the optimizer "
                              f"steps on the workers); job {agent.job!r} is in mode {agent.mode!r}")

    # -- the world --------------------------------------------------------------------------------

    def set_world(self, ranks: list[int], generation: int) -> None:
        """Take ``ranks`` (the job's service ranks, every member agreeing) as the world: ``rank``
        becomes this worker's position among them and ``size`` their number, as Horovod renumbers
        ranks after a reset. ``generation`` (agreed too) keeps unnamed calls and the board of
        different worlds on different keys: a newcomer's counters start from zero."""
        if self.agent.rank not in ranks:
            raise ConfigError(f"rank {self.agent.rank} of job {self.agent.job!r} is not in the world {ranks}")
        with self._lock:
            self.ranks = list(ranks)
            self.rank = self.ranks.index(self.agent.rank)
            self.size = len(self.ranks)
            self.generation = generation
            given_rank, given_size = self._local_given
            self.local_rank = self.rank if given_rank is None else given_rank
            self.local_size = self.size if given_size is None else given_size
            self._unnamed = dict.fromkeys(UNNAMED_KINDS, 0)  # the next unnamed call's number, per kind
            self._unnamed_live = {kind: collections.deque() for kind in UNNAMED_KINDS}  # their calls in flight
            self._in_flight: set[str] = set()
            self._board = Board(self.rank, self.size)
            self._board_key = service_key("hvd", f"board.g{generation}" if generation else "board")
            self._board_sent = 0
            self._board_answers: dict[int, np.ndarray | PslinkError] = {}
            self._board_handles: collections.deque = collections.deque()  # (round, handle) not yet read
            self._board_rows: list[np.ndarray] = []  # this rank's rows not sent yet, in call order
            self._batch = board_batch(self.size)  # (every rank of the world alike: the rounds' shape)
            self._counts: dict[str, int] = {}  # this rank's calls per name
            self._calls: dict[tuple[str, int], Any] = {}  # this rank's undecided calls -> Pending, None, _ENDED or _FAILED
            self._early: dict[tuple[str, int], PslinkError] = {}  # verdicts that came before their Pending
            self._deferred: list[PslinkError] = []  # verdicts on calls that had ended: raised at the next call
            self._mirrors: collections.deque[Decided] = collections.deque()  # for this rank while it is joined
            self._signatures: dict[tuple, tuple] = {}  # allreduce's named calls: (what, Call, key), see allreduce
            self._joined_at = 0
            self._join_done: JoinDone | None = None

    @property
    def capacity(self) -> int:
        """The most workers the job may have (its ``max_workers``, else as many as it has or had):
        sizes the keys whose shape would otherwise follow the number of workers, so that they
        keep it when that number changes."""
        return max(int(self.agent.settings.get("max_workers") or 0), self.agent.num_workers, self.size)

    @property
    def cross_rank(self) -> int:
        """The index of this rank's machine, as Horovod numbers them (``local_size`` ranks each)."""
        return self.rank // max(self.local_size, 1)

    @property
    def cross_size(self) -> int:
        return max(self.size // max(self.local_size, 1), 1)

    def is_homogeneous(self) -> bool:
        """Whether every machine runs ``local_size`` of the ranks (as cross_rank assumes)."""
        return self.local_size >= 1 and self.size % self.local_size == 0

    def reconnect(self):
        """Register this rank again with a new Agent (a late worker of the running job) and close
        the old one (:func:`pslink.core.worker.elastic.register_again`). Returns the new Agent."""
        from pslink.core.worker.elastic import register_again  # elastic drives sessions: it imports this module

        agent = register_again(self.agent, self._reconnect)
        self._check_mode(agent)
        self.agent, self.timeout = agent, agent.timeout
        return agent

    def abandon(self) -> None:
        """Forget what is in flight (elastic recovery: those rounds were given up)."""
        with self._lock:
            self._in_flight.clear()
        for abandon in self._abandons:
            abandon()

    def close(self) -> None:
        self.process_sets.close()
        self._progress.close()
        self._zeros.clear()
        self.agent.close()

    # -- names ------------------------------------------------------------------------------------

    def name(self, kind: str, name: str | None) -> str:
        """``name`` checked, or the next unnamed name of ``kind`` (the n-th unnamed call of a
        kind is the same operation on every rank, as in Horovod)."""
        if name is None:
            kind = "call" if self._ordered else kind
            with self._lock:
                number = self._unnamed[kind]
                self._unnamed[kind] = number + 1
            return f"{kind}.noname.g{self.generation}.{number}" if self.generation else f"{kind}.noname.{number}"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a {kind} name must be a non-empty string, got {name!r}")
        return name

    def data_key(self, kind: str, name: str, how: str, dtype: str, shape: tuple, later: bool = False) -> str:
        """The service key of a call's data. A named call's key is its name's, with ``how`` (the
        reduction, root rank or step), the dtype and the shape: a name may be used again with
        another shape (Horovod allows it), and ranks that disagree in any of them meet on
        different keys, where the board's verdict ends their wait. An unnamed call's key is its
        signature's: the n-th unnamed call of a kind and signature is round n of one key, as the
        n-th unnamed call is the same operation on every rank, so a training loop's unnamed
        calls reuse a few keys instead of making one per call on the service. ``later``:
        for a request sent after the call's first answer (a gather's rows), whose order among
        other calls' no lock keeps: its unnamed key also names the call's number modulo
        :data:`LATER_SLOTS` (no more unnamed calls of a kind than that are in flight: _unnamed_room)."""
        dims = "x".join(str(d) for d in shape) or "scalar"
        match = _UNNAMED.match(name)
        if match is None:
            return service_key(kind, name, how, dtype, dims)
        slot = (f"s{int(match.group(3)) % LATER_SLOTS}",) if later else ()
        return service_key(kind, "noname", f"g{self.generation}", how, dtype, dims, *slot)

    def group_names(self, kind: str, name: str | None, count: int) -> list:
        """A group's names: ``name.i`` each, or None each (unnamed: numbered one by one)."""
        if name is None:
            return [None] * count
        name = self.name(kind, name)
        return [f"{name}.{i}" for i in range(count)]

    def _claim(self, name: str, what: str) -> None:
        """Horovod's rule: one operation per name in flight at a time."""
        if name in self._in_flight:
            raise ConfigError(f"{what}: an operation named {name!r} is in flight on rank {self.rank}; synchronize it "
                              "before starting another under its name, or give each its own name")
        self._in_flight.add(name)

    # -- the board ----------------------------------------------------------------------------------

    def _announce(self, call: Call | None, prompt: bool = False) -> tuple[tuple[str, int] | None, Any]:
        """Put ``call`` on this rank's next board round (None: a joined rank's round, sent at
        once); returns the call's (name, occurrence) and, when the round went now, its handle.
        Raises a verdict on an earlier call that came too late for it (so a disagreement never
        passes silently).

        A round carries up to board_batch(size) calls of each rank: rows wait until that many
        are there, so a training loop pays one small push-pull per batch of calls, not per call.
        Calls that agree need no verdict to run: their keys meet on the service. Rows go at once
        (``prompt``: an optimizer step, whose round the step waits on) when nobody may ever
        wait on the calls (``unattended``) or while a rank has joined (its mirrors of the others'
        allreduces need their rows); and whenever a wait on an undecided call drags on
        (:meth:`_nudge`): calls that disagree wait on different keys, each rank then sends its
        rows, and the verdict ends the waits. The n-th rounds of the ranks pair whatever rows
        they carry (a rank that nudged is a round ahead until the others send theirs): the
        Board matches calls by name and occurrence, not by round."""
        with self._lock:
            if self._deferred:
                raise self._deferred.pop(0)
            entry = None
            if call is not None:
                occurrence = self._counts.get(call.name, 0) + 1
                self._counts[call.name] = occurrence
                entry = (call.name, occurrence)
                self._calls[entry] = None
                self._board_rows.append(boards.encode(call, self._joined_at))
            prompt = prompt or call is None or self._unattended or bool(self._joined_at) or self._board.anyone_joined
            if not prompt and (len(self._board_rows) < self._batch or len(self._board_handles) >= BOARD_WINDOW):
                return entry, None  # (a full window: the rows go with a later round)
        if prompt:
            self._board_backpressure()
        return entry, self._send_board()

    def _send_board(self, empty: bool = False) -> Any:
        """Send this rank's waiting rows as its next board rounds (a batch each), if
        there are any (``empty``: one round without them is wanted too); returns the handle of
        the round with the newest row, or None."""
        handle = None
        while True:
            # The board's own lock orders its rounds (each round's push goes out in round order);
            # the session's lock is not held across the push, which may wait (the key's first
            # use asks pMaster where it lives), while an Agent thread that drives the reply needs
            # the session's lock to end a call (finish): a deadlock under load, once.
            with self._board_sending:
                with self._lock:
                    if not self._board_rows and not (empty or self._joined_at):
                        return handle
                    empty = False
                    rows_ = self._board_rows[: self._batch]
                    del self._board_rows[: self._batch]
                    self._board_sent += 1
                    round_ = self._board_sent
                    rows = np.zeros((self.size, self._batch, boards.WIDTH), np.int64)
                    if rows_:
                        rows[self.rank, : len(rows_)] = rows_
                    if self._joined_at:
                        rows[self.rank, 0] = boards.mark_joined(rows[self.rank, 0], self._joined_at)
                    board, key = self._board, self._board_key
                handle = self.agent.pushpull(key, rows, out=rows)
                with self._lock:
                    if board is self._board:
                        self._board_handles.append((round_, handle))
                    more = bool(self._board_rows)
            # The verdicts are read when some thread reads answers anyway (one that waits on a
            # call, which is what a verdict may have to cancel), unless nobody may ever wait.
            handle.add_done_callback(lambda h, b=board, r=round_, a=rows: self._board_answer(b, r, h, a),
                                     drive=self._unattended)
            if not more:
                return handle
            self._board_backpressure()

    def _nudge(self, entry: tuple[str, int] | None) -> bool:
        """A wait on call ``entry`` drags on: its rank's rows go now (room in the window
        permitting), or, when they have and every round this rank sent is answered while the
        call is still undecided, an empty round (the others' rows may be in a round that waits
        for this rank's next). Returns whether the call is still undecided (nudge again)."""
        with self._lock:
            undecided = entry is not None and entry in self._calls
            if len(self._board_handles) >= BOARD_WINDOW:
                return undecided
            empty = undecided and not self._board_handles
            if not (self._board_rows or empty):
                return undecided
        self._send_board(empty)
        return undecided

    def _board_backpressure(self) -> None:
        """Wait for this rank's oldest board rounds while too many are in flight (the other ranks
        make theirs as they make the same calls)."""
        while True:
            with self._lock:
                if len(self._board_handles) <= BOARD_WINDOW:
                    return
                _, handle = self._board_handles[0]
            try:
                handle.wait(self.timeout)
            except PslinkError:
                pass  # its answer (an error too) is read by the callback
            self._read_board()

    def _board_answer(self, board: Board, round_: int, handle, rows: np.ndarray) -> None:
        """A board round is answered (on the Agent's driving thread)."""
        error = handle.exception()
        with self._lock:
            if board is not self._board:
                return  # a round of a world before this one
            self._board_answers[round_] = error if error is not None else rows
        self._read_board()

    def _read_board(self) -> None:
        """Read the answered board rounds in order; act on their verdicts."""
        failures = []
        with self._lock:
            while self._board.rounds + 1 in self._board_answers:
                round_ = self._board.rounds + 1
                answer = self._board_answers.pop(round_)
                while self._board_handles and self._board_handles[0][0] <= round_:
                    self._board_handles.popleft()
                if isinstance(answer, PslinkError):
                    # A board round that failed (the job's workers changed, the service lost it):
                    # no verdicts from it; reading goes on with the next.
                    log.debug("pslink: board round %d of job %s failed: %s", round_, self.agent.job, answer)
                    self._board.rounds += 1
                    continue
                decided, done = self._board.read(answer)
                for verdict in decided:
                    failures.extend(self._verdict(verdict))
                if done is not None:
                    self._join_done = done
            if self._board.own_joined:
                for verdict in self._board.decide():
                    failures.extend(self._verdict(verdict))
        for pending, error in failures:
            pending.fail(error)

    def _verdict(self, verdict: Decided) -> list:
        """Act on one decided occurrence (under the lock); returns (pending, error) to fail."""
        entry = (verdict.name, verdict.occurrence)
        if self.rank in verdict.absent:
            # Joined while the others called it: this rank's next call of the name (and of its
            # kind, unnamed) is the next one, as on the ranks that called it.
            self._counts[verdict.name] = max(self._counts.get(verdict.name, 0), verdict.occurrence)
            self._follow_unnamed(verdict.name)
        if verdict.mirror:
            self._mirrors.append(verdict)
        mine = self._calls.pop(entry, None) if entry in self._calls else _MISSING
        if verdict.error is None or mine is _MISSING:
            return []
        if mine is None:
            self._early[entry] = verdict.error
        elif mine is _FAILED:
            return []  # it raised already (a joined rank's shapes row failed it first, say)
        elif mine is _ENDED:
            self._deferred.append(verdict.error)
        else:
            return [(mine, verdict.error)]
        return []

    def _pending(self, what: str, steps, entry: tuple[str, int] | None, claimed: str | None = None,
                 inline: bool = False) -> Pending:
        """Run ``steps`` as this rank's call ``entry`` (its board verdict may fail it);
        ``inline``: they only compute after their one push-pull (see Pending)."""
        def finish(failed: bool):
            with self._lock:
                if claimed is not None:
                    self._in_flight.discard(claimed)
                if entry is not None and entry in self._calls:
                    self._calls[entry] = _FAILED if failed else _ENDED

        pending = Pending(what, steps, self.agent.cancel, self._progress, finish, inline, self._unattended,
                          nudge=lambda: self._nudge(entry), timeout=self.timeout)
        if entry is not None:
            with self._lock:
                early = self._early.pop(entry, None)
                if entry in self._calls and self._calls[entry] is None:
                    self._calls[entry] = pending
            if early is not None:
                pending.fail(early)
        return pending

    # -- issuing ----------------------------------------------------------------------------------

    def _issue(self, kind: str, name: str | None, build: Callable[[str], tuple]) -> Pending:
        """Issue one call of ``kind``: name it, claim the name, announce it on the board, start
        it. ``build(name)`` returns (what, its board Call, its steps, inline); the steps' first
        requests go out before this returns. All under the issue lock, so that one rank's calls
        reach the service in the order they were named: an unnamed call's key is shared with the
        other calls of its signature, and its rounds pair with the other ranks' by that order."""
        with self._issuing:
            unnamed = name is None
            name = self.name(kind, name)
            if unnamed:
                self._unnamed_room(kind)
            what, call, steps, inline = build(name)
            with self._lock:
                self._claim(name, what)
            try:
                entry, _ = self._announce(call)
                pending = self._pending(what, steps, entry, claimed=name, inline=inline)
                if unnamed:
                    self._unnamed_live.setdefault(kind, collections.deque()).append(pending)
                return pending
            except BaseException:
                with self._lock:
                    self._in_flight.discard(name)
                raise

    def _unnamed_room(self, kind: str) -> None:
        """Wait while LATER_SLOTS unnamed calls of ``kind`` are in flight (the oldest first): a
        gather's rows go on a slot key by the call's number modulo LATER_SLOTS, so no two calls
        in flight may share one. The n-th unnamed calls of a kind are one operation on every
        rank, so every rank waits for the same ones."""
        live = self._unnamed_live.setdefault(kind, collections.deque())
        while live and (live[0].done() or len(live) >= LATER_SLOTS):
            oldest = live.popleft()
            if not oldest.done():
                try:
                    oldest.wait(self.timeout)
                except PslinkError:
                    pass  # its error is its caller's

    def _send(self, what: str, key, array: np.ndarray, out: np.ndarray, average: bool = False):
        """One push-pull of ``key``; an error found before sending (a shape the service knows
        otherwise) names ``what``."""
        try:
            return self.agent.pushpull(key, array, out=out, average=average)
        except PslinkError as exc:
            raise reworded(exc, what) from None

    def _send_many(self, what: str, keys: list, arrays: list, outs: list):
        if len(keys) == 1:
            return self._send(what, keys[0], arrays[0], outs[0])
        try:
            return self.agent.pushpull_many(keys, arrays, outs=outs)
        except PslinkError as exc:
            raise reworded(exc, what) from None

    # -- allreduce --------------------------------------------------------------------------------

    def allreduce(self, array: np.ndarray, out: np.ndarray | None = None, name: str | None = None,
                  op: ReduceOp = Average, prescale: float = 1.0, postscale: float = 1.0) -> Pending:
        """``array`` reduced over the ranks by ``op`` into ``out`` (a new array if None; ``array``
        itself for in place). ``prescale`` multiplies each rank's array first, ``postscale`` the
        result. The Pending's result is ``out``."""
        op = reduce_op(op)
        array = host_array(array, "allreduce")
        out = out_array(array, out, "allreduce")
        if prescale.__class__ is not float or prescale != 1.0:
            prescale = check_factor(prescale, "allreduce: prescale_factor")
        if postscale.__class__ is not float or postscale != 1.0:
            postscale = check_factor(postscale, "allreduce: postscale_factor")
        if op is Adasum and array.dtype.kind != "f":
            raise ConfigError(f"allreduce: Adasum reduces floating-point tensors, got {array.dtype}")

        def build(name: str):
            # A training loop makes the same named calls step after step: their description,
            # board Call and key are worked out once (a 4 KiB allreduce notices microseconds).
            signature = (name, array.dtype, array.shape, op, prescale, postscale)
            known = self._signatures.get(signature)
            if known is None:
                what = f"allreduce {name!r}"
                call = Call(boards.ALLREDUCE, name, dtype_name(array.dtype), array.shape, op.value, -1, prescale,
                            postscale)
                key = self.data_key("allreduce", name, op.value, dtype_name(array.dtype), array.shape)
                known = (what, call, key)
                if _UNNAMED.match(name) is None:  # (an unnamed call's name is its own: nothing to reuse)
                    if len(self._signatures) >= _SIGNATURES:
                        self._signatures.clear()
                    self._signatures[signature] = known
            what, call, key = known
            if op in GATHERED:
                return what, call, self._gathered_reduce(array, out, name, op, prescale, postscale), False
            return what, call, self._summed(array, out, name, what, op, prescale, postscale, key=key), True

        return self._issue("allreduce", name, build)

    def _summed(self, array: np.ndarray, out: np.ndarray, name: str, what: str, op: ReduceOp, prescale: float,
                postscale: float, kind: str = "allreduce", key: str | None = None):
        """The steps of a sum on the service: prescale, one push-pull, the average's division
        (integers) and postscale (``key``: the data key, if worked out already)."""
        averaged = service_averages(op, array.dtype)
        if array.size:
            source = scale(array, prescale, out) if prescale != 1.0 else array
            if key is None:
                key = self.data_key(kind, name, op.value, dtype_name(array.dtype), array.shape)
            yield self._send(what, key, source, out, averaged)
        if op is Average and not averaged:
            scale(out, postscale / self.size)
        elif postscale != 1.0:
            scale(out, postscale)
        return out

    def _gathered_reduce(self, array: np.ndarray, out: np.ndarray, name: str, op: ReduceOp, prescale: float,
                         postscale: float):
        """The steps of Min, Max, Product, Adasum and the bitwise ops: every rank's (prescaled)
        array gathered in rank order and reduced alike on each."""
        source = scale(array, prescale, np.empty_like(array)) if prescale != 1.0 else array
        rows, _ = yield from self._gather(source.reshape(1, -1), name, f"allreduce {name!r}")
        np.copyto(out, reduce_rows(rows, op).reshape(out.shape))
        if postscale != 1.0:
            scale(out, postscale)
        return out

    def grouped_allreduce(self, arrays: Sequence[np.ndarray], outs: Sequence | None = None, name: str | None = None,
                          op: ReduceOp = Average, prescale: float = 1.0, postscale: float = 1.0) -> PendingGroup:
        """Horovod's grouped allreduce: each array reduced (into ``outs``), started together
        (their small requests travel fused); ``name`` is the group's, each array's ``name.i``."""
        arrays = list(arrays)
        if not arrays:
            raise ConfigError("grouped_allreduce takes a non-empty list of tensors")
        outs = list(outs) if outs is not None else [None] * len(arrays)
        names = self.group_names("allreduce", name, len(arrays))
        return PendingGroup([self.allreduce(a, o, n, op, prescale, postscale) for a, o, n in zip(arrays, outs, names)],
                            f"grouped_allreduce {name!r}")

    # -- broadcast --------------------------------------------------------------------------------

    def check_root(self, root: Any, what: str) -> int:
        """``root`` as this session's rank (a process set's root is given as a world rank)."""
        if self._world_ranks is None:
            return collectives.check_root(root, self.size, what)
        if isinstance(root, np.integer):
            root = int(root)
        if isinstance(root, bool) or not isinstance(root, int) or root not in self._world_ranks:
            raise ConfigError(f"{what}: root_rank must be a rank of the process set {self._world_ranks}, got {root!r}")
        return self._world_ranks.index(root)

    def broadcast(self, array: np.ndarray, root: int, out: np.ndarray | None = None,
                  name: str | None = None) -> Pending:
        """``root``'s ``array`` on every rank, bit for bit, into ``out`` (``array`` for in place)."""
        return self._broadcast(array, self.check_root(root, "broadcast"), out, name)

    def _broadcast(self, array: np.ndarray, root: int, out: np.ndarray | None, name: str | None) -> Pending:
        """:meth:`broadcast` from this session's rank ``root``."""
        array = host_array(array, "broadcast")
        out = out_array(array, out, "broadcast")

        def build(name: str):
            call = Call(boards.BROADCAST, name, dtype_name(array.dtype), array.shape, "", root)
            return f"broadcast {name!r}", call, self._broadcast_steps([(name, array, out)], root, out), True

        return self._issue("broadcast", name, build)

    def broadcast_many(self, named: Sequence[tuple[str, np.ndarray, np.ndarray]], root: int, what: str,
                       name: str) -> Pending:
        """Several arrays (name, array, out) broadcast in one request, as one call ``name``
        (``broadcast_parameters``); the Pending's result is the list of outs."""
        root = self.check_root(root, what)
        items = [(n, host_array(a, f"{what}: {n!r}"), o) for n, a, o in named]

        def build(call_name: str):
            call = Call(boards.BROADCAST, call_name, "", (len(items),), "", root)
            return what, call, self._broadcast_steps(items, root, [o for _, _, o in items]), True

        return self._issue("broadcast", name, build)

    def _broadcast_steps(self, items: list, root: int, result):
        """One push-pull of every item's key: the root pushes its values (as integers of their
        width: the sum with zeros is exact, -0.0 included), the others zeros."""
        keys, pushes, outs = [], [], []
        for item_name, array, out in items:
            if out is not array and self.rank == root:
                np.copyto(out, array)  # the root sends its value from out (and gets it back there)
            if not array.size:
                continue
            # The key names the root and dtype: ranks that disagree on them wait on different
            # keys (the board's verdict ends the wait) instead of summing two roots' values.
            keys.append(self.data_key("broadcast", item_name, f"root{root}", dtype_name(array.dtype), array.shape))
            bits = bits_of(out)
            outs.append(bits)
            pushes.append(bits if self.rank == root else self._zeros.like(bits))
        if keys:
            yield self._send_many(f"broadcast to {len(keys)} key(s)", keys, pushes, outs)
        return result

    # -- allgather ----------------------------------------------------------------------------------

    def allgather(self, array: np.ndarray, name: str | None = None) -> Pending:
        """Every rank's ``array`` concatenated along the first dimension, in rank order (ranks may
        bring different numbers of rows; the other dimensions and the dtype must agree). The
        Pending's result is ``(gathered, rows per rank)``."""
        array = gather_array(host_array(array, "allgather"), "allgather")

        def build(name: str):
            what = f"allgather {name!r}"
            call = Call(boards.ALLGATHER, name, dtype_name(array.dtype), array.shape[1:])
            return what, call, self._gather(array, name, what), False

        return self._issue("allgather", name, build)

    def grouped_allgather(self, arrays: Sequence[np.ndarray], name: str | None = None) -> PendingGroup:
        arrays = list(arrays)
        if not arrays:
            raise ConfigError("grouped_allgather takes a non-empty list of tensors")
        names = self.group_names("allgather", name, len(arrays))
        return PendingGroup([self.allgather(a, n) for a, n in zip(arrays, names)], f"grouped_allgather {name!r}")

    def _gather(self, array: np.ndarray, name: str, what: str, extra: np.ndarray | None = None,
                check: Callable[[np.ndarray], None] | None = None):
        """The steps of a gather: a shapes round (every rank's dimensions, dtype and ``extra``
        values, such as alltoall's splits), then the rows. Returns (gathered, rows per rank),
        and with ``extra`` every rank's extra values too (``check(extras)`` may refuse them
        before any row is sent: every rank sees the same and raises alike)."""
        extra = np.zeros(0, np.int64) if extra is None else extra
        width = GATHER_WIDTH + extra.size
        table = np.zeros((self.capacity, width), np.int64)
        mine = table[self.rank]
        mine[0], mine[1] = array.ndim, collectives.dtype_code(array.dtype)
        mine[2 : 2 + array.ndim] = array.shape
        mine[2 + collectives.MAX_GATHER_DIMS :] = extra
        # The shapes key names neither the dtype nor the rows: ranks that disagree meet there and
        # learn it together.
        described = yield self._send(what, self.data_key("allgather", name, "shapes", "int64", table.shape,
                                                         ), table, table)
        described = described[: self.size]
        joined = [r for r in range(self.size) if described[r, 0] == JOINED_ROW]
        if joined:
            raise MismatchError(f"{what} cannot run while rank(s) {joined} have joined: only allreduce of Average or "
                                "Sum (and DistributedOptimizer steps) take part in join(), as in Horovod",
                                name=name, ranks=joined)
        dims = [tuple(int(d) for d in r[2 : 2 + int(r[0])]) for r in described]
        dtypes = [collectives.dtype_of(int(r[1])) for r in described]
        if any(d[1:] != dims[0][1:] for d in dims) or any(t != dtypes[0] for t in dtypes):
            listing = ", ".join(f"rank {r} has {d} {t}" for r, (t, d) in enumerate(zip(dtypes, dims)))
            raise ShapeMismatchError(f"{what}: the ranks' tensors must agree in dtype and in every dimension but the "
                                     f"first: {listing}", key=name, shapes=[list(d) for d in dims], dtypes=dtypes)
        extras = described[:, 2 + collectives.MAX_GATHER_DIMS :]
        if check is not None:
            check(extras)
        rows = np.array([d[0] for d in dims], np.int64)
        start = int(rows[: self.rank].sum())
        buffer = np.zeros((int(rows.sum()),) + array.shape[1:], array.dtype)
        buffer[start : start + array.shape[0]] = array
        if buffer.size:
            bits = bits_of(buffer)
            key = self.data_key("allgather", name, "rows", dtype_name(array.dtype), buffer.shape, later=True)
            yield self._send(what, key, bits, bits)
        if extra.size:
            return buffer, rows, extras
        return buffer, rows

    # -- reducescatter ------------------------------------------------------------------------------

    def reducescatter(self, array: np.ndarray, name: str | None = None, op: ReduceOp = Average,
                      prescale: float = 1.0, postscale: float = 1.0) -> Pending:
        """Horovod's reducescatter: ``array`` (one shape on every rank) reduced over the ranks,
        this rank's share of its first dimension the result (the first ``rows % size`` ranks get
        one row more, as Horovod splits)."""
        op = reduce_op(op)
        if op not in (Average, Sum):
            raise ConfigError(f"reducescatter reduces with op=Average or Sum, got op={op.name.title()}")
        array = host_array(array, "reducescatter")
        if array.ndim == 0:
            raise ConfigError("reducescatter needs a tensor of at least one dimension (its rows are scattered)")
        prescale = check_factor(prescale, "reducescatter: prescale_factor")
        postscale = check_factor(postscale, "reducescatter: postscale_factor")
        start, rows = collectives.scatter_share(array.shape[0], self.size, self.rank)

        def steps(name: str, what: str):
            summed = yield from self._summed(array, np.empty_like(array), name, what, op, prescale, 1.0,
                                             kind="reducescatter")
            share = summed[start : start + rows].copy()
            if postscale != 1.0:
                scale(share, postscale)
            return share

        def build(name: str):
            what = f"reducescatter {name!r}"
            call = Call(boards.REDUCESCATTER, name, dtype_name(array.dtype), array.shape, op.value, -1, prescale, postscale)
            return what, call, steps(name, what), True

        return self._issue("reducescatter", name, build)

    def grouped_reducescatter(self, arrays: Sequence[np.ndarray], name: str | None = None, op: ReduceOp = Average,
                              prescale: float = 1.0, postscale: float = 1.0) -> PendingGroup:
        arrays = list(arrays)
        if not arrays:
            raise ConfigError("grouped_reducescatter takes a non-empty list of tensors")
        names = self.group_names("reducescatter", name, len(arrays))
        return PendingGroup([self.reducescatter(a, n, op, prescale, postscale) for a, n in zip(arrays, names)],
                            f"grouped_reducescatter {name!r}")

    # -- alltoall -----------------------------------------------------------------------------------

    def alltoall(self, array: np.ndarray, splits: Sequence[int] | None = None, name: str | None = None,
                 expect: Sequence[int] | None = None) -> Pending:
        """Horovod's alltoall: rank i gets ``splits[i]`` rows of every rank's ``array`` (equal
        shares of the first dimension when ``splits`` is None), concatenated in rank order. The
        Pending's result is ``(received, rows received from each rank)``. ``expect``: the rows
        this rank expects from each rank (torch's output splits); every rank checks every rank's
        splits against them, and a disagreement fails the call on every rank before any row is
        sent."""
        array = host_array(array, "alltoall")
        if array.ndim == 0:
            raise ConfigError("alltoall needs a tensor of at least one dimension (its rows are sent)")
        splits = collectives.alltoall_splits("alltoall", array.shape[0], self.size, splits)
        if expect is not None:
            expect = [int(n) for n in expect]
            if len(expect) != self.size or min(expect) < 0:
                raise ConfigError(f"alltoall: expected rows {expect} must be {self.size} counts >= 0")

        def steps(name: str, what: str):
            # Every rank's rows and splits in one gather (its shapes round carries the splits, and
            # the rows each rank expects): each rank takes its pieces of every rank's rows.
            extra = np.array(splits + (expect if expect is not None else [-1] * self.size), np.int64)
            everything, _, table = yield from self._gather(array, name, what, extra, check=_expected_rows(what))
            sends = table[:, : self.size].tolist()
            pieces = [everything[start : start + rows] for start, rows in collectives.alltoall_pieces(sends, self.rank)]
            received = np.concatenate(pieces) if pieces else np.empty((0,) + array.shape[1:], array.dtype)
            return received, np.array([sent[self.rank] for sent in sends], np.int32)

        def build(name: str):
            what = f"alltoall {name!r}"
            return what, Call(boards.ALLTOALL, name, dtype_name(array.dtype), array.shape[1:]), steps(name, what), False

        return self._issue("alltoall", name, build)

    # -- objects --------------------------------------------------------------------------------------

    def broadcast_object(self, obj: Any = None, root: int = 0, name: str | None = None) -> Any:
        """``root``'s ``obj`` on every rank (pickled on the root, unpickled on the others)."""
        name = name or "broadcast_object"
        what = f"broadcast_object {name!r}"
        root = self.check_root(root, what)
        payload = collectives.object_bytes(obj) if self.rank == root else np.zeros(0, np.uint8)
        length = np.array([payload.size], np.int64)
        self._broadcast(length, root, length, f"{name}.length").wait(self.timeout)
        data = payload if self.rank == root else np.empty(int(length[0]), np.uint8)
        data = self._broadcast(data, root, None, f"{name}.data").wait(self.timeout)
        return obj if self.rank == root else collectives.object_from(data)

    def allgather_object(self, obj: Any, name: str | None = None) -> list:
        """Every rank's ``obj``, as a list in rank order."""
        name = None if name is None else f"{name}.object"
        gathered, rows = self.allgather(collectives.object_bytes(obj), name).wait(self.timeout)
        bounds = np.concatenate([[0], np.cumsum(rows)])
        return [collectives.object_from(gathered[bounds[r] : bounds[r + 1]]) for r in range(self.size)]

    # -- barrier and join ----------------------------------------------------------------------------

    def barrier(self, name: str = "barrier") -> None:
        """Wait until every rank of the world reached the barrier of this name."""
        self.agent.barrier(f"hvd/{name}", timeout=self.timeout)

    def register_stepper(self, contribute_zeros: Callable[[], None],
                         abandon: Callable[[], None] | None = None) -> int:
        """An optimizer that averages gradients: ``contribute_zeros()`` pushes one step's worth of
        zero gradients (what a joined rank does while the others step), ``abandon()`` forgets
        its gradients in flight (elastic recovery). Returns its number; every rank must create
        the same optimizers in the same order."""
        self.steppers.append(contribute_zeros)
        if abandon is not None:
            self._abandons.append(abandon)
        return len(self.steppers) - 1

    def step(self, index: int) -> Pending:
        """Optimizer ``index`` steps (its gradients are in flight): its row goes on the board at
        once, which tells a joined rank to mirror it (the joined rank's loop reads every round).
        Nothing waits for the round's answer: the rank's round may pair with a round the others
        send only at their next call (rounds pair by count), and a step must not wait for that. A
        verdict against it (another optimizer on another rank) comes with a later call."""
        entry, _ = self._announce(Call(boards.STEP, f"optimizer.{index}"), prompt=True)

        def steps():
            return None
            yield  # a generator that ends at once

        return self._pending(f"optimizer #{index} step", steps(), entry, inline=True)

    def join(self) -> int:
        """This rank ran out of data: until every rank did, take part in the others' allreduces
        and optimizer steps with zeros (averages still divide by every rank, as in Horovod);
        their other collectives fail on their ranks. Returns the rank that joined last (the
        highest, if several joined in the same round)."""
        with self._lock:
            # Its order among the ranks' joins (Board.read): the calls it has made, each rank's
            # own and the others' it took part in while joined. A rank that called what another
            # did not (since that one joined) joined later, whatever the timing.
            self._joined_at = sum(self._counts.values()) + 1
            self._board.own_joined, self._board.own_calls = True, dict(self._counts)
            self._join_done = None
        mirrored: list = []
        try:
            while True:
                # One joined round for each of the others' rounds (they pair by count): a new one
                # once every round this rank sent is read; until then, wait for what they bring.
                with self._lock:
                    caught_up = self._board.rounds >= self._board_sent
                if caught_up:
                    self._announce(None)
                self._read_board()  # what this rank's join decides already (Board.decide)
                while self._mirrors:
                    mirrored.extend(self._mirror(self._mirrors.popleft()))
                self._wait_board()
                while self._mirrors:
                    mirrored.extend(self._mirror(self._mirrors.popleft()))
                with self._lock:
                    done = self._join_done
                if done is not None:
                    break
            for handle, _ in mirrored:
                handle.wait(self.timeout)
        finally:
            with self._lock:
                self._joined_at = 0
                self._board.own_joined = False
                self._join_done = None
        return done.last

    def _wait_board(self) -> None:
        """Until every board round this rank sent is read, or one read brings something for a
        joined rank to do (a call to mirror, the end of join). Not longer: the others may be
        waiting on that mirror (an optimizer step's gradients) before they send the rounds that
        this rank's later ones pair with."""
        while True:
            with self._lock:
                if self._board.rounds >= self._board_sent or self._mirrors or self._join_done is not None:
                    return
                _, handle = self._board_handles[0] if self._board_handles else (None, None)
            if handle is not None:
                try:
                    handle.wait(self.timeout)
                except PslinkError:
                    if not handle.done():
                        raise
            self._read_board()

    def _mirror(self, verdict: Decided) -> list:
        """Take part, with zeros, in a call of the others while this rank is joined."""
        call = verdict.call
        if call.kind == boards.STEP:
            index = int(call.name.rpartition(".")[2])
            if not 0 <= index < len(self.steppers):
                raise ConfigError(f"join: the other ranks stepped optimizer #{index}, but rank {self.rank} has "
                                  f"{len(self.steppers)} distributed optimizer(s): every rank must create the "
                                  "same ones")
            self.steppers[index]()
            return []
        if call.kind in (boards.ALLGATHER, boards.ALLTOALL) or (call.kind == boards.ALLREDUCE
                                                                 and call.op not in boards.SUMMED_OPS):
            # A gather's shapes round, with a row that says this rank joined: every calling rank
            # then fails it at once, and nobody sends its rows.
            width = GATHER_WIDTH + (2 * self.size if call.kind == boards.ALLTOALL else 0)
            table = np.zeros((self.capacity, width), np.int64)
            table[self.rank, 0] = JOINED_ROW
            key = self.data_key("allgather", call.name, "shapes", "int64", table.shape)
            return [(self.agent.pushpull(key, table, out=table), table)]
        if call.kind == boards.BROADCAST and not call.dtype:
            return []  # broadcast_parameters' batch: its keys are not on the board (it fails, unpaired)
        zeros = np.zeros(call.shape, DTYPES[call.dtype])
        if not zeros.size:
            return []
        if call.kind == boards.BROADCAST:
            key = self.data_key("broadcast", call.name, f"root{call.root}", call.dtype, call.shape)
            zeros = collectives.bits_of(zeros)
        else:
            kind = "reducescatter" if call.kind == boards.REDUCESCATTER else "allreduce"
            key = self.data_key(kind, call.name, call.op, call.dtype, call.shape)
        return [(self.agent.pushpull(key, zeros, out=zeros), zeros)]  # zeros stay alive until answered

    def _follow_unnamed(self, name: str) -> None:
        """A joined rank that mirrors an unnamed call counts it, so its own next unnamed call
        has the others' number."""
        match = _UNNAMED.match(name)
        if match and int(match.group(2) or 0) == self.generation and match.group(1) in self._unnamed:
            with self._lock:
                kind = match.group(1)
                self._unnamed[kind] = max(self._unnamed[kind], int(match.group(3)) + 1)

    # -- for the elastic World ------------------------------------------------------------------------

    def round(self, what: str) -> Callable[[Any, np.ndarray, np.ndarray], np.ndarray]:
        """One synchronous push-pull round of a key (elastic state sync), errors naming ``what``."""
        def pushpull(key, array: np.ndarray, out: np.ndarray) -> np.ndarray:
            try:
                return self.agent.pushpull(key, array, out=out).wait(self.timeout)
            except PslinkError as exc:
                raise reworded(exc, what) from None

        return pushpull


_MISSING = object()


def host_array(array: Any, what: str) -> np.ndarray:
    """``array`` as a C-contiguous numpy array of a dtype the service carries; ConfigError
    naming ``what`` otherwise."""
    if not isinstance(array, np.ndarray):
        array = np.asarray(array)
    if dtype_name(array.dtype) not in DTYPES:
        raise ConfigError(f"{what}: dtype {array.dtype} cannot go through pslink; supported: {', '.join(DTYPES)}")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def _expected_rows(what: str) -> Callable[[np.ndarray], None]:
    """alltoall's check of every rank's (splits sent, rows expected) (``-1``: no expectation)."""
    def check(table: np.ndarray) -> None:
        size = table.shape[0]
        sends, expects = table[:, :size], table[:, size:]
        bad = [(s, d) for s in range(size) for d in range(size) if expects[d, s] >= 0 and sends[s, d] != expects[d, s]]
        if bad:
            raise ShapeMismatchError(f"{what}: the splits do not match: " + "; ".join(
                f"rank {s} sends {sends[s, d]} rows to rank {d}, which expects {expects[d, s]}" for s, d in bad),
                sends=sends.tolist(), expects=expects.tolist())

    return check


def gather_array(array: np.ndarray, what: str) -> np.ndarray:
    """An array to gather: rows along its first dimension (a scalar is one row)."""
    if array.ndim == 0:
        array = array.reshape(1)
    if array.ndim > collectives.MAX_GATHER_DIMS:
        raise ConfigError(f"{what}: at most {collectives.MAX_GATHER_DIMS} dimensions, got {array.ndim}")
    return array


def out_array(array: np.ndarray, out: np.ndarray | None, what: str) -> np.ndarray:
    """Where a result goes: ``out`` checked (writable, contiguous, ``array``'s shape and dtype),
    or a new array."""
    if out is None:
        return np.empty_like(array)
    if out is array:
        if not array.flags.writeable:
            raise ConfigError(f"{what}: the tensor is read-only and cannot take the result in place")
        return out
    if out.shape != array.shape or out.dtype != array.dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise ConfigError(f"{what}: the result's array must be a writable C-contiguous {array.dtype} {array.shape}, "
                          f"got {out.dtype} {out.shape}")
    return out
