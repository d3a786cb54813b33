"""The board: what each rank's collective calls were, shared round by round (pure: no I/O).

Horovod's coordinator sees every rank's request before it runs an operation: it refuses
requests that disagree (another dtype, shape, root rank, reduction, scale factor, operation
under one name), and it lets a rank that called ``join()`` take part in the others'
allreduces with zeros. pslink has no coordinator: ranks meet on the service's keys. The board
gives every rank the same view instead. Each collective call (and each ``DistributedOptimizer``
step) goes on the session's board key: in a push-pull round the rank writes its rows, one
:class:`Call` each, and zeros elsewhere: the sum is every rank's rows. The n-th board rounds of
the ranks pair whatever calls they carry; a call is matched with the other ranks'
calls of the same name by occurrence (the third call of ``"x"`` on rank 0 with the third on
rank 1), as the service matches push rounds. Every rank reads the same sums, so every rank
reaches the same verdicts at the same round:

- **Checks.** Once every rank that has not joined announced an occurrence, its calls are
  compared; a disagreement is a :class:`~pslink.errors.MismatchError` naming each rank's call,
  the same on every rank. (The keys a call uses name its dtype, root rank and reduction, so
  calls that disagree in them meet on different keys and wait there: the verdict ends the wait.)
- **Join.** A rank in ``join()`` keeps making board rounds, with its row saying it joined.
  When a call of the others is decided while ranks have joined, an allreduce is mirrored by
  the joined ranks (they push zeros to its key: the average still divides by every rank, as
  Horovod's), a ``DistributedOptimizer`` step by their optimizer's zeros, and any other
  collective is an error on the ranks that called it (Horovod supports only allreduce then).
  When every rank has joined, each returns the rank that joined last (the highest of those
  that joined in the same round).

A board round carries a batch of each rank's calls (the Session sends one per
batch of calls, sooner when a call's wait drags on or a rank has joined): calls that
agree run without waiting for it, so a training loop pays one small push-pull per batch.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from pslink.core.wire.protocol import DTYPES
from pslink.errors import MismatchError, ShapeMismatchError

MAX_DIMS = 8
MAX_NAME_BYTES = 256  # the service's limit on string keys; names are keys' stems

# kinds of calls
ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, STEP, NOTHING = range(1, 8)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast", ALLTOALL: "alltoall",
              REDUCESCATTER: "reducescatter", STEP: "optimizer step", NOTHING: "nothing"}
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(DTYPES)}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}

# a row: flags, joined-at round, kind, dtype, ndim, dims..., op, root + 1, prescale bits,
# postscale bits, name length, name bytes
_FLAGS, _JOINED_AT, _KIND, _DTYPE, _NDIM = range(5)
_DIMS = 5
_OP = _DIMS + MAX_DIMS
_ROOT = _OP + 1
_PRESCALE = _ROOT + 1
_POSTSCALE = _PRESCALE + 1
_NAME_LEN = _POSTSCALE + 1
_NAME = _NAME_LEN + 1
WIDTH = _NAME + MAX_NAME_BYTES // 8
_HAS_CALL, _JOINED = 1, 2
_OPS = ("average", "sum", "adasum", "min", "max", "product", "band", "bor", "bxor")
SUMMED_OPS = frozenset({"average", "sum"})  # the reductions the service makes (the others gather rows)


@dataclasses.dataclass(frozen=True)
class Call:
    """One rank's collective call as the others see it. ``shape``: what must agree (the whole
    shape for an allreduce or broadcast, the dimensions after the first for a gather); ``key``
    is what a joined rank pushes zeros to (an allreduce's data key), ``name`` what calls are
    matched by. ``op`` is the reduction's name, ``root`` a broadcast's root rank, ``step``
    the optimizer's number for a STEP."""

    kind: int
    name: str
    dtype: str = ""
    shape: tuple = ()
    op: str = ""
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0

    def __hash__(self) -> int:
        # Remembered: a frozen dataclass hashes all its fields on every lookup, and rows are
        # looked up by their call on every collective (encode).
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = hash((self.kind, self.name, self.dtype, self.shape, self.op, self.root, self.prescale,
                          self.postscale))
            object.__setattr__(self, "_hash", value)
            return value

    def describe(self) -> str:
        parts = [KIND_NAMES[self.kind]]
        if self.dtype:
            # A gather's first dimension is each rank's own: only the others must agree.
            shape = ("*", *self.shape) if self.kind in (ALLGATHER, ALLTOALL) else self.shape
            parts.append(f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''}) {self.dtype}")
        if self.op:
            parts.append(f"op={self.op}")
        if self.root >= 0:
            parts.append(f"root_rank={self.root}")
        if self.prescale != 1.0 or self.postscale != 1.0:
            parts.append(f"prescale_factor={self.prescale:g} postscale_factor={self.postscale:g}")
        return " ".join(parts)


