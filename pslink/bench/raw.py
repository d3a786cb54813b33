"""Raw socket baselines (no pslink code), measured in the same run as pslink's figures."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

CHUNK = 4 << 20
WAIT = 30.0  # seconds any accept, receive or helper process may take past its own work


def _reap(proc, timeout: float = WAIT) -> None:
    """Join a helper process; kill it (by its pid) if it has not ended by then."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def stream_send(host: str, port: int, seconds: float) -> None:
    """Send to ``host:port`` as fast as the socket takes it, for ``seconds``."""
    chunk = memoryview(bytearray(CHUNK))
    with socket.create_connection((host, port), timeout=30) as s:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(chunk)


def stream_receive(server: socket.socket) -> float:
    """Accept one stream on the listening ``server`` and read it to its end: MB/s, timed from the
    first byte (not from the sender's start)."""
    server.settimeout(WAIT)
    conn, _ = server.accept()
    conn.settimeout(WAIT)  # a sender that stalls fails the measurement instead of hanging it
    buf = memoryview(bytearray(CHUNK))
    total, start = 0, None
    with conn:
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            if start is None:
                start = time.perf_counter()
                continue
            total += n
    return total / (time.perf_counter() - start) / 1e6


def _stream_sender(port: int, seconds: float) -> None:
    stream_send("127.0.0.1", port, seconds)


def tcp_stream(seconds: float) -> float:
    """MB/s of one Python socket stream between two processes on loopback."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        sender = mp.get_context("spawn").Process(target=_stream_sender, args=(server.getsockname()[1], seconds + 0.3))
        sender.start()
        try:
            mbps = stream_receive(server)
        finally:
            _reap(sender, seconds + WAIT)
    return mbps


def recv_exact(conn: socket.socket, view: memoryview, spin: float = 0.0) -> bool:
    """Fill ``view``; with ``spin`` > 0, poll that long before each blocking receive."""
    got = 0
    while got < len(view):
        n = None
        if spin:
            deadline = time.perf_counter() + spin
            while n is None and time.perf_counter() < deadline:
                try:
                    n = conn.recv_into(view[got:], len(view) - got, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    pass
        if n is None:
            n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def _socket_echo(port: int, size: int, spin: float) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view = memoryview(bytearray(size))
        while recv_exact(conn, view, spin):
            conn.sendall(view)


def socket_round_trips(size: int, trips: int, spin: float = 0.0) -> list[float]:
    """Seconds per round trip of ``size`` bytes to an echo process (blocking sockets, or
    polling ``spin`` seconds before blocking on both sides). Includes a 10% warm-up."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        echo = mp.get_context("spawn").Process(target=_socket_echo, args=(listener.getsockname()[1], size, spin))
        echo.start()
        try:
            listener.settimeout(WAIT)
            conn, _ = listener.accept()
        except BaseException:
            _reap(echo, 0)
            raise
    try:
        conn.settimeout(WAIT)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        view, samples = memoryview(bytearray(size)), []
        for _ in range(trips + trips // 10):
            start = time.perf_counter()
            conn.sendall(view)
            if not recv_exact(conn, view, spin):
                raise ConnectionError("the echo process closed the connection")
            samples.append(time.perf_counter() - start)
    finally:
        conn.close()  # the echo process sees the end and leaves
        _reap(echo, 10)
    return samples[trips // 10:]


def _zmq_echo(port: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2:  # identity + "stop"
            sock.close(0)
            ctx.term()
            return
        sock.send_multipart(frames, copy=False)


def zmq_round_trips(size: int, trips: int) -> list[float]:
    """Seconds per round trip through pyzmq DEALER/ROUTER (header + payload frame, copy=False)."""
    import numpy as np
    import zmq

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = mp.get_context("spawn").Process(target=_zmq_echo, args=(port,))
    server.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    payload, samples = np.ones(size, np.uint8), []
    for _ in range(trips + trips // 10):
        start = time.perf_counter()
        sock.send_multipart([b"header", payload], copy=False)
        sock.recv_multipart(copy=False)
        samples.append(time.perf_counter() - start)
    sock.send(b"stop")
    _reap(server, 10)
    sock.close(0)
    ctx.term()
    return samples[trips // 10:]
