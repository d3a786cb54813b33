"""FUSED messages (pslink.core.transport.fused): built, taken apart and checked without I/O."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.core.transport import DISCARD
from pslink.core.transport.fused import FUSE_BELOW, MAX_FUSED_ITEMS, Cork, Unfused, fuse, fused_header, fused_message
from pslink.core.wire.protocol import Op, decode, encode
from pslink.errors import ProtocolError


def message(i: int, payload: bool = True) -> list:
    header = encode(Op.REPLY, id=i, rnd=1)
    return [header, np.full(4, i, np.float32)] if payload else [header]


def sizes_of(frames: list) -> tuple:
    return tuple(memoryview(p).nbytes for p in frames[1:])


def test_items_keep_their_headers_payloads_and_order():
    messages = [message(1), message(2, payload=False), message(3)]
    frames = fuse(messages)
    header = decode(frames[0], sizes_of(frames))
    assert header["op"] is Op.FUSED and header["np"] == [1, 0, 1]
    seen = []

    def item_header(conn, raw, sizes):
        item = decode(raw, sizes)
        return item, [bytearray(s) for s in sizes]

    state, dests = fused_header(None, header, sizes_of(frames), item_header)
    for dest, payload in zip(dests, frames[1:]):
        dest[:] = memoryview(payload).cast("B")
    fused_message(None, state, dests, lambda conn, item, payloads: seen.append((item["id"], [bytes(p) for p in payloads])))
    assert [i for i, _ in seen] == [1, 2, 3]
    assert seen[1][1] == [] and np.frombuffer(seen[2][1][0], np.float32).tolist() == [3, 3, 3, 3]


def test_an_item_that_discards_or_lets_the_transport_allocate_gets_buffers_of_its_own():
    frames = fuse([message(1), message(2)])
    header = decode(frames[0], sizes_of(frames))
    answers = iter([DISCARD, None])
    state, dests = fused_header(None, header, sizes_of(frames), lambda conn, raw, sizes: (raw, next(answers)))
    assert isinstance(state, Unfused) and [len(d) for d in dests] == [16, 16]


@pytest.mark.parametrize("change, error", [
    (lambda h: {**h, "np": h["np"][:-1]}, "one count per item"),
    (lambda h: {**h, "items": [], "np": []}, "1..128 items"),
    (lambda h: {**h, "np": [2, 0]}, "do not match"),
    (lambda h: {**h, "items": ["text", h["items"][1]]}, "a header's bytes"),
])
def test_a_malformed_fused_message_names_what_is_wrong(change, error):
    frames = fuse([message(1), message(2)])
    header = change(decode(frames[0], sizes_of(frames)))
    with pytest.raises(ProtocolError, match=error):
        fused_header(None, header, sizes_of(frames), lambda conn, raw, sizes: (raw, None))


def test_only_a_fused_message_carries_more_frames_than_the_limit():
    frames = fuse([message(i) for i in range(MAX_FUSED_ITEMS)])
    assert decode(frames[0], sizes_of(frames))["op"] is Op.FUSED
    with pytest.raises(ProtocolError, match="REPLY has 9 payload frames; the limit is 8"):
        decode(encode(Op.REPLY, id=1), (4,) * 9)
    with pytest.raises(ProtocolError, match="129 payload frames"):
        decode(frames[0], (16,) * (MAX_FUSED_ITEMS + 1))


def test_a_cork_holds_small_messages_per_peer_and_sends_them_fused_in_order():
    cork, sent = Cork(), []
    for i in range(MAX_FUSED_ITEMS + 2):
        assert cork.add("a", message(i))
    assert cork.add("b", message(500))
    big = [encode(Op.REPLY, id=900), np.zeros(FUSE_BELOW // 4, np.float32)]
    assert not cork.add("a", big)  # large: sent by the caller, after what is held for "a"
    cork.release("a", lambda conn, frames: sent.append((conn, frames)))
    assert len(sent) == 2  # 130 messages: one FUSED message of 128 and one of 2
    first = decode(sent[0][1][0], sizes_of(sent[0][1]))
    assert first["op"] is Op.FUSED and len(first["items"]) == MAX_FUSED_ITEMS
    assert decode(first["items"][0], (16,))["id"] == 0
    cork.release_all(lambda conn, frames: sent.append((conn, frames)))
    assert sent[-1][0] == "b" and decode(sent[-1][1][0], (16,))["id"] == 500  # one message: sent as it is
