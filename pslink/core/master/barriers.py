"""Named barriers of a job's workers (``Agent.barrier``), kept by pMaster: released once every
current member arrived; a rank that leaves meanwhile, or the job's end, fails its waiters.

A barrier survives a lost control connection: a BARRIER says how often its worker passed that
barrier (``n``), so one asked again on a new connection after its release was lost with the old
one is answered with that release (it would otherwise wait at a barrier the others have left,
and they for it in their next rounds: the chaos run's elastic join), and one asked again while
its first entry still waits takes that entry's place."""

from __future__ import annotations

from pslink.core.master.host_leaders import HostLeaders
from pslink.core.master.records import JobRecord
from pslink.core.transport.rpc import RpcPeer
from pslink.errors import ClosedError, MembershipError


class Barriers:
    def __init__(self, state):
        self.state = state
        self.waiting: dict[tuple[str, str], dict[int, tuple[RpcPeer, dict]]] = {}
        # (job, barrier, rank) -> (the Agent, its count of passes then, the release) of its last pass
        self.passed: dict[tuple[str, str, int], tuple[str, int, dict]] = {}
        self.leaders = HostLeaders(state)  # the other place a job's workers meet: their hosts' leaders

    def enter(self, peer: RpcPeer, req: dict) -> None:
        """BARRIER: a rank arrives (answered when the barrier is released)."""
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        rank, ident = req["rank"], (record.job, req["name"])
        last = self.passed.get((*ident, rank))
        if last is not None and req.get("n") is not None and last[:2] == (self._agent(record, rank), req["n"]):
            peer.reply(req, body=last[2])  # released already: the answer was lost with its connection
            return
        arrived = self.waiting.setdefault(ident, {})
        if rank in arrived and not arrived[rank][0].conn.closed:
            raise MembershipError(f"rank {rank} entered barrier {req['name']!r} of job {record.job!r} twice")
        arrived[rank] = (peer, req)  # (or in place of an entry whose connection was lost)
        self._settle(record, ident)

    @staticmethod
    def _agent(record: JobRecord, rank: int) -> str:
        worker = record.workers.get(rank)
        return worker.agent if worker is not None else ""

    def members_changed(self, record: JobRecord) -> None:
        self.leaders.members_changed(record)
        for ident in [b for b in self.waiting if b[0] == record.job]:
            self._settle(record, ident)

    def job_ended(self, record: JobRecord) -> None:
        self.leaders.job_ended(record)
        for ident in [b for b in self.waiting if b[0] == record.job]:
            for peer, req in self.waiting.pop(ident).values():
                peer.error(req, ClosedError(f"job {record.job!r} ended during barrier {ident[1]!r}"))
        for passed in [p for p in self.passed if p[0] == record.job]:
            del self.passed[passed]

    def _settle(self, record: JobRecord, ident: tuple) -> None:
        """Release a barrier once every current member arrived; a rank that left gets an error."""
        arrived = self.waiting[ident]
        for rank in [r for r in arrived if r not in record.membership]:
            gone_peer, gone_req = arrived.pop(rank)
            gone_peer.error(gone_req, MembershipError(f"rank {rank} left job {record.job!r} during barrier "
                                                      f"{ident[1]!r}", job=record.job))
        if set(arrived) >= record.membership.ranks:
            body = {"epoch": record.membership.epoch, "ranks": sorted(record.membership.ranks)}
            for rank, (waiting_peer, waiting_req) in self.waiting.pop(ident).items():
                if waiting_req.get("n") is not None:
                    self.passed[(*ident, rank)] = (self._agent(record, rank), waiting_req["n"], body)
                waiting_peer.reply(waiting_req, body=body)
