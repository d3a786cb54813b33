"""pMaster's durable state in Redis: off pMaster's host, so a standby elsewhere can take over.

The rows are :class:`~pslink.core.master.store.MasterStore`'s, msgpack-encoded, in hashes under one
prefix (``{pslink}:jobs``, ``{pslink}:keys:JOB``, ``{pslink}:aggregators``, ``{pslink}:meta``; the
braces keep every key in one Redis Cluster slot). Several services share one Redis by its database
number (``redis://HOST:PORT/N``) or by ``?prefix=NAME``.

**Fencing.** Every write is a Lua script that applies only while the store's leader epoch is the
one this pMaster took the lease with (:mod:`pslink.core.master.leadership`): a pMaster deposed
while it was cut off, back on the network, writes nothing; its first write or lease renewal finds
the newer epoch, and it steps down (``on_fenced``).

**The store going away.** pMaster is off the data path and jobs train on without it; so does
pMaster without its store: a write that cannot reach Redis is kept, in order, and pMaster serves on
from memory. Writes are retried every ``retry_interval`` and applied, in order and under the same
fencing, once Redis answers again. The loss and the return are logged once each. A Redis that
restarted empty has no epoch: writes wait the same way until the leader took the store again under
its own epoch and wrote its whole state back (:meth:`pslink.core.master.Master.write_state_back`).
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import parse_qs, urlsplit, urlunsplit

import msgpack

from pslink.core.master.store import SCHEMA_VERSION, MasterStore
from pslink.errors import ConfigError

log = logging.getLogger("pslink.core.master")

SCHEMES = ("redis://", "rediss://", "unix://")
EMPTIED = -1  # a write found no epoch in the store: it lost the state (kept until it is written back)
DEFAULT_PREFIX = "pslink"

# ARGV: the epoch, then (command, key, field, value) four at a time. KEYS[1]: the epoch's key.
# 1: applied; 0: a newer epoch (fenced); -1: no epoch (the store lost the state: kept for later).
_WRITE = """
local epoch = redis.call('GET', KEYS[1])
if not epoch then return -1 end
if epoch ~= ARGV[1] then return 0 end
for i = 2, #ARGV, 4 do
  local command, key = ARGV[i], ARGV[i + 1]
  if command == 'hset' then redis.call('HSET', key, ARGV[i + 2], ARGV[i + 3])
  elseif command == 'hdel' then redis.call('HDEL', key, ARGV[i + 2])
  elseif command == 'del' then redis.call('DEL', key) end
end
return 1
"""


def is_store_url(location: str | None) -> bool:
    return bool(location) and location.startswith(SCHEMES)


def shown(url: str) -> str:
    """The URL without its password (logs, status)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def connect(url: str, timeout: float):
    """A Redis client for ``url`` (``?prefix=`` taken off) and the prefix; the store answered a PING,
    else a ConfigError naming it."""
    try:
        import redis
    except ImportError:
        raise ConfigError(f"--state {shown(url)}: state in Redis needs redis-py: pip install 'pslink[ha]'") from None
    base, _, query = url.partition("?")
    prefix = (parse_qs(query).get("prefix") or [DEFAULT_PREFIX])[0]
    rest = "&".join(pair for pair in query.split("&") if pair and not pair.startswith("prefix="))
    try:
        client = redis.Redis.from_url(base + (f"?{rest}" if rest else ""), socket_timeout=timeout,
                                      socket_connect_timeout=timeout)
        client.ping()
    except (redis.RedisError, ValueError, OSError) as exc:
        raise ConfigError(f"the state store {shown(url)} is unreachable or refused pslink: {exc}") from None
    return client, prefix


def names(prefix: str) -> dict[str, str]:
    """Every key pslink keeps under ``prefix`` (shared with the lease)."""
    base = "{" + prefix + "}"
    return {"jobs": f"{base}:jobs", "keys": f"{base}:keys:", "aggregators": f"{base}:aggregators",
            "meta": f"{base}:meta", "epoch": f"{base}:epoch", "lease": f"{base}:lease", "leader": f"{base}:leader",
            "standby": f"{base}:standby:"}


