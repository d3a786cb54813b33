"""Job traces: the packaged Philly trace or any CSV with the same columns.

The Philly table (``pslink/sim/data/philly_jobs.csv.gz``, see the README next to it) is 82,247
jobs of Microsoft's Philly GPU cluster (Jeon et al., USENIX ATC 2019; msr-fiddle/philly-traces,
CC-BY-4.0), as derived by the Pollux artifact. A trace needs the columns ``jobid``,
``submit_time`` (``YYYY-MM-DD HH:MM:SS``, or seconds), ``num_gpus`` and ``duration_s``; others
are ignored. Times become seconds since the first submission.

:func:`parse_trace` and :func:`select` are pure; :func:`load_trace` reads a file.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import gzip
import math
import re
from importlib import resources
from pathlib import Path
from typing import Iterable

from pslink.errors import ConfigError

PHILLY = "philly"
COLUMNS = ("jobid", "submit_time", "num_gpus", "duration_s")
ATTRIBUTION = ("Philly trace: Jeon et al., USENIX ATC 2019 (msr-fiddle/philly-traces, CC-BY-4.0), "
               "per-job table of the Pollux artifact (petuum/adaptdl)")


class TraceError(ConfigError):
    """A trace file or a window over it is unusable; the message says where and why."""

    code = "trace"


@dataclasses.dataclass(frozen=True)
class TraceJob:
    index: int  # row in the file (0 = first data row): seeds the job's draws
    job: str
    submit: float  # seconds since the trace's first submission
    gpus: int
    duration: float  # seconds


@dataclasses.dataclass(frozen=True)
class Trace:
    source: str
    jobs: tuple[TraceJob, ...]  # by submit time
    epoch: datetime.datetime | None  # the first submission, when the trace gives dates

    def when(self, seconds: float) -> str:
        """A trace time as a date (or seconds, for a trace without dates)."""
        if self.epoch is None:
            return f"{seconds:.0f} s"
        return (self.epoch + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%d %H:%M:%S")


def philly_path() -> Path:
    return Path(str(resources.files("pslink.sim") / "data" / "philly_jobs.csv.gz"))


def _submit(text: str) -> float | datetime.datetime:
    try:
        return float(text)
    except ValueError:
        return datetime.datetime.fromisoformat(text)


def parse_trace(lines: Iterable[str], source: str) -> Trace:
    """Rows of a CSV trace -> :class:`Trace`; a bad row raises :class:`TraceError` naming it."""
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None:
        raise TraceError(f"trace {source} is empty")
    header = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise TraceError(f"trace {source}: missing column(s) {', '.join(missing)} "
                         f"(it has: {', '.join(header) or 'none'}; needs {', '.join(COLUMNS)})")
    where = {c: header.index(c) for c in COLUMNS}
    rows = []
    for index, row in enumerate(reader):
        line = index + 2
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) < len(header):
            raise TraceError(f"trace {source} line {line}: {len(row)} fields, the header has {len(header)}")
        cells = {c: row[i].strip() for c, i in where.items()}
        try:
            submit = _submit(cells["submit_time"])
        except ValueError:
            raise TraceError(f"trace {source} line {line}: submit_time {cells['submit_time']!r} is neither "
                             "YYYY-MM-DD HH:MM:SS nor a number of seconds") from None
        try:
            gpus = int(cells["num_gpus"])
            if gpus < 0:
                raise ValueError
        except ValueError:
            raise TraceError(f"trace {source} line {line}: num_gpus {cells['num_gpus']!r} is not a whole "
                             "number >= 0") from None
        try:
            duration = float(cells["duration_s"])
            if not math.isfinite(duration) or duration < 0:
                raise ValueError
        except ValueError:
            raise TraceError(f"trace {source} line {line}: duration_s {cells['duration_s']!r} is not a number "
                             "of seconds >= 0") from None
        if rows and isinstance(submit, float) != isinstance(rows[0][2], float):
            raise TraceError(f"trace {source} line {line}: submit_time {cells['submit_time']!r} mixes dates "
                             "and seconds")
        rows.append((index, cells["jobid"] or f"job{index}", submit, gpus, duration))
    if not rows:
        raise TraceError(f"trace {source} has a header but no jobs")
    first = min(r[2] for r in rows)
    epoch = None if isinstance(first, float) else first
    jobs = []
    for index, job, submit, gpus, duration in rows:
        seconds = submit - first if epoch is None else (submit - epoch).total_seconds()
        jobs.append(TraceJob(index, job, float(seconds), gpus, duration))
    jobs.sort(key=lambda j: (j.submit, j.index))
    return Trace(source, tuple(jobs), epoch)


def load_trace(name: str) -> Trace:
    """``philly`` (the packaged trace) or the path of a CSV file, gzipped or not."""
    path = philly_path() if name == PHILLY else Path(name)
    source = "philly" if name == PHILLY else repr(name)
    try:
        with path.open("rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        opener = gzip.open if gzipped else open
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            return parse_trace(f, source)
    except FileNotFoundError:
        raise TraceError(f"trace file {name!r} not found (use --trace philly for the packaged Philly trace)") from None
    except IsADirectoryError:
        raise TraceError(f"trace {name!r} is a directory, not a CSV file") from None
    except (OSError, EOFError) as exc:
        raise TraceError(f"cannot read trace {source}: {getattr(exc, 'strerror', None) or exc}") from None
    except UnicodeDecodeError:
        raise TraceError(f"trace {source} is not UTF-8 text (a CSV with columns {', '.join(COLUMNS)})") from None
    except csv.Error as exc:
        raise TraceError(f"trace {source} is not valid CSV: {exc}") from None


_OFFSET = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, trace: Trace, option: str) -> float:
    """``--start``/``--end``: a date-time, or an offset from the trace's start (``90m``, ``36h``, ``3d``)."""
    match = _OFFSET.match(text)
    if match:
        return float(match.group(1)) * _UNITS[match.group(2)]
    if trace.epoch is not None:
        try:
            return (datetime.datetime.fromisoformat(text.strip()) - trace.epoch).total_seconds()
        except ValueError:
            pass
    dates = "a date-time like 2017-10-01 or 2017-10-01 12:00:00, or " if trace.epoch is not None else ""
    raise TraceError(f"{option} {text!r} is not {dates}an offset from the trace's start like 3600, 90m, 36h or 3d")


