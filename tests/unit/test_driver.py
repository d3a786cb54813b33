"""Who drives a client's reactor (pslink.core.agent.driver, the Agent's and the ps-lite node's):
the waiting thread, else the background thread. A real reactor and real threads; every wait has a
timeout."""

from __future__ import annotations

import threading

import pytest

from pslink.core.agent.driver import Driver
from pslink.core.wire.loop import Reactor
from pslink.errors import ConfigError, PslinkTimeoutError


@pytest.fixture
def driver():
    """As a ps-lite node runs it: requests may come unasked."""
    reactor = Reactor("test driver")
    driver = Driver(reactor, "test", idle_poll=0.002, serves=True).start()
    yield driver
    driver.close()
    reactor.close()


def _count_notifies(driver: Driver) -> list:
    calls = []
    notify = driver._cv.notify

    def counted(n: int = 1) -> None:
        calls.append(n)
        notify(n)

    driver._cv.notify = counted
    return calls


def _answered_later(driver: Driver) -> threading.Event:
    """An event set by a callback on the reactor, as a reply's completion would be."""
    done = threading.Event()
    driver.reactor.post(done.set)
    return done


def test_a_wait_that_ends_leaves_the_background_thread_asleep(driver):
    # Waking it at the end of every wait cost more than the wait itself (ps-lite's 4K benchmark,
    # 4 in flight: 73 MB/s with the wake-up, 84-90 without); it looks again within idle_poll.
    notifies = _count_notifies(driver)
    for _ in range(50):
        done = _answered_later(driver)
        driver.wait(done.is_set, 5.0, lambda: "a reply")
    assert notifies == []


def test_a_wait_that_ends_with_callbacks_pending_hands_over_at_once(driver):
    # A callback's request has nobody else to wait for it: the background thread must take over.
    notifies = _count_notifies(driver)
    driver.callbacks_pending(+1)
    del notifies[:]
    # The reply is posted only once the wait began: posted before, the background thread can run
    # it first on a loaded machine, and a wait that finds its reply already there hands nothing over.
    done, asked = threading.Event(), []

    def answered() -> bool:
        if not asked:
            asked.append(True)
            driver.reactor.post(done.set)
            return False
        return done.is_set()

    driver.wait(answered, 5.0, lambda: "a reply")
    assert notifies == [1]
    driver.callbacks_pending(-1)


def test_the_background_thread_drives_once_the_waiter_left(driver):
    done = _answered_later(driver)
    driver.wait(done.is_set, 5.0, lambda: "a reply")
    ran_on = []
    later = threading.Event()

    def on_reactor() -> None:
        ran_on.append(threading.current_thread().name)
        later.set()

    driver.reactor.post(on_reactor)
    assert later.wait(5.0), "nobody drove the reactor after the waiter left"
    assert ran_on == ["pslink-test"]


def test_waiting_inside_a_callback_is_refused(driver):
    errors = []
    finished = threading.Event()

    def callback() -> None:
        try:
            driver.wait(lambda: False, 1.0, lambda: "a pull inside a callback")
        except ConfigError as exc:
            errors.append(exc)
        finished.set()

    driver.reactor.post(callback)
    assert finished.wait(5.0)
    assert len(errors) == 1 and "a pull inside a callback" in str(errors[0])


def test_a_client_with_nothing_in_flight_leaves_incoming_work_to_its_timers():
    # As an Agent runs it: with no request in flight and nobody waiting, the background thread
    # sleeps until a timer is due (heartbeats, probes) instead of polling every idle_poll; with
    # a request in flight it steps in once the client went quiet.
    reactor = Reactor("agent-like")
    in_flight = []
    driver = Driver(reactor, "agent", idle_poll=0.002, in_flight=lambda: bool(in_flight)).start()
    try:
        ran = threading.Event()
        reactor.call_later(0.05, ran.set)  # a due timer is driven
        assert ran.wait(5.0)
        in_flight.append(1)
        answered = threading.Event()
        reactor.post(answered.set)  # posted work is driven at once
        assert answered.wait(5.0)
        with pytest.raises(PslinkTimeoutError, match="a reply that never comes: not done after 0.05 s"):
            driver.wait(lambda: False, 0.05, lambda: "a reply that never comes")
        with pytest.raises(KeyError):
            driver.wait(lambda: False, 0.05, lambda: "x", on_timeout=lambda t: KeyError(t))
    finally:
        driver.close()
        reactor.close()
