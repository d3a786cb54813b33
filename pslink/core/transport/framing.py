"""The frames of pslink's native stream (``tcp.py``): their prefixes, as bytes and nothing else.

Each message on the byte stream is::

    b"PL" | framing version (u8) | payload count (u8) | header length (u32 LE)
    payload sizes (u64 LE each) | header bytes | payload bytes, back to back
"""

from __future__ import annotations

import array
import socket
import struct
from collections.abc import Sequence

MAGIC = b"PL"
FRAMING_VERSION = 1
# Between processes of one host (shm.py): a frame whose payloads may lie in the sender's ring
# (each payload's size is followed by its ring position, or INLINE), and the frame that hands
# the ring over (no payloads; an 8-byte header, the capacity; the descriptor rides with it).
FRAMING_RING = 2
FRAMING_RING_OPEN = 3
_LOCATION = struct.Struct("<QQ")
_FD_SPACE = socket.CMSG_SPACE(4 * array.array("i").itemsize)  # room for a few descriptors
PREFIX = struct.Struct("<2sBBI")
SIZE = struct.Struct("<Q")
_PREFIX0 = struct.Struct("<2sBBI")  # the common shapes, packed in one call
_PREFIX1 = struct.Struct("<2sBBIQ")
_PREFIX2 = struct.Struct("<2sBBIQQ")  # keys and values: every ps-lite KV message
# The sizes that follow PREFIX in the shapes above, by payload count (the reader's fast path).
_SIZES_OF = (None, struct.Struct("<Q"), struct.Struct("<QQ"))


def frame_prefix(header: bytes, payloads: Sequence) -> bytes:
    """The bytes that precede a header on the stream."""
    if not payloads:
        return _PREFIX0.pack(MAGIC, FRAMING_VERSION, 0, len(header))
    if len(payloads) == 1:
        return _PREFIX1.pack(MAGIC, FRAMING_VERSION, 1, len(header), memoryview(payloads[0]).nbytes)
    if len(payloads) == 2:
        return _PREFIX2.pack(MAGIC, FRAMING_VERSION, 2, len(header), memoryview(payloads[0]).nbytes,
                             memoryview(payloads[1]).nbytes)
    sizes = [memoryview(p).nbytes for p in payloads]
    return PREFIX.pack(MAGIC, FRAMING_VERSION, len(sizes), len(header)) + b"".join(
        SIZE.pack(s) for s in sizes
    )
