"""Where replicas go, and what becomes of an Aggregator's parts when it is gone. No I/O.

Replication. A job with ``replication`` k keeps every part on its Aggregator plus k replicas on
other Aggregators (the least loaded, counting primaries and replicas). Each closed round reaches
every replica before any answer of that round goes out, and a push is acknowledged only once its
round is replicated, so whatever a worker was told is done survives the loss of one Aggregator
(two with k = 2).

Failover, for each part of the lost Aggregator:

- moving onto it, its copy not known to have landed, with replicas: it stays on the migration's
  source if that still serves it (it had not handed it over); else a replica is promoted;
- with a live replica: that replica is promoted (it serves the part from the last round it
  has; the workers resend what they had in flight, the same rounds, and a round seen twice is
  applied once), and the replicas are topped up to k again;
- without one, in ``sum`` mode: the part starts afresh elsewhere (a sum-mode part keeps no state
  between rounds; the rounds in flight are resent by the workers); not a table's shard, whose
  rows are state in any mode (it takes the optimizer-mode way);
- without one, in ``optimizer`` mode with a checkpoint: the part restarts elsewhere from its last
  checkpoint; the rounds since are lost, and the workers are told how many;
- without one, in ``optimizer`` mode and no checkpoint: its weights are gone: the key fails
  loudly, naming why.

A lost replica is replaced by another Aggregator, which receives the state at the next round.

The source of a migration lost before its copy landed, once its target was told to expect the
copy (the source may have handed the part over, and workers may queue at the target): the move
goes on, with a replica sending the copy (:func:`copy_sources`); without one the key fails loudly.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping

from pslink.core.master.records import JobRecord, KeySpec, PartSpec
from pslink.errors import KeyStateError


@dataclasses.dataclass
class Promote:
    record: JobRecord
    spec: KeySpec
    part: PartSpec  # already updated: part.aggregator is the promoted replica
    source: str
    # part.aggregator is the source of a move onto the lost Aggregator: it keeps the part if it
    # still serves it, else (it handed the part over) one of part.replicas is promoted instead.
    moving: bool = False


@dataclasses.dataclass
class Recreate:
    record: JobRecord
    spec: KeySpec
    part: PartSpec  # already updated: part.aggregator is where it starts afresh
    source: str


@dataclasses.dataclass
class Lost:
    record: JobRecord
    spec: KeySpec
    error: KeyStateError


@dataclasses.dataclass
class Rereplicate:
    """The part's replicas changed: tell its Aggregator, and the new replicas what they hold."""

    record: JobRecord
    spec: KeySpec
    part: PartSpec
    added: list[str]


def holdings(jobs) -> collections.Counter:
    """Parts per Aggregator, primaries and replicas alike (what a new replica adds load to)."""
    count: collections.Counter = collections.Counter()
    for record in jobs.values():
        for spec in record.keys.values():
            for part in spec.parts:
                count[part.aggregator] += 1
                count.update(part.replicas)
    return count


def pick_replicas(candidates: list[str], load: collections.Counter, count: int, exclude,
                  hosts: Mapping[str, str] | None = None, away_from=()) -> list[str]:
    """``count`` of ``candidates`` (live Aggregators) not in ``exclude``, least loaded first; fewer
    when there are not enough (the status shows it). With ``hosts`` (Aggregator -> host), those on
    a host that none of ``away_from`` (the part's primary and other replicas) nor an earlier pick
    is on come first: a whole host lost (its NIC, its power) then loses no update. Where every
    candidate shares a host with them, the least loaded is taken all the same."""
    pool = [n for n in candidates if n not in exclude]
    used = {hosts.get(n) for n in away_from} if hosts else set()
    chosen = []
    while pool and len(chosen) < count:
        best = min(pool, key=lambda n: (hosts is not None and hosts.get(n) in used, load[n], n))
        pool.remove(best)
        chosen.append(best)
        load[best] += 1
        if hosts is not None:
            used.add(hosts.get(best))
    return chosen


