"""pMaster placing keys: LOOKUP declares them, the control plane places their parts, ASSIGN
tells the Aggregators (primaries and replica holders), and the lookups waiting on a key are
answered once every Aggregator answered. DELETE_KEYS forgets them everywhere.

A placement whose ASSIGN failed is forgotten and placed again (the next placement may differ):
the Aggregators that got it drop what they were given, now or when they register again, or a
later move or replica onto them would find a stale copy of the key there (found by the chaos
run with control faults: "expects no copy", a move that never ended).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from pslink.core.master.records import JobRecord, KeySpec, LookupWait
from pslink.core.master.links import AggregatorLinks
from pslink.core.master.replica_hosts import Replicas
from pslink.core.master.state import MasterState
from pslink.core.master.store import MasterStore
from pslink.core.transport.rpc import RpcPeer
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import Op
from pslink.errors import PeerError, PslinkError, ServiceError, ShapeMismatchError

log = logging.getLogger("pslink.core.master")


def spec_to_wire(spec: KeySpec, aggregators: dict) -> dict:
    return {
        "key": spec.key,
        "shape": list(spec.shape),
        "dtype": spec.dtype,
        "declared_by": spec.declared_by,
        "parts": [
            [p.part, p.span[0], p.span[1], p.aggregator, _address(aggregators, p.aggregator)] for p in spec.parts
        ],
        **({"table": spec.table} if spec.table is not None else {}),
    }


def _address(aggregators: dict, name: str) -> str:
    record = aggregators.get(name)
    return record.address if record is not None else ""  # a lost Aggregator's (the key failed with it)


def holders_of(spec: KeySpec) -> set[str]:
    """Every Aggregator a key's placement gives something: its parts' and their replicas'."""
    return {name for part in spec.parts for name in (part.aggregator, *part.replicas)}