def select(trace: Trace, start: float | None = None, end: float | None = None) -> list[TraceJob]:
    """The jobs submitted in [start, end) (seconds since the trace's start)."""
    if start is not None and end is not None and end <= start:
        raise TraceError(f"the window ends ({trace.when(end)}) before it starts ({trace.when(start)})")
    jobs = [j for j in trace.jobs if (start is None or j.submit >= start) and (end is None or j.submit < end)]
    if not jobs:
        lo = trace.when(start) if start is not None else "the start"
        hi = trace.when(end) if end is not None else "the end"
        raise TraceError(f"no job of trace {trace.source} was submitted between {lo} and {hi} "
                         f"(it spans {trace.when(trace.jobs[0].submit)} to {trace.when(trace.jobs[-1].submit)})")
    return jobs


def scale_arrivals(rows: list[TraceJob], factor: float) -> list[TraceJob]:
    """The same jobs arriving ``factor`` times as often: submit times divided by ``factor`` from
    the first one, durations, GPUs and draws (seeded by the row) kept. ``factor`` 10 makes a
    cluster with ten times the load of Philly's over a tenth of its span (issue 29's 10x run)."""
    if not factor > 0:
        raise ValueError(f"the arrival scale must be > 0, got {factor}")
    if factor == 1 or not rows:
        return list(rows)
    first = min(r.submit for r in rows)
    return [dataclasses.replace(r, submit=first + (r.submit - first) / factor) for r in rows]
