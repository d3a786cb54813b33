"""Periodic checkpoints of a job's parts, for failover without replicas.

A job in optimizer mode with ``checkpoint="DIR or URL"`` (and ``checkpoint_every=N`` rounds,
default 100) has each of its parts written by the Aggregator that serves it: at its init (round 0)
and after every N-th round, the weights and the optimizer state (momentum, Adam moments) as one
``.npz`` file per part::

    <url>/<job>/<key>/part-<n>.npz

``url`` is a local directory or any fsspec URL (``s3://``, ``gs://``, ``memory://``...). Files are
written off the data path by one thread per Aggregator, newest state first (a part whose previous
snapshot is still queued keeps only the newer one), and replaced atomically on a local disk.

When the part's Aggregator dies and there is no replica, pMaster starts the part afresh elsewhere
from its last file. The rounds closed after that file are lost: the new Aggregator tells every
worker so with the first answer (``lost`` and ``restored``), and the Agent logs it as an error
and keeps the count in ``Agent.rounds_lost``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import threading
import urllib.parse

import numpy as np

from pslink.errors import ConfigError, KeyStateError

log = logging.getLogger("pslink.core.checkpoints")

DEFAULT_EVERY = 100


def check_url(url: object) -> str:
    """A job's checkpoint location: a directory or an fsspec URL whose scheme fsspec knows."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"checkpoint must be a directory or an fsspec URL, got {url!r}")
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme and scheme != "file" and len(scheme) > 1:  # "C:" is a drive, not a scheme
        try:
            import fsspec
        except ImportError:
            raise ConfigError(f"checkpoint {url!r} needs fsspec (pip install fsspec) for its {scheme}:// URL") from None
        try:
            fsspec.get_filesystem_class(scheme)
        except (ValueError, ImportError) as exc:
            raise ConfigError(f"checkpoint {url!r}: fsspec cannot write {scheme}:// URLs ({exc})") from None
    return url


def part_path(url: str, job: str, key, part: int) -> str:
    # Keys are ints or strings; a string may hold "/" (torch parameter names do not, MXNet's may).
    safe_key = urllib.parse.quote(str(key), safe="")
    return "/".join([url.rstrip("/"), urllib.parse.quote(job, safe=""), safe_key, f"part-{part}.npz"])


def _encode(state: dict, arrays: list[np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    named = {f"a{i}": a for i, a in enumerate(arrays)}
    np.savez(buffer, __state__=np.frombuffer(json.dumps(state).encode(), np.uint8), **named)
    return buffer.getvalue()


def _decode(data: bytes) -> tuple[dict, list[np.ndarray]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as files:
        state = json.loads(bytes(files["__state__"]).decode())
        arrays = [files[f"a{i}"] for i in range(len(state["arrays"]))]
    return state, arrays


def _local(path: str) -> str | None:
    scheme = urllib.parse.urlsplit(path).scheme
    if scheme == "file":
        return urllib.parse.urlsplit(path).path
    return path if not scheme or len(scheme) == 1 else None


def write(path: str, state: dict, arrays: list[np.ndarray]) -> None:
    data = _encode(state, arrays)
    local = _local(path)
    if local is not None:
        os.makedirs(os.path.dirname(local), exist_ok=True)
        temporary = f"{local}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, local)  # a reader sees the old file or the new one, never half of one
        return
    import fsspec

    with fsspec.open(path, "wb") as f:
        f.write(data)


def read(path: str) -> tuple[dict, list[np.ndarray]]:
    """The state and arrays of a part's last checkpoint; KeyStateError when there is none."""
    local = _local(path)
    try:
        if local is not None:
            with open(local, "rb") as f:
                data = f.read()
        else:
            import fsspec

            with fsspec.open(path, "rb") as f:
                data = f.read()
    except FileNotFoundError:
        raise KeyStateError(f"no checkpoint at {path}") from None
    except OSError as exc:
        raise KeyStateError(f"cannot read checkpoint {path}: {exc}") from None
    return _decode(data)


class CheckpointWriter:
    """One thread that writes parts' snapshots, the newest of each, off the data path."""

    def __init__(self, name: str):
        self.name = name
        self._latest: dict[str, tuple[dict, list[np.ndarray]]] = {}
        self._order: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.written = 0
        self.failed = 0

    def submit(self, path: str, state: dict, arrays: list[np.ndarray]) -> None:
        """``arrays`` must not change afterwards (the caller hands over copies)."""
        with self._lock:
            queued = path in self._latest
            self._latest[path] = (state, arrays)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=f"pslink-checkpoint-{self.name}")
                self._thread.start()
        if not queued:
            self._order.put(path)

    def _run(self) -> None:
        while True:
            path = self._order.get()
            if path is None:
                return
            with self._lock:
                snapshot = self._latest.pop(path, None)
            if snapshot is None:
                continue
            try:
                write(path, *snapshot)
                self.written += 1
            except Exception as exc:  # a full disk must not take the data path down: say it loudly
                self.failed += 1
                log.error("aggregator %s: writing checkpoint %s failed: %s", self.name, path, exc)

    def flush(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the thread (at a clean exit)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._order.put(None)
            thread.join(timeout)
