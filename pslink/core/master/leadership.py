"""One pMaster leads at a time: a lease in the state store, and an epoch that fences the others.

The leader holds ``{prefix}:lease`` (its id, expiring after ``ttl``) and renews it every ``ttl / 3``.
Taking the lease increments ``{prefix}:epoch``; the leader writes its state under that epoch
(:class:`~pslink.core.master.store_redis.RedisStore`), so a leader deposed while it was away
writes nothing when it comes back. A standby registers itself (``{prefix}:standby:ID``, expiring)
and takes the lease once it lapses.

A leader that cannot reach the store leads on (the store may be down for everyone; jobs never
wait for pMaster), retrying; it steps down at the first answer that shows a newer epoch. A
leader whose lease lapsed while nobody took over (the store was down for all) takes it back
under its own epoch: nothing it kept meanwhile is lost.

The Lua scripts make each step atomic in Redis; this module only sequences them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Callable

from pslink.core.master.store_redis import connect, names, shown

log = logging.getLogger("pslink.core.master")

DEFAULT_TTL = 3.0  # seconds a lease lasts unrenewed: a standby leads within about this after a loss

# KEYS: lease, epoch, leader. ARGV: id, ttl (ms), the leader's description (JSON, the epoch added),
# '1' for a standby: it takes over only a state some leader made (-1: none; a Redis restarted
# empty waits for its leader to write the state again, instead of a standby loading nothing).
_ACQUIRE = """
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local epoch = redis.call('INCR', KEYS[2])
  local info = cjson.decode(ARGV[3])
  info['epoch'] = epoch
  redis.call('SET', KEYS[3], cjson.encode(info))
  return epoch
