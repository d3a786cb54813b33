"""The errors pslink raises.

Every error that crosses the wire carries a ``code`` (a short string) so that the receiving side
rebuilds the same class: errors are told apart by class, never by matching message text.
Messages name what was wrong: the job, the key, the shapes and the peer involved.
"""

from __future__ import annotations


class PslinkError(RuntimeError):
    """Base class of every error pslink raises. A RuntimeError, as Horovod's and torch's errors
    are: code written for them that catches RuntimeError (or Horovod's HorovodInternalError,
    which pslink's Horovod APIs name this class) catches pslink's too."""

    code = "error"

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.message = message
        self.details = details


class ConfigError(PslinkError, ValueError):
    """A setting (argument or environment variable) is missing or invalid."""

    code = "config"


class ProtocolError(PslinkError):
    """A message is malformed: bad framing, version, op, dtype, shape or size."""

    code = "protocol"


class AuthError(PslinkError):
    """The request's job credential is missing or wrong."""

    code = "auth"


class UnknownJobError(PslinkError):
    """The job is not registered with this pMaster or Aggregator."""

    code = "unknown_job"


class QuotaError(PslinkError):
    """A job asked for more than its quota (bytes held, keys) on the service."""

    code = "quota"


class KeyStateError(PslinkError):
    """A request does not fit the key's state (round out of order, duplicate push, not here)."""

    code = "key_state"


class ShapeMismatchError(PslinkError, ValueError):
    """Two workers used one key with different shapes or dtypes."""

    code = "shape_mismatch"


class MismatchError(PslinkError):
    """The ranks' calls of one collective disagree (operation, dtype, shape, root rank,
    reduction or scale factors), or a collective cannot run while ranks have joined: raised on
    every rank, naming each rank's call (Horovod's coordinator refuses such requests the same
    way)."""

    code = "mismatch"


class AbortedError(PslinkError):
    """The key was aborted, for example because another worker pushed a bad shape."""

    code = "aborted"


class MembershipError(PslinkError):
    """A worker registration does not fit the job (rank out of range, rank taken, size differs)."""

    code = "membership"


class ServiceError(PslinkError):
    """The service failed to carry out a request (placement, provider, internal error)."""

    code = "service"


class MovedError(PslinkError):
    """The task moved to another Aggregator (``details``: agg, address). Agents follow it by
    themselves; a user sees it only if a task keeps moving."""

    code = "moved"


class FencedError(PslinkError):
    """The Aggregator has not heard from pMaster for its lease: its parts may be served elsewhere
    now. Agents ask pMaster where the part is (or, when they cannot reach pMaster either, tell
    the Aggregator so and go on with it)."""

    code = "fenced"


class PeerError(PslinkError, ConnectionError):
    """A peer (pMaster or Aggregator) could not be reached or went away."""

    code = "peer"


class PslinkTimeoutError(PslinkError, TimeoutError):
    """A wait ran out of time; the message names what was awaited and from whom."""

    code = "timeout"


class ClosedError(PslinkError):
    """The Agent, connection or service was closed."""

    code = "closed"


_BY_CODE = {
    cls.code: cls
    for cls in (
        PslinkError,
        ConfigError,
        ProtocolError,
        AuthError,
        UnknownJobError,
        KeyStateError,
        ShapeMismatchError,
        MismatchError,
        QuotaError,
        AbortedError,
        MembershipError,
        ServiceError,
        MovedError,
        FencedError,
        PeerError,
        PslinkTimeoutError,
        ClosedError,
    )
}


def error_to_wire(error: PslinkError) -> list:
    """``[code, message, details]`` to send an error on (``error_from_code(*wire)`` rebuilds it);
    only the details a message can carry are kept."""
    details = {k: v for k, v in error.details.items() if isinstance(v, (int, str, list))}
    return [error.code, error.message, details]


def error_from_code(code: str, message: str, details: dict | None = None) -> PslinkError:
    """Rebuild an error received from a peer; an unknown code becomes a plain PslinkError."""
    cls = _BY_CODE.get(code, PslinkError)
    return cls(message, **(details or {}))
