"""What moving a part to another Aggregator costs its job: one model, used by the control plane
to decide (how much one migration may carry, when a pack or a revert pays for its moves) and by
the trace-driven simulator to delay the jobs it moves. Pure: numbers in, numbers out.

A move is a pre-copy followed by a switch (issue 54):

1. **Pre-copy**, while the job keeps training. The source sends the part's state (weights and
   optimizer state: ``state_bytes``) to the target at ``copy_bandwidth``, then forwards each
   later round's sum (the part's bytes once: ``round_bytes``) until the target has every round.
   The job waits for none of it. It shares its source Aggregator's CPU with the copy, whose
   sending costs ``copy_cpu_per_byte`` a byte; a CPU second of it delays the job only where it
   falls in the job's communication, the share of its iteration outside its compute gap
   (exposure ``1 - gap / iteration``). On a slow link the pre-copy lasts longer and the slowdown
   while it lasts is smaller; what it adds up to grows only by the rounds forwarded meanwhile.
2. **Switch** at a round boundary. No tensor bytes: the routing changes (the workers learn the
   new place from that round's replies) and the workers' first request goes to the new place,
   ``switch_latency``. The round just closed is the last one forwarded: its sum must land at the
   target before the workers push the next round, within their compute gap, or the job waits
   for the rest.

The job's delay for one migration (a batch of parts that switch together)::

    seed      = copy_latency + state_bytes / copy_bandwidth
    forward   = copy_latency + round_bytes / copy_bandwidth        (one round's sum)
    catch-up  = seed x forward / (iteration - forward)              (rounds closing meanwhile)
    rounds    = ceil((seed + catch-up) / iteration)                 (forwarded before the switch)
    pre-copy  = copy_cpu_per_byte x (state_bytes + rounds x round_bytes) x (1 - gap / iteration)
    switch    = switch_latency + max(0, forward - gap)
    delay     = pre-copy + switch

A link too slow to forward a round within an iteration (``forward >= iteration``) never lets the
target catch up: the switch comes right after the seed and waits for every round behind,
``max(0, (ceil(seed / iteration) + 1) x forward - gap)``. ``copy_bandwidth`` 0 means copies take no time
(placement tests; the simulator's untimed moves).

Before issue 54 the whole state was copied after the job's round closed and the job's next round
waited for it: ``copy_latency + bytes / copy_bandwidth`` a migration, every byte on the job's
critical path.
"""

from __future__ import annotations

import dataclasses
import math

from pslink.errors import ConfigError

DEFAULT_COPY_BANDWIDTH = 1e9  # bytes per second a migration's copy crosses at
DEFAULT_COPY_LATENCY = 0.002  # seconds each message of a copy costs besides its bytes (the seed, a forwarded round)
#: Seconds the switch costs the job: the routing change and the workers' first request to the new
#: place (two messages of the size of a control message, and a connection where there was none).
DEFAULT_SWITCH_LATENCY = 0.002
DEFAULT_COPY_CPU_PER_BYTE = 5e-10  # CPU seconds the source spends sending a byte (a socket copy)
#: A part's state over its bytes when the optimizer is not known: weights and as much again of
#: optimizer state (momentum SGD; Adam keeps two slots, plain summing none), as the migration
#: throttle counts it.
DEFAULT_STATE_FACTOR = 2.0
#: The share of an iteration taken as the workers' compute when they do not report it.
UNREPORTED_COMPUTE_SHARE = 0.5


def compute_gap(iteration: float | None, work: float | None = None) -> float:
    """The time between a round's replies and the workers' next pushes: their own work per
    iteration where reported, else half the iteration; 0 (nothing hidden) when neither is known."""
    if work is not None:
        return max(0.0, work)
    return iteration * UNREPORTED_COMPUTE_SHARE if iteration else 0.0


