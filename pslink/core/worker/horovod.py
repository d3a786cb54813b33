"""Horovod's module-level API, the parts every adapter shares: the process's one Session
(``init``, ``shutdown``, ``init`` again), what Horovod's build reports, and the list of names
every adapter offers (a test holds each adapter to it).

``init()`` joins the job that ``pslink launch``'s environment names (or the arguments). Run
without a launcher and without a job named anywhere, it does what Horovod does without
``horovodrun``: a job of one worker, on a service of this process of its own (one Aggregator on
a thread), so a script runs as size 1 for a quick try.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from pslink.core.config import ENV_ELASTIC, ENV_JOB, local_place
from pslink.core.service.service import Service
from pslink.core.worker.connect import connect
from pslink.core.worker.process_sets import ProcessSet
from pslink.core.worker.session import Session
from pslink.errors import AuthError, ConfigError, PeerError, PslinkTimeoutError, UnknownJobError

SETTLE_BARRIER = "hvd/init"
SETTLE_PAUSE = 0.05  # between barriers while ranks are still missing


class Holder:
    """The process's one Session of a Horovod-style module (``module``: its name, as users
    import it). ``init`` makes it, ``shutdown`` (also at exit) closes it; ``init`` after
    ``shutdown`` joins the same job again, with its token when the job still runs."""

    def __init__(self, module: str):
        self.module = module
        self.session: Session | None = None
        self._token: bytes | None = None  # the job's, from this process's last session: init() again
        self._service: Service | None = None  # a service of this process's own (init() with no job named)
        self._lock = threading.Lock()
        atexit.register(self._exit)

    def init(self, job: str | None = None, rank: int | None = None, num_workers: int | None = None,
             master: str | None = None, **options: Any) -> Session:
        """Join the job (job, rank, num_workers and master from ``pslink launch``'s environment,
        or as arguments, as :func:`pslink.connect` names them); again while initialized: nothing."""
        with self._lock:
            if self.session is not None:
                return self.session
            if options.get("mode", "sum") != "sum" or "optimizer" in options:
                raise ConfigError(f"{self.module} reduces on the service in mode 'sum'; the optimizer steps on the "
                                  "workers")
            options["mode"] = "sum"
            local_rank, local_size = local_place()  # read before registering: nothing to undo if it fails
            if job is None and not os.environ.get(ENV_JOB) and master is None:
                job, rank, num_workers, master = self._alone()
            agent = self._connect(job, rank, num_workers, master, options)
            self._token = agent.token
            # The job's size as it was made (the Agent's own count follows the members present).
            size = int(agent.settings.get("num_workers") or agent.num_workers)
            elastic = int(agent.settings.get("max_workers") or 0) > size or os.environ.get(ENV_ELASTIC) == "1"
            try:
                members = None if elastic else self._rendezvous(agent, size)
            except BaseException:
                agent.close()
                raise

            def connect_again(token: bytes, rejoin: bool = False):
                """The same registration with the job's token (elastic recovery: a new Agent)."""
                return connect(job, rank, num_workers, master, **dict(options, token=token, rejoin=rejoin))

            self.session = Session(agent, local_rank, local_size, reconnect=connect_again, members=members)
            return self.session

    def start(self, comm=None, process_sets=None, job: str | None = None, rank: int | None = None,
              num_workers: int | None = None, master: str | None = None, **options: Any) -> tuple[Session, bool]:
        """Horovod's ``init(comm, process_sets)`` for the module: :meth:`init`, then the process
        sets to add at once (ProcessSets or rank lists) when it made the session. Returns the
        session and whether this call made it."""
        if comm is not None:
            raise ConfigError(f"{self.module}.init: MPI communicators are not supported; call init()")
        initialized = self.is_initialized()
        session = self.init(job, rank, num_workers, master, **options)
        if not initialized:
            for process_set in process_sets or ():
                session.process_sets.add(process_set)
        return session, not initialized

    def _connect(self, job, rank, num_workers, master, options: dict):
        token = options.get("token") or self._token
        try:
            try:
                return connect(job, rank, num_workers, master, **dict(options, token=token))
            except (AuthError, UnknownJobError):
                if token is None or options.get("token"):
                    raise
                # This process's last job ended since (every worker shut down): a new one.
                return connect(job, rank, num_workers, master, **options)
        except PeerError as exc:
            raise PeerError(f"{self.module}.init: no parameter service reachable: {exc.message}. Run the script under "
                            "`pslink launch -n N`, or start `pslink service up` and set PSLINK_MASTER",
                            **exc.details) from None
        except ConfigError as exc:
            raise ConfigError(f"{self.module}.init: {exc.message}. Run the script under `pslink launch -n N python "
                              "script.py`, which sets PSLINK_JOB, PSLINK_RANK and PSLINK_NUM_WORKERS") from None

    def _rendezvous(self, agent, size: int) -> list[int]:
        """Horovod's ``init()`` is collective: return once every rank of the job is in it, so
        that ``size()`` counts them all and no rank runs (or leaves) before the others came.
        After ``shutdown()`` a rank registers into its job while the job runs, and the other
        ranks may not have initialized again yet. So: a barrier until it releases twice in a row
        with every rank (nobody pushes in between), coming into the job's keys meanwhile (a
        worker that registers into a running job does): then every rank's next round is the
        same. ``size``: the job's ranks. Returns them. (Not for an elastic job: its World settles
        it.)"""
        deadline = time.monotonic() + agent.timeout
        previous = None
        while True:
            released = sorted(int(r) for r in agent.barrier(SETTLE_BARRIER, timeout=agent.timeout)["ranks"])
            if agent.late:
                agent.join_all(agent.timeout)
            if len(released) >= size and released == previous:
                return released
            if time.monotonic() > deadline:
                raise PslinkTimeoutError(f"{self.module}.init: job {agent.job!r} has ranks {released} of {size} "
                                         f"after {agent.timeout:g} s: did every rank call init()?", job=agent.job)
            if len(released) < size:
                time.sleep(SETTLE_PAUSE)  # the others have not registered again yet
            previous = released

    def _alone(self) -> tuple[str, int, int, str]:
        """A job of one worker on a service of this process's own (Horovod without a launcher)."""
        if self._service is None:
            self._service = Service(aggregators=1, provider="thread").start()
        return f"{self.module}.alone.{os.getpid()}", 0, 1, self._service.address

    def current(self) -> Session:
        session = self.session
        if session is None:
            raise ConfigError(f"{self.module} has not been initialized; call {self.module}.init() first")
        return session

    def is_initialized(self) -> bool:
        """Whether ``init()`` made a session that ``shutdown()`` has not closed."""
        return self.session is not None

    def shutdown(self) -> None:
        """Leave the job and close the session (``init()`` may be called again)."""
        with self._lock:
            session, self.session = self.session, None
        if session is not None:
            session.close()

    def _exit(self) -> None:
        self.shutdown()
        service, self._service = self._service, None
        if service is not None:
            service.stop()


