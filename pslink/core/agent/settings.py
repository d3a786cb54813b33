"""A job's settings as the first worker proposes them to pMaster (no I/O)."""

from __future__ import annotations


def job_config(*, mode: str | None = None, optimizer: dict | None = None, partition_bytes: int | None = None,
               sync: str | None = None, servers: int | None = None, max_workers: int | None = None,
               staleness: int | None = None, straggler_timeout: float | None = None, replication: int | None = None,
               checkpoint: str | None = None, checkpoint_every: int | None = None, slo: float | None = None,
               priority: str | None = None) -> dict:
    """The settings given, as REGISTER_WORKER carries them (pMaster validates them and fills in
    the defaults; the job's first worker fixes them)."""
    config: dict = {}
    if mode is not None:
        config["mode"] = mode
    if optimizer is not None:
        config["optimizer"] = optimizer
        config.setdefault("mode", "optimizer")
    if partition_bytes is not None:
        config["partition_bytes"] = partition_bytes
    if sync is not None:
        config["sync"] = sync
    elif staleness:
        config["sync"] = "ssp"
    for name, value in (("max_workers", max_workers), ("staleness", staleness),
                        ("straggler_timeout", straggler_timeout), ("replication", replication),
                        ("checkpoint", checkpoint), ("checkpoint_every", checkpoint_every), ("slo", slo),
                        ("priority", priority)):
        if value is not None:
            config[name] = value
    if servers is not None:
        config["servers"] = servers
    return config
