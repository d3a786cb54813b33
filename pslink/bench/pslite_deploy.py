"""A ps-lite program run on pslink as ``pslink launch --pslite -s 1 -n 1`` runs it (a scheduler,
one server, one worker), with a deadline: the benchmarks' pslink side beside C++ ps-lite
(benchmarks/pslite_bench.py, benchmarks/sparse.py)."""

from __future__ import annotations

import io
import os
import sys
import threading
import time

from pslink.bench import pslite_cpp

TAG = "PSLINK_BENCH_TAG"  # in every deployment's environment: stragglers are reaped by it


class _Capture(io.TextIOBase):
    """Collects the deployment's output lines (and echoes those not starting with ``hide``)."""

    def __init__(self, echo: bool, hide: str | None):
        self.echo, self.hide = echo, hide
        self.lines: list[str] = []
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.lines.extend(line for line in text.splitlines() if line)
        if self.echo and not (self.hide and text.startswith(self.hide)):
            sys.stdout.write(text)
        return len(text)

    def flush(self) -> None:
        sys.stdout.flush()


def run(command: list[str], mode: str, what: str, timeout: float, env: dict | None = None, echo: bool = False,
        hide: str | None = None) -> list[str]:
    """Run ``command`` in pslink's ``mode`` (classic or service) with ``env`` added to this
    process's environment; its output lines. Stopped after ``timeout`` seconds (``what`` names it
    in the error); whatever it left running is reaped by its tag."""
    from pslink.launch import PsliteLaunch

    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    capture = _Capture(echo, hide)
    launch = PsliteLaunch(command, num_workers=1, num_servers=1, server_mode=mode, aggregators=1,
                          job=f"pslite-bench-{os.getpid()}-{mode}-{time.monotonic_ns()}", prefix=False,
                          output=capture, env=dict(os.environ, **(env or {}), **{TAG: tag}))
    expired = threading.Event()

    def expire():  # the launcher's own wait has no deadline: stopping its processes ends it
        expired.set()
        launch.stop_workers()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        code = launch.run()
    finally:
        timer.cancel()
        pslite_cpp.reap(TAG, tag)
    if expired.is_set() or code != 0:
        why = f"still running after {timeout:.0f} s" if expired.is_set() else f"exited with status {code}"
        raise RuntimeError(f"{what}: the deployment {why}\n" + "\n".join(capture.lines[-20:]))
    return capture.lines
