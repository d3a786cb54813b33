"""Who an Agent is in its job: :class:`Seat` (no I/O)."""

from __future__ import annotations


class Seat:
    """This worker's place in its job: who it is, the job's token (pMaster gives it at
    registration) and the members as last heard. One object the Agent's collaborators share."""

    __slots__ = ("job", "rank", "num_workers", "token", "host_id", "members")

    def __init__(self, job: str, rank: int, num_workers: int, token: bytes, host_id: str):
        self.job, self.rank, self.num_workers, self.token, self.host_id = job, rank, num_workers, token, host_id
        self.members: dict = {}  # {"ranks": [...], "epoch": n}, as pMaster last said

    def fields(self) -> dict:
        """The fields every request to pMaster about the job carries."""
        return {"job": self.job, "tok": self.token, "rank": self.rank}

    def update_members(self, membership: dict | None) -> None:
        if membership and "ranks" in membership and membership.get("epoch", -1) >= self.members.get("epoch", -1):
            self.members = {"ranks": list(membership["ranks"]), "epoch": membership["epoch"]}
            self.num_workers = len(self.members["ranks"])

    def __str__(self) -> str:
        return f"{self.job}/{self.rank}"
