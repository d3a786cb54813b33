"""A throwaway Redis server for tests of the state kept in Redis (Debian's ``redis-server``).

Nothing is saved to disk; the process is reaped by pid when the test ends. Where there is no
``redis-server`` the tests that need one skip, naming it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def redis_argv(port: int, bind: str | None = None, unixsocket: str | None = None, directory: str = "/tmp") -> list[str]:
    """redis-server keeping nothing on disk (no RDB, no AOF), in the foreground."""
    argv = [REDIS_SERVER, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", directory,
            "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"]
    if bind:
        argv += ["--bind", bind]
    if unixsocket:
        argv += ["--unixsocket", unixsocket, "--unixsocketperm", "700"]
    return argv


def need_redis() -> None:
    if not os.path.exists(REDIS_SERVER):
        pytest.skip("no redis-server here (Debian: apt-get install redis-server; .ci/run installs it)")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'pslink[ha]')")


class UnixRedis:
    """redis-server on a Unix socket of its own (no port to pick): ``url(db)``."""

    def __init__(self):
        need_redis()
        self.dir = tempfile.mkdtemp(prefix="pslink-redis-")
        self.socket = os.path.join(self.dir, "redis.sock")
        self.proc = subprocess.Popen(redis_argv(0, unixsocket=self.socket, directory=self.dir),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"redis-server did not start: {self.proc.stderr.read().decode()[-400:]}")
            time.sleep(0.02)  # polling for the socket to appear, with a deadline

    def url(self, db: int = 0) -> str:
        return f"unix://{self.socket}?db={db}"

    def flush(self) -> None:
        import redis

        client = redis.Redis(unix_socket_path=self.socket)
        client.flushall()
        client.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
