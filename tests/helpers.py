"""Shared test helpers: in-process clusters, worker threads, a raw protocol client."""

from __future__ import annotations

import queue
import threading
import traceback

from pslink.core.wire.loop import Reactor, ReactorThread
from pslink.core.wire.protocol import decode
from pslink.core.service import Service
from pslink.core.transport import Transports

TRANSPORTS = {
    "inproc": ("inproc://master", "inproc://*"),
    "tcp": ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"),
    "zmq": ("zmq+tcp://127.0.0.1:0", "zmq+tcp://127.0.0.1:0"),
}


def start_cluster(kind: str, aggregators: int = 2, transports: Transports | None = None, control: dict | None = None,
                  secret: bytes | None = None, **master_options) -> Service:
    """pMaster plus Aggregators on threads of this process, over one kind of transport (with
    ``secret``, a service that checks credentials)."""
    master, aggregator = TRANSPORTS[kind]
    return Service(
        master, aggregators, provider="thread", transports=transports or Transports(),
        aggregator_listen=aggregator, master_options=master_options or None, control=control, secret=secret,
    ).start()


def serving(kind: str, aggregators: int = 2):
    """A fixture's body: (service, transports) of a cluster of ``kind``, stopped afterwards."""
    transports = Transports()
    service = start_cluster(kind, aggregators=aggregators, transports=transports)
    yield service, transports
    service.stop()
    transports.close()