@dataclasses.dataclass(frozen=True)
class MoveCost:
    """The settings of the model (module docstring): every field a number >= 0."""

    copy_bandwidth: float = DEFAULT_COPY_BANDWIDTH
    copy_latency: float = DEFAULT_COPY_LATENCY
    switch_latency: float = DEFAULT_SWITCH_LATENCY
    copy_cpu_per_byte: float = DEFAULT_COPY_CPU_PER_BYTE

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{field.name} must be a finite number >= 0, got {value!r}"
                                  + (" (0 bytes/s: copies take no time)" if field.name == "copy_bandwidth" else ""))

    # -- the parts of a move --------------------------------------------------------------------

    def _crossing(self, nbytes: float) -> float:
        if not self.copy_bandwidth:
            return 0.0
        return self.copy_latency + nbytes / self.copy_bandwidth

    def seed_seconds(self, state_bytes: float) -> float:
        """How long the part's state takes to cross (the job trains meanwhile)."""
        return self._crossing(state_bytes)

    def forward_seconds(self, round_bytes: float) -> float:
        """How long one round's sum takes to reach the target."""
        return self._crossing(round_bytes)

    def rounds_behind(self, state_bytes: float, round_bytes: float, iteration: float | None) -> int:
        """Rounds the job closes during the pre-copy: each is forwarded to the target."""
        precopy = self.precopy_seconds(state_bytes, round_bytes, iteration)
        return math.ceil(precopy / iteration) if precopy > 0 and iteration else 0

    def keeps_up(self, round_bytes: float, iteration: float | None) -> bool:
        """Whether forwarding a round takes less than the job takes to make one."""
        return not iteration or self.forward_seconds(round_bytes) < iteration

    def precopy_seconds(self, state_bytes: float, round_bytes: float, iteration: float | None) -> float:
        """From the start of the copy until the target has every round closed so far: the seed,
        then the rounds behind it (the rounds closing meanwhile included, while forwarding keeps
        up; a link that does not keep up switches right after the seed)."""
        seed = self.seed_seconds(state_bytes)
        forward = self.forward_seconds(round_bytes)
        if not iteration or not self.keeps_up(round_bytes, iteration):
            return seed
        return seed + seed * forward / (iteration - forward)

    # -- what the job pays -----------------------------------------------------------------------

    def precopy_delay(self, state_bytes: float, round_bytes: float, iteration: float | None, gap: float) -> float:
        """Seconds the pre-copy adds to the job: the source's CPU for what it sends, where it
        falls in the job's communication."""
        if not self.copy_bandwidth:
            return 0.0
        sent = state_bytes + self.rounds_behind(state_bytes, round_bytes, iteration) * round_bytes
        exposure = 1.0 - min(1.0, gap / iteration) if iteration else 1.0
        return self.copy_cpu_per_byte * sent * exposure

    def switch_stall(self, round_bytes: float, gap: float, iteration: float | None = None,
                     state_bytes: float = 0.0) -> float:
        """Seconds the job's round waits at the switch: its fixed cost, plus what of the last
        forwarded round (every round behind, where forwarding does not keep up) outlasts the
        workers' compute gap."""
        if not self.copy_bandwidth:
            return self.switch_latency
        waiting = self.forward_seconds(round_bytes)
        if not self.keeps_up(round_bytes, iteration):
            waiting *= self.rounds_behind(state_bytes, round_bytes, iteration) + 1
        return self.switch_latency + max(0.0, waiting - gap)

    def delay(self, state_bytes: float, round_bytes: float, iteration: float | None, gap: float) -> float:
        """Everything one migration of ``round_bytes`` of parts (``state_bytes`` of state) adds to
        its job's time."""
        return (self.precopy_delay(state_bytes, round_bytes, iteration, gap)
                + self.switch_stall(round_bytes, gap, iteration, state_bytes))

    def batch_bytes(self, gap: float) -> int:
        """The most bytes of parts one migration may switch at once: those whose last forwarded
        round lands within the workers' compute gap (0: no bound of its own, the throttle's)."""
        if not self.copy_bandwidth:
            return 0
        return int(max(0.0, gap - self.copy_latency) * self.copy_bandwidth)

