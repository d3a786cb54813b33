"""pMaster and the hosts of its pool (a mixin of :class:`pslink.core.master.Master`): which
Aggregators may join, and keeping each part's replicas off its primary's host.

An Aggregator joins with the address it advertises and its host's identity
(:mod:`pslink.core.hosts`). It is admitted only if its peers can dial that address: not a
wildcard, not loopback from another host than pMaster's, and answering pMaster when pMaster dials
it (from a thread: the registration goes on when the answer is in). Otherwise the registration
is refused at once, naming the address and the settings that fix it (``--advertise``,
``--interface``), and the Aggregator stops instead of retrying.

Replicas are placed on other hosts than their primary (:func:`~pslink.core.master.recovery.pick_replicas`),
but a migration may then bring a part onto the host of its replica (packing, the guard, a drain
decide where parts go, not where their replicas are). Once such a move landed, the replica moves
to another host when there is one: the new holder learns the part first, then the primary learns
its new replicas, then the old holder drops its copy.
"""

from __future__ import annotations

import logging
import socket
import threading

from pslink.core import hosts
from pslink.core.wire.protocol import Op
from pslink.core.master.recovery import holdings, pick_replicas
from pslink.core.transport.rpc import RpcPeer
from pslink.errors import ConfigError

log = logging.getLogger("pslink.core.master.master")


