"""Fusion: many small data messages to one peer as one FUSED message (no I/O here).

A message of pslink costs its sender and its receiver a fixed price whatever its size: a system
call or two, a wake-up, the framing. For 4 KiB tensors that price is most of the work, so an
Agent sends the small requests it has for one Aggregator together (``fuse``), and the Aggregator
answers what it could answer while handling them together, too. Each item keeps its own header,
exactly as it would travel alone, so every request keeps its own id, round, result and error:
the receiver takes the items apart (:func:`fused_header`) and handles each with the handler it
has for a message of its own. It lives with the transports, not in wire/, because taking a
FUSED message apart answers the transports' Handler interface (each item's destinations, or
``DISCARD``).
"""

from __future__ import annotations

from typing import Any, Callable

from pslink.core.transport.base import DISCARD
from pslink.core.wire.protocol import MAX_FUSED_FRAMES, Op, encode
from pslink.errors import ProtocolError

MAX_FUSED_ITEMS = MAX_FUSED_FRAMES  # items per FUSED message (each has at most one payload)
# Only payloads below this size are fused: larger ones cross through shared-memory rings on one
# host (pslink.core.transport.shm.MIN_PAYLOAD), and elsewhere their own cost dwarfs a message's.
FUSE_BELOW = 64 << 10

#: ``item_header(conn, raw_header, sizes) -> (state, destinations)``: a handler's on_header.
ItemHeader = Callable[[Any, bytes, tuple], tuple]


def fuse(messages: list[list]) -> list:
    """One FUSED message carrying ``messages`` (each ``[header, *payloads]``), in their order."""
    return [encode(Op.FUSED, items=[m[0] for m in messages], np=[len(m) - 1 for m in messages]),
            *(p for m in messages for p in m[1:])]


def items_of(header: dict, sizes: tuple) -> list[tuple[bytes, tuple]]:
    """A decoded FUSED header's items: (raw header, its payloads' sizes), each checked as far as
    the FUSED message itself can be (the items' own headers are decoded by their handler)."""
    items, counts = header["items"], header["np"]
    if not 0 < len(items) <= MAX_FUSED_ITEMS or len(counts) != len(items):
        raise ProtocolError(f"FUSED message of {len(items)} items and {len(counts)} payload counts: it needs "
                            f"1..{MAX_FUSED_ITEMS} items and one count per item")
    if any(type(raw) is not bytes for raw in items):
        raise ProtocolError("FUSED message: every item must be a header's bytes")
    if any(type(c) is not int or not 0 <= c <= 1 for c in counts) or sum(counts) != len(sizes):
        raise ProtocolError(f"FUSED message: payload counts {counts} (0 or 1 each) do not match its "
                            f"{len(sizes)} payload frames")
    out, position = [], 0
    for raw, count in zip(items, counts):
        out.append((raw, tuple(sizes[position : position + count])))
        position += count
    return out


class Unfused:
    """``on_message``'s state for a FUSED message: each item's own state and payload count."""

    __slots__ = ("items",)

    def __init__(self, items: list[tuple[Any, int]]):
        self.items = items


def fused_header(conn, header: dict, sizes: tuple, item_header: ItemHeader) -> tuple[Unfused, list]:
    """Take a FUSED message apart: each item's state and destinations from ``item_header``, and
    one list of destinations for all payloads (fresh buffers where an item lets the transport
    allocate, or discards its payload)."""
    states, destinations = [], []
    for raw, item_sizes in items_of(header, sizes):
        state, dests = item_header(conn, raw, item_sizes)
        states.append((state, len(item_sizes)))
        if dests is None or dests is DISCARD:
            destinations += [bytearray(size) for size in item_sizes]
        else:
            destinations += list(dests)  # a Lent list as plain buffers: nothing here lies in a ring
    return Unfused(states), destinations


def fused_message(conn, state: Unfused, payloads: list, item_message: Callable[[Any, Any, list], None]) -> None:
    """Hand each item of a FUSED message, with its payloads, to ``item_message`` (on_message)."""
    position = 0
    for item_state, count in state.items:
        item_message(conn, item_state, payloads[position : position + count])
        position += count


class Cork:
    """Messages to send later as FUSED ones: an Aggregator's replies while it handles a FUSED
    request. ``send(conn, frames)`` is how a message finally goes."""

    __slots__ = ("queued",)

    def __init__(self):
        self.queued: dict[Any, list] = {}

    def add(self, conn, frames) -> bool:
        """Hold ``frames`` for ``conn`` if they may be fused (small); False: send them now (after
        what is held for ``conn``, which :meth:`release` sends first)."""
        if len(frames) > 2 or (len(frames) == 2 and memoryview(frames[1]).nbytes >= FUSE_BELOW):
            return False
        self.queued.setdefault(conn, []).append(frames)
        return True

    def release(self, conn, send: Callable[[Any, list], None]) -> None:
        """Send what is held for ``conn``: one message, or FUSED ones of up to MAX_FUSED_ITEMS."""
        messages = self.queued.pop(conn, None)
        if messages:
            for start in range(0, len(messages), MAX_FUSED_ITEMS):
                chunk = messages[start : start + MAX_FUSED_ITEMS]
                send(conn, chunk[0] if len(chunk) == 1 else fuse(chunk))

    def release_all(self, send: Callable[[Any, list], None]) -> None:
        for conn in list(self.queued):
            self.release(conn, send)
