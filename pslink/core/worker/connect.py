"""``pslink.connect``: one call to join a job, with every setting named once across adapters,
and the job's token shared with an elastic launcher."""

from __future__ import annotations

import inspect
import os

from pslink.core.config import local_sync_settings, resolve_connect
from pslink.core.agent.agent import Agent
from pslink.core.worker.groups import GroupAgent
from pslink.errors import ConfigError


def connect(
    job: str | None = None,
    rank: int | None = None,
    num_workers: int | None = None,
    master: str | None = None,
    **options,
) -> Agent:
    """Join a job on the parameter service and return its :class:`Agent`.

    Each argument falls back to an environment variable (as ``pslink launch`` sets them):
    ``PSLINK_JOB``, ``PSLINK_RANK``, ``PSLINK_NUM_WORKERS``, ``PSLINK_MASTER`` (default
    tcp://127.0.0.1:7770), ``PSLINK_TOKEN``, ``PSLINK_TIMEOUT``, ``PSLINK_MAX_WORKERS`` and
    ``PSLINK_PARTITION_BYTES``. Options: ``token``, ``mode`` (``"sum"`` or ``"optimizer"``),
    ``optimizer`` (e.g. ``{"type": "sgd", "lr": 0.1}``), ``sync`` (``"bsp"``, the default;
    ``"ssp"`` with ``staleness`` s: a pull of round r is answered once round r - s closed; or
    ``"asp"``: pushes apply at once, pulls never wait), ``straggler_timeout`` (seconds a round may
    wait for its last pushes before it closes with those it has), ``max_workers`` (ranks up to it
    may join the running job; default ``num_workers``), ``replication`` (0, 1 or 2 replicas of
    every part on other Aggregators: the job survives losing that many without losing an update;
    bsp/ssp only), ``servers`` (how many parameter servers the job would ask for: it is profiled
    alone on that many Aggregators before pMaster packs it with others; default one per worker),
    ``slo`` (the slowdown the job accepts from sharing Aggregators, 0.05 = 5%; default the
    service's loss limit, 10%) and ``priority`` (``"high"``: scaling never moves its tasks to
    free an Aggregator),
    ``gradient_compression`` (``{"type": "2bit", "threshold": 0.5}``: pushes quantized to 2 bits
    a value, MXNet's 2-bit compression; see ``Agent.set_gradient_compression``),
    ``sync="local:T"`` makes the workers groups (dSyncPS, :class:`~pslink.core.worker.groups.GroupAgent`):
    each group trains BSP on its own, and the groups average their weights every T local steps;
    ``groups`` (N groups of consecutive ranks; default one per host the launcher started) or
    ``sync_group`` (this worker's group by label) and ``sync_store`` (a directory or fsspec URL to
    meet in instead of the pool) go with it,
    ``rejoin`` (register a rank again as a newcomer: pMaster takes it out of the job and back in,
    in one step; an Agent of this process that held the rank is then closed with
    ``close(leave=False)``), ``partition_bytes``, ``timeout``, ``peer_timeout`` and the other
    :class:`Agent` settings. Job settings are fixed by the worker that creates the job. A name
    that is not one of these is a ConfigError naming the one meant (``size`` -> ``num_workers``).

    Under an elastic ``pslink launch`` (which sets ``PSLINK_TOKEN_FILE``), the job's token is
    written there once, so that the launcher can start a replacement under the rank of a
    worker that died (pMaster asks a rank that was in the job for the token).
    """
    agent = _connect(job, rank, num_workers, master, options)
    path = os.environ.get(ENV_TOKEN_FILE)
    if path:
        share_token(path, agent.token)
    return agent


def _connect(job, rank, num_workers, master, options: dict) -> Agent:
    job, rank, num_workers, master, options = resolve_connect(job, rank, num_workers, master, options,
                                                              AGENT_OPTIONS)
    groups, store, label = options.pop("groups", None), options.pop("sync_store", None), options.pop("sync_group", None)
    local = local_sync_settings(options.get("sync"), groups, store, job, rank, num_workers, label=label)
    if local is None:
        if groups is not None or store is not None or label is not None:
            raise ConfigError(f"job {job!r}: groups=, sync_group= and sync_store= go with sync='local:T' (groups with "
                              f"delayed global sync), not with sync={options.get('sync') or 'bsp'!r}")
        return Agent(job, rank, num_workers, master, **options)
    options.pop("sync", None)
    every, groups, store = local
    return GroupAgent(job, rank, num_workers, master, every=every, groups=groups, store=store, **options)


ENV_TOKEN_FILE = "PSLINK_TOKEN_FILE"


def share_token(path: str, token: bytes) -> None:
    """Write ``token`` (hex) to ``path`` unless it is there already: whole or not at all, so an
    elastic launcher never reads half a token."""
    if os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token.hex())
    os.replace(tmp, path)


#: What :func:`connect` passes on to :class:`Agent` besides job, rank, num_workers and master.
AGENT_OPTIONS = frozenset(inspect.signature(Agent.__init__).parameters) - {"self", "job", "rank", "num_workers",
                                                                            "master"} | {"groups", "sync_store",
                                                                                         "sync_group"}
