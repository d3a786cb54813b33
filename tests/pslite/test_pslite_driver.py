"""Who drives a ps-lite node's reactor (pslink.pslite.driver): the waiting thread, else the
background thread. A real reactor and real threads; every wait has a timeout."""

from __future__ import annotations

import threading

import pytest

from pslink.core.wire.loop import Reactor
from pslink.errors import ConfigError
from pslink.pslite.driver import Driver


@pytest.fixture
def driver():
    reactor = Reactor("test driver")
    driver = Driver(reactor, "test", idle_poll=0.002).start()
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
    done = _answered_later(driver)
    driver.wait(done.is_set, 5.0, lambda: "a reply")
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
    assert ran_on == ["pslite-test"]


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