class MasterHosts:
    """Requires of its host: ``state``, ``store``, ``reactor``, ``provider``, ``host_id``,
    ``dial_back_timeout``, ``_aggregator_peers``, ``_allocating``, ``_deferred``, ``_assign``,
    ``_registered``, ``_pool_registered``, ``_carry_out``, ``assign_timeout``, ``_address_of``
    and ``_log_failure``."""

    # -- joining ------------------------------------------------------------------------------------------

    def _register_aggregator(self, peer: RpcPeer, req: dict) -> None:
        """Admit an Aggregator once its advertised address is one peers can dial: not a wildcard,
        not loopback from another host, and answering pMaster (dialed from a thread; the
        registration goes on when the answer is in). Refused otherwise, naming the address and
        the settings that fix it; the Aggregator stops."""
        address = req["address"]
        who = (f"aggregator {req['agg']}" if req.get("agg") else "an aggregator") + \
            f" (pid {req.get('pid', '?')} on host {req.get('host') or '?'}, connected from {peer.conn.peer})"
        reason = hosts.unreachable_reason(address, req.get("host_id"), self.host_id)
        if reason is not None:
            raise ConfigError(f"{who} is refused: {reason}; {hosts.ADVERTISE_HINT}", address=address)
        if address.split("://", 1)[0] not in ("tcp", "zmq+tcp"):
            self._admit_aggregator(peer, req)
            return

        def dial_back() -> None:
            host, port = hosts.host_of(address), int(address.rpartition(":")[2])
            try:
                socket.create_connection((host, port), timeout=self.dial_back_timeout).close()
                problem = None
            except OSError as exc:
                problem = exc.strerror or str(exc) or type(exc).__name__
            self.reactor.post(answered, problem)

        def answered(problem: str | None) -> None:
            if peer.conn.closed:
                return
            try:
                if problem is not None:
                    peer.error(req, ConfigError(
                        f"{who} is refused: pMaster cannot reach {address}, the address it advertises ({problem}), "
                        f"so workers could not either; {hosts.ADVERTISE_HINT}", address=address))
                    return
                self._admit_aggregator(peer, req)
            finally:
                self._carry_out()

        threading.Thread(target=dial_back, name="pmaster-dial-back", daemon=True).start()

    def _admit_aggregator(self, peer: RpcPeer, req: dict) -> None:
        taken = self.provider.names() if self.provider is not None else ()
        record = self.state.register_aggregator(req["address"], req.get("agg"), req.get("pid", 0), req.get("host", ""),
                                                req.get("host_id", ""), taken=taken)
        if req.get("agg") is None and self.provider is not None:
            self.provider.reserve([record.name])  # the provider must not start another under its name
        old = self._aggregator_peers.get(record.name)
        if old is not None and old is not peer:
            old.conn.close()
        self._aggregator_peers[record.name] = peer
        peer.info.update(role="aggregator", name=record.name)
        self.store.save_aggregator(record)
        peer.reply(req, body={"agg": record.name})
        placeholder = self._allocating.pop(record.name, None)
        self.state.aggregator_joined(record.name, placeholder)
        if req.get("keep"):
            self.state.control.pinned.add(record.name)  # an operator's (`pslink aggregator`): scaling keeps it
        if placeholder is not None:
            for job_record, specs in self._deferred.pop(placeholder, []):
                self._assign(job_record, specs)
        log.info("aggregator %s registered at %s", record.name, record.address)
        with self._registered:
            self._registered.notify_all()
        self._pool_registered()
        # After a pMaster or Aggregator restart: make sure it holds what it was given.
        for job, specs in self.state.tasks_on(record.name):
            peer.call(Op.ASSIGN, self._log_failure(f"re-assigning job {job.job} to {record.name}"),
                      timeout=self.assign_timeout, jobinfo=job.jobinfo(), tasks=specs)
        self._separate_all_replicas()

    # -- replicas apart from their primary ------------------------------------------------------------

    def _separate_replicas(self, task: tuple) -> None:
        """After ``task`` moved: a replica that now shares its primary's host goes to another host,
        if one has a live Aggregator."""
        job, key, index = task
        record = self.state.jobs.get(job)
        spec = record.keys.get(key) if record is not None else None
        if spec is not None and spec.ready and index < len(spec.parts):
            self._separate_part(record, spec, spec.parts[index])

    def _separate_all_replicas(self) -> None:
        """An Aggregator joined: replicas that had to share their primary's host (no other host had
        one, or the new one was still starting when they were placed) may move to its host now."""
        for record in list(self.state.jobs.values()):
            for spec in list(record.keys.values()):
                if spec.ready:
                    for part in spec.parts:
                        self._separate_part(record, spec, part)

    def _separate_part(self, record, spec, part) -> None:
        job, key, index = record.job, spec.key, part.part
        host_of = self.state.control.host_of
        primary_host = host_of.get(part.aggregator)
        for old in [r for r in part.replicas if host_of.get(r) == primary_host]:
            others = [r for r in part.replicas if r != old]
            new = pick_replicas(self.state.replica_candidates(), holdings(self.state.jobs), 1,
                                exclude={part.aggregator, *part.replicas}, hosts=host_of,
                                away_from=[part.aggregator, *others])
            if not new or host_of.get(new[0]) in {host_of.get(n) for n in [part.aggregator, *others]}:
                return  # no other host has room for it: it stays where it is
            log.info("pMaster: key %r part %d of job %s shares a host with its replica on %s; the replica "
                     "goes to %s", key, index, job, old, new[0])
            part.replicas = others + new
            self.store.save_key(job, spec)
            self._swap_replica(record, spec, part, old, new[0])

    def _swap_replica(self, record, spec, part, old: str, new: str) -> None:
        """The new holder learns the part, then the primary its replicas (a round replicated to a
        holder that does not know the part yet would be dropped), then the old holder forgets it."""

        def entries(name, **extra):
            return [dict(e, **extra) for e in spec.task_specs(name, self._address_of) if e["part"] == part.part]

        def tell_primary(result, error):
            if error is not None:
                log.warning("pMaster: giving %s a replica of key %r part %d failed: %s", new, spec.key, part.part,
                            error)
            primary = self._aggregator_peers.get(part.aggregator)
            if primary is not None:
                primary.call(Op.ASSIGN, drop_old, timeout=self.assign_timeout, jobinfo=record.jobinfo(),
                             tasks=entries(part.aggregator))

        def drop_old(result, error):
            holder = self._aggregator_peers.get(old)
            if holder is not None and error is None:
                stale = [dict(e, replica=True, drop=True) for e in spec.task_specs(None) if e["part"] == part.part]
                holder.call(Op.ASSIGN, self._log_failure(f"dropping {old}'s replica of key {spec.key!r}"),
                            timeout=self.assign_timeout, jobinfo=record.jobinfo(), tasks=stale)

        holder = self._aggregator_peers.get(new)
        if holder is None:
            tell_primary(None, None)
            return
        holder.call(Op.ASSIGN, tell_primary, timeout=self.assign_timeout, jobinfo=record.jobinfo(),
                    tasks=entries(new))
