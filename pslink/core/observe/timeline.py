"""A worker's timeline as a Chrome trace (load it in https://ui.perfetto.dev or chrome://tracing).

``PSLINK_TIMELINE=trace.json`` makes every Agent of the process write its push, pull and
push-pull spans per key (one lane per key; a span ends when the answer arrived, so a push-pull's
end is its round's close as this worker saw it), the time its threads waited, and instants for
relocations and migrations it followed. ``PSLINK_TIMELINE_STEPS=a:b`` keeps only iterations
a to b-1 (an iteration ends when a key is pushed again), so a long run leaves a small file:
timelines that grow to gigabytes are a known pain of Horovod's (horovod#603, #1022).

Each rank writes its own file (``{rank}`` in the path is replaced; otherwise a job of several
workers inserts ``.rankR`` before the suffix); ``pslink launch --timeline`` merges them
(:func:`merge`). Events are written as they happen, into a JSON array that :meth:`Timeline.close`
ends; a file cut short by a crash still loads (Chrome's trace format allows the missing ``]``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time

from pslink.errors import ConfigError

log = logging.getLogger(__name__)

ENV_TIMELINE = "PSLINK_TIMELINE"
ENV_TIMELINE_STEPS = "PSLINK_TIMELINE_STEPS"
MAX_EVENTS = 2_000_000  # about 300 MB of JSON: past it, one warning and nothing more is written
WAIT_LANE = 0


def parse_steps(raw: str | None) -> tuple[int, int | None] | None:
    """``"a:b"`` -> (a, b); ``"a:"`` -> (a, None); empty -> None (every step)."""
    if not raw or not raw.strip():
        return None
    first, sep, last = raw.strip().partition(":")
    try:
        start = int(first) if first.strip() else 0
        stop = int(last) if last.strip() else None
    except ValueError:
        raise ConfigError(f"{ENV_TIMELINE_STEPS}={raw!r} must be FIRST:LAST, iterations (e.g. 10:20)") from None
    if not sep or start < 0 or (stop is not None and stop <= start):
        raise ConfigError(f"{ENV_TIMELINE_STEPS}={raw!r} must be FIRST:LAST with 0 <= FIRST < LAST (e.g. 10:20)")
    return start, stop


def path_for(path: str, rank: int, num_workers: int) -> str:
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if num_workers <= 1:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.rank{rank}{suffix or '.json'}"


def started_path(path: str, rank: int) -> str:
    """The file a timeline started at run time writes (Horovod's ``start_timeline``): ``{rank}``
    replaced if there; otherwise rank 0 writes ``path`` itself (Horovod's coordinator writes the
    one file) and rank R ``path.rankR``."""
    if "{rank}" not in path and rank == 0:
        return path
    return path_for(path, rank, 2)


class Timeline:
    """Chrome-trace events of one Agent (``pid``: its rank), written to ``path`` as they come."""

    def __init__(self, path: str, job: str, rank: int, steps: tuple[int, int | None] | None = None,
                 mark_cycles: bool = False):
        self.path = path
        self.rank = rank
        self.steps = steps
        self.mark_cycles = mark_cycles  # an instant where each iteration starts (Horovod's CYCLE_START)
        self.step = 0  # iterations so far (see pushed())
        self._this_step: set = set()
        self._lock = threading.Lock()
        self._lanes: dict = {}
        self._events = 0
        # Microseconds on the wall clock (ranks' files merge on one axis), read through the
        # monotonic counter (steady within the run).
        self._origin = time.time() * 1e6 - time.perf_counter() * 1e6
        try:
            directory = os.path.dirname(os.path.abspath(path))
            os.makedirs(directory, exist_ok=True)
            self._file = open(path, "w", buffering=1 << 16)
        except OSError as exc:
            raise ConfigError(f"{ENV_TIMELINE}: cannot write the timeline {path}: {exc.strerror or exc}") from None
        self._file.write("[")
        self._write({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                     "args": {"name": f"{job} rank {rank}"}})
        self._write({"name": "thread_name", "ph": "M", "pid": rank, "tid": WAIT_LANE, "args": {"name": "waits"}})
        atexit.register(self.close)

    @classmethod
    def from_env(cls, job: str, rank: int, num_workers: int, environ=os.environ) -> "Timeline | None":
        path = environ.get(ENV_TIMELINE)
        if not path:
            return None
        return cls(path_for(path, rank, num_workers), job, rank, parse_steps(environ.get(ENV_TIMELINE_STEPS)))

    def pushed(self, keys) -> None:
        """A push of ``keys``: a key pushed again begins the next iteration (a job's keys are
        pushed once per iteration; new keys, such as DDP's rebuilt buckets, join the current one)."""
        seen = self._this_step
        if any(key in seen for key in keys):
            self.step += 1
            seen.clear()
            if self.mark_cycles and self.active:
                self.instant("CYCLE_START", None)
        seen.update(keys)

    def now(self) -> float:
        return time.perf_counter()

    @property
    def active(self) -> bool:
        steps = self.steps
        return steps is None or (steps[0] <= self.step and (steps[1] is None or self.step < steps[1]))

    def span(self, name: str, key, start: float, end: float, args: dict | None = None) -> None:
        """A span on key ``key``'s lane (None: the waits' lane) from ``start`` to ``end``
        (:meth:`now` readings)."""
        tid = WAIT_LANE if key is None else self._lane(key)
        self._write({"name": name, "cat": "request" if key is not None else "wait", "ph": "X", "pid": self.rank,
                     "tid": tid, "ts": round(self._origin + start * 1e6, 1),
                     "dur": round(max(0.0, end - start) * 1e6, 1), "args": {"step": self.step, **(args or {})}})

    def instant(self, name: str, key, args: dict | None = None) -> None:
        tid = WAIT_LANE if key is None else self._lane(key)
        self._write({"name": name, "cat": "event", "ph": "i", "s": "t", "pid": self.rank, "tid": tid,
                     "ts": round(self._origin + self.now() * 1e6, 1), "args": {"step": self.step, **(args or {})}})

    def part_moved(self, what: str, key, part: int, source: str, target: str) -> None:
        """An instant where a part of ``key`` went from one Aggregator to another (``what``:
        ``migrated`` or ``relocated``), inside the window only."""
        if source != target and self.active:
            self.instant(what, key, {"part": part, "from": source, "to": target})

    def _lane(self, key) -> int:
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = len(self._lanes) + 1
            self._write({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": lane,
                         "args": {"name": f"key {key!r}"}})
        return lane

    def _write(self, event: dict) -> None:
        line = json.dumps(event, default=str)
        with self._lock:
            if self._file is None or self._events >= MAX_EVENTS:
                return
            if self._events:
                line = ",\n" + line
            self._events += 1
            if self._events == MAX_EVENTS:
                log.warning("timeline %s: %d events written; no more (set %s to a window of steps)", self.path,
                            MAX_EVENTS, ENV_TIMELINE_STEPS)
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write("\n]\n")
            self._file.close()
            self._file = None
        atexit.unregister(self.close)


def read(path: str) -> list[dict]:
    """A timeline's events (a file cut short by a crash included)."""
    with open(path) as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = json.loads(text.rstrip().rstrip(",") + "]")
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e]


def merge(paths: list[str], output: str) -> int:
    """Merge ranks' timelines into one Chrome trace at ``output``; returns the events written."""
    events: list[dict] = []
    for path in paths:
        events += read(path)
    with open(output, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)
