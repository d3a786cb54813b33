"""TensorFlow tensors to and from the parameter service: sums, broadcasts and model checks.

Everything here is a few Agent calls (``pushpull_many``) wrapped so that TensorFlow can run them:
directly when executing eagerly, as one ``tf.numpy_function`` op inside a ``tf.function``. Keys
name what travels: ``tf.var/<variable name>/...`` for variables, ``tf.grad/<variable name>`` for
gradients of the Horovod-style wrappers, ``tf.reduce/<signature>...`` for the strategy's reductions.

A broadcast is a sum in which only the root contributes its value (the others push zeros), so
the same key can be broadcast any number of times, one round each.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from pslink.core.worker import collectives, elastic
from pslink.core.agent import Agent
from pslink.core.worker.collectives import service_key
from pslink.errors import ConfigError, PslinkError, ShapeMismatchError
from pslink.tf import _internals

# TensorFlow dtypes the service carries as they are; others are converted for the trip (exactly).
_NATIVE = {
    tf.float16, tf.float32, tf.float64,
    tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32, tf.uint64,
}
_CARRIED_AS = {tf.bfloat16: tf.float32, tf.bool: tf.uint8}
_INT_OF_WIDTH = {1: tf.uint8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def shape_text(shape) -> str:
    dims = tf.TensorShape(shape).as_list() if tf.TensorShape(shape).rank is not None else None
    if dims is None:
        return "(?)"
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def variable_name(variable) -> str:
    """The name that keys a variable: a Keras variable's path, else the TensorFlow name (without
    the ``:0`` that every TensorFlow variable name ends with)."""
    name = getattr(variable, "path", None) or variable.name
    return name.removesuffix(":0")


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with repeats told apart (``a``, ``a#2``, ...), the same way on every worker."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


class SiteKeys:
    """Keys for values that have no name (the strategy's reductions, unnamed allreduce calls).

    A reduction is named by its signature (dtypes and static shapes of the tensors reduced
    together) and by how many reductions of that signature came before it in the function being
    traced: deterministic on every worker running the same program, stable across retracing, and
    distinct for two reductions of one step, which TensorFlow may run in either order."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def keys(self, tensors: Sequence[tf.Tensor]) -> list[str]:
        signature = ";".join(f"{t.dtype.name}{shape_text(t.shape)}" for t in tensors)
        digest = hashlib.sha1(signature.encode()).hexdigest()[:12]
        occurrence = 0
        if not tf.executing_eagerly():
            counts = self._counts.setdefault(tf.compat.v1.get_default_graph(), {})
            occurrence = counts.get(digest, 0)
            counts[digest] = occurrence + 1
        return [service_key(self.prefix, f"{digest}.{occurrence}", i) for i in range(len(tensors))]


class Exchange:
    """Runs Agent requests for TensorFlow values; one per process, shared by the adapter's parts."""

    def __init__(self, agent: Agent, connect: Callable | None = None):
        self.agent = agent
        self._connect = connect  # connect(token, rejoin=...): this rank's registration again (elastic recovery)
        self.rank: int = agent.rank
        self.num_workers: int = agent.num_workers
        self._last_op: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> op
        self._checked: set[tuple] = set()  # variable lists already found equal on every worker
        # join (uneven data): the gradient reductions this worker makes, numbered in the order it
        # first makes them (every worker the same), and what each last sent (keys, shapes,
        # dtypes, average): a worker that joined mirrors them with zeros (see join()).
        self.steppers: dict[tuple, int] = {}
        self.stepped: dict[int, tuple] = {}
        self.joined_seen = np.zeros(self.num_workers, np.int64)
        self.process_sets = None  # Horovod's process sets this worker added (pslink.tf.process_sets)
        self.generation = 0  # of the world (pslink.tf.elastic): 0 until a membership change is agreed

    def __repr__(self) -> str:
        return f"<Exchange job={self.agent.job!r} rank={self.rank}/{self.num_workers}>"

    # -- the world, for elastic training (pslink.core.worker.elastic drives these) -------------------

    @property
    def size(self) -> int:
        return self.num_workers

    @property
    def timeout(self) -> float:
        return self.agent.timeout

    @property
    def capacity(self) -> int:
        """The most workers the job may have (:func:`pslink.core.worker.elastic.capacity`)."""
        return elastic.capacity(self.agent, self.num_workers)

    def set_world(self, ranks: list[int], generation: int) -> None:
        """The workers agreed on ``ranks`` (service ranks): this worker's rank becomes its position
        among them and the size their number, as Horovod renumbers after a reset; checks of the
        variables run again, on keys of the ``generation``."""
        if self.agent.rank not in ranks:
            raise ConfigError(f"rank {self.agent.rank} of job {self.agent.job!r} is not in the world {ranks}")
        self.rank, self.num_workers, self.generation = list(ranks).index(self.agent.rank), len(ranks), generation
        self.joined_seen = np.zeros(self.num_workers, np.int64)
        self._checked.clear()

    def reconnect(self) -> Agent:
        """Register this rank again (:func:`pslink.core.worker.elastic.register_again`); returns the new Agent."""

        self.agent = elastic.register_again(self.agent, self._connect)
        return self.agent

    def abandon(self) -> None:
        """Nothing to forget: TensorFlow's reductions return only once answered."""

    # -- sums and broadcasts -------------------------------------------------------------------

    def sum(self, keys: Sequence[str], tensors: Sequence, average: bool = False,
            what: str = "all-reduce", stepper: int | None = None) -> list[tf.Tensor]:
        """Sum (``average``: the mean) of each tensor over every worker, in one request.

        A key gets the runtime shape appended when the tensor's static shape is not fully known,
        so a value whose shape changes from step to step never meets a differently shaped round.
        ``stepper``: this is gradient reduction number ``stepper`` (:meth:`stepper`); a join round
        goes along with it, for the workers that ran out of data (:meth:`join`)."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]  # also densifies IndexedSlices
        if not tensors:
            return []
        carried = [self._carry(t, key, summing=True) for t, key in zip(tensors, keys)]
        dynamic = [not t.shape.is_fully_defined() for t in tensors]
        keys = list(keys)

        def run(*arrays):
            final = [service_key(k, a.shape) if d else k for k, a, d in zip(keys, arrays, dynamic)]
            outs = [np.empty(a.shape, a.dtype) for a in arrays]
            try:
                joining = None if stepper is None else self._join_round(stepper)
                self.agent.pushpull_many(final, arrays, outs=outs, average=average).wait()
                if joining is not None:
                    self.stepped[stepper] = (final, [a.shape for a in arrays], [a.dtype for a in arrays], average)
                    joining[0].wait()
                    self.joined_seen = joining[1][: self.num_workers].copy()
            except PslinkError as exc:
                raise type(exc)(f"{what} (rank {self.rank} of {self.num_workers}): {exc.message}",
                                **exc.details) from None
            return outs

        results = self._call(run, carried, what)
        return [self._restore(r, t) for r, t in zip(results, tensors)]

    # -- join: uneven data (as pslink.torch's Session.join) -------------------------------------

    def stepper(self, keys: tuple) -> int:
        """The number of the gradient reduction of ``keys`` (in the order first seen)."""
        return self.steppers.setdefault(keys, len(self.steppers))

    def _join_round(self, stepper: int | None):
        """This worker's part of a join round (:func:`pslink.core.worker.collectives.join_vector`),
        started: (handle, vector)."""
        vector = collectives.join_vector(self.capacity, self.rank, stepper)
        return self.agent.pushpull("tf.join", vector, out=vector), vector

    def join(self) -> int:
        """This worker ran out of data: until every worker did, mirror the others' gradient
        reductions (``DistributedGradientTape``, the Keras ``DistributedOptimizer``) with zeros,
        so averages stay over every worker, as in Horovod. Returns the worker that joined last."""
        def round_():
            handle, vector = self._join_round(None)
            handle.wait()
            return vector

        def mirror(stepper: int) -> None:
            if stepper not in self.stepped:
                raise ConfigError(f"join: the other workers reduce gradients #{stepper}, which rank {self.rank} "
                                  "never reduced: every worker must train the same model the same way")
            keys, shapes, dtypes, average = self.stepped[stepper]
            zeros = [np.zeros(shape, dtype) for shape, dtype in zip(shapes, dtypes)]
            self.agent.pushpull_many(keys, zeros, outs=[np.empty_like(z) for z in zeros], average=average).wait()

        last, self.joined_seen = collectives.join(round_, self.num_workers, self.rank, self.joined_seen, mirror)
        return last

    def broadcast(self, keys: Sequence[str], tensors: Sequence, root: int,
                  what: str = "broadcast") -> list[tf.Tensor]:
        """Every worker gets ``root``'s value of each tensor."""
        self._check_root(root, what)
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        carried = [self._carry(t, key, summing=False) for t, key in zip(tensors, keys)]
        # Summed as integers of the element's width: the root's value and zeros give its bits
        # exactly (a float sum turns -0.0 into 0.0), as pslink.core.worker.collectives does.
        bits = [t if t.dtype.is_integer else tf.bitcast(t, _INT_OF_WIDTH[t.dtype.size]) for t in carried]
        if self.rank != root:
            bits = [tf.zeros_like(t) for t in bits]
        results = self.sum(keys, bits, what=what)
        results = [r if r.dtype == c.dtype else tf.bitcast(r, c.dtype) for r, c in zip(results, carried)]
        return [self._restore(r, t) for r, t in zip(results, tensors)]

    def _call(self, run: Callable, tensors: list[tf.Tensor], what: str,
              shapes: list[tf.TensorShape] | None = None) -> list[tf.Tensor]:
        """``run`` on the tensors' values, eagerly or as one op of the graph being traced; the
        results have the tensors' dtypes and ``shapes`` (default: the tensors' shapes)."""
        if tf.executing_eagerly():
            # Directly: our own errors reach the caller unchanged.
            outs = run(*[t.numpy() for t in tensors])
            return [tf.convert_to_tensor(o) for o in outs]
        if _internals.in_xla_context():
            raise ConfigError(
                f"{what}: pslink cannot run inside an XLA-compiled function; compile without XLA "
                "(Keras: model.compile(..., jit_compile=False); tf.function(jit_compile=False))"
            )
        results = self.ordered(lambda: tf.numpy_function(
            run, tensors, Tout=[t.dtype for t in tensors], stateful=True, name="pslink_pushpull"))
        for r, shape in zip(results, shapes or [t.shape for t in tensors]):
            r.set_shape(shape)
        return results

    def ordered(self, build: Callable):
        """``build()`` the ops of one service request so that, in the graph being traced, they run
        after the previous request's: every worker then makes its requests in the same order
        (program order). Unordered, two workers could each block in a different request, waiting
        for the other to make it."""
        if tf.executing_eagerly():
            return build()
        graph = tf.compat.v1.get_default_graph()
        last = self._last_op.get(graph)
        with tf.control_dependencies([last] if last is not None else []):
            out = build()
        self._last_op[graph] = tf.nest.flatten(out)[0].op
        return out

    @staticmethod
    def _carry(tensor: tf.Tensor, key: str, summing: bool) -> tf.Tensor:
        dtype = tensor.dtype
        if dtype in _NATIVE:
            return tensor
        if dtype in _CARRIED_AS and not (summing and dtype == tf.bool):
            return tf.cast(tensor, _CARRIED_AS[dtype])
        raise ConfigError(f"key {key!r}: pslink cannot {'sum' if summing else 'send'} {dtype.name} tensors")

    @staticmethod
    def _restore(result: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
        return result if result.dtype == like.dtype else tf.cast(result, like.dtype)

    def _check_root(self, root: int, what: str) -> None:
        collectives.check_root(root, self.num_workers, what)

    # -- variables -------------------------------------------------------------------------------

    def broadcast_variables(self, variables: Sequence, root: int = 0, scope: str = "vars",
                            what: str = "broadcast_variables", prefix: str = "tf.var") -> None:
        """Give every worker ``root``'s values of ``variables``, after checking that every worker
        has the same variables (names, shapes, dtypes) in the same order; keys under ``prefix``."""
        self._check_root(root, what)
        variables = list(variables)
        if not variables or self.num_workers == 1:
            return
        entries = describe_variables(variables)
        self.check_same_variables(entries, scope, what)
        self.assign_from_root(variables, entries, root, what, prefix)

    def assign_from_root(self, variables: Sequence, entries: list[tuple[str, str, str]], root: int,
                         what: str, prefix: str = "tf.var") -> list:
        """Assign ``root``'s values to ``variables`` (checked already); returns the assign ops."""
        keys = [service_key(prefix, name, dtype, shape) for name, shape, dtype in entries]
        values = self.broadcast(keys, [tf.convert_to_tensor(v) for v in variables], root, what)
        return [variable.assign(value) for variable, value in zip(variables, values)]

    # -- gathers and objects ------------------------------------------------------------------

    def allgather(self, tensor, name: str, what: str) -> tf.Tensor:
        """Every worker's ``tensor`` concatenated along the first dimension, in rank order (the
        first dimension may differ between workers, the others must agree)."""
        tensor = tf.convert_to_tensor(tensor)
        carried = self._carry(tensor, name, summing=False)
        pushpull = self.round(what)

        def run(array):
            gathered, _ = collectives.gather_rows(pushpull, name, array, self.rank, self.num_workers)
            return [gathered]

        shape = tf.TensorShape([None]).concatenate(tensor.shape[1:]) if tensor.shape.rank else tf.TensorShape([None])
        return self._restore(self._call(run, [carried], what, shapes=[shape])[0], tensor)

    def broadcast_object(self, obj, root: int, name: str, what: str = "broadcast_object"):
        """``root``'s ``obj`` (any picklable object) on every worker."""
        self._check_root(root, what)
        return collectives.broadcast_object(self.round(what), name, obj, self.rank, root)

    def allgather_object(self, obj, name: str, what: str) -> list:
        """Every worker's ``obj``, as a list in rank order."""
        return collectives.allgather_object(self.round(what), name, obj, self.rank, self.num_workers)

    def round(self, what: str) -> collectives.PushPull:
        """One synchronous push-pull round for the shared collectives, its errors naming ``what``."""

        def pushpull(key: str, array: np.ndarray, out: np.ndarray) -> np.ndarray:
            try:
                return self.agent.pushpull(key, array, out=out).wait()
            except PslinkError as exc:
                raise type(exc)(f"{what} (rank {self.rank} of {self.num_workers}): {exc.message}",
                                **exc.details) from None

        return pushpull

    def check_once(self, entries: list[tuple[str, str, str]], scope: str, what: str) -> None:
        """:meth:`check_same_variables`, the first time this process meets this list of variables.

        Keyed by the list itself, not by when it is met: a function that one worker retraces
        (say, for its last, smaller batch) and another does not must not make only one of them
        ask."""
        signature = (scope, tuple(entries))
        if signature in self._checked:
            return
        self.check_same_variables(entries, scope, what)
        self._checked.add(signature)

    def check_same_variables(self, entries: list[tuple[str, str, str]], scope: str, what: str) -> None:
        """Raise ShapeMismatchError, on every worker at once, naming the first variable (and both
        shapes) in which some worker differs from rank 0. One small round trip when all agree."""
        if self.num_workers == 1:
            return
        text = "\n".join("\t".join(entry) for entry in entries).encode()
        digest = np.frombuffer(hashlib.sha256(text).digest()[:16], np.uint8)
        pushpull = self.round(what)

        def gather(key: str, row: np.ndarray) -> np.ndarray:
            return collectives.gather_same_rows(pushpull, key, row, self.rank, self.num_workers)

        if self.generation:  # a new world's checks: keys every member of it is in from the start
            scope = f"g{self.generation}.{scope}"
        digests = gather(service_key("tf.check", scope, "digest"), digest)
        if (digests == digests[0]).all():
            return
        lengths = gather(service_key("tf.check", scope, "length"), np.array([len(text)], np.int64))
        width = int(lengths.max())
        padded = np.zeros(width, np.uint8)
        padded[: len(text)] = np.frombuffer(text, np.uint8)
        texts = gather(service_key("tf.check", scope, "text", width), padded)
        manifests = [_parse(texts[r, : int(lengths[r, 0])].tobytes()) for r in range(self.num_workers)]
        raise _difference(manifests, what)


def describe_variables(variables: Sequence) -> list[tuple[str, str, str]]:
    """(unique name, shape, dtype) of each variable, as the model checks compare them."""
    names = unique_names([variable_name(v) for v in variables])
    return [describe(n, v) for n, v in zip(names, variables)]


def describe(name: str, value) -> tuple[str, str, str]:
    """(name, shape, dtype) of a variable or tensor, as text."""
    return name, shape_text(value.shape), tf.as_dtype(value.dtype).name


def _parse(text: bytes) -> list[tuple[str, str, str]]:
    if not text:
        return []
    return [tuple(line.split("\t")) for line in text.decode().split("\n")]  # type: ignore[misc]


def _shape(entry) -> str:
    return f"{entry[1]} {entry[2]}"


def _difference(manifests: list[list[tuple[str, str, str]]], what: str) -> ShapeMismatchError:
    """The first way in which a worker's variables differ from rank 0's, as an error."""
    base = manifests[0]
    for rank, other in enumerate(manifests[1:], start=1):
        if other == base:
            continue
        for i, (a, b) in enumerate(zip(base, other)):
            if a == b:
                continue
            if a[0] == b[0]:
                message = (f"variable {a[0]!r} is {_shape(a)} on rank 0 but {_shape(b)} on rank {rank}")
            else:
                message = (f"variable #{i + 1} is {a[0]!r} {_shape(a)} on rank 0 but {b[0]!r} {_shape(b)} "
                           f"on rank {rank}")
            return ShapeMismatchError(
                f"{what}: the workers' models differ: {message}; every worker must build the same model",
                variable=a[0], shapes=[_shape(a), _shape(b)], ranks=[0, rank],
            )
        longer, shorter, extra = (rank, 0, other[len(base)]) if len(other) > len(base) else (0, rank, base[len(other)])
        return ShapeMismatchError(
            f"{what}: the workers' models differ: rank {longer} has {max(len(base), len(other))} variables, "
            f"rank {shorter} has {min(len(base), len(other))}; the first that rank {shorter} lacks is "
            f"{extra[0]!r} {_shape(extra)}; every worker must build the same model",
            variable=extra[0], ranks=[0, rank],
        )
    return ShapeMismatchError(f"{what}: the workers' variables differ")  # digests differed, texts not