_CACHE_SIZE = 4096  # rows remembered both ways: a training loop makes the same calls over and over
_encoded: dict[tuple[Call | None, int], np.ndarray] = {}
_decoded: dict[bytes, tuple[Call | None, int]] = {}


def encode(call: Call | None, joined_at: int = 0) -> np.ndarray:
    """One rank's row for a board round (``joined_at``: the round it joined in, 0 if it has not);
    read only (the same row comes back for the same call)."""
    row = _encoded.get((call, joined_at))
    if row is None:
        if len(_encoded) >= _CACHE_SIZE:
            _encoded.clear()
        row = _encoded[(call, joined_at)] = _encode(call, joined_at)
        row.flags.writeable = False
    return row


def _encode(call: Call | None, joined_at: int) -> np.ndarray:
    row = np.zeros(WIDTH, np.int64)
    if joined_at:
        row[_FLAGS] |= _JOINED
        row[_JOINED_AT] = joined_at
    if call is None:
        return row
    name = call.name.encode()
    if len(name) > MAX_NAME_BYTES:
        raise ValueError(f"a call's name is at most {MAX_NAME_BYTES} bytes, got {len(name)}")
    if len(call.shape) > MAX_DIMS:
        raise ValueError(f"a call's shape has at most {MAX_DIMS} dimensions, got {call.shape}")
    row[_FLAGS] |= _HAS_CALL
    row[_KIND] = call.kind
    row[_DTYPE] = _DTYPE_CODES.get(call.dtype, 0)
    row[_NDIM] = len(call.shape)
    row[_DIMS : _DIMS + len(call.shape)] = call.shape
    row[_OP] = _OPS.index(call.op) + 1 if call.op else 0
    row[_ROOT] = call.root + 1
    row[_PRESCALE], row[_POSTSCALE] = struct.unpack("<2q", struct.pack("<2d", call.prescale, call.postscale))
    row[_NAME_LEN] = len(name)
    padded = name.ljust(MAX_NAME_BYTES, b"\0")
    row[_NAME:] = np.frombuffer(padded, np.int64)
    return row


def mark_joined(row: np.ndarray, joined_at: int) -> np.ndarray:
    """``row`` saying its rank has joined (since its round ``joined_at``)."""
    row[_FLAGS] |= _JOINED
    row[_JOINED_AT] = joined_at
    return row


def decode(row: np.ndarray | bytes) -> tuple[Call | None, int]:
    """(the row's call or None, the round its rank joined in or 0); ``row`` may be its bytes.
    The same row gives the same Call object."""
    raw = row if isinstance(row, bytes) else row.tobytes()
    decoded = _decoded.get(raw)
    if decoded is None:
        if len(_decoded) >= _CACHE_SIZE:
            _decoded.clear()
        decoded = _decoded[raw] = _decode(raw)
    return decoded


