"""The ps-lite scheduler's decisions, with no I/O: registration, ranks, barriers, failures.

The scheduler node (:class:`~pslink.pslite.node.Node` with role ``scheduler``) feeds this object
what arrives on its control connections and sends what it returns. Tests drive it directly.

- **Registration.** Servers and workers register with their address; once every expected node
  did (``DMLC_NUM_SERVER`` servers, none in service mode, and ``DMLC_NUM_WORKER`` workers),
  everyone gets the node table: that is ps-lite's start barrier. Ranks are the ones asked for
  (``PSLINK_PSLITE_RANK``, as ``pslink launch --pslite`` sets) or, for the others, the free ones
  in order of arrival. Node ids follow ps-lite: scheduler 1, server rank r is 8 + 2r, worker
  rank r is 9 + 2r; groups are sums of scheduler 1, servers 2 and workers 4.
- **Barriers** are counted per (group, customer id, final): a barrier completes when every live
  node of the group voted; a node voting twice waits for two completions.
- **Key ranges.** Server i holds keys ``[kMaxKey / n * i, kMaxKey / n * (i + 1))``.
- **Failures.** A node that disconnects (or goes silent past the heartbeat timeout) before it
  finalized fails everyone's waits with a message naming it, instead of leaving them hanging.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pslink.core import hosts

SCHEDULER, SERVER_GROUP, WORKER_GROUP = 1, 2, 4
K_MAX_KEY = (1 << 64) - 1  # ps-lite's kMaxKey
ROLE_BIT = {"scheduler": SCHEDULER, "server": SERVER_GROUP, "worker": WORKER_GROUP}
ALL_GROUPS = SCHEDULER + SERVER_GROUP + WORKER_GROUP


class Range:
    """A key range ``[begin, end)``, as ps-lite's ``Range``."""

    __slots__ = ("begin", "end")

    def __init__(self, begin: int, end: int):
        self.begin, self.end = int(begin), int(end)

    def size(self) -> int:
        return self.end - self.begin

    def __eq__(self, other) -> bool:
        return isinstance(other, Range) and (self.begin, self.end) == (other.begin, other.end)

    def __repr__(self) -> str:
        return f"Range({self.begin}, {self.end})"


