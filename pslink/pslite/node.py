"""A ps-lite node as an object: ps-lite's Postoffice and Van, without the process-wide singleton.

::

    node = Node(Config.from_env())      # or Config(role="worker", root_uri=..., ...)
    node.start()                        # blocks until every node registered
    ... KVWorker(0, 0, node=node) / KVServer(0, node=node) / SimpleApp(0, node=node) ...
    node.finalize()                     # a barrier with every node, then teardown

Several nodes may live in one process (tests run a whole ps-lite deployment on threads); the
module-level functions of :mod:`pslink.pslite` act on a default node built from the environment.

A node listens on its own address; peers connect lazily to send it requests and it answers on
the connection a request came from. Control messages (registration, barriers, heartbeats) go to
the scheduler over the connection each node opened to it. The scheduler's decisions live in
:class:`~pslink.pslite.scheduler.SchedulerState`; apps (KVWorker, KVServer, SimpleApp) register
with the node and get the messages addressed to them, routed as ps-lite routes them: on a
worker by (app id, customer id), elsewhere by app id. A request for an app that does not exist
yet is queued until it does (ps-lite aborts there after 5 s).
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from pslink.core import hosts
from pslink.core.agent.driver import Driver
from pslink.core.wire.loop import Reactor
from pslink.core.wire.protocol import DEFAULT_LIMITS, Limits
from pslink.core.transport import DISCARD, Transports, split_host_port
from pslink.errors import ClosedError, ConfigError, PeerError, ProtocolError, PslinkError, error_from_code
from pslink.pslite import wire
from pslink.pslite.config import Config
from pslink.pslite.inbox import Inbox
from pslink.pslite.links import LocalConn, Links
from pslink.pslite.resend import Resender
from pslink.pslite.scheduler import ALL_GROUPS, ROLE_BIT, SCHEDULER, Range, SchedulerState, key_ranges
from pslink.pslite.scheduling import HANDLED as SCHEDULER_KINDS
from pslink.pslite.scheduling import SchedulerRunner
from pslink.pslite.wire import Kind

log = logging.getLogger("pslink.pslite")

FINAL_CUSTOMER = -1  # the barrier key finalize uses, apart from every user barrier


class NodeInfo:
    __slots__ = ("id", "role", "rank", "address", "pid")

    def __init__(self, id_, role, rank, address, pid):
        self.id, self.role, self.rank, self.address, self.pid = id_, role, rank, address, pid

    def describe(self) -> str:
        name = "scheduler" if self.role == "scheduler" else f"{self.role} {self.rank}"
        return f"{name} (node id {self.id}, {self.address})"


class Node:
    """One ps-lite node (worker, server or scheduler). See the module docstring."""

    def __init__(self, config: Config, *, transports: Transports | None = None, limits: Limits = DEFAULT_LIMITS,
                 spin: float | None = None, idle_poll: float = 0.002, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.role = config.role
        self.limits = limits
        self.clock = clock
        _apply_verbosity(config.verbose)
        self.transports = transports or Transports()
        self._own_transports = transports is None
        self.reactor = Reactor(f"pslite {self.role}", clock)
        if spin is None:
            # Servers spin as Aggregators do: requests come in bursts, and a wake-up costs more
            # than a round trip here. Workers spin briefly, as Agents do.
            spin = 2e-3 if self.role == "server" else 100e-6
        # Nodes serve requests that come unasked (servers, SimpleApp): the background thread drives
        # whenever no thread waits and none submitted lately.
        self.driver = Driver(self.reactor, f"pslite-{self.role}", spin=spin, idle_poll=idle_poll, serves=True, clock=clock)
        self._lock = threading.RLock()
        self._local = LocalConn(self.reactor, self._deliver_local)
        try:
            self.listener = self.transports.listen(config.listen_address(), self.reactor, self, limits)
        except PeerError as exc:
            self.reactor.close()
            if self._own_transports:
                self.transports.close()
            what = "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT" if self.role == "scheduler" else "DMLC_NODE_HOST/PORT"
            raise PeerError(f"{self.role} cannot listen ({what}): {exc.message}") from None
        _, port = split_host_port(self.listener.address)
        host = config.advertised_host()
        self.address = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        self.scheduler_address = self.address if self.role == "scheduler" else config.scheduler_address
        self.id: int | None = SCHEDULER if self.role == "scheduler" else None
        self.rank: int | None = 0 if self.role == "scheduler" else None
        self.nodes: dict[int, NodeInfo] = {}
        self._groups: dict[int, list[int]] = {}
        self._ranges: list[Range] | None = None
        self._apps: dict[tuple[int, int], Any] = {}
        self.inbox = Inbox(self._apps, self.route_key, lambda: self.id or 0, self.describe)
        self._resender = Resender(self, config.resend_timeout) if config.resend else None
        self._trace = config.verbose >= 2  # PS_VERBOSE=2: log every message, as ps-lite does
        self.links = Links(self.transports, self.reactor, self, limits, local=self._local,
                           connect_timeout=config.start_timeout, node_id=lambda: self.id, nodes=lambda: self.nodes,
                           scheduler_conn=lambda: self._sched_conn, apps=self._apps, closed=lambda: self._closed,
                           describe=self.describe, resending=self._resender is not None, trace=self._trace)
        self._sched_conn = None
        self._start_begun = False
        self._ready = False
        self._failure: PslinkError | None = None
        self._started_customers: set[int] = set()
        self._finalized_customers: set[int] = set()
        self._barrier_seq: dict[tuple, int] = collections.Counter()
        self._released: dict[tuple, int] = collections.Counter()
        self._finalizing = False
        self._closed = False
        self._exit_callbacks: list[Callable[[], None]] = []
        self._agent = None
        self._agent_lock = threading.Lock()
        self._sched: SchedulerRunner | None = None
        if self.role == "scheduler":
            state = SchedulerState(config.num_workers, config.num_servers, config.mode, self.address,
                                   os.getpid(), self._local, clock(), host_id=hosts.host_id())
            self._sched = SchedulerRunner(state, self.reactor, clock, config.heartbeat_interval,
                                          config.heartbeat_timeout, self.driver.notify)
        self.driver.start()
        if config.heartbeat_interval > 0 and self.role != "scheduler":
            self.reactor.call_later(config.heartbeat_interval, self._heartbeat)

    @property
    def bad_messages(self) -> int:
        """Messages this node could not read (each logged, and answered if it was a request)."""
        return self.inbox.bad_messages

    def __repr__(self) -> str:
        rank = "?" if self.rank is None else self.rank
        return f"<pslite Node {self.role} {rank} at {self.address}>"

    def describe(self) -> str:
        if self.role == "scheduler":
            return f"scheduler at {self.address}"
        rank = f" {self.rank}" if self.rank is not None else ""
        return f"{self.role}{rank} at {self.address}"

    # -- roles and topology -------------------------------------------------------------------

    @property
    def is_worker(self) -> bool:
        return self.role == "worker"

    @property
    def is_server(self) -> bool:
        return self.role == "server"

    @property
    def is_scheduler(self) -> bool:
        return self.role == "scheduler"

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    @property
    def num_servers(self) -> int:
        return self.config.num_servers

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def closed(self) -> bool:
        return self._closed

    def my_rank(self) -> int:
        """This node's rank in its group (available after :meth:`start`, as in ps-lite)."""
        if self.rank is None:
            raise ConfigError(f"my_rank() of the {self.role} at {self.address}: the rank is known only after start()")
        return self.rank

    def require_ready(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"{what}: the {self.describe()} was finalized")
        if self._failure is not None:
            raise self._failure
        if not self._ready:
            raise ConfigError(f"{what}: call start() first (the {self.describe()} has not joined yet)")

    def node_ids(self, group_or_id: int) -> list[int]:
        """The node ids a group (1 scheduler, 2 servers, 4 workers, or a sum) or one id stands for."""
        self.require_ready("node_ids")
        ids = self._groups.get(group_or_id)
        if ids is None:
            if group_or_id in self.nodes:
                return [group_or_id]
            known = ", ".join(f"{i} ({n.role} {n.rank})" for i, n in sorted(self.nodes.items()))
            raise ConfigError(f"node {group_or_id!r} does not exist: groups are 1..7, node ids {known}")
        return ids

    def server_key_ranges(self) -> list[Range]:
        """ps-lite's key ranges: server i holds ``[kMaxKey / n * i, kMaxKey / n * (i + 1))``."""
        if self._ranges is None:
            self._ranges = key_ranges(self.config.num_servers)
        return self._ranges

    def server_id(self, rank: int) -> int:
        return 8 + 2 * rank

    def register_exit_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` after :meth:`finalize` (ps-lite keeps only the last one; we run all)."""
        self._exit_callbacks.append(callback)

    # -- life cycle ---------------------------------------------------------------------------

    def start(self, customer_id: int = 0, do_barrier: bool = True, timeout: float | None = None) -> None:
        """Join the deployment; blocks until every node registered (ps-lite's start barrier).

        Every customer (thread) of a node may call it; the node registers once. ``do_barrier``
        is accepted for ps-lite's signature: registration completing already means every node
        started, so no further barrier is needed.
        """
        customer_id = wire.check_i32("customer_id", customer_id)
        with self._lock:
            if self._closed:
                raise ClosedError(f"start: the {self.describe()} was finalized; build a new node")
            self._started_customers.add(customer_id)
            first = not self._start_begun
            self._start_begun = True
        timeout = self.config.start_timeout if timeout is None else timeout
        if first and self.role != "scheduler":
            try:
                self._register(time.monotonic() + timeout)
            except PslinkError as exc:
                self._fail(exc)
                raise
        self.driver.wait(lambda: self._ready or self._failure is not None, timeout, self._start_progress)
        if self._failure is not None:
            raise self._failure
        if self.role == "worker" and self.mode == "service":
            _ = self.agent  # connect now, so a bad service address fails start(), not the first push

    def _start_progress(self) -> str:
        if self._sched is not None:
            return self._sched.progress(self.num_workers, self.address)
        return (f"start of the {self.role} at {self.address}: waiting for every node to register with the "
                f"scheduler at {self.scheduler_address}")

    def _register(self, deadline: float) -> None:
        conn = self._connect_scheduler(deadline)
        self._sched_conn = conn
        config = self.config
        fields = {"role": self.role, "addr": self.address, "host": os.uname().nodename, "host_id": hosts.host_id(),
                  "pid": os.getpid(),
                  "rank": -1 if config.rank is None else config.rank, "nw": config.num_workers,
                  "ns": config.num_servers, "mode": config.mode}
        conn.send([wire.encode_fields(Kind.REGISTER, fields)])

    def _connect_scheduler(self, deadline: float):
        delay, last = 0.02, None
        while True:
            try:
                return self.transports.connect(self.scheduler_address, self.reactor, self, self.limits,
                                               timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except PeerError as exc:
                last = exc
            if time.monotonic() + delay > deadline:
                raise PeerError(
                    f"the {self.role} at {self.address} cannot reach the scheduler at {self.scheduler_address} "
                    f"(DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT): {last.message}", peer=self.scheduler_address)
            time.sleep(delay)  # the scheduler may not be up yet: retry, backing off
            delay = min(0.5, delay * 2)

    def barrier(self, customer_id: int = 0, group: int = ALL_GROUPS, timeout: float | None = None) -> None:
        """Wait until every node of ``group`` called ``barrier`` with this customer id."""
        customer_id = wire.check_i32("customer_id", customer_id)
        self.require_ready("barrier")
        if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= ALL_GROUPS:
            raise ConfigError(f"barrier group {group!r} must be 1..7 (scheduler 1 + servers 2 + workers 4)")
        if not group & ROLE_BIT[self.role]:
            raise ConfigError(f"a {self.role} cannot join barrier group {group}: the group does not include "
                              f"{self.role}s")
        if len(self.node_ids(group)) <= 1:
            return
        self._barrier((group, customer_id, False), timeout)

    def _barrier(self, key: tuple, timeout: float | None) -> None:
        group, customer, final = key
        with self._lock:
            self._barrier_seq[key] += 1
            seq = self._barrier_seq[key]
        self._send_control(Kind.BARRIER, {"group": group}, customer=customer, flags=wire.FINAL if final else 0)
        what = "finalize" if final else f"barrier of group {group} (customer {customer})"
        self.driver.wait(lambda: self._released[key] >= seq or self._failure is not None, timeout,
                         lambda: f"{what} of the {self.describe()}")
        if self._failure is not None:
            raise self._failure

    def finalize(self, customer_id: int = 0, do_barrier: bool = True, timeout: float | None = None) -> None:
        """Leave the deployment: with ``do_barrier``, once every node finalized (ps-lite's
        Finalize); then close, and run the exit callbacks. A node with several customers
        finalizes when the last customer that started calls this; the others wait for it."""
        customer_id = wire.check_i32("customer_id", customer_id)
        with self._lock:
            if self._closed:
                return
            self._finalized_customers.add(customer_id)
            last = self._started_customers <= self._finalized_customers
            if last:
                owner = not self._finalizing
                self._finalizing = True
        if not last or not owner:
            self.driver.wait(lambda: self._closed or self._failure is not None, timeout,
                             lambda: f"finalize of customer {customer_id} on the {self.describe()}")
            if self._failure is not None:
                raise self._failure
            return
        error = None
        try:
            if self._ready and self._failure is None:
                if do_barrier:
                    self._barrier((ALL_GROUPS, FINAL_CUSTOMER, True), timeout)
                else:
                    self._send_control(Kind.LEAVE, {})
            elif self._failure is not None:
                error = self._failure
        except PslinkError as exc:
            error = exc
        finally:
            self._teardown()
        if error is not None:
            raise error

    def _teardown(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            agent.close()
        if self._sched is not None and self._failure is None:
            # Stay until every node heard its release and hung up (so none finds us gone early).
            try:
                remaining = self._sched.state.remaining
                self.driver.wait(lambda: not remaining(), 10.0,
                                 lambda: f"scheduler waiting for {len(remaining())} node(s) to leave")
            except PslinkError as exc:
                log.warning("%s", exc)
        with self._lock:
            self._closed = True
        if self._sched is not None:
            self._sched.stopped = True
        self.driver.notify()
        self.reactor.wake()  # a customer thread driving in poll returns and sees the node closed
        self.driver.close()
        self.links.close()
        if self._sched_conn is not None:
            self._sched_conn.close()
        self.listener.close()
        self.reactor.drain()
        self.reactor.close()
        if self._own_transports:
            self.transports.close()
        for callback in self._exit_callbacks:
            try:
                callback()
            except Exception:
                log.exception("exit callback %r failed", callback)

    def close(self) -> None:
        """Release everything without the finalize barrier (for tests and error paths)."""
        with self._lock:
            if self._closed:
                return
            self._finalizing = True
            self._failure = self._failure or ClosedError(f"the {self.describe()} was closed")
        self._teardown()

    # -- service mode ---------------------------------------------------------------------------

    @property
    def agent(self):
        """The pslink Agent serving this worker's KV requests in service mode."""
        with self._agent_lock:
            if self._agent is None:
                self.require_ready("service mode")
                if self.role != "worker" or self.mode != "service":
                    raise ConfigError(f"the {self.describe()} has no Agent: only workers in service mode use one")
                from pslink.core.worker.connect import connect

                config = self.config
                self._agent = connect(config.job, self.rank, config.num_workers, config.master, token=config.token,
                                      mode="sum", sync="asp", timeout=config.timeout)
            return self._agent

    # -- apps -----------------------------------------------------------------------------------

    def route_key(self, app_id: int, customer_id: int) -> tuple[int, int]:
        # ps-lite routes by (app, customer) on workers and by app alone elsewhere.
        return (app_id, customer_id) if self.role == "worker" else (app_id, app_id)

    def add_app(self, app) -> None:
        key = self.route_key(app.app_id, app.customer_id)
        with self._lock:
            if self._closed:
                raise ClosedError(f"the {self.describe()} was finalized")
            if key in self._apps:
                raise ConfigError(f"app {app.app_id} customer {app.customer_id} already exists on the "
                                  f"{self.describe()}")
            self._apps[key] = app
            queued = self.inbox.take_queued(key)
        if queued:
            self.reactor.post(self.inbox.replay, queued)

    def remove_app(self, app) -> None:
        with self._lock:
            key = self.route_key(app.app_id, app.customer_id)
            if self._apps.get(key) is app:
                del self._apps[key]

    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the thread that drives this node's I/O."""
        self.reactor.post(fn, *args)

    # -- sending --------------------------------------------------------------------------------

    def send_request(self, target: int, frames: list, app, ts: int) -> None:
        """Send a request to node ``target``; the app hears of its answer or of the link failing."""
        key = self.route_key(app.app_id, app.customer_id)
        if self._resender is not None:
            self._resender.sent(target, (key, ts), frames)
        self.links.send_request(target, frames, app, key, ts)

    def _send_control(self, kind: Kind, fields: dict, **fixed) -> None:
        frame = wire.encode_fields(kind, fields, sender=self.id or 0, **fixed)
        conn = self._local if self.role == "scheduler" else self._sched_conn
        if conn is None:
            raise ConfigError(f"{kind.name}: the {self.describe()} has not joined yet")
        conn.send([frame])

    def _heartbeat(self) -> None:
        if self._closed:
            return
        try:
            if self._sched_conn is not None and not self._sched_conn.closed:
                self._sched_conn.send([wire.encode_fields(Kind.HEARTBEAT, {}, sender=self.id or 0)])
        except PslinkError:
            pass
        finally:
            self.reactor.call_later(self.config.heartbeat_interval, self._heartbeat)

    # -- receiving (on the driving thread) --------------------------------------------------------

    def on_accept(self, conn) -> None:
        pass

    def on_header(self, conn, raw, sizes):
        try:
            header = wire.decode(raw, sizes)
        except ProtocolError as exc:
            return (exc, raw), DISCARD
        kind = header.kind
        if kind == Kind.KV_RESPONSE:
            app = self._apps.get(self.route_key(header.app, header.customer))
            if app is None or not sizes:
                return (header, app), (DISCARD if sizes else None)
            return (header, app), app._response_buffers(header, sizes)
        if kind == Kind.KV_REQUEST:
            arrays = self.inbox.buffers(header, sizes)
            return (header, arrays), [memoryview(a).cast("B") for a in arrays]
        return (header, None), None

    def on_message(self, conn, state, payloads) -> None:
        header, extra = state
        if isinstance(header, ProtocolError):
            self.inbox.bad_message(conn, header, extra)
            return
        if self._trace:
            log.debug("%s <- %s: %r", self, conn.peer, header)
        kind = header.kind
        if kind == Kind.KV_RESPONSE or kind == Kind.SIMPLE_RESPONSE or kind == Kind.ERROR:
            key = self.route_key(header.app, header.customer)
            self.links.answered(header.sender, key, header.ts)
            if self._resender is not None:
                self._resender.answered(header.sender, (key, header.ts))
            app = extra if kind == Kind.KV_RESPONSE else self._apps.get(key)
            if app is None:
                log.debug("%s: answer for app %s customer %s nobody waits for", self, header.app, header.customer)
            elif kind == Kind.KV_RESPONSE:
                app._on_kv_response(header)
            elif kind == Kind.SIMPLE_RESPONSE:
                app._on_simple_response(header)
            else:
                app._on_error(header, error_from_code(header.tail["code"], header.tail["msg"]))
        elif kind == Kind.KV_REQUEST or kind == Kind.SIMPLE_REQUEST:
            if self._resender is not None:
                conn = self._resender.receive(conn, header)
                if conn is None:
                    return  # a duplicate (PS_RESEND)
            self.inbox.deliver(conn, header, extra)
        else:
            self._on_control(conn, header)

    def _deliver_local(self, raw: bytes, payloads: list) -> None:
        state, buffers = self.on_header(self._local, raw, tuple(p.nbytes for p in payloads))
        if buffers is DISCARD:
            payloads = []
        elif buffers is not None:
            for dest, src in zip(buffers, payloads):
                dest[:] = memoryview(src).cast("B")
            payloads = buffers
        self.on_message(self._local, state, payloads)

    def reply_error(self, conn, header, exc: BaseException) -> None:
        self.inbox.reply_error(conn, header, exc)

    def on_close(self, conn, exc) -> None:
        reason = exc.message if isinstance(exc, PslinkError) else str(exc or "closed")
        if self._sched is not None:
            self._sched.lost(conn, reason)
        if conn is self._sched_conn:
            if not self._finalizing and not self._closed:
                self._fail(PeerError(f"the {self.describe()} lost the scheduler at {self.scheduler_address}: {reason}",
                                     peer=self.scheduler_address))
        self.links.lost(conn, reason)

    def _fail(self, error: PslinkError) -> None:
        """Something the whole deployment needs failed: every wait on this node raises ``error``."""
        with self._lock:
            if self._failure is None:
                self._failure = error
            apps = list(self._apps.values())
        for app in apps:
            self.reactor.post(app._fail_all, error)
        self.driver.notify()

    # -- control --------------------------------------------------------------------------------

    def _on_control(self, conn, header) -> None:
        kind, fields = header.kind, header.tail
        if self._sched is not None and kind in SCHEDULER_KINDS:
            self._sched.on_control(conn, header)
            return
        if kind == Kind.NODES:
            self._apply_table(fields)
        elif kind == Kind.RELEASE:
            self._released[(fields["group"], header.customer, bool(header.flags & wire.FINAL))] += 1
        elif kind == Kind.REFUSED:
            self._fail(ConfigError(f"the scheduler at {self.scheduler_address} refused the {self.describe()}: "
                                   f"{fields['msg']}"))
        elif kind == Kind.NODE_FAILED:
            self._fail(PeerError(fields["msg"]))
        else:
            log.warning("%s: unexpected %s from %s", self, kind.name, conn.peer)
        self.driver.notify()

    def _apply_table(self, fields: dict) -> None:
        nodes = {row[0]: NodeInfo(*row) for row in fields["nodes"]}
        me = nodes.get(fields["id"])
        if me is None or me.role != self.role:
            self._fail(ProtocolError(f"the scheduler's node table does not list this {self.role} as id {fields['id']}"))
            return
        groups: dict[int, list[int]] = {}
        for group in range(1, ALL_GROUPS + 1):
            groups[group] = [i for i, n in sorted(nodes.items()) if ROLE_BIT[n.role] & group]
        with self._lock:
            self.nodes, self._groups = nodes, groups
            self.id, self.rank = me.id, me.rank
            self._ready = True
        self.inbox.table_known()
        log.info("%s joined: %d worker(s), %d server process(es)", self, len(groups[4]), len(groups[2]))

    # -- helpers for apps ---------------------------------------------------------------------------

    def wait(self, done: Callable[[], bool], timeout: float | None, what: Callable[[], str]) -> None:
        self.driver.wait(done, timeout, what)

    def complete(self) -> None:
        """An app finished a request: wake threads parked on it."""
        self.driver.notify()


def _sizes(frames) -> tuple:
    return tuple(memoryview(p).nbytes for p in frames[1:])


def _apply_verbosity(verbose: int) -> None:
    """PS_VERBOSE: 0 warnings, 1 info, 2 debug, on stderr (as ps-lite's logging)."""
    if verbose <= 0:
        return
    log.setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    if not any(getattr(h, "_pslite", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s pslite %(levelname)s] %(message)s"))
        handler._pslite = True  # type: ignore[attr-defined]
        log.addHandler(handler)