def plan_failover(jobs, lost: str, candidates: list[str], stays: dict[tuple, str] | None = None,
                  hosts: Mapping[str, str] | None = None, incoming: Mapping[tuple, str] | None = None) -> list:
    """Update every part that lived on, or was replicated to, the Aggregator ``lost``; return what
    pMaster must do. ``candidates``: the live Aggregators that may take parts or replicas.
    ``stays``: parts that were moving onto ``lost`` and whose copy had not landed, with the
    migration's source: that may still be serving the part (a move waits for a round to close),
    and a promoted replica would then be a second server; so the source is asked first.
    ``hosts``: Aggregator -> host, to keep replicas off their primary's host. ``incoming``: parts
    moving (their copy under way) and their targets, which serve them next and so cannot be
    their replicas too (found by the chaos run: such a part then had no replica but itself,
    and the target's loss lost the key)."""
    load = holdings(jobs)
    actions: list = []
    stays, incoming = stays or {}, incoming or {}
    for record in jobs.values():
        for spec in record.keys.values():
            dead_key = False
            for part in spec.parts:
                ident = (record.job, spec.key, part.part)
                source, coming = stays.get(ident), incoming.get(ident)
                if source in candidates and record.replication:
                    part.aggregator, part.replicas = source, [r for r in part.replicas if r != lost]
                    actions.append(Promote(record, spec, part, lost, moving=True))
                    added = _top_up(record, part, candidates, load, lost, hosts, coming)
                    if added:
                        actions.append(Rereplicate(record, spec, part, added))
                elif part.aggregator == lost:
                    survivors = [r for r in part.replicas if r in candidates]
                    if survivors:
                        part.aggregator, part.replicas = survivors[0], survivors[1:]
                        actions.append(Promote(record, spec, part, lost))
                    elif (record.mode == "sum" and spec.table is None) or record.checkpoint:
                        target = pick_replicas(candidates, load, 1, exclude=())
                        if not target:
                            dead_key = True
                            continue
                        part.aggregator, part.replicas = target[0], []
                        actions.append(Recreate(record, spec, part, lost))
                    else:
                        dead_key = True
                        continue
                    added = _top_up(record, part, candidates, load, lost, hosts, coming)
                    if added:
                        actions.append(Rereplicate(record, spec, part, added))
                elif lost in part.replicas:
                    part.replicas = [r for r in part.replicas if r != lost]
                    added = _top_up(record, part, candidates, load, lost, hosts, coming)
                    actions.append(Rereplicate(record, spec, part, added))
            if dead_key:
                if spec.table is not None and not record.checkpoint:
                    why = "a table's rows are its state, and it has no replica and no checkpoint"
                elif record.mode == "optimizer" and not record.checkpoint:
                    why = ("no replica (replication 0) and no checkpoint in optimizer mode" if not record.replication
                           else "its replicas were lost with it, and there is no checkpoint in optimizer mode")
                else:
                    why = "no Aggregator is left to take it"
                actions.append(Lost(record, spec, KeyStateError(
                    f"key {spec.key!r} of job {record.job!r}: aggregator {lost} is gone and the key's state went "
                    f"with it ({why}); set replication=1 to survive this, or checkpoint=DIR to resume from "
                    "a checkpoint", job=record.job, key=spec.key)))
    return actions


def copy_sources(replicas: list[str], target: str, target_held_replica: bool, live, lost: str) -> list[str]:
    """Who may send the copy of a part whose migration's source (``lost``) died after it may
    have handed the part over, best first. The part's replicas have every round the source
    acknowledged (a round reaches them before any of its answers). If the target was one of
    them when the move began, it comes first: pMaster gave its replica's place to another
    Aggregator, but the source, never told, went on replicating to the target alone, so the
    newcomer may hold no state yet. ``live``: the Aggregators connected to pMaster."""
    first = [target] if target_held_replica and target in live else []
    return first + [r for r in replicas if r in live and r not in (lost, target)]


def plan_replica_moves(jobs, leaving: str, candidates: list[str], hosts: Mapping[str, str] | None = None,
                       incoming: Mapping[tuple, str] | None = None) -> list[Rereplicate]:
    """An operator removes ``leaving``: every replica it holds goes to another of ``candidates``
    (the live Aggregators not being removed), so each part keeps its replica count.
    ``incoming``: parts moving now and their targets, which serve them next (a replica there
    would be the part's primary once the move lands)."""
    load = holdings(jobs)
    incoming = incoming or {}
    actions = []
    for record in jobs.values():
        for spec in record.keys.values():
            for part in spec.parts:
                if leaving in part.replicas:
                    part.replicas = [r for r in part.replicas if r != leaving]
                    coming = incoming.get((record.job, spec.key, part.part))
                    added = _top_up(record, part, candidates, load, leaving, hosts, coming)
                    actions.append(Rereplicate(record, spec, part, added))
    return actions


def _top_up(record: JobRecord, part: PartSpec, candidates: list[str], load, lost: str,
            hosts: Mapping[str, str] | None = None, coming: str | None = None) -> list[str]:
    missing = record.replication - len(part.replicas)
    if missing <= 0:
        return []
    added = pick_replicas(candidates, load, missing, exclude={part.aggregator, lost, coming, *part.replicas}, hosts=hosts,
                          away_from=[part.aggregator, *part.replicas])
    part.replicas = part.replicas + added
    return added