end
return 0
"""
# KEYS: lease, epoch. ARGV: id, ttl (ms), epoch. 1: renewed (or taken back: nobody took it meanwhile);
# 0: a newer epoch (deposed); -1: no epoch at all (the store lost the state).
_RENEW = """
local epoch = redis.call('GET', KEYS[2])
if not epoch then return -1 end
if epoch ~= ARGV[3] then return 0 end
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: epoch, leader. ARGV: epoch, the leader's description (JSON). Only the epoch's own leader.
_DESCRIBE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
return 1
"""
# KEYS: lease, epoch, leader. ARGV: id, ttl (ms), epoch, the leader's description. A store that lost
# the state (no epoch): its leader takes it again under its own epoch, to write the state back.
_RESEED = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[3], ARGV[4])
return 1
"""
# KEYS: lease. ARGV: id. A leader stopping cleanly hands over at once.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Lease:
    """This pMaster's part in the election over the store at ``url``. ``address``: where it serves
    once it leads (status shows it to operators)."""

    def __init__(self, url: str, address: str, *, ttl: float = DEFAULT_TTL, timeout: float = 1.0,
                 clock: Callable[[], float] = time.time):
        import redis

        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        if ttl <= 0:
            raise ValueError(f"a lease of {ttl} s cannot be held")
        self.url = shown(url)
        self.client, prefix = connect(url, timeout)
        self.keys = names(prefix)
        self.ttl = ttl
        self.clock = clock
        self.id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.info = {"id": self.id, "address": address, "host": socket.gethostname(), "pid": os.getpid()}
        self.epoch: int | None = None
        self.since: float | None = None
        self.reachable = True
        # The last leader and standbys read (status serves them without I/O).
        self.view: dict = {"leader": None, "standbys": []}
        self._acquire = self.client.register_script(_ACQUIRE)
        self._renew = self.client.register_script(_RENEW)
        self._release = self.client.register_script(_RELEASE)
        self._describe = self.client.register_script(_DESCRIBE)
        self._reseed = self.client.register_script(_RESEED)
        self._waiting_for_state = False

    # -- the steps --------------------------------------------------------------------------

    def try_acquire(self, standby: bool = False) -> int | None:
        """Take the lease if nobody holds it: the new epoch, or None. A ``standby`` takes only a
        state some leader made (None while the store holds none)."""
        info = dict(self.info, since=self.clock())
        epoch = int(self._acquire(keys=[self.keys["lease"], self.keys["epoch"], self.keys["leader"]],
                                  args=[self.id, int(self.ttl * 1000), json.dumps(info), "1" if standby else "0"]))
        if epoch == -1:
            if not self._waiting_for_state:
                log.warning("pMaster standby: the state store %s holds no pMaster state (new, or it lost it): "
                            "a standby waits for a leader to write it (start one without --standby)", self.url)
            self._waiting_for_state = True
            return None
        self._waiting_for_state = False
        if epoch:
            self.epoch, self.since = epoch, info["since"]
        return epoch or None

    def renew(self) -> int:
        """1: renewed; 0: a newer leader took over (this one is deposed); -1: the store lost the
        state (no epoch in it: a Redis restarted without persistence)."""
        return int(self._renew(keys=[self.keys["lease"], self.keys["epoch"]],
                               args=[self.id, int(self.ttl * 1000), self.epoch]))

    def reseed(self) -> bool:
        """The store lost the state: take it again under this leader's epoch (False: another pMaster
        came first), so that the leader writes the state back."""
        info = dict(self.info, since=self.since, epoch=self.epoch)
        return bool(self._reseed(keys=[self.keys["lease"], self.keys["epoch"], self.keys["leader"]],
                                 args=[self.id, int(self.ttl * 1000), self.epoch, json.dumps(info)]))

    def describe(self, address: str) -> None:
        """The address this leader serves at, once known (a port picked at bind)."""
        self.info["address"] = address
        info = dict(self.info, since=self.since, epoch=self.epoch)
        try:
            self._describe(keys=[self.keys["epoch"], self.keys["leader"]], args=[self.epoch, json.dumps(info)])
        except self._errors:
            pass  # shown as it was until the next term: the address given at start

    def release(self) -> None:
        try:
            self._release(keys=[self.keys["lease"]], args=[self.id])
        except self._errors:
            pass  # the store is away: the lease lapses on its own

    def leader(self) -> dict | None:
        raw = self.client.get(self.keys["leader"])
        holder = self.client.get(self.keys["lease"])
        if raw is None:
            return None
        leader = json.loads(raw)
        leader["holds_lease"] = holder is not None and holder.decode() == leader.get("id")
        return leader

    def announce_standby(self, state: str) -> None:
        """This pMaster waits to lead (expires unless repeated within 3 lease times)."""
        self.client.set(self.keys["standby"] + self.id, json.dumps(dict(self.info, state=state, seen=self.clock())),
                        px=int(self.ttl * 3000))

    def withdraw_standby(self) -> None:
        try:
            self.client.delete(self.keys["standby"] + self.id)
        except self._errors:
            pass

    def standbys(self) -> list[dict]:
        found = []
        for key in self.client.scan_iter(match=self.keys["standby"] + "*", count=100):
            raw = self.client.get(key)
            if raw is not None:
                found.append(json.loads(raw))
        return sorted(found, key=lambda s: s["id"])

    def refresh_view(self) -> None:
        self.view = {"leader": self.leader(), "standbys": self.standbys(),
                     "epoch": int(self.client.get(self.keys["epoch"]) or 0)}

    def status(self) -> dict:
        """For pMaster's status: who leads, under which epoch, who stands by, the store."""
        return {"store": self.url, "lease_seconds": self.ttl, "epoch": self.epoch, "id": self.id,
                "leading_since": self.since, "store_reachable": self.reachable, **self.view}

    # -- the loops ----------------------------------------------------------------------------

    def wait_to_lead(self, stop: threading.Event, poll: float | None = None) -> int | None:
        """As a standby: announce it, and take the lease once it lapses. The epoch, or None if
        ``stop`` was set first."""
        poll = self.ttl / 6 if poll is None else poll
        waiting_for = None
        while not stop.is_set():
            try:
                self.announce_standby("standby")
                epoch = self.try_acquire(standby=True)
                if epoch is not None:
                    self.withdraw_standby()
                    self.reachable = True
                    return epoch
                leader = self.leader()
                if leader is not None and leader.get("id") != waiting_for:
                    waiting_for = leader.get("id")
                    log.info("pMaster standby: %s leads (epoch %s); taking over when its lease lapses",
                             leader.get("address"), leader.get("epoch"))
                self.reachable = True
            except self._errors as exc:
                if self.reachable:
                    log.warning("pMaster standby: the state store %s is unreachable (%s); retrying", self.url, exc)
                self.reachable = False
            stop.wait(poll)
        return None

    def keep(self, deposed: Callable[[], None], stop: threading.Event,
             emptied: Callable[[], None] = lambda: None) -> threading.Thread:
        """As the leader: renew every ttl / 3 on a thread until ``stop``; ``deposed()`` once a newer
        leader shows; ``emptied()`` when the store lost the state (after taking it again)."""

        def run():
            while not stop.wait(self.ttl / 3):
                try:
                    renewed = self.renew()
                    self.refresh_view()
                except self._errors as exc:
                    if self.reachable:
                        log.warning("pMaster: the state store %s is unreachable (%s); leading on, retrying",
                                    self.url, exc)
                    self.reachable = False
                    continue
                if not self.reachable:
                    log.warning("pMaster: the state store %s is back; still the leader (epoch %d)", self.url,
                                self.epoch)
                self.reachable = True
                if renewed == -1:
                    log.error("pMaster: the state store %s has lost pMaster's state (a Redis restarted without "
                              "persistence?); this leader writes it back from memory (epoch %d)", self.url,
                              self.epoch)
                    try:
                        if self.reseed():
                            emptied()
                    except self._errors:
                        pass  # asked again at the next renewal
                    continue
                if not renewed:
                    log.error("pMaster: a newer leader took over the state in %s (this one had epoch %d); "
                              "stepping down", self.url, self.epoch)
                    deposed()
                    return

        thread = threading.Thread(target=run, name="pslink-lease", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.client.close()
