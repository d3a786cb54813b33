"""pMaster's side of an operator changing the pool while jobs run (a mixin of
:class:`pslink.core.master.Master`): ``pslink service add`` and ``pslink service remove``.

Adding starts Aggregators through the provider; the answer comes once they registered (or, past
``pool_timeout``, an error naming those that did not). ``min_aggregators`` rises with them, so
scaling down keeps them.

Removing one drains it first: the control plane takes it out of the plan (no new task goes
there) and moves every task it serves by live migration (to the others with room, else to a new
Aggregator); the replicas it holds go to other Aggregators at once. It is released (SHUTDOWN,
then the provider stops it) once no migration leaves it any more, and only then is the answer
sent: what moved where. A move that fails to start keeps it in the pool, and the answer says so.
"""

from __future__ import annotations

import logging

from pslink.core.wire.protocol import Op
from pslink.core.master.recovery import Rereplicate
from pslink.core.transport.rpc import RpcPeer
from pslink.errors import ConfigError, ProtocolError, PslinkError, PslinkTimeoutError, ServiceError

log = logging.getLogger("pslink.core.master.master")

MAX_ADD = 64  # per request: a typo (-n 1000) should not start a thousand processes


class MasterPool:
    """Requires of its host: ``state``, ``store``, ``reactor``, ``provider``, ``_aggregator_peers``,
    ``_allocate``, ``_release_after``, ``assign_timeout``, ``aggregator_alive``,
    ``_address_of`` and ``_log_failure``."""

    pool_timeout = 60.0  # how long an added Aggregator may take to register

    def _init_pool(self) -> None:
        self._pool_adds: list[dict] = []  # {peer, req, names, timer}: answered once all registered
        self._pool_removals: dict[str, dict] = {}  # draining Aggregator -> {peer, req, moves, replicas}

    def _pool(self, peer: RpcPeer, req: dict) -> None:
        action = req["action"]
        if action == "add":
            self._pool_add(peer, req)
        elif action == "remove":
            if not req.get("agg"):
                raise ProtocolError("POOL remove needs the name of the Aggregator to remove (agg)")
            self._pool_remove(peer, req, req["agg"])
        else:
            raise ProtocolError(f"POOL action {action!r} is unknown: use 'add' or 'remove'")

    # -- adding ---------------------------------------------------------------------------------------

    def _pool_add(self, peer: RpcPeer, req: dict) -> None:
        count = req.get("count", 1)
        if self.provider is None:
            raise ServiceError("this pMaster has no provider to start Aggregators with (it serves those that "
                               "register with it): start one on any host with `pslink aggregator --master ...`")
        if not 1 <= count <= MAX_ADD:
            raise ConfigError(f"the number of Aggregators to add must be 1 to {MAX_ADD}, got {count}")
        allocations = self.state.control.add_aggregators(count)
        names = []
        try:
            for allocation in allocations:
                names.append(self._allocate(allocation))
        except Exception as exc:
            for allocation in allocations[len(names):]:  # never started: out of the plan again
                self.state.control.aggregator_lost(allocation.placeholder)
            raise ServiceError(f"starting Aggregators failed after {names or 'none'}: {exc}") from exc
        log.info("pMaster: an operator adds aggregator(s) %s", ", ".join(names))
        wait = {"peer": peer, "req": req, "names": names}
        wait["timer"] = self.reactor.call_later(self.pool_timeout, self._pool_add_timed_out, wait)
        self._pool_adds.append(wait)
        self._pool_registered()

    def _pool_registered(self) -> None:
        """An Aggregator registered: answer the adds now complete."""
        for wait in [w for w in self._pool_adds if all(self.aggregator_alive(n) for n in w["names"])]:
            self._pool_adds.remove(wait)
            wait["timer"].cancel()
            wait["peer"].reply(wait["req"], body={"added": wait["names"],
                                                  "min_aggregators": self.state.control.min_aggregators})

    def _pool_add_timed_out(self, wait: dict) -> None:
        if wait in self._pool_adds:
            self._pool_adds.remove(wait)
            missing = [n for n in wait["names"] if not self.aggregator_alive(n)]
            details = "; ".join(filter(None, (self.provider.diagnose(n) for n in missing))) if self.provider else ""
            wait["peer"].error(wait["req"], PslinkTimeoutError(
                f"aggregator(s) {', '.join(missing)} did not register within {self.pool_timeout:.0f} s"
                + (f" ({details})" if details else "")))

    # -- removing -------------------------------------------------------------------------------------

    def _pool_remove(self, peer: RpcPeer, req: dict, name: str) -> None:
        if name in self._pool_removals:
            raise ServiceError(f"aggregator {name} is already being removed")
        if name in self.state.aggregators and name not in self._aggregator_peers:
            # Its tasks could not be copied off it: pMaster fails it over by itself instead.
            raise ServiceError(f"aggregator {name} is not connected to pMaster (down, or failing over); "
                               "it cannot be drained")
        moves, replicas = self.state.remove_from_pool(name)
        log.info("pMaster: an operator removes aggregator %s: %d task(s) and %d replica(s) move", name, len(moves),
                 len(replicas))
        self._pool_removals[name] = {"peer": peer, "req": req, "moves": list(moves), "replicas": replicas,
                                     "pending": len(replicas)}
        for action in replicas:
            self._move_replica(name, action)
        # The moves and the Release are in the outbox: pMaster carries them out after this request.

    def _move_replica(self, leaving: str, action: Rereplicate) -> None:
        """The new replicas learn what they hold first; then the part's Aggregator learns where its
        replicas are (a round replicated to one that does not hold it yet would drop it); only
        then may ``leaving`` go (until then, it is the replica the rounds reach)."""
        record, spec, part = action.record, action.spec, action.part
        self.store.save_key(record.job, spec)
        primary = self._aggregator_peers.get(part.aggregator)

        def entries(name):
            return [e for e in spec.task_specs(name, self._address_of) if e["part"] == part.part]

        def tell_primary(result=None, error=None):
            if error is not None:
                log.warning("pMaster: giving a replica of key %r part %d failed: %s", spec.key, part.part, error)
            outcome["left"] -= 1
            if outcome["left"] == 0:
                if primary is None:
                    self._replica_moved(leaving)
                    return
                primary.call(Op.ASSIGN, told, timeout=self.assign_timeout, jobinfo=record.jobinfo(),
                             tasks=entries(part.aggregator))

        def told(result, error):
            if error is not None:
                log.warning("pMaster: telling %s of key %r's replicas failed: %s", part.aggregator, spec.key, error)
            self._replica_moved(leaving)

        holders = [(n, self._aggregator_peers.get(n)) for n in action.added]
        holders = [(n, p) for n, p in holders if p is not None]
        outcome = {"left": len(holders)}
        if not holders:
            tell_primary()
        for name, holder in holders:
            holder.call(Op.ASSIGN, tell_primary, timeout=self.assign_timeout, jobinfo=record.jobinfo(),
                        tasks=entries(name))

    def _replicas_moving(self, name: str) -> bool:
        removal = self._pool_removals.get(name)
        return removal is not None and removal["pending"] > 0

    def _replica_moved(self, leaving: str) -> None:
        removal = self._pool_removals.get(leaving)
        if removal is None:
            return
        removal["pending"] -= 1
        waiting = self._release_after.get(leaving)
        if removal["pending"] == 0 and waiting is not None and not self._moving(leaving):
            del self._release_after[leaving]
            self._release(waiting)

    def _pool_released(self, name: str) -> None:
        """``name`` was released: answer its removal with what moved where."""
        removal = self._pool_removals.pop(name, None)
        if removal is None:
            return
        moved = []
        for job, key, part in removal["moves"]:
            record = self.state.jobs.get(job)
            spec = record.keys.get(key) if record is not None else None
            if spec is not None and part < len(spec.parts):
                moved.append([job, key, part, spec.parts[part].aggregator])
        replicas = [[a.record.job, a.spec.key, a.part.part, list(a.added)] for a in removal["replicas"]]
        removal["peer"].reply(removal["req"], body={"removed": name, "moved": moved, "replicas": replicas,
                                                    "min_aggregators": self.state.control.min_aggregators})

    def _removal_failed(self, source: str, task: tuple, target: str, error: PslinkError) -> None:
        """A task leaving a draining Aggregator could not move: it stays in the pool with what it
        still holds (the caller puts the task back in the plan)."""
        if source not in self.state.control.draining:
            return
        self.state.control.undrain(source)
        self._release_after.pop(source, None)
        removal = self._pool_removals.pop(source, None)
        if removal is not None:
            removal["peer"].error(removal["req"], ServiceError(
                f"removing aggregator {source}: moving {task} to {target} failed ({error}); {source} stays in the "
                "pool with the tasks it still has"))
