"""Figures from two simulated runs: CPU time saved, the allocated/requested ratio, job slowdowns.

The ratio is the paper's Figure 11: pslink's allocated Aggregators over the servers its running
jobs asked for, sampled every ``interval`` seconds (the paper: one minute) while any job runs.
CPU time is the integral of allocated CPUs over time; the static baseline allocates exactly what
its jobs request. Pure: arrays in, numbers out.
"""

from __future__ import annotations

import collections

import numpy as np

from pslink.sim.engine import SimResult, Timeline

PERCENTILES = (50, 90, 99, 99.9)


def integral(times: np.ndarray, values: np.ndarray) -> float:
    """The integral of a step function (``values[i]`` holds from ``times[i]`` to ``times[i+1]``;
    the last value is where it ends)."""
    if len(times) < 2:
        return 0.0
    return float(np.sum(values[:-1] * np.diff(times)))


def sample(times: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The step function's values at the instants ``at`` (0 before it starts)."""
    index = np.searchsorted(times, at, side="right") - 1
    out = np.where(index >= 0, values[np.clip(index, 0, None)], 0)
    return out.astype(float)


def ratio_samples(timeline: Timeline, interval: float = 60.0) -> np.ndarray:
    """Allocated over requested every ``interval`` seconds, where jobs ask for anything."""
    a = timeline.arrays()
    if len(a["times"]) < 2:
        return np.zeros(0)
    grid = np.arange(a["times"][0], a["times"][-1], interval)
    requested = sample(a["times"], a["requested"], grid)
    allocated = sample(a["times"], a["allocated"], grid)
    running = requested > 0
    return allocated[running] / requested[running]


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {}
    out = {f"p{p:g}": float(np.percentile(values, p)) for p in PERCENTILES}
    out["max"] = float(values.max())
    out["mean"] = float(values.mean())
    return out


def summarize(pslink: SimResult, static: SimResult, interval: float = 60.0) -> dict:
    """Everything the report, the JSON summary and the plots say."""
    ps, st = pslink.timeline.arrays(), static.timeline.arrays()
    hours = 3600.0
    cpu_static = integral(st["times"], st["allocated"])
    cpu_pslink = integral(ps["times"], ps["allocated"])
    busy_static = integral(st["times"], st["busy"])
    busy_pslink = integral(ps["times"], ps["busy"])
    ratios = ratio_samples(pslink.timeline, interval)
    slowdowns = np.array([o.slowdown for o in pslink.jobs])
    by_model: dict[str, list[float]] = collections.defaultdict(list)
    for o in pslink.jobs:
        by_model[o.model].append(o.slowdown)
    migrated = [o.migrations for o in pslink.jobs]
    parts_moved = [o.parts_moved for o in pslink.jobs]
    relocated = [o.relocations for o in pslink.jobs]
    by_slo: dict[float, list[float]] = collections.defaultdict(list)
    for o in pslink.jobs:
        if o.slo is not None:
            by_slo[o.slo].append(o.slowdown)
    over = [s > slo for slo, values in by_slo.items() for s in values]
    return {
        "jobs": len(pslink.jobs),
        "jobs_by_model": {m: len(v) for m, v in sorted(by_model.items())},
        "workers": int(sum(o.workers for o in pslink.jobs)),
        "span_hours": (st["times"][-1] - st["times"][0]) / hours if len(st["times"]) else 0.0,
        "cpu_hours": {"static": cpu_static / hours, "pslink": cpu_pslink / hours,
                      "busy": busy_static / hours, "busy_pslink": busy_pslink / hours},
        "cpu_time_saved": 1.0 - cpu_pslink / cpu_static if cpu_static else 0.0,
        # How much of the allocated CPU aggregation really used: the ceiling on any saving.
        "utilization": {"static": busy_static / cpu_static if cpu_static else 0.0,
                        "pslink": busy_pslink / cpu_pslink if cpu_pslink else 0.0},
        "peak_cpus": {"requested": float(ps["requested"].max(initial=0)), "allocated": float(ps["allocated"].max(initial=0))},
        "ratio": {"interval_s": interval, "samples": int(len(ratios)),
                  "above_1": float(np.mean(ratios > 1)) if len(ratios) else 0.0, **_percentiles(ratios)},
        "slowdown": {**_percentiles(slowdowns),
                     "over_5pct": float(np.mean(slowdowns > 0.05)) if len(slowdowns) else 0.0,
                     "over_10pct": float(np.mean(slowdowns > 0.10)) if len(slowdowns) else 0.0},
        "slowdown_median_by_model": {m: float(np.median(v)) for m, v in sorted(by_model.items())},
        # A job above the slowdown it accepted (its SLO: its own limit or the service's).
        "over_slo": float(np.mean(over)) if over else 0.0,
        # Jobs a NIC carrying more than its bandwidth slowed at some point (hosts on).
        "network_slowed": float(np.mean([o.network_slowed for o in pslink.jobs])) if pslink.jobs else 0.0,
        "slo_classes": {f"{slo:g}": {"jobs": len(v), "over_slo": float(np.mean(np.array(v) > slo)),
                                     **_percentiles(np.array(v))} for slo, v in sorted(by_slo.items())},
        # A migration: one decision's parts of a job between two Aggregators, one copy (a batch).
        "migrations": _per_job(migrated),
        "parts_moved": _per_job(parts_moved),
        # Decisions that moved a job's parts (its pack, the guard's moves, reverts, drains).
        "relocations": {"total": int(sum(relocated)),
                        "per_job_median": float(np.median(relocated)) if relocated else 0.0,
                        "per_job_p90": float(np.percentile(relocated, 90)) if relocated else 0.0,
                        "per_job_max": int(max(relocated)) if relocated else 0},
        "counters": {k: float(v) for k, v in sorted(pslink.counters.items())},
    }


def _per_job(counts: list[int]) -> dict:
    return {"total": int(sum(counts)), "per_job_median": float(np.median(counts)) if counts else 0.0,
            "per_job_p90": float(np.percentile(counts, 90)) if counts else 0.0}


def binned_mean(times: np.ndarray, values: np.ndarray, width: float) -> tuple[np.ndarray, np.ndarray]:
    """The step function's average over consecutive bins of ``width`` seconds: (bin starts, means)."""
    if len(times) < 2:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(times[0], times[-1] + width, width)
    cumulative = np.concatenate([[0.0], np.cumsum(values[:-1] * np.diff(times))])  # exact at change points
    at_edges = np.interp(edges, times, cumulative)  # and linear in between
    return edges[:-1], np.diff(at_edges) / width