class RedisStore(MasterStore):
    """The state in Redis at ``url``, written under leader epoch ``epoch`` (see the module's doc).
    ``on_fenced()`` is called once, from whichever thread found that a newer leader took over."""

    def __init__(self, url: str, epoch: int, *, on_fenced=lambda: None, timeout: float = 1.0,
                 retry_interval: float = 0.5):
        import redis

        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self.path = shown(url)
        self.client, prefix = connect(url, timeout)
        self.keys = names(prefix)
        self.epoch = epoch
        self.on_fenced = on_fenced
        self.retry_interval = retry_interval
        self.fenced = False
        self.written = 0  # writes Redis took
        self.discarded = 0  # writes a newer leader's epoch refused
        self.pending: list = []  # writes Redis has not taken yet (it is away), in order
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._retrying: threading.Thread | None = None
        self._script = self.client.register_script(_WRITE)
        schema = self._meta().get("schema")
        if schema is not None and int(schema) != SCHEMA_VERSION:
            raise ConfigError(f"the state in {self.path} has schema {schema}; this pslink reads "
                              f"schema {SCHEMA_VERSION}")
        if schema is None:
            self._put("meta", "schema", ("schema", str(SCHEMA_VERSION)))

    @property
    def reachable(self) -> bool:
        return not self.pending

    @property
    def pending_writes(self) -> int:
        return len(self.pending)

    # -- MasterStore's backend ------------------------------------------------------------------

    def _put(self, table: str, name: str, row: tuple) -> None:
        self._write([("hset", self.keys[table], name, msgpack.packb(list(row), use_bin_type=True))])

    def _put_key(self, job: str, key: bytes, row: tuple) -> None:
        self._write([("hset", self.keys["keys"] + job, key, msgpack.packb(list(row), use_bin_type=True))])

    def _delete(self, table: str, name: str) -> None:
        self._write([("hdel", self.keys[table], name, "")])

    def _delete_key(self, job: str, key: bytes) -> None:
        self._write([("hdel", self.keys["keys"] + job, key, "")])

    def _delete_job(self, job: str) -> None:
        self._write([("del", self.keys["keys"] + job, "", ""), ("hdel", self.keys["jobs"], job, "")])

    def _rows(self) -> tuple[list, list, list, dict]:
        client = self.client
        unpack = lambda value: msgpack.unpackb(value, raw=False)  # noqa: E731
        aggregators = [unpack(v) for v in client.hgetall(self.keys["aggregators"]).values()]
        jobs = [unpack(v) for v in client.hgetall(self.keys["jobs"]).values()]
        keys = [unpack(v) for row in jobs for v in client.hgetall(self.keys["keys"] + row[0]).values()]
        return aggregators, jobs, keys, self._meta()

    def _meta(self) -> dict:
        return {name.decode(): msgpack.unpackb(value, raw=False)[1]
                for name, value in self.client.hgetall(self.keys["meta"]).items()}

    def close(self) -> None:
        self._closed.set()
        if self._retrying is not None:
            self._retrying.join(5.0)
        self.client.close()

    # -- writing under the epoch ----------------------------------------------------------------

    def _write(self, ops: list) -> None:
        with self._lock:
            if self.fenced or self._closed.is_set():
                return
            if self.pending:  # Redis is away: in order behind what waits already
                self.pending.extend(ops)
                return
            try:
                applied = self._apply(ops)
            except self._errors as exc:
                self._keep(ops, f"the state store {self.path} is unreachable ({exc})")
                return
            if applied == EMPTIED:
                self._keep(ops, f"the state store {self.path} has lost pMaster's state")
            elif not applied:
                self._fenced_out(len(ops))

    def _keep(self, ops: list, why: str) -> None:
        """Redis cannot take ``ops`` now: keep them, in order, and retry (on the lock)."""
        self.pending.extend(ops)
        log.warning("pMaster: %s; serving on from memory, retrying every %.1f s", why, self.retry_interval)
        self._retrying = threading.Thread(target=self._retry, name="pslink-store-retry", daemon=True)
        self._retrying.start()

    def _apply(self, ops: list) -> int:
        """Apply ``ops`` if this pMaster's epoch is still the store's: 1 if applied, 0 if a newer
        leader's epoch is there, EMPTIED if none is (nothing applied either way)."""
        argv: list = [self.epoch]
        for op in ops:
            argv.extend(op)
        applied = int(self._script(keys=[self.keys["epoch"]], args=argv))
        if applied == 1:
            self.written += len(ops)
        return applied

    def abandon(self) -> None:
        """A newer leader took over (the lease said so first): what waits for the store never goes."""
        with self._lock:
            if not self.fenced:
                self._discard(0)

    def _fenced_out(self, refused: int) -> None:
        self._discard(refused)
        threading.Thread(target=self.on_fenced, name="pslink-fenced", daemon=True).start()

    def _discard(self, refused: int) -> None:
        self.fenced = True
        self.discarded = len(self.pending) + refused
        self.pending = []
        log.error("pMaster: a newer leader took over the state in %s (this one had epoch %d): wrote nothing "
                  "(%d write(s) discarded); stepping down", self.path, self.epoch, self.discarded)

    def _retry(self) -> None:
        """While Redis is away: apply what waits, in order, once it answers. A try that timed out
        may still land later (Redis had it); the whole list that follows it lands after it, so the
        store ends as the writes left it."""
        while not self._closed.wait(self.retry_interval):
            with self._lock:
                if self.fenced or not self.pending:
                    return
                try:
                    applied = self._apply(self.pending)
                except self._errors:
                    continue
                if applied == EMPTIED:
                    continue  # until the leader took the state again (pslink.core.master.leadership)
                if not applied:
                    self._fenced_out(0)
                    return
                log.warning("pMaster: the state store %s is back: %d write(s) kept meanwhile applied", self.path,
                            len(self.pending))
                self.pending = []
                return
