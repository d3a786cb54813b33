"""What the migration benchmarks (``benchmarks/migration*.py``) share: when pMaster's moves ran,
seen from outside (:class:`MoveWatch`, polling the status an operator sees), which iterations of
the job that was, and each round's stall against the same round's undisturbed run.

The benchmarks measure; they do not look into how a move is carried out: a move is "under way"
while ``pslink service status`` lists it (running or queued), and the count of moves done says
one began and ended between two looks.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
import threading
import time

WINDOW = 6  # iterations before the disturbance whose median is the run's pace (as disturbed_job.WINDOW)
POLL_S = 0.025  # how often the watch asks pMaster for its status: the resolution of a move's times
EPISODE_GAP_S = 0.5  # moves this close after each other are one decision's (a batch after a batch)


@dataclasses.dataclass(frozen=True)
class Sample:
    at: float  # wall clock
    listed: int  # moves the status lists (running or queued)
    done: int  # moves done so far
    phases: dict = dataclasses.field(default_factory=dict)  # job -> the control plane's phase for it


@dataclasses.dataclass(frozen=True)
class Episode:
    """Moves under way without a pause longer than ``EPISODE_GAP_S``: ``begun`` (the first look
    that saw one, or the look before the one that counted it done), ``ended`` (the first look
    that saw none left), ``moves`` (done meanwhile)."""

    begun: float
    ended: float
    moves: int

    @property
    def seconds(self) -> float:
        return self.ended - self.begun


def episodes(samples: list[Sample], gap: float = EPISODE_GAP_S) -> list[Episode]:
    """The spans during which moves were under way, oldest first. A move that began and ended
    between two looks shows only as the count of moves done rising: it is placed between them.
    An episode still under way at the last look ends there."""
    out: list[list] = []  # [begun, ended, moves]
    current = None
    previous = None
    for sample in samples:
        rose = previous is not None and sample.done > previous.done
        if sample.listed or rose:
            if current is None:
                begun = previous.at if rose else sample.at  # counted done: it began after the last look
                if out and begun - out[-1][1] <= gap:
                    current = out[-1]  # the next batch of the same decision
                else:
                    current = [begun, sample.at, 0]
                    out.append(current)
            current[1] = sample.at
            if rose:
                current[2] += sample.done - previous.done
            if not sample.listed:
                current = None
        elif current is not None:
            current[1] = sample.at  # the first look with nothing left
            current = None
        previous = sample
    return [Episode(b, e, m) for b, e, m in out]


def span(samples: list[Sample], after: float | None = None) -> Episode | None:
    """The moves seen from ``after`` on (all of them: None) as one episode: the migration from its
    first move begun to its last move done. Looks before ``after`` are left out, so that moves
    that ended just before it (a pack before a drain) are not taken for its own."""
    if after is not None:
        samples = [s for s in samples if s.at >= after]
    found = episodes(samples)
    if not found:
        return None
    return Episode(found[0].begun, found[-1].ended, sum(e.moves for e in found))


def iteration_at(starts: list[float], moment: float) -> int:
    """The iteration running at ``moment``: the last that started at or before it (0 before the first)."""
    if not starts:
        raise ValueError("no iteration started: no timeline to place a moment on")
    return max(0, bisect.bisect_right(starts, moment) - 1)


@dataclasses.dataclass(frozen=True)
class Window:
    """Iterations ``[start, end)`` of a run: from the one during which the first move began to the
    one after the last move ended (the workers learn the new places from that round's replies)."""

    start: int
    end: int
    taken: int  # iterations from the first move begun to the last move done, both counted

    @classmethod
    def of(cls, starts: list[float], moves: Episode, iterations: int) -> Window:
        first, last = iteration_at(starts, moves.begun), iteration_at(starts, moves.ended)
        if first < 1:
            raise ValueError(f"the moves began during iteration {first}: no iteration before them to compare with")
        return cls(first, min(iterations, last + 2), last - first + 1)


def median_before(durations: list[float], start: int) -> float:
    if start < 1:
        raise ValueError(f"the disturbance must come after at least one iteration, not at iteration {start}")
    return statistics.median(durations[max(0, start - WINDOW):start])


def excess_ms(durations: list[float], window: Window) -> float:
    """The window's longest iteration minus the median of those before it, in ms."""
    return (max(durations[window.start:window.end]) - median_before(durations, window.start)) * 1e3


@dataclasses.dataclass(frozen=True)
class Round:
    """One round's migrated run read against its still run over the same iterations."""

    window: Window
    stall_ms: float  # the migrated run's longest iteration of the window minus its median before
    noise_ms: float  # the still run's same figure over the same iterations
    margin_ms: float  # how far over the noise the issue lets a stall be

    @property
    def met(self) -> bool:
        return self.stall_ms <= self.noise_ms + self.margin_ms

    def verdict(self) -> str:
        return (f"stall {self.stall_ms:.1f} ms <= noise {self.noise_ms:.1f} ms + {self.margin_ms:.0f} ms: "
                + ("met" if self.met else "NOT met"))


def read_round(moved: list[float], still: list[float], window: Window, margin_ms: float) -> Round:
    if window.end > min(len(moved), len(still)):
        raise ValueError(f"window {window.start}-{window.end - 1} passes the runs' {min(len(moved), len(still))} "
                         "iterations")
    return Round(window, excess_ms(moved, window), excess_ms(still, window), margin_ms)


def slowdowns(durations: list[float], window: Window) -> list[float]:
    """Each iteration of the window over the median of those before it, less 1 (0.1: 10% slower)."""
    pace = median_before(durations, window.start)
    return [d / pace - 1.0 for d in durations[window.start:window.end]]


def speed_points(durations: list[float]) -> list[tuple[float, float]]:
    """(seconds since the first iteration began, iterations per second) per iteration: a timeline."""
    clock, points = 0.0, []
    for duration in durations:
        clock += duration
        points.append((clock, 1.0 / duration))
    return points


class MoveWatch:
    """Looks at pMaster's status every ``POLL_S`` on a thread of its own while it runs (``with``):
    the samples say when moves were under way. ``connect()`` makes the
    :class:`~pslink.core.service.client.ControlClient` (on the watch's thread: across network
    namespaces the caller says where its socket is made)."""

    def __init__(self, connect, poll: float = POLL_S):
        self.connect = connect
        self.poll = poll
        self.samples: list[Sample] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="move-watch", daemon=True)

    def _run(self) -> None:
        try:
            with self.connect() as client:
                while not self._stop.is_set():
                    status = client.status()
                    phases = {j["job"]: (j.get("control") or {}).get("phase") for j in status.get("jobs", ())}
                    self.samples.append(Sample(time.time(), len(status.get("migrations") or ()),
                                               int(status.get("migrations_done") or 0), phases))
                    self._stop.wait(self.poll)
        except BaseException as exc:  # noqa: BLE001 - reported by the benchmark: a watch that died saw nothing
            self.error = exc

    def __enter__(self) -> MoveWatch:  # noqa: PYI034 - used as itself, never subclassed
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def span(self, after: float | None = None) -> Episode | None:
        """:func:`span` of what the watch saw."""
        if self.error is not None:
            raise RuntimeError(f"the status watch failed, so the moves' times are unknown: {self.error!r}")
        return span(list(self.samples), after)

    def phase(self, job: str) -> str | None:
        """The control plane's phase for ``job`` at the last look (profiling, packed, reverted)."""
        samples = self.samples
        return samples[-1].phases.get(job) if samples else None

    def wait(self, done, what: str, timeout: float) -> None:
        """Until ``done()`` holds, looked at as often as the watch looks; TimeoutError naming ``what``."""
        deadline = time.monotonic() + timeout
        while not done():
            if self.error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the status watch stopped ({self.error!r}) while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")
            self._stop.wait(self.poll)

    def idle_since(self, moment: float) -> bool:
        """No move listed at the last look, taken after ``moment``."""
        samples = self.samples
        return bool(samples) and samples[-1].at > moment and samples[-1].listed == 0
