"""The futures torch code waits on: failed at their deadline, and a closed Deadlines leaves no
thread behind (a daemon thread that drops a torch future while the interpreter goes down
aborts the process: "terminate called without an active exception")."""

from __future__ import annotations

import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")

from pslink.torch.works import Collective, Deadlines, PslinkBackendError  # noqa: E402


def test_a_future_not_answered_in_time_fails_with_its_message():
    deadlines = Deadlines()
    try:
        collective = Collective(torch.futures.Future(), "allreduce not done within 0.05 s")
        deadlines.add(time.monotonic() + 0.05, collective)
        with pytest.raises(PslinkBackendError, match="allreduce not done within 0.05 s"):
            collective.future.wait()  # the deadline ends it (no timeout of its own)
        answered = Collective(torch.futures.Future(), "never shown")
        deadlines.add(time.monotonic() + 0.05, answered)
        answered.succeed([torch.ones(2)])
        assert torch.equal(answered.future.wait()[0], torch.ones(2))
    finally:
        deadlines.close()


def test_close_joins_the_thread_which_holds_no_future():
    deadlines = Deadlines()
    soon = Collective(torch.futures.Future(), "soon")
    deadlines.add(time.monotonic() + 0.01, soon)
    with pytest.raises(PslinkBackendError):
        soon.future.wait()
    later = Collective(torch.futures.Future(), "later")
    alone = sys.getrefcount(later)
    deadlines.add(time.monotonic() + 3600, later)  # the thread now waits for this one's deadline
    thread = deadlines._thread
    assert thread is not None and thread.is_alive()
    deadlines.close()
    assert not thread.is_alive(), "close() must join the deadline thread"
    assert sys.getrefcount(later) == alone, "close() dropped every reference to the futures it watched"
