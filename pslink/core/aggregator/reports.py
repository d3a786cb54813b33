"""What an Aggregator reports to pMaster with its heartbeats (no I/O): each task's CPU cost per
round (e_t, for placement) and per-job totals (for ``pslink service status`` and the metrics)."""

from __future__ import annotations


def task_costs(tasks: dict, smoothing: float) -> dict[str, list]:
    """e_t of every task that closed rounds since the last call: CPU seconds per round,
    smoothed, per job as [key, part, seconds]."""
    out: dict[str, list] = {}
    for (job_id, key, part), task in tasks.items():
        cpu, rounds = task.reported
        if task.rounds_closed > rounds:
            sample = (task.cpu - cpu) / (task.rounds_closed - rounds)
            task.cost = sample if task.cost is None else smoothing * sample + (1 - smoothing) * task.cost
            task.reported = (task.cpu, task.rounds_closed)
        if task.cost is not None:
            out.setdefault(job_id, []).append([key, part, task.cost])
    return out


def job_stats(tasks: dict, jobs: dict) -> dict:
    """Per job: tasks held, bytes, rounds closed over all tasks, the furthest round, the bytes
    pushed here and pulled from here (since this Aggregator knew the job); for a job with
    tables, the rows its shards hold here and how many they evicted."""
    per_job: dict[str, dict] = {}
    for (job_id, _, _), task in tasks.items():
        entry = per_job.setdefault(job_id, {"tasks": 0, "bytes": 0, "task_rounds": 0, "round": 0})
        entry["tasks"] += 1
        entry["bytes"] += task.nbytes
        entry["task_rounds"] += task.rounds_closed
        entry["round"] = max(entry["round"], task.closed)
        if task.table is not None:
            entry["table_rows"] = entry.get("table_rows", 0) + task.table.size
            entry["evicted_rows"] = entry.get("evicted_rows", 0) + task.table.evicted
    for job_id, entry in per_job.items():
        job = jobs.get(job_id)
        if job is not None:
            entry["pushed_bytes"], entry["pulled_bytes"] = job.pushed_bytes, job.pulled_bytes
    return per_job
