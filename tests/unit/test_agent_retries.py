"""How an Agent paces a request an Aggregator keeps answering "ask pMaster again" (FencedError):
the first try at once, the next ones further apart, so that the MAX_MOVES tries wait out a
failover's promotion instead of spending themselves in a burst of round trips (issue 23)."""

from __future__ import annotations

from pslink.core.agent.requests import MAX_MOVES, fenced_pause


def test_a_fenced_request_asks_at_once_then_less_and_less_often_for_seconds_in_all():
    pauses = [fenced_pause(moves) for moves in range(1, MAX_MOVES + 1)]
    assert pauses[0] == 0.0  # a lease that ran out: pMaster knows the new place now
    assert all(a < b or b == 1.0 for a, b in zip(pauses[1:], pauses[2:]))  # growing, up to 1 s each
    assert max(pauses) == 1.0
    assert 2.0 <= sum(pauses) <= 5.0  # seconds of patience in all, then the error