class HorovodAPI:
    """Horovod's module-level API over the Session ``current()`` gives, the part that holds no
    tensors: the world (rank, size, local and cross), process sets, objects, join, barrier and
    the timeline. Each adapter's ``Horovod`` class adds its tensors' collectives; the module's
    functions are the methods of one, over the Session ``init()`` made, and a test or a library
    may hold its own over any Session. ``process_set=None`` (or a global set) is the whole world."""

    def __init__(self, current: Callable[[], Session]):
        self._current = current

    def _session_of(self, process_set) -> Session:
        """The Session a collective of ``process_set`` runs on (this one's for the global set)."""
        return self._current().process_sets.session_for(process_set)

    def add_process_set(self, process_set) -> ProcessSet:
        """Make a process set of these ranks (a list, or a ProcessSet): every rank calls it, in the
        same order for every set; the ranks in it then reduce among themselves."""
        return self._current().process_sets.add(process_set)

    def remove_process_set(self, process_set: ProcessSet) -> bool:
        """Forget a process set (its ranks leave its job); False if it was not added."""
        return self._current().process_sets.remove(process_set)

    def rank(self) -> int:
        return self._current().rank

    def size(self) -> int:
        return self._current().size

    def local_rank(self) -> int:
        return self._current().local_rank

    def local_size(self) -> int:
        return self._current().local_size

    def cross_rank(self) -> int:
        return self._current().cross_rank

    def cross_size(self) -> int:
        return self._current().cross_size

    def is_homogeneous(self) -> bool:
        return self._current().is_homogeneous()

    def broadcast_object(self, obj: Any = None, root_rank: int = 0, name: str | None = None,
                         process_set=None) -> Any:
        """root_rank's ``obj`` (any picklable object) on every rank."""
        return self._session_of(process_set).broadcast_object(obj, root_rank, name)

    def allgather_object(self, obj: Any, name: str | None = None, process_set=None) -> list:
        """Every rank's ``obj``, as a list in rank order."""
        return self._session_of(process_set).allgather_object(obj, name)

    def join(self, device: int = -1) -> int:
        """This rank is out of data: take part in the others' allreduces and optimizer steps with
        zeros until every rank joined; returns the rank that joined last."""
        return self._current().join()

    def barrier(self, process_set=None) -> None:
        self._session_of(process_set).barrier()

    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Horovod's: record this worker's requests to a Chrome trace at ``file_path`` from now on
        (rank 0 writes ``file_path``, rank R ``file_path.rankR``; see docs/visibility.md);
        ``mark_cycles`` marks where each iteration starts."""
        self._current().agent.start_timeline(file_path, mark_cycles)

    def stop_timeline(self) -> None:
        """Stop recording the timeline and close its file."""
        self._current().agent.stop_timeline()


# -- what Horovod's build reports ---------------------------------------------------------------
# pslink needs none of MPI, Gloo, NCCL, DDL, CCL or ROCm (CUDA is the framework's own question,
# answered by each adapter). The adapters export these as they are.

def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


NOT_BUILT = ("mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
             "nccl_built", "ddl_built", "ccl_built", "rocm_built")


class NoneCompressor:
    """Horovod's ``Compression.none`` in every adapter: tensors go as they are (each adapter's
    ``Compression.fp16`` casts with its framework's own calls)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


