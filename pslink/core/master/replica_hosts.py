"""Each part's replicas on another host than its primary, as far as the pool's hosts allow.

Replicas are placed on other hosts than their primary (:func:`~pslink.core.master.failover_plan.pick_replicas`),
but a migration may then bring a part onto the host of its replica (packing, the guard, a drain
decide where parts go, not where their replicas are), and a part placed while the only other host's
Aggregator was still starting had no other host to replicate to. So after a move lands, when a key
is placed and when an Aggregator joins, a replica that shares its primary's host moves to another
host that has a live Aggregator: the new holder learns the part first, then the primary learns its
new replicas, then the old holder drops its copy. At the same moments a part short of replicas
gets them.
"""

from __future__ import annotations

import logging
from typing import Callable

from pslink.core.master.links import AggregatorLinks
from pslink.core.master.failover_plan import holdings, pick_replicas
from pslink.core.master.state import MasterState
from pslink.core.master.store import MasterStore
from pslink.core.wire.protocol import Op
from pslink.errors import PslinkError, ServiceError

log = logging.getLogger("pslink.core.master")

#: Seconds a replica pMaster counts may go unreached by any round (its holder's heartbeats say)
#: while its primary is connected, before pMaster gives both their orders again.
UNREACHED_PATIENCE = 3.0


class Replicas:
    """Moves replicas off their primary's host for pMaster."""

    def __init__(self, state: MasterState, store: MasterStore, links: AggregatorLinks,
                 incoming: Callable[[], dict] = dict):
        self.state, self.store, self.links = state, store, links
        self.incoming = incoming  # parts moving now -> their targets (no replica goes there)
        self._unreached: dict[tuple, list] = {}  # (holder, part) -> [since, orders sent again]

    def _not_for(self, record, spec, part) -> set:
        """Who may not hold ``part``'s replicas: its primary, its replicas, its move's target."""
        return {part.aggregator, *part.replicas, self.incoming().get((record.job, spec.key, part.part))}

    def after_move(self, task: tuple) -> None:
        """After ``task`` moved: a replica that now shares its primary's host goes to another host,
        if one has a live Aggregator."""
        job, key, index = task
        record = self.state.jobs.get(job)
        spec = record.keys.get(key) if record is not None else None
        if spec is not None and spec.ready and index < len(spec.parts):
            self.top_up(record, spec, spec.parts[index])
            self.separate(record, spec, spec.parts[index])

    def everywhere(self) -> None:
        """An Aggregator joined: replicas that had to share their primary's host (no other host had
        one, or the new one was still starting when they were placed) may move to its host now."""
        for record in list(self.state.jobs.values()):
            for spec in list(record.keys.values()):
                if spec.ready:
                    for part in spec.parts:
                        self.top_up(record, spec, part)
                        self.separate(record, spec, part)

    def unreached(self) -> None:
        """pMaster's sweep: a replica it counts that no round reached (its holder's heartbeats
        say) for :data:`UNREACHED_PATIENCE`, its primary connected, gets its orders again (the
        holder's, then the primary's list of replicas), and again each such spell. An order
        lost with its connection, or refused, otherwise left a replica no round ever reached:
        found in CI under lost control messages with nothing killed (the next failover would
        promote it). One walk over the parts, whatever the number of Aggregators."""
        now, seen = self.state.clock(), set()
        reached = {name: record.stats.get("replicas_with_state", ()) for name, record in self.state.aggregators.items()}
        for job in list(self.state.jobs.values()):
            for spec in list(job.keys.values()):
                for part in spec.parts if spec.ready else ():
                    ident = (job.job, spec.key, part.part)
                    for holder in part.replicas:
                        if holder not in reached or ident in reached[holder] or self.links.get(holder) is None \
                                or self.links.get(part.aggregator) is None:
                            continue
                        seen.add((holder, ident))
                        since = self._unreached.setdefault((holder, ident), [now, 0])
                        if now - since[0] < UNREACHED_PATIENCE:
                            continue
                        since[:] = [now, since[1] + 1]
                        (log.info if since[1] == 1 else log.debug)(
                            "pMaster: no round reached %s's replica of key %r part %d of job %s for %.0f s; telling "
                            "%s and %s again", holder, spec.key, part.part, job.job, UNREACHED_PATIENCE, holder,
                            part.aggregator)
                        give_replicas(self.links, job, spec, part, [holder])
        for gone in [k for k in self._unreached if k not in seen]:
            del self._unreached[gone]

    def top_up(self, record, spec, part, avoid: frozenset = frozenset()) -> bool:
        """A part with fewer replicas than its job's replication (a move onto the Aggregator that
        held its replica, resumed after a pMaster restart when no other Aggregator had registered
        yet; a replica its primary could not reach) gets them from the live Aggregators, when
        there are (not from ``avoid``). True if it did."""
        need = record.replication - len(part.replicas)
        if need <= 0 or self.links.get(part.aggregator) is None:
            return False
        added = pick_replicas(self.state.replica_candidates(), holdings(self.state.jobs), need,
                              exclude={*self._not_for(record, spec, part), *avoid}, hosts=self.state.control.pool.host_of,
                              away_from=[part.aggregator, *part.replicas])
        if not added:
            return False
        log.info("pMaster: key %r part %d of job %s has %d of its %d replica(s); %s take(s) the others", spec.key,
                 part.part, record.job, len(part.replicas), record.replication, ", ".join(added))
        part.replicas += added
        self.store.save_key(record.job, spec)
        give_replicas(self.links, record, spec, part, added)
        return True

    def dropped(self, primary: str, entries) -> None:
        """``primary`` went on without replicas it could not reach (its heartbeat says so until
        pMaster names the part's replicas again): pMaster no longer counts them (a failover
        would promote one without the rounds since), their holders drop their stale copies, and
        the part gets other replicas where it can (else at the next registration)."""
        for entry in entries:
            found = self.state.reported_part(entry)
            if found is None or len(entry) != 4 or not isinstance(entry[3], str):
                continue
            record, spec, index = found
            part, name = spec.parts[index], entry[3]
            if part.aggregator != primary or name not in part.replicas:
                continue
            log.warning("pMaster: %s could not reach %s, its replica of key %r part %d of job %s; it no longer "
                        "counts as one", primary, name, spec.key, index, record.job)
            part.replicas.remove(name)
            self.store.save_key(record.job, spec)
            self._drop_copy(record, spec, part, name)
            if not self.top_up(record, spec, part, avoid=frozenset({name})):
                give_replicas(self.links, record, spec, part, [])  # the primary hears its replicas: it stops saying

    def _drop_copy(self, record, spec, part, holder_name: str) -> None:
        holder = self.links.get(holder_name)
        if holder is not None:
            stale = [dict(e, replica=True, drop=True) for e in spec.task_specs(None) if e["part"] == part.part]
            holder.call(Op.ASSIGN, self.links.log_failure(f"dropping {holder_name}'s replica of key {spec.key!r}"),
                        timeout=self.links.timeout, jobinfo=record.jobinfo(), tasks=stale)

    def separate(self, record, spec, part) -> None:
        """Move the replicas of ``part`` that share its primary's host, if another host can take them."""
        job, key, index = record.job, spec.key, part.part
        host_of = self.state.control.pool.host_of
        primary_host = host_of.get(part.aggregator)
        for old in [r for r in part.replicas if host_of.get(r) == primary_host]:
            others = [r for r in part.replicas if r != old]
            new = pick_replicas(self.state.replica_candidates(), holdings(self.state.jobs), 1,
                                exclude=self._not_for(record, spec, part), hosts=host_of,
                                away_from=[part.aggregator, *others])
            if not new or host_of.get(new[0]) in {host_of.get(n) for n in [part.aggregator, *others]}:
                return  # no other host has room for it: it stays where it is
            log.info("pMaster: key %r part %d of job %s shares a host with its replica on %s; the replica "
                     "goes to %s", key, index, job, old, new[0])
            part.replicas = others + new
            self.store.save_key(job, spec)
            self._swap_replica(record, spec, part, old, new[0])

    def _swap_replica(self, record, spec, part, old: str, new: str) -> None:
        """The new holder learns the part, then the primary its replicas, then the old holder
        forgets it (if the primary took the news)."""

        def drop_old(error):
            if error is None:
                self._drop_copy(record, spec, part, old)

        give_replicas(self.links, record, spec, part, [new], drop_old)


