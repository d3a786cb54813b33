"""Running a Session call for TensorFlow: eagerly, or as one op of the graph being built.

:func:`run` takes the call as a function of host arrays (numpy in, numpy out, in the dtypes
the service carries) and the tensors it reads:

- **eagerly** it calls it at once on views of the tensors (:func:`pslink.tf.tensors.host`) and
  hands its results to TensorFlow without a copy; pslink's errors come out as TensorFlow's
  (:mod:`pslink.tf.errors`);
- **inside a graph** (a ``tf.function``, a TF1 session) it adds one ``tf.numpy_function`` op that
  calls it when the graph runs. The op returns a status beside its results, which
  :func:`pslink.tf.errors.fail_if` turns into Horovod's FailedPreconditionError; every such op
  of a graph takes the previous one's checked status as an input (a token), so it runs after
  that op succeeded: each rank then makes its calls in program order, two ranks can never each
  block a thread of TensorFlow's pool in a call the other has not reached, and after a call
  that failed (on every rank alike) no rank starts the next. (In a TF1 graph, fetching an op
  therefore runs the collectives built before it too.) XLA cannot compile such an op: building
  one under XLA is refused, naming what to change.

:func:`run_in_flight` builds several calls of one reduction (the strategy's gradient buckets)
as a start op each, run as soon as its own inputs exist, and a finish op each that waits for the
results later: the exchange of the gradients backward produces first overlaps the rest of it.

:func:`call_name` gives a call built into a graph its name then, as Horovod names its ops
(``HorovodAllreduce_<tensor>``, unique in the graph): each run of the op is the next call of
that name on every rank. Eagerly a call without a name is numbered by the Session.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from pslink.errors import ConfigError, PslinkError
from pslink.tf import _internals, errors, tensors

log = logging.getLogger("pslink.tf")

_tokens: weakref.WeakKeyDictionary[tf.Graph, tf.Tensor] = weakref.WeakKeyDictionary()  # the last call's


class Out(NamedTuple):
    """One result of a call: its dtype (one the service carries) and static shape."""

    dtype: tf.DType
    shape: tf.TensorShape


def eager() -> bool:
    return tf.executing_eagerly()


def call_name(kind: str, name: str | None, *named) -> str | None:
    """The name of a call of ``kind`` (Horovod's op type: ``Allreduce``, ``Broadcast``, ...):
    eagerly ``name`` (None: the Session numbers it); built into a graph, ``name`` or
    ``Horovod<kind>_<names of the tensors named>``, made unique in the graph (TensorFlow's own
    rule for op names, so the same on every rank building the same program): two ops built
    with one name are two operations, as Horovod's ops are, and one graph run may run both."""
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a {kind.lower()} name must be a non-empty string, got {name!r}")
        if eager():
            return name
        return tf.compat.v1.get_default_graph().unique_name(name, mark_as_used=True)
    if eager():
        return None
    stem = "_".join([f"Horovod{kind}", *(tensors.name_of(t) for t in named)])
    return tf.compat.v1.get_default_graph().unique_name(stem, mark_as_used=True)


def run(what: str, call: Callable[..., Sequence[np.ndarray]], inputs: Sequence, outputs: Sequence[Out],
        kind: str = "collective") -> list[tf.Tensor]:
    """``call(*arrays)`` on the values of ``inputs``, its results as tensors of ``outputs``'
    dtypes and shapes (see the module). ``what`` names the call in errors; ``kind`` its op."""
    inputs = [tf.convert_to_tensor(t) for t in inputs]
    if eager():
        try:
            results = call(*[tensors.host(t) for t in inputs])
        except PslinkError as exc:
            raise errors.as_tf_error(exc) from None
        return [tensors.to_tensor(r) for r in results]
    _refuse_xla(what)

    graph_ = tf.compat.v1.get_default_graph()
    token = _tokens.get(graph_)
    chained = ([token] if token is not None else []) + inputs

    def op(*arrays):
        if token is not None:
            arrays = arrays[1:]  # the previous call's status: only an order
        return _with_status(lambda: call(*arrays), outputs)

    *results, status = tf.numpy_function(op, chained, [o.dtype for o in outputs] + [tf.int32], stateful=True,
                                         name=f"pslink_{kind}")
    checked, results = _checked(results, status, what, outputs)
    _tokens[graph_] = checked
    return results


def _refuse_xla(what: str) -> None:
    if _internals.in_xla_context():
        raise ConfigError(f"{what}: pslink cannot run inside an XLA-compiled function; compile without XLA "
                          "(Keras: model.compile(..., jit_compile=False); tf.function(jit_compile=False))")


def _with_status(results: Callable[[], Sequence[np.ndarray]], outputs: Sequence[Out],
                 on_error: Callable[[], None] | None = None) -> list:
    """(Inside a graph op.) ``results()`` as the op's arrays and an OK status; a disagreement
    between ranks as zeros of the outputs' shapes and the DISAGREE status (the status op fails
    every rank with it), any other pslink error raised (``on_error`` first, if given)."""
    try:
        arrays = results()
    except PslinkError as exc:
        if on_error is not None:
            on_error()
        errors.remember(exc)
        if not errors.disagreement(exc):
            raise  # TensorFlow keeps the text; ConfigError (a ValueError) arrives as InvalidArgument
        log.error("pslink: %s", exc.message)
        stand_ins = [tensors.zeros([d or 0 for d in (o.shape.as_list() if o.shape.rank is not None else [])],
                                   o.dtype.as_numpy_dtype) for o in outputs]
        return [*stand_ins, np.int32(errors.DISAGREE)]
    return [*(tensors.aligned(np.asarray(r)) for r in arrays), np.int32(errors.OK)]


def _checked(results: list, status, what: str, outputs: Sequence[Out]) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """The status op that fails the step on a bad status, and the results after it, shaped."""
    checked = errors.fail_if(status, what)
    with tf.control_dependencies([checked]):
        results = [tf.identity(r) for r in results]
    for result, out in zip(results, outputs):
        result.set_shape(out.shape)
    return checked, results


class _Started(NamedTuple):
    finish: Callable[[], Sequence[np.ndarray]] | None  # waits for the results (None: starting failed)
    error: PslinkError | None


def run_in_flight(what: str, calls: Sequence[tuple[Callable, Sequence, Sequence[Out]]],
                  kind: str = "collective") -> list[list[tf.Tensor]]:
    """Several calls of one reduction whose work goes on in the background, built into the
    graph so that each starts as soon as its own inputs exist (a gradient bucket as soon as
    backward produced it) and is waited for only later: ``calls`` are ``(start, inputs,
    outputs)``, ``start(*arrays)`` begins the work and returns a function that waits for it and
    returns the results (as :func:`run`'s ``call`` does). Graph mode only (eagerly there is
    nothing to overlap: use :func:`run`).

    Each call is two ``tf.numpy_function`` ops: a start op returning a ticket, and a finish op
    that takes it, waits and returns the results with a status (handled as :func:`run`'s). The
    start ops are chained in ``calls``' order after the previous call of the graph, the finish
    ops in the same order after each other, and the next call of the graph after the last
    finish: every rank starts the calls in one order, and a finish only waits for starts that
    every rank makes before any finish of theirs can block (no rank ever waits on a call another
    rank has not reached). After a finish fails, the calls still in flight are dropped."""
    _refuse_xla(what)
    graph_ = tf.compat.v1.get_default_graph()
    in_flight: dict[int, _Started] = {}  # by ticket, for this batch of ops
    tickets = itertools.count()
    order = _tokens.get(graph_)
    starts = []
    for start, inputs, _ in calls:
        inputs = [tf.convert_to_tensor(t) for t in inputs]

        def start_op(*arrays, start=start, chained=order is not None):
            if chained:
                arrays = arrays[1:]  # the previous op's ticket or status: only an order
            ticket = next(tickets)
            try:
                # The arrays are views of TensorFlow's buffers: the finish function keeps them.
                in_flight[ticket] = _Started(start(*arrays), None)
            except PslinkError as exc:
                in_flight[ticket] = _Started(None, exc)
            return np.int64(ticket)

        ticket = tf.numpy_function(start_op, ([order] if order is not None else []) + inputs, tf.int64,
                                   stateful=True, name=f"pslink_{kind}_start")
        starts.append(ticket)
        order = ticket
    results = []
    for ticket, (_, _, outputs) in zip(starts, calls):
        def finish_op(ticket, *previous, outputs=outputs):
            started = in_flight.pop(int(ticket))

            def finished():
                if started.error is not None:
                    raise started.error
                return started.finish()

            # After a failure the step ends here: what is still in flight is not waited for.
            return _with_status(finished, outputs, on_error=in_flight.clear)

        previous = [order] if results else []
        *outs, status = tf.numpy_function(finish_op, [ticket, *previous], [o.dtype for o in outputs] + [tf.int32],
                                          stateful=True, name=f"pslink_{kind}_finish")
        order, outs = _checked(outs, status, what, outputs)
        results.append(outs)
    _tokens[graph_] = order
    return results


def ordered(build: Callable):
    """``build()`` ops that make calls of their own (through :func:`run` in a nested function,
    say a branch of ``tf.cond``) so that, in the graph being built, they run after the previous
    call, and the next after them; ``build()``'s first output must depend on their calls."""
    graph_ = tf.compat.v1.get_default_graph()
    token = _tokens.get(graph_)
    with tf.control_dependencies([token] if token is not None else []):
        out = build()
    _tokens[graph_] = tf.nest.flatten(out)[0]
    return out


def value_op(read: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 scalar that ``read()`` gives when the op runs (eagerly: now). Horovod's
    ``rank_op`` and friends: a graph built in one place may run in another."""
    if eager():
        return tf.constant(read(), tf.int32, name=name)
    value = tf.numpy_function(lambda: np.int32(read()), [], tf.int32, stateful=True, name=name or "pslink_value")
    value.set_shape([])
    return value
