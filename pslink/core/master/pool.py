"""pMaster's pool: starting and releasing Aggregators, and an operator changing the pool while
jobs run (``pslink service add`` and ``pslink service remove``).

A release waits until no migration leaves or reaches the Aggregator (nor, for one being removed,
a replica it hands on); then it gets SHUTDOWN and the provider stops it.

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
import threading
from typing import Callable

from pslink.core.master.actions import Allocate, Release
from pslink.core.master.links import AggregatorLinks
from pslink.core.master.migration_core import Migrations
from pslink.core.master.failover_plan import Rereplicate, holdings
from pslink.core.master.replica_hosts import give_replicas
from pslink.core.master.state import MasterState
from pslink.core.master.store import MasterStore
from pslink.core.transport.rpc import RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Op
from pslink.errors import ConfigError, ProtocolError, PslinkError, PslinkTimeoutError, ServiceError

log = logging.getLogger("pslink.core.master")  # as every part of pMaster: one name to filter its log by

MAX_ADD = 64  # per request: a typo (-n 1000) should not start a thousand processes


class Pool:
    """The pool as pMaster runs it. ``provider()`` starts and stops Aggregators (None: the pool
    stays as it is); ``moves`` tells which Aggregators are part of a migration; ``alive(name)``
    whether an Aggregator is registered and connected; ``carry_out()`` carries out what the
    control plane decided meanwhile."""

    pool_timeout = 60.0  # how long an added Aggregator may take to register

    def __init__(self, state: MasterState, store: MasterStore, reactor: Reactor, links: AggregatorLinks, *,
                 provider: Callable, moves: Migrations, alive: Callable[[str], bool], carry_out: Callable[[], None]):
        self.state, self.store, self.reactor, self.links = state, store, reactor, links
        self.provider, self.moves, self.alive, self.carry_out = provider, moves, alive, carry_out
        self.allocating: dict[str, str] = {}  # Aggregator being started -> placeholder it fills
        self._release_after: dict[str, Release] = {}  # released once no migration leaves it
        self._pool_adds: list[dict] = []  # {peer, req, names, timer}: answered once all registered
        self._pool_removals: dict[str, dict] = {}  # draining Aggregator -> {peer, req, moves, replicas}
        # Removals stored by a pMaster that stopped before they ended: resumed once each registers.
        self.resume: set[str] = set(store.load_removing())

    # -- starting and releasing ---------------------------------------------------------------------

    def allocate(self, action: Allocate) -> str | None:
        provider = self.provider()
        if provider is None:
            log.error("pMaster: %s needs a new Aggregator, but there is no provider", action.reason)
            return None
        (name,) = provider.start(1)
        self.allocating[name] = action.placeholder
        log.info("pMaster: starting aggregator %s (%s)", name, action.reason)
        return name

    def release(self, action: Release) -> None:
        name = action.aggregator
        if self.moves.moving(name) or self._replicas_moving(name):
            # Tasks (or replicas) are still moving off (or onto) it: let it go when they are done.
            self._release_after[name] = action
            return
        if self._keeps_parts(name, action.reason):
            return
        log.info("pMaster: releasing aggregator %s (%s)", name, action.reason)
        peer = self.links.peers.pop(name, None)
        if peer is not None:
            peer.notify(Op.SHUTDOWN)
        self.state.remove_aggregator(name)
        self.store.delete_aggregator(name)
        self._reap(name)
        self._pool_released(name)

    def _keeps_parts(self, name: str, reason: str) -> bool:
        """Parts still placed on ``name`` (a move off it failed: its source or target was not
        connected) keep it in the pool, back in the plan with them: released, it would be
        forgotten with them, never failed over, and the Agents told no address for them (found
        by the chaos run: a scale-down drained an Aggregator that had just died)."""
        placed = [(record.job, spec.key, part.part) for record in self.state.jobs.values()
                  for spec in record.keys.values() for part in spec.parts if part.aggregator == name]
        if not placed:
            return False
        log.warning("pMaster: not releasing aggregator %s (%s): %d part(s) still placed on it (a move off it "
                    "failed); it stays in the pool", name, reason, len(placed))
        control = self.state.control
        control.aggregator_added(name)
        for ident in placed:
            try:
                control.move_task(ident, name, "its move failed")  # what is (not carried out)
            except KeyError:
                pass  # the plan does not count it (its job is profiling, or ended)
        return True

    def forget(self, name: str) -> None:
        """A failed Aggregator: reap its process, if the provider started it."""
        provider = self.provider()
        if provider is not None and name in provider.names():
            self._reap(name)

    def _reap(self, name: str) -> None:
        provider = self.provider()
        if provider is not None:
            # Reaping may take seconds: not on the loop that serves everyone else.
            threading.Thread(target=provider.stop, args=(name,), daemon=True).start()

    def settled(self, names) -> None:
        """Moves involving ``names`` ended: release those waiting for it; sources may be idle now."""
        for name in dict.fromkeys(names):
            waiting = self._release_after.get(name)
            if waiting is not None and not self.moves.moving(name) and not self._replicas_moving(name):
                del self._release_after[name]
                self.release(waiting)
        if self.moves.idle():
            # Sources that kept tasks until their migrations were under way may be empty now.
            # Judged once this turn is over, not now: a failover abandons the moves onto a lost
            # target before it re-homes their tasks (back on their source, or on a replica).
            self.reactor.post(self._release_idle)

    def _release_idle(self) -> None:
        if self.moves.idle():
            # Whatever pMaster's jobs place on an Aggregator keeps it, also where the plan does not
            # count it (yet): a part a failover gave back to its source. Replica holders the
            # control plane keeps by itself (PoolPlan.replica_holders, which MasterState gives the plane).
            holding = {name for name, count in holdings(self.state.jobs).items() if count}
            self.state.outbox += self.state.control.release_idle("emptied by migrations", keep=holding)
            self.carry_out()

    # -- an operator's requests ---------------------------------------------------------------------

    def request(self, peer: RpcPeer, req: dict) -> None:
        """POOL: add (``count``) or remove (``agg``) Aggregators."""
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
        if self.provider() is None:
            raise ServiceError("this pMaster has no provider to start Aggregators with (it serves those that "
                               "register with it): start one on any host with `pslink aggregator --master ...`")
        if not 1 <= count <= MAX_ADD:
            raise ConfigError(f"the number of Aggregators to add must be 1 to {MAX_ADD}, got {count}")
        allocations = self.state.control.add_aggregators(count)
        names = []
        try:
            for allocation in allocations:
                names.append(self.allocate(allocation))
        except Exception as exc:
            for allocation in allocations[len(names):]:  # never started: out of the plan again
                self.state.control.aggregator_lost(allocation.placeholder)
            raise ServiceError(f"starting Aggregators failed after {names or 'none'}: {exc}") from exc
        log.info("pMaster: an operator adds aggregator(s) %s", ", ".join(names))
        wait = {"peer": peer, "req": req, "names": names}
        wait["timer"] = self.reactor.call_later(self.pool_timeout, self._pool_add_timed_out, wait)
        self._pool_adds.append(wait)
        self.registered()

    def registered(self) -> None:
        """An Aggregator registered: answer the adds now complete; removals a restart interrupted
        may go on (judged once this turn is over: the registration's own work comes first)."""
        for wait in [w for w in self._pool_adds if all(self.alive(n) for n in w["names"])]:
            self._pool_adds.remove(wait)
            wait["timer"].cancel()
            wait["peer"].reply(wait["req"], body={"added": wait["names"],
                                                  "min_aggregators": self.state.control.pool.min_aggregators})
        if self.resume:
            self.reactor.post(self._resume_removals)

    def _pool_add_timed_out(self, wait: dict) -> None:
        if wait in self._pool_adds:
            self._pool_adds.remove(wait)
            missing = [n for n in wait["names"] if not self.alive(n)]
            provider = self.provider()
            details = "; ".join(filter(None, (provider.diagnose(n) for n in missing))) if provider else ""
            wait["peer"].error(wait["req"], PslinkTimeoutError(
                f"aggregator(s) {', '.join(missing)} did not register within {self.pool_timeout:.0f} s"
                + (f" ({details})" if details else "")))

    # -- removing -------------------------------------------------------------------------------------

    def removing(self) -> set[str]:
        """The Aggregators an operator is removing: under way, or to go on with after a restart."""
        return set(self._pool_removals) | set(self.resume)

    def _pool_remove(self, peer: RpcPeer, req: dict, name: str) -> None:
        if name in self._pool_removals:
            raise ServiceError(f"aggregator {name} is already being removed")
        if name in self.state.aggregators and name not in self.links.peers:
            # Its tasks could not be copied off it: pMaster fails it over by itself instead.
            raise ServiceError(f"aggregator {name} is not connected to pMaster (down, or failing over); "
                               "it cannot be drained")
        moves, replicas = self.state.remove_from_pool(name, {task: m.target for task, m in self.moves.running.items()})
        log.info("pMaster: an operator removes aggregator %s: %d task(s) and %d replica(s) move", name, len(moves),
                 len(replicas))
        self._pool_removals[name] = {"peer": peer, "req": req, "moves": list(moves), "replicas": replicas,
                                     "pending": len(replicas)}
        self.store.save_removing(self._pool_removals)  # a pMaster restarted before it ends goes on with it
        for action in replicas:
            self._move_replica(name, action)
        # The moves and the Release are in the outbox: pMaster carries them out after this request.

    def _resume_removals(self) -> None:
        """pMaster restarted while an operator was removing Aggregators: each such removal goes on once its Aggregator is back and the pool has room for its
        parts (until then it waits for the next registration; nobody waits for its answer now)."""
        for name in sorted(self.resume):
            if name not in self.links.peers:
                continue
            try:
                self._pool_remove(None, None, name)
            except PslinkError as exc:
                log.info("pMaster: the removal of aggregator %s, begun before a restart, waits: %s", name,
                         exc.message)
                continue
            self.resume.discard(name)
            log.info("pMaster: the removal of aggregator %s, begun before a restart, goes on", name)
            self.carry_out()

    def _move_replica(self, leaving: str, action: Rereplicate) -> None:
        """The new replicas learn what they hold first; then the part's Aggregator learns where its
        replicas are; only then may ``leaving`` go (until then, it is the replica the rounds reach)."""
        self.store.save_key(action.record.job, action.spec)
        give_replicas(self.links, action.record, action.spec, action.part, action.added,
                      lambda error: self._replica_moved(leaving))

    def _replicas_moving(self, name: str) -> bool:
        removal = self._pool_removals.get(name)
        return removal is not None and removal["pending"] > 0

    def _replica_moved(self, leaving: str) -> None:
        removal = self._pool_removals.get(leaving)
        if removal is None:
            return
        removal["pending"] -= 1
        waiting = self._release_after.get(leaving)
        if removal["pending"] == 0 and waiting is not None and not self.moves.moving(leaving):
            del self._release_after[leaving]
            self.release(waiting)

    def _pool_released(self, name: str) -> None:
        """``name`` was released: answer its removal with what moved where."""
        removal = self._pool_removals.pop(name, None)
        if removal is None:
            return
        self.store.save_removing(self._pool_removals)
        moved = []
        for job, key, part in removal["moves"]:
            record = self.state.jobs.get(job)
            spec = record.keys.get(key) if record is not None else None
            if spec is not None and part < len(spec.parts):
                moved.append([job, key, part, spec.parts[part].aggregator])
        replicas = [[a.record.job, a.spec.key, a.part.part, list(a.added)] for a in removal["replicas"]]
        if removal["peer"] is None:  # resumed after a pMaster restart: whoever asked is gone
            log.info("pMaster: aggregator %s is removed (its removal resumed after a restart): %d part(s) moved",
                     name, len(moved))
            return
        removal["peer"].reply(removal["req"], body={"removed": name, "moved": moved, "replicas": replicas,
                                                    "min_aggregators": self.state.control.pool.min_aggregators})

    def removal_failed(self, source: str, task: tuple, target: str, error: PslinkError) -> None:
        """A task leaving a draining Aggregator could not move: it stays in the pool with what it
        still holds (the caller puts the task back in the plan)."""
        if source not in self.state.control.pool.draining:
            return
        self.state.control.undrain(source)
        self._release_after.pop(source, None)
        removal = self._pool_removals.pop(source, None)
        self.store.save_removing(self._pool_removals)
        if removal is not None and removal["peer"] is not None:
            removal["peer"].error(removal["req"], ServiceError(
                f"removing aggregator {source}: moving {task} to {target} failed ({error}); {source} stays in the "
                "pool with the tasks it still has"))
