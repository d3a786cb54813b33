"""A pMaster whose state lives in a store off its host: it leads while it holds the store's lease,
and stands by otherwise (``pslink master --standby``; ``pslink service up --state redis://...``).

Each term of leadership is a fresh :class:`~pslink.core.master.Master` loaded from the store under
the term's epoch: a standby that takes over loads what the last leader wrote and adopts the
Aggregators and Agents that come to it (they hold every pMaster's address and follow the one that
answers). A leader deposed (a newer epoch in the store) stops serving at once, writes nothing, and
goes back to standing by (``pslink master``) or stays stopped (``pslink service up``).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from pslink.core.master import Master
from pslink.core.master.leadership import Lease
from pslink.core.master.store_redis import RedisStore
from pslink.errors import ServiceError

log = logging.getLogger("pslink.core.service")


class Terms:
    """This process's terms as the leader of the state at ``url``. ``address``: where it serves
    when it leads (shown to operators)."""

    def __init__(self, url: str, address: str, *, ttl: float):
        self.url = url
        self.lease = Lease(url, address, ttl=ttl)
        self.master: Master | None = None
        self.store: RedisStore | None = None
        self.count = 0  # terms begun
        self.deposed = threading.Event()
        self._keeping = threading.Event()
        self._on_deposed: Callable[[], None] = lambda: None
        self._lock = threading.Lock()

    def lead_now(self) -> RedisStore:
        """Take the lease at once (a pMaster started without ``--standby``) and open the state under
        it; a ServiceError names the pMaster that leads instead."""
        epoch = self.lease.try_acquire()
        if epoch is None:
            leader = self.lease.leader() or {}
            raise ServiceError(f"pMaster at {leader.get('address', '?')} (host {leader.get('host', '?')}, pid "
                               f"{leader.get('pid', '?')}) leads the service whose state is in {self.lease.url}: "
                               "start this one as its standby (`pslink master --standby`), or stop that one first")
        return self.begin(epoch)

    def begin(self, epoch: int) -> RedisStore:
        """A term under ``epoch``: the state, written under it (a newer epoch deposes this one)."""
        self.deposed.clear()
        self._keeping = threading.Event()  # this term's: the last term's renewals end with it
        self.count += 1
        self.store = RedisStore(self.url, epoch, on_fenced=self._depose)
        return self.store

    def keep(self, master: Master, on_deposed: Callable[[], None] = lambda: None) -> None:
        """``master`` leads this term: renew the lease until :meth:`end`; if deposed, stop it (its
        Aggregators are left serving: they follow the new leader) and call ``on_deposed``."""
        self.master = master
        self._on_deposed = on_deposed
        self.lease.describe(master.address)
        self.lease.refresh_view()  # status shows who stands by from the start
        log.warning("pMaster: leading at %s (epoch %d, term %d of this process); state in %s", master.address,
                    self.lease.epoch, self.count, self.lease.url)
        self.lease.keep(self._depose, self._keeping, emptied=lambda: master.call_soon(master.write_state_back))

    def _depose(self) -> None:
        with self._lock:
            if self.deposed.is_set():
                return
            master = self.master  # (taken before the term's loop hears of it and lets go of it)
            self.deposed.set()
        if self.store is not None:
            self.store.abandon()
        if master is not None:
            log.warning("pMaster at %s steps down: a newer leader holds the state in %s", master.address,
                        self.lease.url)
            master.stop(shutdown_aggregators=False)  # writes nothing more, answers nobody
        self._on_deposed()

    def end(self) -> None:
        """The term ends here (a clean stop hands the lease over at once)."""
        self._keeping.set()
        if not self.deposed.is_set():
            self.lease.release()
        self.master = None

    def run(self, make_master: Callable[..., Master], stop: threading.Event, *, standby: bool,
            on_lead: Callable[[Master], None] = lambda master: None) -> None:
        """Lead or stand by until ``stop`` (``pslink master``): each term a fresh
        ``make_master(store, leadership)`` (``leadership``: the lease's status, for pMaster's own);
        the first taken at once unless ``standby``."""
        store = None if standby else self.lead_now()
        try:
            while not stop.is_set():
                if store is None:
                    epoch = self.lease.wait_to_lead(stop)
                    if epoch is None:
                        return
                    store = self.begin(epoch)
                master = make_master(store, self.lease.status)
                store = None
                master.start()
                self.keep(master)
                try:
                    on_lead(master)
                    while not self.deposed.wait(0.2) and not stop.is_set():
                        pass
                finally:
                    self.end()
                    master.stop(shutdown_aggregators=False)
                if self.deposed.is_set():
                    log.warning("pMaster at %s standing by again", master.address)
        finally:
            self.lease.withdraw_standby()
            self.lease.close()
