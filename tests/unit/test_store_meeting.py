"""The groups' meeting in shared storage (a directory here): who is late, and the sync it meets."""

import os
import threading
import time

import numpy as np

from pslink.core.worker.meeting import StoreMeeting


def wait_for_file(path: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def test_a_founding_group_slower_to_start_meets_the_first_sync_the_others_wait_at(tmp_path):
    # Group 0 reaches its first sync before group 1 has started: sync 1's folder exists when
    # group 1 starts. Group 1 is a founder, awaited there: not late; both average at sync 1.
    # (Before: group 1 took itself for a latecomer and went to sync 2, its weights not averaged.)
    first = StoreMeeting(str(tmp_path), "job", 0, 2, timeout=30)
    out = {}
    a = np.full(4, 1.0, np.float32)
    thread = threading.Thread(target=lambda: out.setdefault("sizes", first.average(["w"], [a], 3)))
    thread.start()
    wait_for_file(str(tmp_path / "job" / "sync-00000001" / "g0.npz"))
    second = StoreMeeting(str(tmp_path), "job", 1, 2, timeout=30)
    assert not second.late
    b = np.full(4, 3.0, np.float32)
    assert second.average(["w"], [b], 2) == {0: 3, 1: 2}
    thread.join(30)
    assert out["sizes"] == {0: 3, 1: 2}
    np.testing.assert_array_equal(a, np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(b, a)
    assert first.index == second.index == 1


def test_a_group_is_late_once_the_others_synced_without_it(tmp_path):
    job = tmp_path / "job"
    (job / "sync-00000001").mkdir(parents=True)
    assert StoreMeeting(str(tmp_path), "job", 2, 2, timeout=30).late  # not a founder: sync 1 is under way
    (job / "sync-00000002").mkdir()
    late = StoreMeeting(str(tmp_path), "job", 1, 2, timeout=30)  # a founder: sync 1 was done without it
    assert late.late and late.index == 2
