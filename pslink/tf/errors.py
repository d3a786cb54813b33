"""pslink's errors as the TensorFlow errors Horovod's ops raise.

Horovod's TensorFlow ops fail with ``tf.errors.OpError`` subclasses: ranks whose calls disagree
(dtype, shape, root rank, reduction) with ``FailedPreconditionError``, a bad argument (splits that
do not add up) with ``InvalidArgumentError``. The Session raises pslink's own errors for them
(:class:`~pslink.errors.MismatchError`, :class:`~pslink.errors.ShapeMismatchError`,
:class:`~pslink.errors.ConfigError`); this module gives them TensorFlow's classes:

- **eagerly**, the error raised is of both classes (:class:`CallsDisagree` is a
  ``FailedPreconditionError`` and a ``MismatchError``), so code written for Horovod and code
  written for pslink (elastic recovery catches ``PslinkError``) both catch it;
- **in a graph** (a ``tf.function``, a TF1 session) a Python exception raised inside
  ``tf.numpy_function`` reaches TensorFlow as a status whose code TensorFlow picks from the
  exception's Python class alone: ``ValueError`` and ``TypeError`` give InvalidArgument (so a
  ``ConfigError`` arrives as Horovod's InvalidArgumentError by itself), ``NotImplementedError``
  Unimplemented, any other class Unknown, a ``tf.errors.OpError`` subclass included (TensorFlow
  2.17, checked). A disagreement therefore leaves the op as a status output, and
  :func:`fail_if` turns a non-zero status into a ``FailedPreconditionError`` of TensorFlow's
  own: the only ops that fail with that code are TensorFlow's, and reading a resource variable
  that was never created is the one whose failure has no other effect. Its message is fixed
  when the graph is built (it names the collective); the ranks' calls, which only the run
  knows, are logged by each rank (logger ``pslink.tf``) and kept for :func:`original`.
"""

from __future__ import annotations

import logging
import threading

import tensorflow as tf

from pslink.errors import ConfigError, MismatchError, PslinkError, ShapeMismatchError

log = logging.getLogger("pslink.tf")

OK, DISAGREE = 0, 1  # the status a graph op returns beside its results


# pslink's class first: OpError.__init__ ends in super().__init__() without arguments, which
# Exception takes and PslinkError.__init__ would not; the message is OpError's (its property).

class CallsDisagree(MismatchError, tf.errors.FailedPreconditionError):
    """The ranks' calls of one collective disagree (Horovod's FailedPreconditionError)."""

    def __init__(self, error: PslinkError):
        tf.errors.FailedPreconditionError.__init__(self, None, None, error.message)
        self.details = error.details


class ShapesDisagree(ShapeMismatchError, tf.errors.FailedPreconditionError):
    """The ranks' tensors of one key differ in shape or dtype (Horovod's FailedPreconditionError)."""

    def __init__(self, error: PslinkError):
        tf.errors.FailedPreconditionError.__init__(self, None, None, error.message)
        self.details = error.details


class BadArgument(ConfigError, tf.errors.InvalidArgumentError):
    """A collective's arguments are invalid (Horovod's InvalidArgumentError)."""

    def __init__(self, error: PslinkError):
        tf.errors.InvalidArgumentError.__init__(self, None, None, error.message)
        self.details = error.details


def disagreement(error: BaseException) -> bool:
    """Whether ``error`` says that the ranks' calls (or tensors) disagree."""
    return isinstance(error, (MismatchError, ShapeMismatchError)) and not isinstance(error, tf.errors.OpError)


def as_tf_error(error: BaseException) -> BaseException:
    """``error`` as the TensorFlow error Horovod raises for it (itself when there is none)."""
    if isinstance(error, tf.errors.OpError):
        return error
    if isinstance(error, ShapeMismatchError):
        return ShapesDisagree(error)
    if isinstance(error, MismatchError):
        return CallsDisagree(error)
    if isinstance(error, ConfigError):
        return BadArgument(error)
    return error


# -- in graphs ---------------------------------------------------------------------------------------

_recent: list[PslinkError] = []  # pslink errors raised inside graph ops lately, newest last
_recent_lock = threading.Lock()
_RECENT = 16


def remember(error: PslinkError) -> None:
    """Keep ``error`` (raised inside a graph op, where TensorFlow keeps only its text)."""
    with _recent_lock:
        _recent.append(error)
        del _recent[:-_RECENT]


def original(error: tf.errors.OpError) -> PslinkError | None:
    """The pslink error behind ``error``, an OpError a graph op failed with, if it was one of
    the last few (elastic recovery needs the class TensorFlow's status lost)."""
    with _recent_lock:
        for candidate in reversed(_recent):
            if candidate.message and candidate.message in error.message:
                return candidate
    return None


def fail_if(status: tf.Tensor, what: str) -> tf.Tensor:
    """An op that fails with ``FailedPreconditionError`` when ``status`` (a graph op's status
    output) is :data:`DISAGREE`, naming ``what``; make the op's results depend on it."""
    def fail():
        # A resource variable that is never created: reading it is a FailedPreconditionError
        # whose message carries the variable's name, which is ours.
        missing = tf.raw_ops.VarHandleOp(
            dtype=tf.int32, shape=[], shared_name=(
                f"pslink: {what}: the ranks' calls disagree (dtype, shape, root rank, reduction or scale factors; "
                "every rank logged the calls)"))
        return tf.raw_ops.ReadVariableOp(resource=missing, dtype=tf.int32)

    return tf.cond(tf.equal(status, OK), lambda: tf.constant(0), fail)
