"""The elastic World's check of a fresh process (pslink.core.worker.elastic), with a fake session."""

from __future__ import annotations

import pytest

from pslink.core.worker.elastic import World
from pslink.errors import PeerError


class FakeAgent:
    def __init__(self, answers: list):
        self.rank, self.late, self.keys_known = 1, False, False
        self.answers = answers  # what job_keys() gives, in turn (an exception is raised)

    def job_keys(self):
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class FakeSession:
    def __init__(self, agent):
        self.agent, self.reconnects = agent, 0

    def reconnect(self):
        self.reconnects += 1
        self.agent = FakeAgent([])
        self.agent.late = True  # registered anew: a newcomer


def test_a_fresh_process_whose_check_failed_is_checked_again_and_registers_anew():
    """Found by the chaos run with control faults: a replacement for a dead worker lost its
    pMaster connection while it asked for the job's keys. The check counted as made, so the
    next reset went on with the Agent pMaster took for the dead worker (at its rounds), and the
    job waited for it until the timeout. Now a failed check is made again."""
    session = FakeSession(FakeAgent([PeerError("pMaster at tcp://10.77.0.1:7770 closed the connection"),
                                     [{"key": "w"}]]))
    world = World(session)
    with pytest.raises(PeerError):
        world._check_fresh()
    assert world.checked_agent is None
    world._check_fresh()
    assert session.reconnects == 1 and world.checked_agent is session.agent
    world._check_fresh()  # checked: not again
    assert session.reconnects == 1


def test_a_fresh_process_of_a_job_with_no_keys_yet_is_no_newcomer():
    session = FakeSession(FakeAgent([[]]))
    world = World(session)
    world._check_fresh()
    assert session.reconnects == 0 and world.checked_agent is session.agent
