"""Prometheus metrics made from pMaster's status (the same figures ``pslink service status --json``
shows, so the two never disagree).

Naming follows Prometheus' conventions: the ``pslink_`` prefix, base units (seconds, bytes, ratios),
``_total`` for counters. Labels are ``job`` and ``aggregator`` only: never keys, whose number is
unbounded.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry


def _family(kind, name: str, doc: str, labels: list[str], rows) -> Metric:
    family = kind(name, doc, labels=labels)
    for label_values, value in rows:
        family.add_metric(label_values, value)
    return family


def metric_families(status: dict) -> Iterator[Metric]:
    """Every metric of one status snapshot."""
    aggs = status.get("aggregators", [])
    jobs = status.get("jobs", [])
    G, C = GaugeMetricFamily, CounterMetricFamily
    yield G("pslink_aggregators", "Aggregators alive in the pool", value=sum(1 for a in aggs if a.get("alive")))
    yield G("pslink_jobs", "Jobs registered", value=len(jobs))
    per_agg = [
        (G, "pslink_aggregator_up", "1 while the Aggregator is alive", lambda a: 1 if a.get("alive") else 0),
        (G, "pslink_aggregator_tasks", "tasks (key parts) placed on the Aggregator", lambda a: a.get("tasks", 0)),
        (G, "pslink_aggregator_held_bytes", "bytes of tensors the Aggregator holds", lambda a: a.get("bytes", 0)),
        (G, "pslink_aggregator_load_ratio", "share of one CPU spent aggregating", lambda a: a.get("load", 0.0)),
        (G, "pslink_aggregator_cycle_seconds", "cyclic-execution period placement set (0: none)",
         lambda a: a.get("cycle", 0.0)),
        (G, "pslink_aggregator_task_rounds_per_second", "rounds closed per second over all its tasks",
         lambda a: a.get("task_rounds_per_s", 0.0)),
        (C, "pslink_aggregator_bad_messages", "malformed messages and broken peers", lambda a: a.get("errors", 0)),
        (C, "pslink_aggregator_requests", "requests received", lambda a: a.get("requests", 0)),
        (G, "pslink_aggregator_replicas", "replicas of parts the Aggregator holds", lambda a: a.get("replicas", 0)),
        (G, "pslink_aggregator_replicas_without_state", "of its replicas, those no round reached yet",
         lambda a: a.get("replicas_without_state", 0)),
    ]
    for kind, name, doc, get in per_agg:
        yield _family(kind, name, doc, ["aggregator"], [([a["name"]], get(a)) for a in aggs])
    per_job = [
        (G, "pslink_job_workers", "workers connected", lambda j: j.get("workers", 0)),
        (G, "pslink_job_keys", "keys declared", lambda j: j.get("keys", 0)),
        (G, "pslink_job_held_bytes", "bytes the service holds for the job (replicas counted)",
         lambda j: j.get("held_bytes", 0)),
        (C, "pslink_job_rounds", "the furthest round closed", lambda j: j.get("round", 0)),
        (G, "pslink_job_rounds_per_second", "rounds closed per second", lambda j: j.get("rounds_per_s", 0.0)),
        (C, "pslink_job_pushed_bytes", "bytes the job's workers pushed", lambda j: j.get("pushed_bytes", 0)),
        (C, "pslink_job_pulled_bytes", "bytes the job's workers pulled", lambda j: j.get("pulled_bytes", 0)),
        (C, "pslink_job_stalls", "rounds that waited longer than the stall threshold", lambda j: j.get("stalls", 0)),
        (G, "pslink_job_stalled_rounds", "rounds stalled now", lambda j: j.get("stalled_rounds", 0)),
        (G, "pslink_job_parts_short_of_replicas", "parts with fewer live replicas than the job's replication",
         lambda j: j.get("parts_short_of_replicas", 0)),
        (G, "pslink_job_parts_on_lost_aggregators", "parts whose Aggregator is not alive (to be failed over)",
         lambda j: j.get("parts_on_lost_aggregators", 0)),
    ]
    for kind, name, doc, get in per_job:
        yield _family(kind, name, doc, ["job"], [([j["job"]], get(j)) for j in jobs])
    loss = [([j["job"]], j["control"]["loss"]) for j in jobs if (j.get("control") or {}).get("loss") is not None]
    yield _family(G, "pslink_job_loss_ratio", "slowdown from sharing Aggregators, as the guard measures it (iteration "
                  "over the standalone one, minus 1)", ["job"], loss)
    slo = [([j["job"]], j["control"]["slo"]) for j in jobs if (j.get("control") or {}).get("slo") is not None]
    yield _family(G, "pslink_job_slo_ratio", "the slowdown the job accepts from sharing (its SLO)", ["job"], slo)
    histogram = HistogramMetricFamily("pslink_job_iteration_seconds", "iteration durations (the job's lowest rank)",
                                      labels=["job"])
    for job in jobs:
        h = job.get("iteration_seconds") or {"buckets": [["+Inf", 0]], "sum": 0.0}
        histogram.add_metric([job["job"]], [(str(float(le)) if le != "+Inf" else "+Inf", n) for le, n in h["buckets"]],
                             h["sum"])
    yield histogram
    counters = status.get("counters", {})
    for name, doc in (("migrations", "live migrations completed"), ("failovers", "Aggregators failed over"),
                      ("reverts", "placements the performance guard reverted"),
                      ("allocations", "Aggregators the pool started"), ("releases", "Aggregators the pool let go")):
        yield C(f"pslink_{name}", doc, value=counters.get(name, 0))
    yield G("pslink_migrations_in_flight", "migrations running or queued", value=len(status.get("migrations", [])))
    master = status.get("master", {})
    yield C("pslink_master_bad_messages", "malformed messages pMaster dropped", value=master.get("bad_messages", 0))
    yield C("pslink_master_refused", "requests refused for their credentials", value=master.get("refused", 0))
    leading = status.get("leadership")
    if leading is not None:  # a pMaster elected over a shared store (pslink.core.master.leadership)
        yield G("pslink_master_epoch", "the leader's epoch (it grows at each takeover)", value=leading.get("epoch") or 0)
        yield G("pslink_master_standbys", "pMasters standing by to take over",
                value=len(leading.get("standbys") or ()))
        yield G("pslink_master_store_up", "1 while the state store answers",
                value=1 if leading.get("store_reachable") else 0)
        yield G("pslink_master_store_pending_writes", "writes kept while the state store is away",
                value=leading.get("pending_writes", 0))


class StatusCollector(Collector):
    """A collector that takes a fresh status (``snapshot()``) on every scrape."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield from metric_families(self.snapshot())


def registry_for(snapshot: Callable[[], dict]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(snapshot))
    return registry
