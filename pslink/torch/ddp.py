"""A DDP communication hook that averages gradient buckets through the parameter service.

::

    ddp_model = DistributedDataParallel(model)
    ddp_model.register_comm_hook(pslink.torch.connect(), pslink.torch.comm_hook)

``connect()`` joins the job at once (job, rank, size and service address from the environment
``pslink launch`` sets, or as arguments), so a missing service fails there, before training
starts. The hook pushes each bucket and returns a ``torch.futures.Future`` at once; the Agent
completes it when the bucket's average is back, so later buckets go out while earlier ones are
still on the wire.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations as objects.

import os
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from pslink.core.config import ENV_NUM_WORKERS, ENV_RANK, resolve_connect
from pslink.core.agent import Agent
from pslink.core.worker.connect import AGENT_OPTIONS, connect as connect_agent
from pslink.core.worker.collectives import service_key
from pslink.core.worker.groups import whole_job
from pslink.errors import ConfigError, PeerError, PslinkError
from pslink.torch import local_sync
from pslink.torch.tensors import StagingPool, explain_mismatch
from pslink.torch.works import Deadlines, FutureOnce

__all__ = ["HookState", "connect", "comm_hook"]


class HookState:
    """What :func:`comm_hook` needs: the Agent, the name that scopes this model's keys, the
    bucket layouts seen so far, staging buffers and the deadlines of buckets in flight."""

    __slots__ = ("agent", "name", "timeout", "_layouts", "_generations", "_staging", "_deadlines", "_release",
                 "__weakref__")

    def __init__(self, agent: Agent, name: str = "ddp", timeout: float | None = None, own_agent: bool = False):
        _check_name(name)
        self.agent = agent
        self.name = name
        self.timeout = agent.timeout if timeout is None else float(timeout)
        # bucket index -> (numel, dtype) last seen, and how often that layout changed
        self._layouts: dict[int, tuple[int, torch.dtype]] = {}
        self._generations: dict[int, int] = {}
        self._staging = StagingPool()
        self._deadlines = Deadlines()
        _SHARED.named(self)
        # An Agent that connect() joined for this state leaves the job when the state is closed,
        # or collected (a DDP model deleted without close()), or at the latest at exit: never
        # later, when its threads would complete bucket futures, whose callbacks run Python, while
        # the interpreter shuts down (a thread that then takes the GIL is ended inside torch's
        # C++ frames: "terminate called without an active exception", SIGABRT).
        self._release = weakref.finalize(self, _SHARED.release, agent) if own_agent else None

    def __repr__(self) -> str:
        agent = self.agent
        return f"<pslink.torch.HookState {self.name!r} job={agent.job!r} rank={agent.rank}/{agent.num_workers}>"

    @property
    def rank(self) -> int:
        return self.agent.rank

    @property
    def size(self) -> int:
        return self.agent.num_workers

    def bucket_key(self, bucket: dist.GradBucket) -> str:
        """The bucket's key: its index, plus a generation that grows each time DDP gives that
        index a new size or dtype (it rebuilds its buckets once, after the first iteration or
        two). Every rank sees the same layouts, so every rank derives the same keys; ranks whose
        buckets differ share a key and get a shape mismatch instead of waiting for each other."""
        index = bucket.index()
        buffer = bucket.buffer()
        layout = (buffer.numel(), buffer.dtype)
        seen = self._layouts.get(index)
        if seen is None:
            self._generations[index] = 0
        elif seen != layout:
            self._generations[index] += 1
        self._layouts[index] = layout
        return service_key(self.name, f"b{index}.{self._generations[index]}")

    def close(self) -> None:
        """Release the staging buffers; leave the job if :func:`connect` joined it."""
        self._deadlines.close()
        self._staging.clear()
        if self._release is not None:
            self._release()  # (a finalizer runs once)

    def __enter__(self) -> "HookState":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(
    job: str | None = None,
    rank: int | None = None,
    num_workers: int | None = None,
    master: str | None = None,
    *,
    name: str = "ddp",
    agent: Agent | None = None,
    timeout: float | None = None,
    **options: Any,
) -> HookState:
    """Join the job on the parameter service and return the state for :func:`comm_hook`.

    Each argument falls back to what ``pslink launch`` sets (``PSLINK_JOB``, ``PSLINK_RANK``,
    ``PSLINK_NUM_WORKERS``, ``PSLINK_MASTER``); rank and num_workers then fall back to an initialized
    ``torch.distributed`` or torchrun's ``RANK``/``WORLD_SIZE``. ``name`` scopes the keys: give
    each DDP model of a job its own. ``agent`` reuses a connected Agent instead of joining;
    ``timeout`` (default: the Agent's, ``PSLINK_TIMEOUT`` or 300 s) bounds how long a bucket
    may wait for the other ranks. Other options go to :func:`pslink.connect`.

    Raises PeerError here, not at the first backward, when no service is reachable.
    """
    _check_name(name)
    if agent is None and job is None and master is None and not options:
        agent = _backend_agent()  # the process group's own, when torch.distributed runs on pslink
    if agent is None:
        rank = _fallback(rank, ENV_RANK, "RANK", dist.get_rank)
        num_workers = _fallback(num_workers, ENV_NUM_WORKERS, "WORLD_SIZE", dist.get_world_size)
        if options.get("mode", "sum") != "sum" or "optimizer" in options:
            raise ConfigError("the DDP hook averages gradients (mode 'sum'); DDP's optimizer steps locally")
        options["mode"] = "sum"
        try:
            agent = _SHARED.join(job, rank, num_workers, master, options)
        except PeerError as exc:
            raise PeerError(
                f"pslink.torch.connect: no parameter service reachable: {exc.message}. Start one with "
                "`pslink service up` (and set PSLINK_MASTER) or run the script under `pslink launch`",
                **exc.details,
            ) from None
        except ConfigError as exc:
            raise ConfigError(f"pslink.torch.connect: {exc.message}. `pslink launch -n N python script.py` "
                              "sets PSLINK_JOB, PSLINK_RANK and PSLINK_NUM_WORKERS", **exc.details) from None
        own = True
    else:
        if agent.mode != "sum":
            raise ConfigError(f"the DDP hook needs an Agent in mode 'sum', this one is in mode {agent.mode!r}")
        own = False
    whole, workers = whole_job(agent)  # a group's Agent: the whole job's, not its group's
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != workers:
        if own:
            _SHARED.release(agent)
        raise ConfigError(
            f"torch.distributed has {dist.get_world_size()} ranks but pslink job {whole!r} has {workers} workers: "
            "every DDP rank must be one pslink worker"
        )
    local_sync.watch(agent)  # sync="local:T": the optimizer's steps end with the groups' sync
    try:
        state = HookState(agent, name=_SHARED.name_for(agent, name), timeout=timeout, own_agent=own)
    except ConfigError:
        if own:
            _SHARED.release(agent)
        raise
    return state


class _SharedAgents:
    """The Agents :func:`connect` joined, one per (service, job, rank) in this process: a second
    DDP model of the job (a GAN's generator and discriminator) shares the first one's Agent, since
    a rank can register only once, and gets keys of its own (``name`` numbered: ``ddp``,
    ``ddp2``, ..., the same on every rank as every rank connects its models in one order). The
    Agent leaves the job when the last state using it is closed. The first connect's options hold."""

    def __init__(self):
        self._lock = threading.Lock()
        self._agents: dict[tuple, Agent] = {}
        self._users: dict[int, int] = {}  # id(agent) -> states that use it
        self._names: dict[int, weakref.WeakValueDictionary] = {}  # id(agent) -> name -> its live state

    def join(self, job, rank, num_workers, master, options: dict) -> Agent:
        job, rank, num_workers, master, _ = resolve_connect(job, rank, num_workers, master, dict(options),
                                                            AGENT_OPTIONS)
        with self._lock:
            agent = self._agents.get((master, job, rank))
            if agent is None:
                agent = self._agents[(master, job, rank)] = connect_agent(job, rank, num_workers, master, **options)
                self._users[id(agent)] = 0
            elif whole_job(agent)[1] != num_workers:
                raise ConfigError(f"pslink.torch.connect: job {job!r} rank {rank} is connected in this process with "
                                  f"{whole_job(agent)[1]} workers, not {num_workers}")
            self._users[id(agent)] += 1
            return agent

    def name_for(self, agent: Agent, name: str) -> str:
        """``name``, numbered if a live state of ``agent`` has it (the default ``ddp`` only: a name
        given twice is an error, since two models would share keys)."""
        with self._lock:
            live = self._names.setdefault(id(agent), weakref.WeakValueDictionary())
            if name in live and name != "ddp":
                raise ConfigError(f"pslink.torch.connect: name {name!r} is already used by another DDP model of job "
                                  f"{agent.job!r} in this process; give each model its own")
            chosen, number = name, 1
            while chosen in live:
                number += 1
                chosen = f"{name}{number}"
            return chosen

    def named(self, state: "HookState") -> None:
        with self._lock:
            self._names.setdefault(id(state.agent), weakref.WeakValueDictionary())[state.name] = state

    def release(self, agent: Agent) -> None:
        with self._lock:
            left = self._users.get(id(agent), 1) - 1
            if left > 0:
                self._users[id(agent)] = left
                return
            self._users.pop(id(agent), None)
            self._names.pop(id(agent), None)
            for key, known in list(self._agents.items()):
                if known is agent:
                    del self._agents[key]
        agent.close()


_SHARED = _SharedAgents()


def _backend_agent() -> Agent | None:
    """The default process group's Agent when it is a ``pslink`` group (``init_process_group
    ("pslink")``): the hook then shares it instead of joining a job of its own."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "pslink":
        return None
    return getattr(dist.group.WORLD, "agent", None)


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the job's workers through the service (a DDP comm hook).

    Returns at once; the future completes with the averaged bucket (in place) when the service
    answered, or fails with the reason (a shape mismatch naming the bucket, a lost peer, a
    timeout). Register it with ``ddp_model.register_comm_hook(state, comm_hook)``.
    """
    if not isinstance(state, HookState):
        raise TypeError(f"pslink.torch.comm_hook needs the state from pslink.torch.connect(), got {state!r}")
    tensor = bucket.buffer()
    key = state.bucket_key(bucket)
    dtype = str(tensor.dtype).replace("torch.", "")
    what = (f"DDP gradient bucket {bucket.index()} (key {key!r}: {tensor.numel()} {dtype} elements, "
            f"{len(bucket.parameters())} parameters)")
    future = torch.futures.Future(devices=[tensor.device]) if tensor.is_cuda else torch.futures.Future()
    result = future.then(_unwrap)  # an error in there fails the future DDP waits on, with our message
    try:
        view = state._staging.view(key, tensor, what)
        handle = state.agent.pushpull(key, view.array, out=view.array, average=True)
    except PslinkError as exc:
        future.set_exception(explain_mismatch(exc, what, _HINT))
        return result
    pending = FutureOnce(future, f"{what} got no average within {state.timeout:g} s (job "
                               f"{state.agent.job!r}, rank {state.rank}): has another rank died or stalled?")

    def done(handle) -> None:
        # On the Agent's I/O thread: a staged bucket's copy back is the only real work here.
        error = handle.exception()
        if error is not None:
            pending.fail(explain_mismatch(error, what, _HINT))
            return
        try:
            pending.succeed(view.finish())
        except Exception as exc:  # a device copy that failed must still complete the future
            pending.fail(exc)

    state._deadlines.add(time.monotonic() + state.timeout, pending)
    handle.add_done_callback(done)
    return result


_HINT = "do all ranks build the same model and pass DDP the same bucket_cap_mb?"


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"name must be a non-empty string without '/', got {name!r}")


def _unwrap(future: torch.futures.Future) -> torch.Tensor:
    return future.value()  # raises the exception the future was failed with


def _fallback(value: int | None, pslink_variable: str, torchrun_variable: str, from_dist) -> int | None:
    """The argument, else PSLINK_*, else torch.distributed, else torchrun's variable (None: let
    pslink.connect report what is missing)."""
    if value is not None or os.environ.get(pslink_variable):
        return value
    if dist.is_available() and dist.is_initialized():
        return from_dist()
    raw = os.environ.get(torchrun_variable)
    return int(raw) if raw and raw.isdigit() else None