def give_replicas(links: AggregatorLinks, record, spec, part, added: list[str],
                  done: Callable[[PslinkError | None], None] = lambda error: None) -> None:
    """Tell the Aggregators in ``added`` that they hold a replica of ``part``, then, once they
    answered, the part's own Aggregator where its replicas are: it replicates to them at once
    (a new replica gets the part's state without waiting for a round), and a replica that does
    not know the part yet would refuse it. ``done(error)`` follows the primary's answer (an
    error if it failed or is not connected). Holders not connected are left out: their own
    failover deals with them."""

    def entries(name):
        return [e for e in spec.task_specs(name, links.address_of) if e["part"] == part.part]

    def told(result, error):
        if error is not None:
            log.warning("pMaster: telling %s of key %r's replicas failed: %s", part.aggregator, spec.key, error)
        done(error)

    def held(name, error):
        if error is not None:
            log.warning("pMaster: giving %s a replica of key %r part %d failed: %s", name, spec.key, part.part, error)
        waiting.discard(name)
        if not waiting and not links.call(part.aggregator, Op.ASSIGN, told, jobinfo=record.jobinfo(),
                                          tasks=entries(part.aggregator)):
            done(ServiceError(f"aggregator {part.aggregator} is not connected"))

    holders = [name for name in added if links.get(name) is not None]
    waiting = set(holders)
    if not holders:
        held(None, None)
    for name in holders:
        links.call(name, Op.ASSIGN, lambda result, error, name=name: held(name, error), jobinfo=record.jobinfo(),
                   tasks=entries(name))