class KeyPlacing:
    """LOOKUP and DELETE_KEYS. ``abort_key(record, key, error)`` fails a key everywhere."""

    def __init__(self, state: MasterState, store: MasterStore, reactor: Reactor, links: AggregatorLinks,
                 replicas: Replicas, abort_key: Callable[[JobRecord, Any, PslinkError], None]):
        self.state, self.store, self.reactor, self.links, self.replicas = state, store, reactor, links, replicas
        self.abort_key = abort_key
        self.deferred: dict[str, list] = {}  # placeholder -> (record, specs) to assign once it is up
        self.waits: dict[tuple[str, Any], list[LookupWait]] = {}
        self.drops_owed: dict[str, dict[str, set]] = {}  # Aggregator away -> job -> keys it must drop

    # -- LOOKUP ---------------------------------------------------------------------------------

    def lookup(self, peer: RpcPeer, req: dict, attempts: int = 1) -> None:
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        specs, created = [], []
        for item in req["items"]:
            try:
                spec, new = self.state.declare(record, req["rank"], item)
            except ShapeMismatchError as exc:
                # The first declarer may be waiting on this key already: fail it too, now.
                self.abort_key(record, item.get("key"), exc)
                for spec_ in created:
                    self.state.forget_key(record, spec_.key)
                raise
            except PslinkError:
                for spec_ in created:
                    self.state.forget_key(record, spec_.key)
                raise
            specs.append(spec)
            if new:
                created.append(spec)
        wait = LookupWait(peer, req, record, specs, attempts)
        if not wait.missing:
            self._answer(wait)
            return
        for key in wait.missing:
            self.waits.setdefault((record.job, key), []).append(wait)
        if created:
            self.assign(record, created)

    def _lookup_again(self, wait: LookupWait, attempts: int) -> None:
        if not wait.peer.conn.closed:  # (else the worker is gone meanwhile)
            try:
                self.lookup(wait.peer, wait.request, attempts)
            except PslinkError as exc:
                wait.peer.error(wait.request, exc)

    def _answer(self, wait: LookupWait) -> None:
        aggs = self.state.aggregators
        wait.peer.reply(wait.request, body={"keys": [spec_to_wire(s, aggs) for s in wait.specs]})

    # -- ASSIGN ---------------------------------------------------------------------------------

    def assign(self, record: JobRecord, specs: list[KeySpec]) -> None:
        starting = sorted({p.aggregator for s in specs for p in s.parts if self.state.control.pool.is_placeholder(p.aggregator)})
        if starting:
            # Some parts go to Aggregators still starting: assign once they registered.
            self.deferred.setdefault(starting[0], []).append((record, specs))
            return
        by_aggregator: dict[str, list[dict]] = {}
        for spec in specs:
            for name in holders_of(spec):
                by_aggregator.setdefault(name, []).extend(spec.task_specs(name, self.links.address_of))
        missing = [n for n in by_aggregator if n not in self.links.peers]
        if missing:
            self._assigned(record, specs, PeerError(f"aggregator(s) {missing} are not connected to pMaster"))
            return
        calls = [(self.links.peers[n], dict(jobinfo=record.jobinfo(), tasks=t)) for n, t in by_aggregator.items()]
        self.links.broadcast_each(calls, Op.ASSIGN, lambda error: self._assigned(record, specs, error))

    def assign_deferred(self, placeholder: str) -> None:
        """The Aggregator started for ``placeholder`` registered: what waited for it is assigned."""
        for record, specs in self.deferred.pop(placeholder, []):
            self.assign(record, specs)

    def _assigned(self, record: JobRecord, specs: list[KeySpec], error: PslinkError | None) -> None:
        if error is not None:
            self._drop_everywhere(record, specs)
        for spec in specs:
            if error is None:
                spec.ready = True
                self.store.save_key(record.job, spec)
            else:
                self.state.forget_key(record, spec.key)
            # A key aborted while it was being placed (its ASSIGN poisoned the task, or the ABORT
            # followed the ASSIGN on the same connection) fails the lookups waiting for it: a
            # worker that learnt where it lives could init and push before the Aggregator heard.
            failure = ServiceError(f"placing key {spec.key!r} failed: {error}") if error is not None else spec.aborted
            for wait in self.waits.pop((record.job, spec.key), []):
                if failure is not None and wait.missing:
                    wait.missing.clear()
                    if isinstance(error, PeerError) and wait.attempts < LookupWait.ATTEMPTS:
                        # An Aggregator's connection broke under the ASSIGN: place the keys again.
                        self.reactor.call_later(0.5 * wait.attempts, self._lookup_again, wait, wait.attempts + 1)
                    else:
                        wait.peer.error(wait.request, failure)
                if failure is not None:
                    continue
                wait.missing.discard(spec.key)
                if not wait.missing:
                    self._answer(wait)
            if error is None and spec.aborted is None:
                for part in spec.parts:  # placed while the host it should replicate to was starting
                    self.replicas.separate(record, spec, part)

    def _drop_everywhere(self, record: JobRecord, specs: list[KeySpec]) -> None:
        """A placement that failed is forgotten: whoever got its ASSIGN drops the keys (those
        away now, once they register again)."""
        keys = [spec.key for spec in specs]
        for name in set().union(*(holders_of(spec) for spec in specs)):
            if name in self.links.peers:
                self.links.notify(name, Op.DROP_KEYS, job=record.job, keys=keys)
            elif name in self.state.aggregators:
                self.drops_owed.setdefault(name, {}).setdefault(record.job, set()).update(keys)

    def registered(self, name: str) -> None:
        """``name`` is connected again: first, it drops what failed placements gave it meanwhile
        (the same connection carries anything assigned to it after this)."""
        for job, keys in self.drops_owed.pop(name, {}).items():
            self.links.notify(name, Op.DROP_KEYS, job=job, keys=sorted(keys, key=repr))

    # -- DELETE_KEYS ----------------------------------------------------------------------------

    def delete_keys(self, peer: RpcPeer, req: dict) -> None:
        """Forget keys of the job (keys it does not have are ignored: every worker may delete the
        same ones); answered once every Aggregator that held a part or a replica dropped them."""
        record = self.state.authorize(req["job"], req["tok"], req["rank"])
        specs = [record.keys[k] for k in dict.fromkeys(req["keys"]) if k in record.keys]
        holders = set().union(*(holders_of(spec) for spec in specs))
        for spec in specs:
            self.state.forget_key(record, spec.key)
            self.store.delete_key(record.job, spec.key)
        keys = [spec.key for spec in specs]
        calls = [(self.links.peers[name], dict(job=record.job, keys=keys)) for name in sorted(holders)
                 if name in self.links.peers]
        self.links.broadcast_each(calls, Op.DROP_KEYS, lambda error: peer.error(req, error) if error is not None
                                  else peer.reply(req, body={"deleted": keys}))
