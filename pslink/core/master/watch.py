"""What pMaster shows its operators (no I/O): the status made from its state (:func:`status_of`),
what it counts besides (allocations, releases, iteration times per job) and the figures the status
carries beyond the state itself (counters, bytes pushed and pulled, stalled rounds). ``/metrics`` (:mod:`pslink.core.observe.metrics`) is made from that same status, so the
two never disagree."""

from __future__ import annotations

import bisect

from pslink.core.master.actions import Allocate, Release

# Iteration seconds: from a small model's few milliseconds to a large one's minute.
ITERATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def job_rounds_per_s(aggregators: dict, job: str) -> float:
    """How fast a job's rounds close: the fastest of its Aggregators' (each reports the furthest
    round of its own parts)."""
    return max((a.rates.get("_job_rounds", {}).get(job, 0.0) for a in aggregators.values()), default=0.0)


def status_of(state) -> dict:
    """pMaster's status from its state (:class:`~pslink.core.master.state.MasterState`): every
    Aggregator and job as ``pslink service status`` shows them; :meth:`Watch.add_to` adds the rest."""
    now = state.clock()
    plans = {}
    for plan in state.control.pool.clusters.values():
        for name, agg in plan.aggregators.items():
            plans[name] = agg
    replicas: dict[str, int] = {}  # name -> the parts it holds a replica of
    stateless: dict[str, int] = {}  # name -> of those, replicas its last heartbeat did not report a round in
    short: dict[str, int] = {}  # job -> its parts with fewer live replicas than its replication
    lost: dict[str, int] = {}  # job -> its parts on an Aggregator that is not alive (a failover to come)
    alive = {name for name, agg in state.aggregators.items() if agg.alive}
    for record in state.jobs.values():
        for spec in record.keys.values():
            for part in spec.parts:
                lost[record.job] = lost.get(record.job, 0) + (part.aggregator not in alive)
                live = sum(name in alive for name in part.replicas)
                short[record.job] = short.get(record.job, 0) + (live < record.replication)
                for name in part.replicas:
                    replicas[name] = replicas.get(name, 0) + 1
                    holder = state.aggregators.get(name)
                    reached = holder.stats.get("replicas_with_state", ()) if holder is not None else ()
                    stateless[name] = stateless.get(name, 0) + ((record.job, spec.key, part.part) not in reached)
    aggregators = []
    for agg in sorted(state.aggregators.values(), key=lambda a: a.name):
        jobs = agg.stats.get("_jobs", {})
        plan = plans.get(agg.name)
        aggregators.append(
            {
                "name": agg.name,
                "address": agg.address,
                "pid": agg.pid,
                "host": agg.host,
                "host_id": agg.host_id,
                "alive": agg.alive,
                "draining": agg.name in state.control.pool.draining,
                "cluster": state.control.pool.cluster_of.get(agg.name),
                "last_seen": round(now - agg.last_seen, 1),
                "tasks": sum(e.get("tasks", 0) for e in jobs.values()) if jobs else (len(plan.tasks) if plan else 0),
                "replicas": replicas.get(agg.name, 0),
                # Of those, replicas no round reached yet (as far as its last heartbeat said):
                # their part has no up-to-date replica.
                "replicas_without_state": stateless.get(agg.name, 0),
                "bytes": sum(e.get("bytes", 0) for e in jobs.values()),
                "jobs": {j: e.get("tasks", 0) for j, e in jobs.items()},
                "cycle": plan.cycle if plan else 0.0,
                "free": plan.free if plan else 0.0,
                "load": agg.stats.get("load", 0.0),
                "reserved_for": state.control.pool.reserved.get(agg.name) or state.control.pool.exclusive.get(agg.name),
                "task_rounds_per_s": round(sum(v for k, v in agg.rates.items() if k != "_job_rounds"), 1),
                "errors": agg.stats.get("errors", 0),
                "requests": agg.stats.get("requests", 0),
            }
        )
    control_jobs = state.control.describe()["jobs"]
    jobs = []
    for record in sorted(state.jobs.values(), key=lambda r: r.job):
        rate = job_rounds_per_s(state.aggregators, record.job)
        jobs.append(
            {
                "job": record.job,
                "mode": record.mode,
                "sync": record.sync,
                "optimizer": (record.optimizer or {}).get("type"),
                "workers": len(record.live_workers()),
                "worker_hosts": len({w.host_id for w in record.workers.values()
                                     if w.rank in record.live_workers()}),
                "num_workers": record.num_workers,
                "keys": len(record.keys),
                "tasks": sum(len(s.parts) for s in record.keys.values()),
                "parts_short_of_replicas": short.get(record.job, 0),
                "parts_on_lost_aggregators": lost.get(record.job, 0),
                "bytes": sum(s.nbytes() for s in record.keys.values()),
                "held_bytes": sum(s.held_bytes() for s in record.keys.values()),
                "quota": state.quota_of(record),
                "round": max(record.rounds.values(), default=0),
                "rounds_per_s": round(rate, 2),
                "aggregators": sorted(record.aggregators()),
                "control": control_jobs.get(record.job, {}),
            }
        )
    return {"aggregators": aggregators, "jobs": jobs, "time": now}


