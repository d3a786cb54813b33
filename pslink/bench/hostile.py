"""Hostile peers, for the tests and ``benchmarks/fuzz.py``: what an attacker on the network or on
the host can send to a listener of the service (pMaster, an Aggregator, a ps-lite node).

Each function plays one kind of attack against one ``tcp://HOST:PORT`` address and returns what
it saw; none needs a credential, and none sends anything but to that address. ``frames`` makes
malformed input deterministically from a seed, so a failing run can be replayed.
"""

from __future__ import annotations

import array
import os
import random
import socket
import struct

from pslink.core.transport.framing import _LOCATION, FRAMING_RING, FRAMING_RING_OPEN, FRAMING_VERSION, MAGIC, PREFIX
from pslink.core.transport.tcp import local_socket_name
from pslink.core.wire.protocol import Op, encode

RING_BYTES = 1 << 20
_RING_HEADER = 64  # shm.HEADER_BYTES: the counter's cache line before the data


def _host_port(address: str) -> tuple[str, int]:
    host, port = address[len("tcp://"):].rsplit(":", 1)
    return host.strip("[]"), int(port)


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes the connection within ``timeout`` (answers are read and dropped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except (TimeoutError, socket.timeout):
        return False


def shrunk_ring(address: str, seal: bool = False, lie: bool = False, timeout: float = 5.0) -> str:
    """The same-host ring attack: over the listener's local Unix socket, hand over a memfd ring
    declared 1 MiB, then shrink it to nothing (unless ``seal``: sealed against resizing as pslink's
    own are; ``lie``: sealed but smaller than declared from the start), then send a frame whose
    payload lies in the ring. A receiver that maps and reads it dies of SIGBUS. Returns
    ``"refused"`` (the local socket closed before the frame went), ``"closed"`` (the receiver closed
    the connection after it) or ``"kept"`` (still open after ``timeout``)."""
    host, port = _host_port(address)
    name = local_socket_name(host, port)
    if name is None:
        raise RuntimeError("no local sockets on this platform")
    fd = os.memfd_create("hostile-ring", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, _RING_HEADER + (RING_BYTES // 2 if lie else RING_BYTES))
        if seal or lie:
            import fcntl

            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(name)
            opening = PREFIX.pack(MAGIC, FRAMING_RING_OPEN, 0, 8) + RING_BYTES.to_bytes(8, "little")
            try:
                sock.sendmsg([opening], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            except (BrokenPipeError, ConnectionResetError):
                return "refused"
            # A request answered means the ring-opening frame before it was read (and the ring mapped).
            probe = encode(Op.STATUS, id=1)
            try:
                sock.sendall(PREFIX.pack(MAGIC, FRAMING_VERSION, 0, len(probe)) + probe)
                if not sock.recv(65536):
                    return "closed"
            except (BrokenPipeError, ConnectionResetError):
                return "closed"
            if not seal and not lie:
                os.ftruncate(fd, 0)
            header = encode(Op.STATUS, id=2)
            size = RING_BYTES // 2 + 4096  # past the end of the lying ring too
            frame = PREFIX.pack(MAGIC, FRAMING_RING, 1, len(header)) + _LOCATION.pack(size, 0) + header
            try:
                sock.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                return "closed"
            return "closed" if _closed_by_peer(sock, timeout) else "kept"
    finally:
        os.close(fd)


def frames(seed: int, count: int):
    """``count`` malformed messages of the kinds a fuzzer finds: garbage, truncated prefixes,
    huge declared header and payload sizes, valid framing around bad headers, and well-formed
    requests with wrong fields and forged tokens."""
    rng = random.Random(seed)
    ops = [int(op) for op in Op]
    for i in range(count):
        kind = i % 8
        if kind == 0:
            yield rng.randbytes(rng.randint(1, 2048))
        elif kind == 1:  # a prefix cut short
            yield PREFIX.pack(MAGIC, FRAMING_VERSION, 1, 100)[: rng.randint(1, PREFIX.size - 1)]
        elif kind == 2:  # a header of 4 GiB declared
            yield PREFIX.pack(MAGIC, FRAMING_VERSION, 0, 0xFFFFFFFF)
        elif kind == 3:  # payloads of 2**63 bytes declared
            yield PREFIX.pack(MAGIC, FRAMING_VERSION, 2, 4) + struct.pack("<QQ", 1 << 63, 1 << 62) + b"\x80" * 4
        elif kind == 4:  # valid framing, a header that is not msgpack
            body = rng.randbytes(rng.randint(1, 64))
            yield PREFIX.pack(MAGIC, FRAMING_VERSION, 0, len(body)) + body
        elif kind == 5:  # a bad framing version or magic
            yield PREFIX.pack(b"XX" if rng.random() < 0.5 else MAGIC, rng.randint(4, 255), 0, 0)
        else:  # well-formed messages with wrong fields, unknown ops and forged tokens
            fields = {"id": rng.randint(0, 1 << 40), "job": rng.choice(["", "x" * 300, "victim", "j\x00b"]),
                      "tok": rng.randbytes(16), "rank": rng.choice([-1, 0, 1 << 40, "r"]),
                      "key": rng.choice([0, "k", None, [1, 2]]), "num_workers": rng.choice([0, -5, 2, "two"]),
                      "agg": rng.choice(["agg-0", "agg-1", None]), "address": "tcp://127.0.0.1:1",
                      "stats": rng.choice([None, {}, [1]]), "shape": [rng.randint(-1, 1 << 40)]}
            header = encode(Op(rng.choice(ops)), **dict(rng.sample(sorted(fields.items()), rng.randint(0, 6))))
            if kind == 7:  # a valid version but garbage after it
                header = header[:-1] + rng.randbytes(4)
            yield PREFIX.pack(MAGIC, FRAMING_VERSION, 0, len(header)) + header


def send_frames(address: str, messages, per_connection: int = 50, timeout: float = 2.0) -> dict:
    """Send ``messages`` to ``address`` over TCP, ``per_connection`` on each connection (the
    listener may close it at the first bad one: then the rest go on a new one). Returns counts."""
    host, port = _host_port(address)
    sent = connections = dropped = 0
    sock = None
    for i, message in enumerate(messages):
        if sock is None or i % per_connection == 0:
            if sock is not None:
                sock.close()
            sock = socket.create_connection((host, port), timeout=timeout)
            connections += 1
        try:
            sock.sendall(message)
            sent += 1
        except OSError:
            dropped += 1
            sock.close()
            sock = None
    if sock is not None:
        sock.close()
    return {"sent": sent, "connections": connections, "dropped": dropped}


def churn(address: str, count: int, timeout: float = 2.0) -> int:
    """Connect and close ``count`` times (half of them after sending a partial frame); returns
    how many connections were made."""
    host, port = _host_port(address)
    partial = PREFIX.pack(MAGIC, FRAMING_VERSION, 0, 64) + b"\x80" * 10
    for i in range(count):
        with socket.create_connection((host, port), timeout=timeout) as sock:
            if i % 2:
                sock.sendall(partial)
    return count


def http_garbage(host: str, port: int, seed: int, count: int, timeout: float = 2.0) -> dict:
    """``count`` connections to an HTTP port, each sending one hostile request (random bytes, a
    request line or header past any limit, a truncated request, a method not served); returns how
    many were answered with a status line, closed without one, or timed out."""
    rng = random.Random(seed)
    outcomes = {"answered": 0, "closed": 0, "timeout": 0}
    for i in range(count):
        kind = i % 5
        if kind == 0:
            data = rng.randbytes(rng.randint(1, 4096))
        elif kind == 1:
            data = b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n"
        elif kind == 2:
            data = b"GET /metrics HTTP/1.1\r\n" + b"X-Junk: " + b"b" * 70_000 + b"\r\n\r\n"
        elif kind == 3:
            data = b"GET /metr"
        else:
            data = b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n" + rng.randbytes(512)
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)  # all it sends: the server must not wait for more
                answer = sock.recv(64)
            outcomes["answered" if answer.startswith(b"HTTP/") else "closed"] += 1
        except socket.timeout:
            outcomes["timeout"] += 1
        except OSError:
            outcomes["closed"] += 1
    return outcomes


__all__ = ["churn", "frames", "http_garbage", "send_frames", "shrunk_ring"]
