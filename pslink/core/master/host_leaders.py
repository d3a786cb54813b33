"""Where each host's leader takes its followers' pushes (host-local reduce,
:mod:`pslink.core.agent.host_reduce`), kept by pMaster for the job: the leader says where it
listens (HOST_LEADER with ``address``); a follower asks, and is answered as soon as its leader
has said, so workers of a host may start in any order. A leader that leaves, or the job's end,
answers those still asking with an error (they push on their own, through the pool)."""

from __future__ import annotations

from pslink.core.master.records import JobRecord
from pslink.core.transport.rpc import RpcPeer
from pslink.errors import ClosedError, ConfigError, MembershipError


class HostLeaders:
    def __init__(self, state):
        self.state = state
        self.places: dict[tuple[str, int], tuple[str, str]] = {}  # (job, leader) -> (address, host id)
        self.asking: dict[tuple[str, int], list[tuple[RpcPeer, dict]]] = {}

    def call(self, peer: RpcPeer, req: dict) -> None:
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        ident = (record.job, req["leader"])
        if req["leader"] not in record.membership:
            raise MembershipError(f"rank {req['leader']} is not a member of job {record.job!r}", job=record.job)
        if "address" not in req:
            place = self.places.get(ident)
            if place is None:
                self.asking.setdefault(ident, []).append((peer, req))  # answered once the leader says
            else:
                peer.reply(req, body={"address": place[0], "host_id": place[1]})
            return
        if req["leader"] != req["rank"]:
            raise ConfigError(f"rank {req['rank']} of job {record.job!r} cannot say where rank {req['leader']} "
                              "leads its host")
        place = self.places[ident] = (req["address"], req.get("host_id", ""))
        peer.reply(req, body={})
        for asking_peer, asking_req in self.asking.pop(ident, []):
            asking_peer.reply(asking_req, body={"address": place[0], "host_id": place[1]})

    def members_changed(self, record: JobRecord) -> None:
        for ident in [i for i in self.places if i[0] == record.job and i[1] not in record.membership]:
            del self.places[ident]  # a leader that left: its followers found out by its connection
        for ident in [i for i in self.asking if i[0] == record.job and i[1] not in record.membership]:
            for peer, req in self.asking.pop(ident):
                peer.error(req, MembershipError(f"rank {ident[1]} left job {record.job!r} before it led its host",
                                                job=record.job))

    def job_ended(self, record: JobRecord) -> None:
        for ident in [i for i in self.places if i[0] == record.job]:
            del self.places[ident]
        for ident in [i for i in self.asking if i[0] == record.job]:
            for peer, req in self.asking.pop(ident):
                peer.error(req, ClosedError(f"job {record.job!r} ended before rank {ident[1]} led its host"))
