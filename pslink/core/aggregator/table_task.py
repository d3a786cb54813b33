"""A shard of a sparse table as an aggregation task (no I/O).

A :class:`TableTask` is a :class:`~pslink.core.aggregator.tasks.Task` whose state is a
:class:`~pslink.core.tables.TableShard` instead of one array, so the rounds, memberships,
migrations, replicas and checkpoints that carry a tensor's part carry a table's shard too. A
push's payload is ``(ids, rows)``, a pull's is the ids it wants; a round keeps each rank's push
and applies them, in rank order, when it closes (asynchronous jobs apply each push as it comes).
"""

from __future__ import annotations

import numpy as np

from pslink.core.aggregator.tasks import JobState, Request, Summer, Task, _Round, whole_tensor_error
from pslink.core.tables import ID_DTYPE, TableShard, table_options
from pslink.core.wire.protocol import DTYPES

_NO_VALUE = np.zeros(0, np.float32)  # a table has rows, not a value; a Task with a value is "initialized"


def new_task(job: JobState, spec: dict, summer: Summer, max_ahead: int, clock=lambda: 0.0) -> Task:
    """The task for an ASSIGN entry: a table's shard, or a tensor's part."""
    if spec.get("table") is not None:
        return TableTask(job, spec, summer, max_ahead, clock)
    return Task(job, spec, summer, max_ahead)


class TableTask(Task):
    """One shard of a table of job ``job`` (``spec["table"]``: the table's options)."""

    def __init__(self, job: JobState, spec: dict, summer: Summer, max_ahead: int, clock=lambda: 0.0):
        super().__init__(job, dict(spec, needs_init=False), summer, max_ahead)
        self.table = TableShard(table_options(spec["table"], f"table {spec['key']!r}"), self.dtype, clock)
        self.width = self.table.width
        self.poisoned = self.poisoned or whole_tensor_error(self)
        self.value = _NO_VALUE
        self.needs_init = False

    @property
    def name(self) -> str:
        return f"table {self.key!r} of job {self.job.job!r} (shard {self.part})"

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def describe(self) -> str:
        return f"a table of width {self.width} {self.dtype_name} in {self.shape[0]} shard(s)"

    # -- rounds (the core calls these where a tensor's part adds and applies arrays) -----------------

    keeps_state = True  # its rows, in any mode

    def count_push(self, req: Request) -> None:
        self.job.pushed_bytes += req.payload[0].nbytes + req.payload[1].nbytes  # what came, not what is held

    def add_push(self, round_: _Round, req: Request) -> None:
        if round_.acc is None:
            round_.acc = {}
        round_.acc[req.rank] = req.payload

    def apply_round(self, round_: _Round, optimizes: bool) -> None:
        pushes = [round_.acc[rank] for rank in sorted(round_.acc)] if round_.acc else []
        if not pushes:
            ids, rows = np.empty(0, ID_DTYPE), np.empty((0, self.width), self.dtype)
        elif len(pushes) == 1:
            ids, rows = pushes[0]
        else:
            ids, rows = np.concatenate([p[0] for p in pushes]), np.concatenate([p[1] for p in pushes])
        self.table.apply(ids, rows, len(round_.contributors), self._job_optimizer(optimizes))

    def apply_push(self, req: Request) -> None:
        ids, rows = req.payload
        self.table.apply(ids, rows, 1, self._job_optimizer(self.job.optimizes(self.key, self.closed + 1)))

    def _job_optimizer(self, optimizes: bool):
        """The job's optimizer for this round (None: the round closes as MXNet's servers do
        without an updater, a job in sum mode or a round before its switch to the optimizer)."""
        optimizer = self.job.optimizer
        return optimizer.for_key(self.key) if optimizer is not None and optimizes else None

    def rows_for(self, req: Request) -> np.ndarray:
        ids = req.payload[0] if isinstance(req.payload, tuple) else req.payload
        rows = self.table.read(ids)
        self.job.pulled_bytes += rows.nbytes
        return rows.reshape(-1)  # flat: a frame's buffer

    # -- state crossing Aggregators -------------------------------------------------------------------

    def export_state(self, open_rounds: bool) -> tuple[list, list, dict, list, dict]:
        scalars, named = self.table.export()
        names, arrays = [n for n, _ in named], [a for _, a in named]
        rounds, counts, open_ids, open_rows = [], [], [], []
        for r in sorted(self.rounds) if open_rounds else ():
            round_ = self.rounds[r]
            rounds.append([r, sorted(round_.contributors)])
            for rank, (ids, rows) in sorted((round_.acc or {}).items()):
                counts.append([r, rank, int(ids.size)])
                open_ids.append(ids)
                open_rows.append(rows)
        if counts:
            names += ["open_ids", "open_rows"]
            arrays += [np.concatenate(open_ids), np.concatenate(open_rows)]
        # Frames of their own sizes and dtypes (a tensor's state frames are all its part's size).
        layout = [[a.dtype.name, int(a.size)] for a in arrays]
        return names, arrays, {}, rounds, {"table": scalars, "open_pushes": counts, "layout": layout}

    def import_state(self, named: dict, state: dict, now: float) -> None:
        self.table.load(state["table"], named)
        self.rounds = {}
        for r, ranks in state["open"]:
            round_ = self.rounds[r] = _Round(now)
            round_.contributors = set(ranks)
        at = 0
        for r, rank, count in state.get("open_pushes", ()):
            ids = named["open_ids"][at:at + count]
            rows = named["open_rows"].reshape(-1, self.width)[at:at + count]
            self.rounds[r].acc = (self.rounds[r].acc or {})
            self.rounds[r].acc[rank] = (ids.astype(ID_DTYPE), np.ascontiguousarray(rows, self.dtype))
            at += count


def check_layout(layout, sizes) -> str | None:
    """Why the frames ``sizes`` do not match a table state's ``layout``, or None if they do."""
    if not isinstance(layout, list) or len(layout) != len(sizes):
        return f"its layout {layout!r} does not name its {len(sizes)} frames"
    for entry, size in zip(layout, sizes):
        if (not isinstance(entry, list) or len(entry) != 2 or entry[0] not in DTYPES or not isinstance(entry[1], int)
                or entry[1] < 0 or entry[1] * DTYPES[entry[0]].itemsize != size):
            return f"its layout entry {entry!r} does not match a frame of {size} bytes"
    return None
