"""The errors the MXNet adapter raises: MXNet's own error class, with pslink's reason attached."""

from __future__ import annotations

from mxnet.base import MXNetError

from pslink.errors import PslinkError


class KVStoreError(MXNetError):
    """An error of the pslink kvstore, raised as MXNet raises its own (an ``MXNetError``).

    ``pslink_error`` is the pslink error it came from, if any (also chained as ``__cause__``);
    ``key`` and ``shapes`` name the key and the shapes involved where there are some.
    """

    def __init__(self, message: str, key=None, shapes=None, pslink_error: PslinkError | None = None):
        super().__init__(message)
        self.message = message
        self.key = key
        self.shapes = shapes
        self.pslink_error = pslink_error


def translate(error: PslinkError, doing: str, hint: str = "") -> KVStoreError:
    """Wrap a pslink error from the service or the Agent; its message already names the job,
    key, shapes and peer involved."""
    details = error.details or {}
    return KVStoreError(
        f"pslink kvstore: {doing} failed: {error.message}" + (f" ({hint})" if hint else ""),
        key=details.get("key"),
        shapes=details.get("shapes"),
        pslink_error=error,
    )
