"""Fault injection for tests and chaos runs: lose, repeat or delay data-path messages.

As ps-lite's ``PS_DROP_MSG``, but for all three faults. Set ``PSLINK_FAULTS`` in the environment
of workers and Aggregators (``pslink service up`` passes its environment on), or pass a
:class:`Faults` to an Agent or Aggregator::

    PSLINK_FAULTS="drop=0.01,dup=0.01,delay=0.01,delay_ms=50,seed=7"

Each message an Agent sends to an Aggregator, and each answer back, is dropped with probability
``drop``, sent twice with probability ``dup``, or sent ``delay_ms`` later with probability
``delay`` (so it may overtake others). Control messages to and from pMaster are left alone.

``ctl_drop``, ``ctl_dup`` and ``ctl_delay`` (probabilities) do the same to the control messages
to and from pMaster (each process's requests, answers and heartbeats on its control
connections), as TCP can: a lost message is lost with its connection (the connection closes
instead of sending it; both ends must reconnect and carry on), a repeated one arrives twice (as a
resend after a reconnect would), and a delayed one holds that connection's later messages
behind it for ``delay_ms`` (TCP keeps their order).

``kill=NAME@N`` kills one process at a chosen point, as a crash would (SIGKILL, no clean-up): the
process named NAME (an Aggregator's name, such as ``agg-1``, or an Agent's ``job/rank``) kills
itself as it sends its N-th data-path message. Every process can share one setting; only the named
one dies. ``kill=NAME@copy`` kills the Aggregator NAME as it is about to send its first migration
copy (TENSOR_COPY): it handed a part over, and the copy never lands.

``kill=pmaster@POINT`` kills pMaster (``pslink service up``'s process) as it reaches a named
point of its control plane (:data:`PMASTER_POINTS`): ``failover`` (a lost Aggregator's loss is
stored, its replicas not yet promoted), ``promoted`` (a replica answered its promotion, which is not
stored yet), ``hand-over`` (a migration's source was told to hand its parts over, and the answer
not heard) or ``copy-landed`` (a migration's copy landed, the move not yet finished). The
restarted pMaster must carry on from what it stored.

The Agent resends a request that got no answer within its resend timeout (one second while faults
are injected, else only with ``resend_timeout``) and the Aggregator applies a request seen twice
once, so a job under faults computes what it computes without them.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading

from pslink.errors import ConfigError, PeerError

ENV_FAULTS = "PSLINK_FAULTS"
#: Where ``kill=pmaster@POINT`` can stop pMaster (see the module's text).
PMASTER_POINTS = ("failover", "promoted", "hand-over", "copy-landed")
_armed: tuple[str, str] | None = None  # (process, point) this process dies at: arm()


@dataclasses.dataclass
class Faults:
    drop: float = 0.0
    dup: float = 0.0
    delay: float = 0.0
    delay_ms: float = 50.0
    seed: int | None = None
    kill: str | None = None  # "NAME@N", or "NAME@copy"
    ctl_drop: float = 0.0  # control messages (see the module's text)
    ctl_dup: float = 0.0
    ctl_delay: float = 0.0
    dropped: int = 0
    duplicated: int = 0
    delayed: int = 0

    def __post_init__(self):
        for name in ("drop", "dup", "delay", "ctl_drop", "ctl_dup", "ctl_delay"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{ENV_FAULTS}: {name} is a probability in [0, 1], got {value}")
        if self.drop + self.dup + self.delay > 1.0:
            raise ConfigError(f"{ENV_FAULTS}: drop + dup + delay must not exceed 1")
        if self.ctl_drop + self.ctl_dup + self.ctl_delay > 1.0:
            raise ConfigError(f"{ENV_FAULTS}: ctl_drop + ctl_dup + ctl_delay must not exceed 1")
        if self.delay_ms < 0:
            raise ConfigError(f"{ENV_FAULTS}: delay_ms must be >= 0, got {self.delay_ms}")
        self._kill_target, self._kill_at, self._kill_at_copy = None, 0, False
        self.point: str | None = None  # kill=pmaster@POINT: the named point
        if self.kill:
            target, sep, count = self.kill.rpartition("@")
            named = target == "pmaster" and count in PMASTER_POINTS
            if not sep or not target or not (named or count == "copy" or count.isdigit() and int(count) >= 1):
                raise ConfigError(f"{ENV_FAULTS}: kill must be NAME@N (N >= 1), NAME@copy or pmaster@POINT "
                                  f"(POINT one of {', '.join(PMASTER_POINTS)}), got {self.kill!r}")
            self._kill_target = target
            self.point = count if named else None
            if count == "copy":
                self._kill_at_copy = True
            elif not named:
                self._kill_at = int(count)
        self.owner: str | None = None
        self.sent = 0
        self._random = random.Random(self.seed)
        self._lock = threading.Lock()
        self._held: dict = {}  # control connection -> its messages held behind a delayed one

    def bind(self, owner: str) -> "Faults":
        """Name the process these faults act in (for ``kill``)."""
        self.owner = owner
        return self

    @classmethod
    def parse(cls, text: str) -> "Faults":
        """``drop=0.01,dup=0.01,delay=0.01,delay_ms=50,seed=7`` (any subset)."""
        fields = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name not in ("drop", "dup", "delay", "delay_ms", "seed", "kill", "ctl_drop", "ctl_dup",
                                       "ctl_delay"):
                raise ConfigError(f"{ENV_FAULTS}: cannot read {item!r}; expected drop=, dup=, delay=, delay_ms=, "
                                  "ctl_drop=, ctl_dup=, ctl_delay=, seed= or kill=")
            if name == "kill":
                fields[name] = value.strip()
                continue
            try:
                fields[name] = int(value) if name == "seed" else float(value)
            except ValueError:
                raise ConfigError(f"{ENV_FAULTS}: {name} must be a number, got {value!r}") from None
        return cls(**fields)

    @classmethod
    def from_env(cls) -> "Faults | None":
        text = os.environ.get(ENV_FAULTS, "").strip()
        return cls.parse(text) if text else None

    def send(self, conn, frames: list) -> None:
        """Send ``frames`` on ``conn``, or not, or twice, or later; or die first (``kill``)."""
        with self._lock:
            self.sent += 1
            if self._kill_at and self._kill_target == self.owner and self.sent >= self._kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # as a crash: nothing flushed, nothing closed
            draw = self._random.random()
        if draw < self.drop:
            self.dropped += 1
            return
        if draw < self.drop + self.dup:
            self.duplicated += 1
            conn.send(frames)
            conn.send(frames)
            return
        if draw < self.drop + self.dup + self.delay:
            self.delayed += 1
            # The caller may reuse its arrays once answered, which can be before this goes out.
            copies = [bytes(memoryview(f)) for f in frames]
            conn.reactor.call_later(self.delay_ms / 1000.0, self._send_late, conn, copies)
            return
        conn.send(frames)

    @property
    def on_control(self) -> bool:
        return bool(self.ctl_drop or self.ctl_dup or self.ctl_delay)

    def send_control(self, conn, frames: list) -> None:
        """A control message: sent, or lost with its connection, or sent twice, or held (with
        every later one on ``conn``) for ``delay_ms``."""
        copies = [bytes(memoryview(f)) for f in frames]  # (held ones go later; callers reuse buffers)
        with self._lock:
            held = self._held.get(conn)
            if held is not None:
                held.append(copies)
                return
            draw = self._random.random()
            if self.ctl_drop + self.ctl_dup <= draw < self.ctl_drop + self.ctl_dup + self.ctl_delay:
                self.delayed += 1
                self._held[conn] = [copies]
                conn.reactor.call_later(self.delay_ms / 1000.0, self._release_held, conn)
                return
        if draw < self.ctl_drop:
            self.dropped += 1
            error = PeerError(f"{conn.peer}: the connection was cut (PSLINK_FAULTS ctl_drop)")
            conn.close()
            handler = getattr(conn, "handler", None)
            if handler is not None:  # this end sees the reset too (a close of its own tells it nothing)
                conn.reactor.post(handler.on_close, conn, error)
            raise error
        conn.send(copies)
        if draw < self.ctl_drop + self.ctl_dup:
            self.duplicated += 1
            conn.send(copies)

    def _release_held(self, conn) -> None:
        with self._lock:
            held = self._held.pop(conn, [])
        for frames in held:
            try:
                conn.send(frames)
            except PeerError:
                return  # gone meanwhile: lost with it

    def copying(self) -> None:
        """An Aggregator is about to send a migration's copy: ``kill=NAME@copy`` dies here, after
        it handed the part over (the workers may already be told the new place) and before any
        byte of the copy leaves."""
        if self._kill_at_copy and self._kill_target == self.owner:
            os.kill(os.getpid(), signal.SIGKILL)

    def arm(self) -> None:
        """Make this process die at its named point (``kill=pmaster@POINT``), if it is the one
        named (:meth:`bind` first): :func:`reached` checks it where the point is."""
        global _armed
        if self.point is not None and self._kill_target == self.owner:
            _armed = (self.owner, self.point)

    @staticmethod
    def _send_late(conn, frames: list) -> None:
        try:
            conn.send(frames)
        except PeerError:
            pass  # gone meanwhile: as lost as a dropped message


_control: list = []  # [Faults or None]: this process's control-message faults, read once


def control() -> "Faults | None":
    """The control-message faults of this process (``PSLINK_FAULTS`` ctl_*), or None."""
    if not _control:
        found = Faults.from_env()
        _control.append(found if found is not None and found.on_control else None)
    return _control[0]


def reached(process: str, point: str) -> None:
    """``process`` (e.g. "pmaster") reached the named ``point``: it dies here, as a crash would,
    if ``kill=process@point`` was armed in it."""
    if _armed == (process, point):
        os.kill(os.getpid(), signal.SIGKILL)