def key_ranges(num_servers: int) -> list[Range]:
    """ps-lite's key ranges: server i holds ``[kMaxKey / n * i, kMaxKey / n * (i + 1))``."""
    n = num_servers
    return [Range(K_MAX_KEY // n * i, K_MAX_KEY // n * (i + 1)) for i in range(n)]


def node_id(role: str, rank: int) -> int:
    if role == "scheduler":
        return SCHEDULER
    return 8 + 2 * rank + (1 if role == "worker" else 0)


@dataclasses.dataclass
class Member:
    id: int
    role: str
    rank: int
    address: str
    pid: int
    origin: Any  # the control connection (opaque here)
    last_heard: float = 0.0
    state: str = "active"  # "finalizing" (voted the final barrier), "left" (no barrier) or "failed"

    @property
    def done(self) -> bool:
        """Its disconnect is expected (or already reported)."""
        return self.state != "active"

    def describe(self) -> str:
        name = "scheduler" if self.role == "scheduler" else f"{self.role} {self.rank}"
        return f"{name} (node id {self.id}, pid {self.pid}, {self.address})"

    def row(self) -> list:
        return [self.id, self.role, self.rank, self.address, self.pid]


@dataclasses.dataclass
class Out:
    """A message to send: to a member's node id, or (before ids exist) to an origin."""

    target: Any
    kind: str  # a wire.Kind name
    fields: dict
    customer: int = 0
    flags: int = 0
    by_origin: bool = False


class SchedulerState:
    def __init__(self, num_workers: int, num_servers: int, mode: str, address: str, pid: int,
                 local_origin: Any, now: float = 0.0, host_id: str = ""):
        self.host_id = host_id  # the scheduler's host: a node elsewhere must not advertise loopback
        self.num_workers = num_workers
        self.num_servers = num_servers  # as configured (DMLC_NUM_SERVER)
        self.expected_servers = 0 if mode == "service" else num_servers
        self.mode = mode
        self.members: dict[int, Member] = {
            SCHEDULER: Member(SCHEDULER, "scheduler", 0, address, pid, local_origin, now)
        }
        self.by_origin: dict[Any, int] = {local_origin: SCHEDULER}
        self.waiting: list[dict] = []  # registrations before the table is complete
        self.complete = False
        self.failed: str | None = None
        self.votes: dict[tuple, dict[int, int]] = {}

    # -- registration -------------------------------------------------------------------------

    def register(self, origin: Any, fields: dict, now: float) -> list[Out]:
        role = fields["role"]
        problem = self._refusal(fields)
        if problem is not None:
            return [Out(origin, "REFUSED", {"msg": problem}, by_origin=True)]
        self.waiting.append(dict(fields, origin=origin, heard=now))
        if len(self._waiting(role)) < self._expected(role):
            return []
        if len(self._waiting("server")) == self.expected_servers and len(self._waiting("worker")) == self.num_workers:
            return self._complete_table()
        return []

    def _expected(self, role: str) -> int:
        return self.expected_servers if role == "server" else self.num_workers

    def _waiting(self, role: str) -> list[dict]:
        return [w for w in self.waiting if w["role"] == role]

    def _refusal(self, fields: dict) -> str | None:
        role = fields["role"]
        who = f"a {role} at {fields['addr']} (pid {fields['pid']})"
        if self.failed is not None:
            return f"{who} cannot join: {self.failed}"
        if self.complete:
            return f"{who} registered after all {self.num_workers} worker(s) and {self.expected_servers} server(s) did"
        if fields["mode"] != self.mode:
            return (f"{who} runs in PSLINK_PSLITE_MODE={fields['mode']}, but the scheduler in {self.mode}: "
                    "set it the same on every node")
        if (fields["nw"], fields["ns"]) != (self.num_workers, self.num_servers):
            return (f"{who} has DMLC_NUM_WORKER={fields['nw']} DMLC_NUM_SERVER={fields['ns']}, but the "
                    f"scheduler has DMLC_NUM_WORKER={self.num_workers} DMLC_NUM_SERVER={self.num_servers}")
        unreachable = hosts.unreachable_reason(fields["addr"], fields.get("host_id"), self.host_id)
        if unreachable is not None:
            return (f"{who} ({fields['host']}) cannot join: {unreachable}; set DMLC_NODE_HOST to an address of its "
                    "host that the other nodes reach, or DMLC_INTERFACE to the interface that has one")
        if role == "server" and self.mode == "service":
            return (f"{who}: in service mode the Aggregator pool serves the workers, so no server process "
                    "may register (run servers only with PSLINK_PSLITE_MODE=classic)")
        expected = self._expected(role)
        if len(self._waiting(role)) >= expected:
            variable = "DMLC_NUM_SERVER" if role == "server" else "DMLC_NUM_WORKER"
            return f"{who} is one {role} too many: {variable}={expected}"
        rank = fields["rank"]
        if rank >= 0:
            if rank >= expected:
                return f"{who} asks for rank {rank} (PSLINK_PSLITE_RANK), but there are only {expected} {role}(s)"
            if any(w["rank"] == rank for w in self._waiting(role)):
                return f"{who} asks for rank {rank} (PSLINK_PSLITE_RANK), which another {role} already has"
        return None

    def _complete_table(self) -> list[Out]:
        for role in ("server", "worker"):
            entries = self._waiting(role)
            taken = {w["rank"] for w in entries if w["rank"] >= 0}
            free = iter(r for r in range(len(entries)) if r not in taken)
            for entry in entries:
                rank = entry["rank"] if entry["rank"] >= 0 else next(free)
                member = Member(node_id(role, rank), role, rank, entry["addr"], entry["pid"], entry["origin"],
                                entry["heard"])
                self.members[member.id] = member
                self.by_origin[member.origin] = member.id
        self.waiting = []
        self.complete = True
        table = [m.row() for m in sorted(self.members.values(), key=lambda m: m.id)]
        return [Out(m.id, "NODES", {"id": m.id, "nodes": table}) for m in self.members.values()]

    # -- barriers -------------------------------------------------------------------------------

    def group_members(self, group: int) -> list[Member]:
        return [m for m in self.members.values() if ROLE_BIT[m.role] & group]

    def barrier(self, origin: Any, group: int, customer: int, final: bool) -> list[Out]:
        member_id = self.by_origin.get(origin)
        if member_id is None or not self.complete:
            return [Out(origin, "REFUSED", {"msg": "a barrier before every node registered"}, by_origin=True)]
        member = self.members[member_id]
        if not ROLE_BIT[member.role] & group:
            return [Out(member_id, "REFUSED", {"msg": f"{member.describe()} is not in barrier group {group}"})]
        key = (group, customer, final)
        votes = self.votes.setdefault(key, {})
        votes[member_id] = votes.get(member_id, 0) + 1
        if final:
            member.state = "finalizing"
        return self._release_ready()

    def _release_ready(self) -> list[Out]:
        outs = []
        for (group, customer, final), votes in list(self.votes.items()):
            # Nodes that left without a barrier (or failed) are not waited for.
            members = [m for m in self.group_members(group) if m.state in ("active", "finalizing") or votes.get(m.id)]
            if not members or any(votes.get(m.id, 0) == 0 for m in members):
                continue
            for m in members:
                votes[m.id] -= 1
            if not any(votes.values()):
                del self.votes[(group, customer, final)]
            flags = 8 if final else 0  # wire.FINAL
            outs += [Out(m.id, "RELEASE", {"group": group}, customer=customer, flags=flags) for m in members]
        return outs

    def leave(self, origin: Any) -> list[Out]:
        member_id = self.by_origin.get(origin)
        if member_id is None:
            return []
        self.members[member_id].state = "left"
        return self._release_ready()

    # -- liveness -----------------------------------------------------------------------------

    def heard(self, origin: Any, now: float) -> None:
        member_id = self.by_origin.get(origin)
        if member_id is not None:
            self.members[member_id].last_heard = now
        for entry in self.waiting:
            if entry["origin"] is origin:
                entry["heard"] = now

    def lost(self, origin: Any, reason: str) -> list[Out]:
        """A control connection closed. Before the table is complete the registration is void
        (and everyone waiting hears why); after, a node that had not finalized failed."""
        if not self.complete:
            entry = next((w for w in self.waiting if w["origin"] is origin), None)
            if entry is None:
                return []
            self.waiting.remove(entry)
            message = (f"{entry['role']} at {entry['addr']} (pid {entry['pid']}) went away before every node "
                       f"registered: {reason}")
            self.failed = message
            outs = [Out(w["origin"], "REFUSED", {"msg": message}, by_origin=True) for w in self.waiting]
            self.waiting = []
            return outs + [Out(SCHEDULER, "NODE_FAILED", {"id": 1, "msg": message})]
        member_id = self.by_origin.pop(origin, None)
        if member_id is None:
            return []
        member = self.members[member_id]
        if member.done:
            return []
        return self._fail(member, f"{member.describe()} went away before finalize: {reason}")

    def expired(self, now: float, timeout: float) -> list[Out]:
        """Members silent for longer than ``timeout`` (PS_HEARTBEAT_TIMEOUT) have failed."""
        outs = []
        for member in list(self.members.values()):
            if member.id != SCHEDULER and not member.done and now - member.last_heard > timeout:
                outs += self._fail(member, f"{member.describe()} sent no heartbeat for {now - member.last_heard:.1f} s "
                                           f"(PS_HEARTBEAT_TIMEOUT={timeout:g})")
        return outs

    def _fail(self, member: Member, message: str) -> list[Out]:
        member.state = "failed"
        if self.failed is None:
            self.failed = message
        return [Out(m.id, "NODE_FAILED", {"id": member.id, "msg": message})
                for m in self.members.values() if m.id != member.id and (m.origin in self.by_origin)]

    def remaining(self) -> list[Member]:
        """Members whose control connection is still open (the scheduler waits for them to go)."""
        return [m for m in self.members.values() if m.id != SCHEDULER and m.origin in self.by_origin]

    def gone(self, origin: Any) -> None:
        self.by_origin.pop(origin, None)
