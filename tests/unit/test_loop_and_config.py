"""The reactor (timers, posted callbacks, drive hand-over) and environment configuration."""

from __future__ import annotations

import threading
import time

import pytest

from pslink.core.config import resolve_float, resolve_int, resolve_str, resolve_token
from pslink.core.worker.connect import connect
from pslink.core.wire.loop import Reactor, ReactorThread
from pslink.errors import ConfigError


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_timers_fire_in_deadline_order_and_can_be_cancelled():
    clock = FakeClock()
    reactor = Reactor(clock=clock)
    fired = []
    reactor.call_later(2.0, fired.append, "b")
    reactor.call_later(1.0, fired.append, "a")
    cancelled = reactor.call_later(1.5, fired.append, "never")
    cancelled.cancel()
    with reactor._drive_lock:
        reactor.run_once(0)
        assert fired == []
        clock.now = 1.0
        reactor.run_once(0)
        assert fired == ["a"]
        clock.now = 5.0
        reactor.run_once(0)
    assert fired == ["a", "b"]
    assert reactor.next_deadline() is None
    reactor.close()


def test_cancelled_timers_do_not_pile_up_until_their_deadlines():
    # An RPC's timeout timer is cancelled by the reply at once; its deadline is far off. Ten
    # thousand such calls must not leave ten thousand timers (and what they hold) in the heap.
    clock = FakeClock()
    reactor = Reactor(clock=clock)
    fired = []
    late = reactor.call_later(100.0, fired.append, "late")
    for i in range(10_000):
        reactor.call_later(30.0 + i * 1e-4, fired.append, i).cancel()
    assert len(reactor._timers) < 600
    soon = reactor.call_later(1.0, fired.append, "soon")
    with reactor._drive_lock:
        clock.now = 200.0
        reactor.run_once(0)
    assert fired == ["soon", "late"] and not soon.cancelled and not late.cancelled
    assert reactor.next_deadline() is None
    reactor.close()


def test_posts_from_other_threads_wake_a_blocked_driver():
    reactor = Reactor()
    thread = ReactorThread(reactor).start()
    done = threading.Event()
    reactor.post(done.set)
    assert done.wait(5.0)
    thread.stop()
    reactor.close()


def test_a_failing_callback_does_not_stop_the_loop():
    reactor = Reactor()
    ran = []
    reactor.post(lambda: 1 / 0)
    reactor.post(ran.append, 1)
    with reactor._drive_lock:
        reactor.run_once(0)
    assert ran == [1]
    reactor.close()


def test_release_hands_the_drive_to_a_parked_thread():
    reactor = Reactor()
    assert reactor.try_drive()
    event = threading.Event()
    parked = threading.Thread(target=reactor.park, args=(event, 5.0))
    parked.start()
    while not reactor._parked:  # wait until it is parked (bounded by the join below)
        pass
    reactor.release()
    parked.join(5.0)
    assert event.is_set() and not parked.is_alive()
    reactor.close()


def test_a_thread_that_parks_after_the_driver_released_does_not_wait_out_its_timeout():
    # The driver released between the waiter's failed try_drive() and its park(): the release
    # nudged nobody, so a park that waited would sleep its whole timeout (50 ms in the Agent's
    # waits, with nobody reading the sockets: a quarter of a training step's exchanges did).
    reactor = Reactor()
    assert reactor.try_drive()
    reactor.release()
    event = threading.Event()
    started = time.monotonic()
    reactor.park(event, 5.0)
    assert time.monotonic() - started < 1.0
    assert not event.is_set() and not reactor._parked
    assert reactor.try_drive()  # the caller goes back to drive itself
    reactor.release()
    reactor.close()


def test_settings_come_from_arguments_then_environment():
    env = {"PSLINK_JOB": "envjob", "PSLINK_RANK": "1", "PSLINK_TIMEOUT": "2.5", "PSLINK_TOKEN": "0a0b"}
    assert resolve_str(None, "job", "PSLINK_JOB", environ=env) == "envjob"
    assert resolve_str("arg", "job", "PSLINK_JOB", environ=env) == "arg"
    assert resolve_int(None, "rank", "PSLINK_RANK", 0, environ=env) == 1
    assert resolve_float(None, "timeout", "PSLINK_TIMEOUT", 9.0, environ=env) == 2.5
    assert resolve_float(None, "timeout", "PSLINK_NOPE", 9.0, environ=env) == 9.0
    assert resolve_token(None, environ=env) == b"\x0a\x0b"


@pytest.mark.parametrize("call, match", [
    (lambda: resolve_str(None, "job", "PSLINK_JOB", environ={}), "job is not set: pass job= or set PSLINK_JOB"),
    (lambda: resolve_int(None, "rank", "PSLINK_RANK", 0, environ={"PSLINK_RANK": "one"}), "PSLINK_RANK='one' is not an integer"),
    (lambda: resolve_int(-1, "rank", "PSLINK_RANK", 0, environ={}), "rank= must be an integer >= 0"),
    (lambda: resolve_int(None, "num_workers", "PSLINK_NUM_WORKERS", 1, environ={"PSLINK_NUM_WORKERS": "0"}), "PSLINK_NUM_WORKERS must be an integer >= 1"),
    (lambda: resolve_float(None, "timeout", "PSLINK_TIMEOUT", 1.0, environ={"PSLINK_TIMEOUT": "soon"}), "PSLINK_TIMEOUT='soon' is not a number"),
    (lambda: resolve_token(None, environ={"PSLINK_TOKEN": "zz"}), "PSLINK_TOKEN must be the job token in hex"),
])
def test_bad_settings_name_the_variable(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_connect_checks_its_arguments_before_touching_the_network(monkeypatch):
    for name in ("PSLINK_JOB", "PSLINK_RANK", "PSLINK_NUM_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="rank is not set"):
        connect(job="j", num_workers=2)
    with pytest.raises(ConfigError, match="rank 2 is out of range for 2 workers"):
        connect(job="j", rank=2, num_workers=2)
    with pytest.raises(ConfigError, match="no scheme"):
        connect(job="j", rank=0, num_workers=1, master="127.0.0.1:7770")


def test_an_iteration_that_ran_posted_work_does_not_block():
    # A posted delivery can complete exactly what the driving thread waits for; the iteration
    # must return so that the caller re-checks, instead of sleeping out its whole timeout.
    reactor = Reactor()
    ran = []
    reactor.post(ran.append, "delivered")
    returned = threading.Event()

    def drive():
        with reactor._drive_lock:
            reactor.run_once(30.0)
        returned.set()

    thread = threading.Thread(target=drive)
    thread.start()
    assert returned.wait(5.0), "run_once blocked after running posted work"
    thread.join()
    assert ran == ["delivered"]
    reactor.close()