# -- the names every adapter offers --------------------------------------------------------------

# The names of Horovod's API (horovod.torch, horovod.tensorflow and horovod.mxnet share them) that
# every pslink adapter offering Horovod's API must export, with Horovod's meaning.
HOROVOD_NAMES = frozenset({
    "init", "shutdown", "is_initialized",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    *NOT_BUILT, "cuda_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "allreduce", "allgather", "broadcast", "broadcast_object", "allgather_object",
    "barrier", "join",
    "allgather_async", "grouped_allreduce", "grouped_allreduce_async", "grouped_allgather",
    "reducescatter", "alltoall", "add_process_set", "remove_process_set", "ProcessSet", "global_process_set",
    "Compression", "DistributedOptimizer",
})

# The public names of Horovod 0.28.1's modules (their __init__.py, read from its sdist; helpers a
# module imports for itself, such as check_extension, split_list or vars_to_refs, left out):
# each adapter offers every one of its module's, but the gaps listed below.
HOROVOD_MODULE_NAMES: dict[str, frozenset] = {
    "pslink.torch": frozenset({
        "HorovodInternalError", "SyncBatchNorm", "allgather_async", "allreduce_", "allreduce_async",
        "allreduce_async_", "alltoall_async", "barrier", "broadcast_", "broadcast_async", "broadcast_async_",
        "broadcast_optimizer_state", "broadcast_parameters", "elastic", "grouped_allgather_async",
        "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
        "grouped_reducescatter_async", "poll", "reducescatter_async", "sparse_allreduce_async", "start_timeline",
        "stop_timeline", "synchronize"}),
    "pslink.tf": frozenset({
        "BroadcastGlobalVariablesHook", "DistributedGradientTape", "PartialDistributedGradientTape",
        "SyncBatchNormalization", "broadcast_", "broadcast_global_variables", "broadcast_object_fn",
        "broadcast_variables", "elastic", "grouped_reducescatter", "is_homogeneous", "local_rank_op",
        "local_size_op", "process_set_included_op", "rank_op", "size_op", "start_timeline", "stop_timeline"}),
    "pslink.tf.keras": frozenset({
        "broadcast_global_variables", "callbacks", "elastic", "load_model", "reducescatter", "start_timeline",
        "stop_timeline"}),
    "pslink.tf.keras.callbacks": frozenset({
        "BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
        "LearningRateWarmupCallback", "MetricAverageCallback"}),
    "pslink.mxnet.horovod": frozenset({
        "DistributedTrainer", "allreduce_", "broadcast_", "broadcast_parameters", "grouped_allreduce_",
        "grouped_reducescatter", "start_timeline", "stop_timeline"}),
}
# (each set above holds the names beyond HOROVOD_NAMES, which every module but the callbacks' has)

# Names of HOROVOD_NAMES an adapter does not offer, and why (the test also checks that each
# listed name is really missing, so that this stays true as names are added).
HOROVOD_GAPS: dict[str, dict[str, str]] = {
    "pslink.torch": {},
    "pslink.tf": {
        # Horovod's TensorFlow API has none either: its ops run asynchronously in the graph.
        **{name: "asynchronous collectives with handles are torch's only (Horovod's TensorFlow API has none)"
           for name in ("allgather_async", "grouped_allreduce_async")},
    },
    "pslink.mxnet.horovod": {
        # Horovod's MXNet API has no handles either (its collectives return when done).
        **{name: "asynchronous collectives of NDArrays: Horovod's MXNet API has none"
           for name in ("allgather_async", "grouped_allreduce_async")},
    },
    "pslink.tf.keras": {
        # Horovod's TensorFlow API has none either: its ops run asynchronously in the graph.
        **{name: "asynchronous collectives with handles are torch's only (Horovod's TensorFlow API has none)"
           for name in ("allgather_async", "grouped_allreduce_async")},
    },
    "pslink.tf.keras.callbacks": {},
}