def run_workers(count: int, fn, timeout: float = 60.0) -> list:
    """Run ``fn(rank)`` on ``count`` threads; return the results or raise the first failure."""
    results: list = [None] * count
    errors: list = []

    def body(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # reported to the test below
            errors.append((rank, exc, traceback.format_exc()))

    threads = [threading.Thread(target=body, args=(r,), name=f"worker-{r}") for r in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        raise AssertionError(f"workers {hung} did not finish within {timeout} s")
    if errors:
        rank, exc, tb = errors[0]
        raise AssertionError(f"worker {rank} failed:\n{tb}") from exc
    return results


class RawClient:
    """Speaks the wire protocol by hand, to send what a well-behaved Agent never would."""

    def __init__(self, address: str, transports: Transports):
        self.reactor = Reactor("raw-client")
        self.thread = ReactorThread(self.reactor).start()
        self.replies: queue.Queue = queue.Queue()
        self.closed: queue.Queue = queue.Queue()
        self.conn = transports.connect(address, self.reactor, self, timeout=5.0)

    def on_header(self, conn, header, sizes):
        return decode(header, sizes), None

    def on_message(self, conn, header, payloads):
        self.replies.put((header, [bytes(p) for p in payloads]))

    def on_close(self, conn, exc):
        self.closed.put(exc)

    def on_accept(self, conn):
        pass

    def send(self, *frames):
        self.conn.send(list(frames))

    def reply(self, timeout: float = 5.0):
        return self.replies.get(timeout=timeout)

    def close(self):
        self.conn.close()
        self.thread.stop()
        self.reactor.drain()
        self.reactor.close()


def rank_session(job: str, rank: int, size: int, address: str, transports: Transports, **session_options):
    """A worker layer Session for ``rank`` of ``job`` (``size`` ranks, threads of this process),
    once every rank has registered (a barrier, as Horovod's ``init`` is a rendezvous: a rank
    that finished and left before another registered would shrink the job)."""
    from pslink.core.worker.connect import connect
    from pslink.core.worker.session import Session

    agent = connect(job, rank, size, master=address, transports=transports, timeout=30.0, mode="sum")
    members = sorted(int(r) for r in agent.barrier("test/start", timeout=30.0)["ranks"])
    return Session(agent, members=members, **session_options)


def on_sessions(job: str, size: int, address: str, transports: Transports, fn, timeout: float = 60.0,
                **session_options) -> list:
    """``fn(rank, session)`` for ranks 0..size-1 of ``job``, each on its own thread with its own
    Session (:func:`rank_session`); the results in rank order. Each Session closes only once every
    rank's ``fn`` returned: a rank that closed (leaving the job) while another still waited on a
    round of it would let that round end without it, a partial sum instead of what the test
    looks for (a verdict the other rank reads a moment later, say)."""
    finished = threading.Barrier(size)

    def body(rank):
        session = rank_session(job, rank, size, address, transports, **session_options)
        try:
            return fn(rank, session)
        finally:
            try:
                finished.wait(timeout)
            except threading.BrokenBarrierError:
                pass  # another rank failed or hung: run_workers reports it
            session.close()

    return run_workers(size, body, timeout)


def launch_elastic(script, args=(), workers: int = 2, max_restarts: int = 0, timeout: float = 100.0,
                   env: dict | None = None) -> str:
    """``pslink launch --min-np 1 --max-np W -n W --max-restarts R --heartbeat-timeout 2 python
    script args...`` from the repository, with ``PSLINK_TIMEOUT=60``; its output, once it exited
    with 0 (an AssertionError with the output if it failed or hung past ``timeout``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    environ = dict(os.environ, PSLINK_TIMEOUT="60", TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "pslink.cli", "launch", "--min-np", "1", "--max-np", str(workers), "-n",
               str(workers), "--max-restarts", str(max_restarts), "--heartbeat-timeout", "2", sys.executable,
               str(script), *map(str, args)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, env=environ, cwd=str(repo))
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its workers on SIGTERM
        out, _ = proc.communicate(timeout=30)
        raise AssertionError(f"the job hung:\n{out}") from None
    assert proc.returncode == 0, out
    return out


class RecordingPeer:
    """A control connection as pMaster sees an Aggregator's (or an Aggregator pMaster's), driven by
    hand: what it was answered (``replies``) and asked (``calls``: (op, fields))."""

    def __init__(self):
        self.info, self.replies, self.calls, self.callbacks = {}, [], [], []
        self.conn = type("Conn", (), {"closed": False, "peer": "test"})()

    def reply(self, req, **fields):
        self.replies.append(fields)

    def call(self, op, callback, timeout=None, **fields):
        self.calls.append((op, fields))
        self.callbacks.append(callback)  # (the test answers: callback(result, error))


class DelayRelay:
    """A TCP relay to ``target`` (``tcp://host:port``) that holds every chunk ``delay / 2``
    seconds each way: a far site's round trip on loopback (this kernel has no netem). Its
    ``address`` is what to dial; :meth:`close` stops it and joins its threads."""

    def __init__(self, target: str, delay: float):
        import socket

        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target, self.delay = (host, int(port)), delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.threads: list[threading.Thread] = []
        self.sockets: list = []
        self.closed = threading.Event()
        self._start(self._accept)

    def _start(self, fn, *args) -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        import socket

        while not self.closed.is_set():
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            if self.closed.is_set():
                near.close()
                return
            far = socket.create_connection(self.target, timeout=10)
            for sock in (near, far):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(None)
            self.sockets += [near, far]
            self._start(self._pump, near, far)
            self._start(self._pump, far, near)

    def _pump(self, source, sink) -> None:
        try:
            while True:
                chunk = source.recv(1 << 16)
                if not chunk or self.closed.wait(self.delay / 2):
                    break
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(2)
                except OSError:
                    pass

    def close(self) -> None:
        import socket

        self.closed.set()
        try:
            socket.create_connection(self.listener.getsockname(), timeout=1).close()  # wakes accept()
        except OSError:
            pass
        self.listener.close()
        for sock in self.sockets:
            try:
                sock.shutdown(2)
            except OSError:
                pass
        for thread in self.threads:
            thread.join(10)
        for sock in self.sockets:
            sock.close()


class FirstAnswerLost(DelayRelay):
    """A relay (no delay) whose first connection closes, both ways, instead of passing on the
    ``answer``-th answer of the far end (1: the first bytes it sends): a request that reached
    pMaster and whose answer was lost with the connection. Later connections pass everything;
    ``cut`` counts the lost answers. (Each answer comes alone: the near end waits for it.)"""

    def __init__(self, target: str, answer: int = 1):
        self.cut, self.answer = 0, answer
        super().__init__(target, 0.0)

    def _pump(self, source, sink) -> None:
        if source is not self.sockets[1]:  # (``sockets``: near, far of each connection, in order)
            super()._pump(source, sink)
            return
        try:
            for _ in range(self.answer - 1):
                sink.sendall(source.recv(1 << 16))
            if source.recv(1 << 16):
                self.cut += 1
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(2)
            except OSError:
                pass

