"""Hostile peers against a real service (``pslink service up`` in a subprocess): attacks from the
host (shared-memory rings, another user on the local socket) and from the network (malformed
frames, connection churn). Every process must live, and a job beside them must be served."""

from __future__ import annotations

import os

import numpy as np
import psutil
import pytest

import pslink
from pslink.bench import hostile
from pslink.core.transport.options import rings_supported
from tests.integration.test_processes import service_up, status_of  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

NOBODY = 65534


def _listeners(master: str) -> dict[str, str]:
    """pMaster's address and every Aggregator's, by name."""
    found = {"pmaster": master}
    found.update({a["name"]: a["address"] for a in status_of(master)["aggregators"]})
    return found


def _pids(proc) -> list[int]:
    return [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]


def _trains(master: str, job: str) -> None:
    with pslink.connect(job, 0, 1, master=master, timeout=20) as agent:
        agent.init("w", np.zeros(4096, np.float32)).wait()
        for _ in range(5):
            np.testing.assert_array_equal(agent.pushpull("w", np.ones(4096, np.float32)).wait(), np.ones(4096))


@pytest.mark.skipif(not rings_supported(), reason="no shared-memory rings on this platform")
def test_a_ring_that_can_shrink_or_lies_about_its_size_is_refused_and_every_process_lives(service_up):
    # Before rings had to be sealed, this killed the Aggregator and then pMaster with SIGBUS.
    master, proc = service_up
    pids = _pids(proc)
    for name, address in _listeners(master).items():
        assert hostile.shrunk_ring(address) == "closed", name
        assert hostile.shrunk_ring(address, lie=True) == "closed", name
        assert hostile.shrunk_ring(address, seal=True) == "kept", name  # as pslink's own rings are: served
    assert all(psutil.pid_exists(pid) for pid in pids)
    _trains(master, "after-rings")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_is_refused_on_the_local_socket_and_every_process_lives(service_up):
    master, proc = service_up
    pids = _pids(proc)
    for name, address in _listeners(master).items():
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's outcome travels through the pipe
            code = 1
            try:
                os.close(read)
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                os.write(write, hostile.shrunk_ring(address, seal=True).encode())  # a well-made ring
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as pipe:
            outcome = pipe.read()
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # Served from the service's own user (the test above); from another, the listener closes
        # the connection at once and the ring never reaches it.
        assert outcome in ("refused", "closed"), (name, outcome)
    assert all(psutil.pid_exists(pid) for pid in pids)
    _trains(master, "after-nobody")