class Histogram:
    """Cumulative-bucket histogram in Prometheus' sense (``le`` upper bounds, +Inf last)."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self):
        self.counts = [0] * (len(ITERATION_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(ITERATION_BUCKETS, value)] += 1
        self.sum += value
        self.count += 1

    def to_wire(self) -> dict:
        cumulative, total = [], 0
        for bound, count in zip(ITERATION_BUCKETS + (float("inf"),), self.counts):
            total += count
            cumulative.append(["+Inf" if bound == float("inf") else bound, total])
        return {"buckets": cumulative, "sum": round(self.sum, 6), "count": self.count}


class Watch:
    """Counters pMaster keeps for its operators, fed from its loop."""

    def __init__(self):
        self.allocations = 0
        self.releases = 0
        self.iterations: dict[str, Histogram] = {}

    def action(self, action) -> None:
        if isinstance(action, Allocate):
            self.allocations += 1
        elif isinstance(action, Release):
            self.releases += 1

    def iterations_reported(self, job: str, durations) -> None:
        """One rank's iteration durations (the job's lowest rank: workers of a job step together)."""
        histogram = self.iterations.get(job)
        if histogram is None:
            histogram = self.iterations[job] = Histogram()
        for duration in durations or ():
            if duration > 0:
                histogram.observe(float(duration))

    def job_ended(self, job: str) -> None:
        self.iterations.pop(job, None)

    def add_to(self, status: dict, aggregators: dict, *, migrations: int, failovers: int) -> dict:
        """``status`` (:func:`status_of`) with the counters, each job's bytes pushed and pulled,
        stall counts and iteration histogram, and every stalled round (oldest first)."""
        per_job: dict[str, dict] = {}
        stalled = []
        for record in aggregators.values():
            for job, entry in (record.stats.get("_jobs") or {}).items():
                totals = per_job.setdefault(job, {"pushed_bytes": 0, "pulled_bytes": 0, "stalls": 0})
                for name in totals:
                    totals[name] += int(entry.get(name, 0))
            if record.alive:
                stalled += [dict(s, aggregator=record.name) for s in record.stats.get("stalled") or []]
        stalled.sort(key=lambda s: -s.get("seconds", 0))
        by_job: dict[str, list] = {}
        for stall in stalled:
            by_job.setdefault(stall["job"], []).append(stall)
        for job in status["jobs"]:
            job.update(per_job.get(job["job"], {"pushed_bytes": 0, "pulled_bytes": 0, "stalls": 0}))
            job["stalled_rounds"] = len(by_job.get(job["job"], ()))
            histogram = self.iterations.get(job["job"])
            job["iteration_seconds"] = (histogram or Histogram()).to_wire()
        status["stalled"] = stalled
        status["counters"] = {
            "migrations": migrations,
            "failovers": failovers,
            "reverts": sum(j.get("control", {}).get("reverts", 0) for j in status["jobs"]),
            "allocations": self.allocations,
            "releases": self.releases,
        }
        return status


HISTORY_EVERY = 5.0  # seconds between samples of the pool's load
HISTORY_KEEP = 120  # samples: the last ten minutes


class History:
    """The pool's recent load, for the live page: every ``HISTORY_EVERY`` s, each Aggregator's
    load and each job's rounds per second."""

    def __init__(self):
        self.samples: list[dict] = []
        self._last = float("-inf")

    def sample(self, now: float, wall: float, aggregators: dict, jobs) -> None:
        if now - self._last < HISTORY_EVERY:
            return
        self._last = now
        rounds = {job: round(job_rounds_per_s(aggregators, job), 2) for job in jobs}
        self.samples.append({"t": round(wall, 1),
                             "load": {a.name: a.stats.get("load", 0.0) for a in aggregators.values() if a.alive},
                             "rounds_per_s": rounds})
        del self.samples[:-HISTORY_KEEP]

    def to_wire(self) -> dict:
        return {"every": HISTORY_EVERY, "samples": list(self.samples)}