def _decode(raw: bytes) -> tuple[Call | None, int]:
    row = np.frombuffer(raw, np.int64)
    joined_at = int(row[_JOINED_AT]) if row[_FLAGS] & _JOINED else 0
    if not row[_FLAGS] & _HAS_CALL:
        return None, joined_at
    ndim = int(row[_NDIM])
    name = row[_NAME:].tobytes()[: int(row[_NAME_LEN])].decode(errors="replace")
    prescale, postscale = struct.unpack("<2d", struct.pack("<2q", int(row[_PRESCALE]), int(row[_POSTSCALE])))
    op = int(row[_OP])
    call = Call(kind=int(row[_KIND]), name=name, dtype=_DTYPE_NAMES.get(int(row[_DTYPE]), ""),
                shape=tuple(int(d) for d in row[_DIMS : _DIMS + ndim]), op=_OPS[op - 1] if op else "",
                root=int(row[_ROOT]) - 1, prescale=prescale, postscale=postscale)
    return call, joined_at


@dataclasses.dataclass
class Decided:
    """An occurrence of a name every rank that has not joined called: ``error`` if their calls
    disagree (or it cannot run while ranks have joined), ``mirror`` when this rank has joined
    and must take part with zeros (an allreduce or an optimizer step)."""

    name: str
    occurrence: int
    call: Call  # the lowest calling rank's
    error: MismatchError | ShapeMismatchError | None = None
    mirror: bool = False
    absent: tuple = ()  # joined ranks that did not call it (their next call of the name is the next occurrence)


@dataclasses.dataclass
class JoinDone:
    """Every rank has joined: ``last`` is the rank that joined last."""

    last: int


