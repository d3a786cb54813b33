"""Named barriers of a job's workers (``Agent.barrier``), kept by pMaster: released once every
current member arrived; a rank that leaves meanwhile, or the job's end, fails its waiters."""

from __future__ import annotations

from pslink.core.master.host_leaders import HostLeaders
from pslink.core.master.jobs import JobRecord
from pslink.core.transport.rpc import RpcPeer
from pslink.errors import ClosedError, MembershipError


class Barriers:
    def __init__(self, state):
        self.state = state
        self.waiting: dict[tuple[str, str], dict[int, tuple[RpcPeer, dict]]] = {}
        self.leaders = HostLeaders(state)  # the other place a job's workers meet: their hosts' leaders

    def enter(self, peer: RpcPeer, req: dict) -> None:
        """BARRIER: a rank arrives (answered when the barrier is released)."""
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        ident = (record.job, req["name"])
        arrived = self.waiting.setdefault(ident, {})
        if req["rank"] in arrived:
            raise MembershipError(f"rank {req['rank']} entered barrier {req['name']!r} of job {record.job!r} twice")
        arrived[req["rank"]] = (peer, req)
        self._settle(record, ident)

    def members_changed(self, record: JobRecord) -> None:
        self.leaders.members_changed(record)
        for ident in [b for b in self.waiting if b[0] == record.job]:
            self._settle(record, ident)

    def job_ended(self, record: JobRecord) -> None:
        self.leaders.job_ended(record)
        for ident in [b for b in self.waiting if b[0] == record.job]:
            for peer, req in self.waiting.pop(ident).values():
                peer.error(req, ClosedError(f"job {record.job!r} ended during barrier {ident[1]!r}"))

    def _settle(self, record: JobRecord, ident: tuple) -> None:
        """Release a barrier once every current member arrived; a rank that left gets an error."""
        arrived = self.waiting[ident]
        for rank in [r for r in arrived if r not in record.membership]:
            gone_peer, gone_req = arrived.pop(rank)
            gone_peer.error(gone_req, MembershipError(f"rank {rank} left job {record.job!r} during barrier "
                                                      f"{ident[1]!r}", job=record.job))
        if set(arrived) >= record.membership.ranks:
            body = {"epoch": record.membership.epoch, "ranks": sorted(record.membership.ranks)}
            for waiting_peer, waiting_req in self.waiting.pop(ident).values():
                waiting_peer.reply(waiting_req, body=body)
