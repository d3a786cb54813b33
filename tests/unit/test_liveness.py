"""pMaster's probe of an Aggregator whose control connection closed: a process serving at the
address answers its PING; a dead port or no answer is said, each within the timeout."""

from __future__ import annotations

import socket
import threading

from pslink.core.aggregator.process import Aggregator
from pslink.core.master.aggregator_probe import Prober
from pslink.core.transport import Transports
from pslink.core.wire.loop import Reactor, ReactorThread
from pslink.core.wire.protocol import DEFAULT_LIMITS


def _probe(prober: Prober, address: str) -> str | None:
    said, answered = [], threading.Event()

    def done(problem):
        said.append(problem)
        answered.set()

    prober.probe(address, 2.0, done)
    assert answered.wait(10), f"no answer from the probe of {address}"
    return said[0]


def test_a_serving_aggregator_answers_and_a_dead_or_silent_port_does_not():
    transports = Transports()
    reactor = Reactor("probe-test")
    thread = ReactorThread(reactor).start()
    aggregator = Aggregator(None, "tcp://127.0.0.1:0", name="agg-0", transports=transports).start()
    silent = socket.socket()  # accepts connections (the kernel does) but never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nobody listens there
    try:
        prober = Prober(transports, reactor, DEFAULT_LIMITS)
        assert _probe(prober, aggregator.address) is None
        assert not prober.endpoint.peers  # the probe's connection is forgotten once answered
        assert "refused" in _probe(prober, f"tcp://127.0.0.1:{dead_port}")
        assert "no answer within 2.0 s" in _probe(prober, f"tcp://127.0.0.1:{silent.getsockname()[1]}")
    finally:
        silent.close()
        aggregator.stop()
        thread.stop()
        reactor.close()
        transports.close()