class Board:
    """One rank's reading of its session's board rounds, in order (:meth:`read`), into verdicts.

    ``rank`` and ``size``: this rank's place in the session's world (the rows of a round are
    the world's ranks)."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.rounds = 0  # board rounds read
        self.joined_at = np.zeros(size, np.int64)  # per rank: the round it joined in (0: it has not)
        self.anyone_joined = False  # joined_at.any(), kept (asked on every call)
        self._seen: list[dict[str, int]] = [{} for _ in range(size)]  # per rank: calls per name so far
        self._open: dict[tuple[str, int], dict[int, Call]] = {}  # (name, occurrence) -> rank -> call
        # This rank is in join() (before any round read says so), having made own_calls[name]
        # calls of each name: see decide().
        self.own_joined = False
        self.own_calls: dict[str, int] = {}
        # occurrences this rank was absent from, decided before its own earlier rows were read:
        # its count of the name moves on once they are (else they would be counted after them)
        self._own_absent: dict[str, int] = {}

    @property
    def joined(self) -> list[int]:
        return [int(r) for r in np.flatnonzero(self.joined_at)]

    def read(self, rows: np.ndarray) -> tuple[list[Decided], JoinDone | None]:
        """One board round's sum (per rank: its rows, calls in its order; a 2-d array is one row
        each), in round order: the occurrences it decides and, if every rank has joined now,
        when join ends (the joined marks are then cleared). A rank's mark orders its join among
        the others' (the Session writes the calls it had made, plus one; ties: the higher rank)."""
        self.rounds += 1
        if rows.ndim == 2:
            rows = rows[:, None, :]
        ranks, slots = np.nonzero(rows[:, :, _FLAGS])  # (in rank order, then slot order)
        raw = np.ascontiguousarray(rows).tobytes()
        width = rows.shape[2] * 8
        per_rank = rows.shape[1] * width
        touched: dict = {}  # (ordered: the same on every rank, which reads the same rows)
        for rank, slot in zip(ranks.tolist(), slots.tolist()):
            start = rank * per_rank + slot * width
            call, joined_at = decode(raw[start : start + width])
            if joined_at and not self.joined_at[rank]:
                self.joined_at[rank] = joined_at
                self.anyone_joined = True
            if call is not None:
                seen = self._seen[rank]
                occurrence = seen.get(call.name, 0) + 1
                seen[call.name] = occurrence
                entry = (call.name, occurrence)
                self._open.setdefault(entry, {})[rank] = call
                touched[entry] = None
        self._settle_own_absent()
        # An occurrence is decided by a call of it read now, or by a rank's join: with nobody
        # joined only the touched ones can be (a round carries a batch of calls; the others
        # wait for theirs).
        everything = self.anyone_joined or self.own_joined
        decided = self._decide(None if everything else touched)
        if self.joined_at.all():
            last = max(range(self.size), key=lambda r: (int(self.joined_at[r]), r))
            self.joined_at[:] = 0
            self.anyone_joined = False
            self.own_joined = False  # join is over here: rows read after this are calls to make
            return decided, JoinDone(last)
        return decided, None

    def _settle_own_absent(self) -> None:
        seen = self._seen[self.rank]
        for name, occurrence in list(self._own_absent.items()):
            if seen.get(name, 0) >= self.own_calls.get(name, 0):
                seen[name] = max(seen.get(name, 0), occurrence)
                del self._own_absent[name]

    def decide(self) -> list[Decided]:
        """The occurrences the rounds read so far decide once this rank's own join counts
        (``own_joined``): a joined rank mirrors the others' calls that wait only for it at once,
        not one round later, when its mark is read: the others may have sent those calls a round
        ahead of it, and then have no reason to send the next round that its mark needs. Only
        occurrences it has not made itself count (its own rows of those may be unread yet). The
        verdicts are the ones every rank reaches when it reads the mark (a joined rank makes no
        call that could change them)."""
        decided = self._decide()
        self._settle_own_absent()
        return decided

    def _decide(self, entries=None) -> list[Decided]:
        """The open occurrences (those of ``entries`` only, if given) that are now decided."""
        read_joined = set(self.joined) if self.anyone_joined else set()
        decided = []
        if entries is None:
            candidates = list(self._open.items())
        else:
            candidates = [(entry, self._open[entry]) for entry in entries if entry in self._open]
        for (name, occurrence), calls in candidates:
            joined = read_joined
            if self.own_joined and occurrence > self.own_calls.get(name, 0):
                joined = read_joined | {self.rank}  # (its own row of a call it made may be unread yet)
            if len(calls) < self.size and (not joined or len(calls.keys() | joined) < self.size):
                continue
            del self._open[(name, occurrence)]
            absent = tuple(sorted(joined - calls.keys())) if joined else ()
            for rank in absent:
                if rank == self.rank and rank not in read_joined:
                    self._own_absent[name] = max(self._own_absent.get(name, 0), occurrence)
                else:
                    self._seen[rank][name] = max(self._seen[rank].get(name, 0), occurrence)
            first = calls[min(calls)]
            verdict = Decided(name, occurrence, first, absent=absent)
            differing = {r: c for r, c in calls.items() if c is not first and c != first}
            if differing:
                listing = "; ".join(f"rank {r}: {c.describe()}" for r, c in sorted(calls.items()))
                ranks = sorted(calls)
                # Tensors that differ in shape or dtype only are the service's ShapeMismatchError
                # (which the same calls meet there, whichever comes first); anything else the
                # coordinator's refusal.
                only_tensors = all(dataclasses.replace(c, shape=first.shape, dtype=first.dtype) == first
                                   for c in differing.values())
                kind = ShapeMismatchError if only_tensors else MismatchError
                which = f" (its use #{occurrence})" if occurrence > 1 else ""
                verdict.error = kind(
                    f"the ranks' calls of {name!r}{which} disagree: {listing}",
                    name=name, ranks=ranks, calls=[calls[r].describe() for r in ranks],
                    shapes=[list(calls[r].shape) for r in ranks], dtypes=[calls[r].dtype for r in ranks])
            elif absent:
                # A joined rank takes part in every call, so that each key's rounds stay paired
                # (with zeros, or a gather's row that says it joined); only summed allreduces and
                # optimizer steps succeed, as in Horovod, the others fail on the calling ranks.
                verdict.mirror = self.rank in absent
                summed = first.kind == STEP or (first.kind == ALLREDUCE and first.op in SUMMED_OPS)
                if not summed:
                    verdict.error = MismatchError(
                        f"{first.describe()} {name!r} cannot run while rank(s) {list(absent)} have joined: only "
                        "allreduce of Average or Sum (and DistributedOptimizer steps) take part in join(), as in "
                        "Horovod", name=name, ranks=list(absent))
            decided.append(verdict)
        return decided
