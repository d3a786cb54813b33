"""The Agent: the worker-side library that pushes and pulls tensors through the service.

::

    agent = pslink.connect(job="mnist", rank=0, num_workers=2, master="tcp://127.0.0.1:7770")
    agent.init("w", w).wait()                  # rank 0's value becomes the master copy
    g = agent.pushpull("w", grad, average=True) # returns at once: a Handle
    g.wait()                                   # grad now holds the average over the workers

The Agent asks pMaster once where each key lives (its parts may sit on different Aggregators),
then talks to the Aggregators directly. Requests are asynchronous; any number may be in flight.
Payloads are sent from the caller's array and received straight into the ``out`` array, so the
arrays must stay untouched until their handle is done.

The Agent is the public API; it composes:

- :class:`~pslink.core.agent.driver.Driver`: whoever waits drives the I/O (``Handle.wait``
  reads the sockets on the calling thread); a background thread drives only when nobody waits;
- :class:`~pslink.core.agent.handle.Handles`: the handles requests return;
- :class:`~pslink.core.agent.requests.Requests`: requests in flight, Aggregator links, probes;
- :class:`~pslink.core.agent.master_link.MasterLink`: calls to pMaster, heartbeats;
- :class:`~pslink.core.agent.lookup.KeyLookup`: where new keys live, asked of pMaster;
- :class:`~pslink.core.agent.sending.Sender`: a request's round, handle and parts, sent;
- :class:`~pslink.core.agent.replies.Replies`: the answers, taken on the driving thread;
- :class:`~pslink.core.agent.failover.Failover`: a lost Aggregator's requests go where their
  parts went;
- :class:`~pslink.core.agent.task_requests.TaskRequests`: optimizer state, joining a running job.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

from pslink.core.config import DEFAULT_MASTER, DEFAULT_TIMEOUT, fusion_settings, host_reduce_settings, link_window, resolve_token
from pslink.core import hosts
from pslink.core.agent.driver import Driver
from pslink.core.agent.failover import Failover
from pslink.core.agent.handle import Handle, Handles
from pslink.core.agent.host_reduce import local_group
from pslink.core.agent.host_reduce import start as host_reduce_start
from pslink.core.agent.iterations import Iterations
from pslink.core.agent.keys import KeyInfo, check_key
from pslink.core.agent.lookup import KeyLookup
from pslink.core.agent.replies import Replies
from pslink.core.agent.requests import Requests
from pslink.core.agent.seat import Seat
from pslink.core.agent.master_link import MasterLink
from pslink.core.agent.settings import job_config
from pslink.core.agent.tables import Table
from pslink.core.agent.tables import declare as declare_table
from pslink.core.agent.sending import Sender
from pslink.core.agent.task_requests import TaskRequests
from pslink.core.faults import Faults
from pslink.core.observe.timeline import Timeline, started_path
from pslink.core.transport import Transports
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits, Op
from pslink.errors import ClosedError, ConfigError, PslinkError

log = logging.getLogger("pslink.core.agent")


class Agent:
    """A worker's connection to the parameter service. See :func:`pslink.connect`."""

    def __init__(
        self,
        job: str,
        rank: int,
        num_workers: int,
        master: str = DEFAULT_MASTER,
        *,
        token: bytes | str | None = None,
        mode: str | None = None,
        optimizer: dict | None = None,
        partition_bytes: int | None = None,
        sync: str | None = None,
        servers: int | None = None,
        max_workers: int | None = None,
        staleness: int | None = None,
        straggler_timeout: float | None = None,
        replication: int | None = None,
        checkpoint: str | None = None,
        checkpoint_every: int | None = None,
        slo: float | None = None,
        priority: str | None = None,
        gradient_compression: dict | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        resend_timeout: float | None = None,
        fusion_bytes: int | None = None,
        fusion_cycle_ms: float | None = None,
        failover: bool = True,
        host_reduce: bool | None = None,
        local_rank: int | None = None,
        local_size: int | None = None,
        faults: Faults | None = None,
        peer_timeout: float = 10.0,
        probe_interval: float = 0.5,
        heartbeat_interval: float = 2.0,
        connect_timeout: float = 10.0,
        rejoin: bool = False,
        spin: float = 100e-6,
        idle_poll: float = 0.002,
        transports: Transports | None = None,
        limits: Limits = DEFAULT_LIMITS,
        timeline: Timeline | None = None,
        clock=time.monotonic,
    ):
        self.master_address = master
        self.timeout = timeout
        self.faults = faults if faults is not None else Faults.from_env()
        if self.faults is not None:
            self.faults.bind(f"{job}/{rank}")
        self.limits = limits
        self.clock = clock
        self.transports = transports or Transports()
        self._own_transports = transports is None
        # pMaster places the job's parts and replicas by the hosts of its workers.
        self.seat = Seat(job, rank, num_workers, resolve_token(token) or b"", hosts.host_id())
        self._reactor = Reactor(f"agent {job}/{rank}", clock)
        self._keys: dict[Any, KeyInfo] = {}
        self._lock = threading.Lock()  # rounds
        self._closed = False
        self._driver = Driver(self._reactor, f"agent-{rank}", spin=spin, idle_poll=idle_poll, in_flight=self._in_flight,
                              clock=clock)
        # PSLINK_TIMELINE: a Chrome trace of this worker's requests (pslink.core.observe.timeline)
        self._timeline = timeline if timeline is not None else Timeline.from_env(job, rank, num_workers)
        self._iterations = Iterations(clock, self._timeline, self._lock)  # durations for pMaster; the timeline's steps
        fusion = fusion_settings(fusion_bytes, fusion_cycle_ms)  # small requests to one Aggregator travel together
        # With fusion off nothing waits in an outbox: no look at every link before each wait.
        self._handles = Handles(self._driver, timeout, job, rank, self._timeline,
                                before_wait=self._flush_fused if fusion[0] else None, waited=self._iterations.waited,
                                explain=self._explain_wait)
        # A request unanswered this long is sent again (same id; Aggregators apply it once).
        # Messages over TCP are not lost, so it is off unless faults are injected.
        resend_timeout = resend_timeout if resend_timeout is not None else (1.0 if self.faults else None)
        self._requests = Requests(self.seat, self.transports, self._reactor, self, limits, self._handles,
                                  connect_timeout=connect_timeout, peer_timeout=peer_timeout,
                                  probe_interval=probe_interval, resend_timeout=resend_timeout, faults=self.faults,
                                  clock=clock, fusion_bytes=fusion[0], fusion_cycle=fusion[1], link_window=link_window(),
                                  on_lost=self._link_lost)
        self._master = MasterLink(self.seat, master, self.transports, self._reactor, limits, self._handles,
                                  connect_timeout=connect_timeout, timeout=timeout,
                                  heartbeat_interval=heartbeat_interval, take_iterations=self._iterations.take,
                                  on_back=self._registered_again, closed=lambda: self._closed)
        config = job_config(mode=mode, optimizer=optimizer, partition_bytes=partition_bytes, sync=sync,
                            servers=servers, max_workers=max_workers, staleness=staleness,
                            straggler_timeout=straggler_timeout, replication=replication, checkpoint=checkpoint,
                            checkpoint_every=checkpoint_every, slo=slo, priority=priority)
        try:
            self.settings = self._master.register(config, token=self.seat.token or None, rejoin=rejoin)
        except BaseException:
            self._release_io()  # a refused or failed registration leaves nothing open behind
            raise
        self.seat.token = self.settings["token"]
        self.seat.update_members(self.settings.get("membership"))
        self.seat.num_workers = num_workers  # the job's size as this worker was told it, until members change
        self.mode: str = self.settings["mode"]
        self.sync: str = self.settings["sync"]
        self.partition_bytes: int = self.settings["partition_bytes"]
        self._failover = Failover(self.seat, self._keys, self._requests, self._master, self._reactor,
                                  enabled=failover, closed=lambda: self._closed)
        lookup = KeyLookup(self._keys, self._master)
        # Elastic membership: a worker registered while its job ran joins each key before use.
        self._tasks = TaskRequests(self.seat, self._keys, lookup, self._requests, self._handles, self._master,
                                   late=bool(self.settings.get("late")))
        self._sender = Sender(self.seat, self._keys, self._lock, self._iterations, self._handles, self._requests,
                              lookup, self._tasks, self._failover, clock, compression=gradient_compression)
        self._replies = Replies(self.seat, limits, self._reactor, self._requests, self._handles, self._master,
                                self._failover, self._sender, self._tasks, self._timeline, clock,
                                epoch=self.seat.members.get("epoch", 0))
        local = host_reduce_settings(host_reduce, local_rank, local_size, job, rank, num_workers,
                                     elastic=max_workers is not None)
        if local is not None and self.sync == "bsp" and not rejoin and not self._tasks.late:
            try:  # the workers of this host sum their pushes here first (pslink.core.agent.host_reduce)
                self._sender.host = host_reduce_start(
                    self.seat, local_group(rank, *local), self._master, self.transports, self._reactor, limits,
                    self._requests, self._sender, self._handles, connect_timeout)
            except BaseException:
                self.close(leave=False)
                raise
        self._master.start_heartbeats()
        self._driver.start()

    # -- who it is --------------------------------------------------------------------------------

    @property
    def job(self) -> str:
        return self.seat.job

    @property
    def rank(self) -> int:
        return self.seat.rank

    @property
    def num_workers(self) -> int:
        """The job's workers (its members now, in an elastic job)."""
        return self.seat.num_workers

    @property
    def token(self) -> bytes:
        return self.seat.token

    @property
    def host_id(self) -> str:
        return self.seat.host_id

    @property
    def host_role(self) -> str | None:
        """This worker's part in its host's reduce (docs/hierarchy.md): "leader" (it pushes its
        host's sums), "follower" (its pushes go through the leader), or None (it pushes itself)."""
        host = self._sender.host
        return None if host is None else ("leader" if host.leads else "follower")

    @property
    def epoch(self) -> int:
        """The job's membership epoch, as replies last said."""
        return self._replies.epoch

    @property
    def dropped_pushes(self) -> int:
        """Pushes that came after their round closed without them (a straggler's)."""
        return self._replies.dropped_pushes

    @property
    def rounds_lost(self) -> dict:
        """key -> (rounds of updates lost, checkpoint round) when it restarted from a checkpoint."""
        return self._failover.rounds_lost

    @property
    def rounds_lost_by_part(self) -> dict:
        """(key, part) -> (rounds of updates lost, checkpoint round): the parts of a key (a table's
        shards) may have restarted from checkpoints of different rounds."""
        return self._failover.rounds_lost_by_part

    def _registered_again(self, body: dict) -> None:
        """pMaster answered this worker's registration after it had lost pMaster."""
        self.seat.update_members(body.get("membership"))
        if body.get("late"):
            # It had been taken out of the job (silent too long) and came back as a new member:
            # it joins every key again, at the rounds under way.
            log.error("agent %s: this worker had been removed from the job; it rejoins at the current rounds (its "
                      "own state may be behind the others')", self.seat)
            self._tasks.late, self._tasks.joined = True, set()
        else:
            log.info("agent %s: reconnected to pMaster", self.seat)

    def __repr__(self) -> str:
        return f"<Agent job={self.job!r} rank={self.rank}/{self.num_workers} master={self.master_address}>"

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- public API -----------------------------------------------------------------------------

    def init(self, key, array) -> Handle:
        """Declare ``key`` and, on rank 0, set its initial value. Call it on every worker: other
        ranks' values only check the shape, and their handles complete once rank 0's value is in."""
        return self._submit(Op.INIT, [key], [array], None, False)

    def push(self, key, array) -> Handle:
        """Contribute ``array`` to this worker's next round of ``key``."""
        return self._submit(Op.PUSH, [key], [array], None, False)

    def pull(self, key, out=None, average: bool = False) -> Handle:
        """Fetch the result of this worker's latest round of ``key`` (its initial value before
        any push) into ``out`` (allocated if None); ``average`` divides a sum by the number of
        workers that pushed."""
        return self._submit(Op.PULL, [key], None, [out], average)

    def pushpull(self, key, array, out=None, average: bool = False) -> Handle:
        """Push ``array`` and pull that round's result into ``out`` (may be ``array`` itself)."""
        return self._submit(Op.PUSHPULL, [key], [array], [out], average)

    def cancel(self, handle: Handle, error: PslinkError) -> None:
        """Fail ``handle`` now with ``error``. Its requests stay where they are; an answer that
        still comes changes nothing. For a caller that learned by other means that the request
        cannot succeed (the worker layer's board, when the ranks' calls disagree)."""
        if not handle.done():
            self._handles.complete(handle, error)

    def table(self, name: str, width: int, dtype: str = "float32", **options) -> Table:
        """The sparse table ``name`` of rows of ``width`` (declared on first use; every worker calls
        it alike): ``shards``, ``init`` ("zeros", ["uniform", low, high], ["normal", mean, std]),
        ``seed``, ``optimizer`` ("sum", "sgd", "adagrad", "adam", or a map with its settings),
        ``capacity`` (rows per shard) with ``evict`` ("lru", or "ttl" with ``ttl`` seconds)."""
        return declare_table(self, name, width, dtype, options)

    def init_many(self, keys: Sequence, arrays: Sequence) -> Handle:
        return self._submit(Op.INIT, list(keys), list(arrays), None, False)

    def push_many(self, keys: Sequence, arrays: Sequence) -> Handle:
        return self._submit(Op.PUSH, list(keys), list(arrays), None, False)

    def pull_many(self, keys: Sequence, outs: Sequence | None = None, average: bool = False) -> Handle:
        keys = list(keys)
        return self._submit(Op.PULL, keys, None, list(outs) if outs is not None else [None] * len(keys), average)

    def pushpull_many(self, keys: Sequence, arrays: Sequence, outs: Sequence | None = None, average: bool = False) -> Handle:
        keys = list(keys)
        return self._submit(Op.PUSHPULL, keys, list(arrays), list(outs) if outs is not None else [None] * len(keys), average)

    def delete(self, keys: Sequence) -> list:
        """Delete keys (tensors or tables) of the job on the service: their parts and replicas are
        dropped and their memory returns; a key not known is ignored, so every worker may call it.
        Stop using the keys on every worker first; a key deleted may be declared again afresh.
        Returns the keys deleted."""
        keys = [check_key(k) for k in keys]
        body = self._master.call(Op.DELETE_KEYS, keys=keys)
        for key in keys:
            self._keys.pop(key, None)
        if self._sender.host is not None:
            self._sender.host.forget(keys)
        return list(body.get("deleted", []))

    def set_gradient_compression(self, params: dict | None) -> None:
        """Quantize this worker's pushes of floating keys to 2 bits a value from now on, with a
        residual per key part kept here (``{"type": "2bit", "threshold": 0.5}``, MXNet's
        semantics: pslink.core.compression); ``{"type": "none"}`` or None sends them whole again."""
        self._sender.set_compression(params)

    @property
    def fusion_bytes(self) -> int:
        """The fusion threshold (0: off): the most payload one fused message holds; adapters that
        fuse tensors themselves (DistributedOptimizer's buckets) use it too."""
        return self._requests.fusion_bytes

    @property
    def payload_bytes(self) -> int:
        """Payload bytes this worker's pushes sent so far (what compression saves shows here)."""
        return self._sender.payload_bytes

    def set_optimizer(self, optimizer: dict) -> None:
        """Have the Aggregators apply ``optimizer`` (plain data, see pslink.core.optim) to every
        push from now on: pulls then return weights. Any time, as MXNet's store takes it: in a
        job that sums, each key's value so far (its init or its last round's sum) becomes the
        weights, and the rounds after the ones this worker pushed step them. So every worker
        calls it after the same pushes (MXNet's workers all do), or one worker calls it between
        two barriers; it returns once every Aggregator of the job has it. A new optimizer of
        another type starts its state (momentum, moments) afresh; new hyperparameters keep it."""
        pushed = [[key, info.round] for key, info in list(self._keys.items()) if info.round]
        body = self._master.call(Op.SET_OPTIMIZER, optimizer=optimizer, pushed=pushed)
        self.settings = body
        self.mode = body["mode"]

    def barrier(self, name: str = "barrier", timeout: float | None = None) -> dict:
        """Wait until every member of the job reached the barrier of this name (a member that
        leaves meanwhile is not waited for). Returns the members it released: ``{"ranks", "epoch"}``."""
        body = self._master.barrier(name, timeout)
        self.seat.update_members(body)
        return body

    def optimizer_state(self, keys: Sequence | None = None, timeout: float | None = None) -> dict:
        """The service's optimizer state (optimizer mode), for checkpoints: see
        :meth:`TaskRequests.optimizer_state <pslink.core.agent.task_requests.TaskRequests.optimizer_state>`."""
        return self._tasks.optimizer_state(keys, timeout)

    def set_optimizer_state(self, states: dict, timeout: float | None = None) -> None:
        """Replace the service's optimizer state of the keys in ``states`` (e.g. from a checkpoint)."""
        self._tasks.set_optimizer_state(states, timeout)

    def join_all(self, timeout: float | None = None) -> list:
        """Come into every key the job has (a worker added to a running job, before it trains)."""
        return self._tasks.join_all(timeout)

    def start_timeline(self, path: str, mark_cycles: bool = False) -> str:
        """Record this worker's requests to a Chrome trace from now on (Horovod's
        ``start_timeline``); a timeline being recorded (``PSLINK_TIMELINE`` or an earlier call)
        is closed first; the file is :func:`~pslink.core.observe.timeline.started_path`'s.
        ``mark_cycles``: an instant at each iteration's start. Returns the file written."""
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f"start_timeline needs a file path, got {path!r}")
        written = started_path(path, self.rank)
        timeline = Timeline(written, self.job, self.rank, mark_cycles=mark_cycles)
        self._set_timeline(timeline)
        return written

    def stop_timeline(self) -> None:
        """Stop recording the timeline and close its file (nothing if none is recorded)."""
        self._set_timeline(None)

    def _set_timeline(self, timeline: Timeline | None) -> None:
        with self._lock:
            old, self._timeline = self._timeline, timeline
            self._handles.timeline = self._iterations.timeline = self._replies.timeline = timeline
        if old is not None:
            old.close()

    def membership(self) -> dict:
        """The job's members now, from pMaster: ``{"ranks": [...], "epoch": n}``."""
        return self._tasks.membership()

    def job_keys(self) -> list:
        """Every key the job has declared, with where its parts live (pMaster's view)."""
        return self._master.call_again_if_cut(Op.JOB_KEYS)["keys"]

    def close(self, leave: bool = True) -> None:
        """Leave the job (the job ends once every worker left) and release everything. With
        ``leave=False`` only release: for an Agent whose rank a new Agent of this process
        registered again (``rejoin``), which is the member now."""
        if self._closed:
            return
        if leave:
            try:
                self._master.call(Op.LEAVE, timeout=min(5.0, self.timeout))
            except PslinkError as exc:
                log.debug("agent %s: leave failed: %s", self.seat, exc)
        self._closed = True
        self._requests.closed = True
        if self._sender.host is not None and self._sender.host.leads:
            self._sender.host.close()  # its followers push to the pool themselves from now on
        self._driver.close()
        self._requests.fail(list(self._requests.pending), ClosedError(f"agent of job {self.job!r} rank {self.rank} "
                                                                        "closed"))
        self._release_io()
        if self._timeline is not None:
            self._timeline.close()

    def _release_io(self) -> None:
        self._requests.close_links()
        self._master.close()
        self._reactor.drain()  # carry out the connections' teardown
        self._reactor.close()
        if self._own_transports:
            self.transports.close()

    @property
    def keys_known(self) -> int:
        """How many of the job's keys this Agent has made requests for (none: a process that has
        not taken part yet, say one that just took over a rank)."""
        return len(self._keys)

    @property
    def late(self) -> bool:
        """True when this worker registered while its job was running (it joins keys under way)."""
        return self._tasks.late

    @property
    def closed(self) -> bool:
        return self._closed

    def key_info(self, key) -> dict | None:
        """Where a key lives, as pMaster placed it (None if this Agent has not used it)."""
        info = self._keys.get(key)
        if info is None:
            return None
        return {
            "shape": info.shape,
            "dtype": info.dtype_name,
            "round": info.round,
            "parts": [(p.index, p.start, p.stop, p.aggregator, p.address) for p in info.parts],
        }

    # -- submitting -----------------------------------------------------------------------------

    def _submit(self, op: Op, keys: list, arrays: list | None, outs: list | None, average: bool) -> Handle:
        if self._closed:
            raise ClosedError(f"agent of job {self.job!r} rank {self.rank} is closed")
        self._driver.touch()
        return self._sender.submit(op, keys, arrays, outs, average)

    # -- the owner's forwarding ------------------------------------------------------------------
    # The Agent's collaborators need each other both ways (the requests' links deliver to the
    # replies, which find their requests in flight; the handles wait while the requests hold
    # fused messages, and the requests complete the handles). The ones made first get the Agent's
    # methods below, which forward each event to the collaborator that handles it: every
    # collaborator gets what it needs in its constructor, and none is patched after.

    def on_accept(self, conn) -> None:  # pragma: no cover - an Agent listens nowhere
        conn.close()

    def on_header(self, conn, raw, sizes):
        return self._replies.on_header(conn, raw, sizes)

    def on_message(self, conn, state, payloads) -> None:
        self._replies.on_message(conn, state, payloads)

    def on_close(self, conn, exc) -> None:
        self._replies.on_close(conn, exc)

    def _link_lost(self, link, exc, rids: list[int] | None = None) -> None:
        self._replies.link_lost(link, exc, rids)

    def _in_flight(self) -> bool:
        return bool(self._requests.pending)

    def _flush_fused(self) -> None:
        self._requests.flush()

    def _explain_wait(self, handle: Handle) -> str:
        """A timeout names the ranks its round waits for."""
        return self._tasks.explain_wait(handle)
