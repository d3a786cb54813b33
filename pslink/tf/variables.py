"""Variables by name, and the check that every rank has the same ones.

Gradients and broadcasts of variables are keyed by the variables' names. Before the first of
them, :func:`check_same` compares every rank's list (names, shapes, dtypes, in order): workers
whose models differ get, all at once, a ShapeMismatchError naming the first variable that
differs and both shapes, instead of a mismatch deep in the service or a wait. One small
allgather when all agree (a digest of the list); the lists themselves only when they differ.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Sequence

import tensorflow as tf

from pslink.core.worker.session import Session
from pslink.errors import ShapeMismatchError

_checked: weakref.WeakKeyDictionary[Session, set] = weakref.WeakKeyDictionary()


def variable_name(variable) -> str:
    """The name that keys a variable: a Keras variable's path, else the TensorFlow name (without
    the ``:0`` that every TensorFlow variable name ends with)."""
    name = getattr(variable, "path", None) or variable.name
    return name.removesuffix(":0")


def source_name(source, index: int) -> str:
    """A gradient source's name: a variable's, a graph tensor's, else its place in the list."""
    if isinstance(source, tf.Variable) or hasattr(source, "path"):
        return variable_name(source)
    if not tf.executing_eagerly() and hasattr(source, "name"):
        return source.name.removesuffix(":0")
    return f"source{index}"


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` with repeats told apart (``a``, ``a#2``, ...), the same way on every rank."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def shape_text(shape) -> str:
    shape = tf.TensorShape(shape)
    if shape.rank is None:
        return "(?)"
    dims = shape.as_list()
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def describe(name: str, value) -> tuple[str, str, str]:
    """(name, shape, dtype) of a variable or tensor, as text."""
    return name, shape_text(value.shape), tf.as_dtype(value.dtype).name


def describe_variables(variables: Sequence) -> list[tuple[str, str, str]]:
    """(unique name, shape, dtype) of each variable, as the checks compare them."""
    names = unique_names([variable_name(v) for v in variables])
    return [describe(n, v) for n, v in zip(names, variables)]


def check_same(session: Session, entries: list[tuple[str, str, str]], scope: str, what: str) -> None:
    """Raise ShapeMismatchError, on every rank at once, naming the first variable (and both
    shapes) in which some rank differs from rank 0 (see the module). Runs at once (eagerly, or
    while a function is traced: every rank traces the same program)."""
    if session.size == 1:
        return
    text = "\n".join("\t".join(entry) for entry in entries)
    digest = hashlib.sha256(text.encode()).hexdigest()
    digests = session.allgather_object(digest, name=f"tf.check.{scope}.digest")
    if all(d == digests[0] for d in digests):
        return
    manifests = session.allgather_object(entries, name=f"tf.check.{scope}.list")
    raise _difference([[tuple(e) for e in m] for m in manifests], what)


def check_once(session: Session, entries: list[tuple[str, str, str]], scope: str, what: str) -> None:
    """:func:`check_same`, the first time this session meets this list of variables in its
    current world (an elastic reset makes a new one: a newcomer checks, so the others check too).

    Keyed by the list itself, not by when it is met: a function that one rank retraces (say,
    for its last, smaller batch) and another does not must not make only one of them ask."""
    signature = (session.generation, scope, tuple(entries))
    done = _checked.setdefault(session, set())
    if signature in done:
        return
    check_same(session, entries, scope, what)
    done.add(signature)


def _shape(entry) -> str:
    return f"{entry[1]} {entry[2]}"


def _difference(manifests: list[list[tuple[str, str, str]]], what: str) -> ShapeMismatchError:
    """The first way in which a rank's variables differ from rank 0's, as an error."""
    base = manifests[0]
    for rank, other in enumerate(manifests[1:], start=1):
        if other == base:
            continue
        for i, (a, b) in enumerate(zip(base, other)):
            if a == b:
                continue
            if a[0] == b[0]:
                message = f"variable {a[0]!r} is {_shape(a)} on rank 0 but {_shape(b)} on rank {rank}"
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
    return ShapeMismatchError(f"{what}: the workers' variables differ")  # digests differed, lists not
