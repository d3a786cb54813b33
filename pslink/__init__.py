"""pslink: a shared, elastic parameter service for deep-learning training jobs.

    import pslink
    agent = pslink.connect(job="mnist", rank=0, num_workers=2, master="tcp://127.0.0.1:7770")
    agent.pushpull("grad", grad, average=True).wait()

See ``pslink.connect`` and the README for the service side (``pslink service up``).
"""

import os as _os

from pslink.core.agent import Agent
from pslink.core.agent import connect as _connect
from pslink.core.agent.handle import Handle
from pslink.errors import (
    AbortedError,
    AuthError,
    ClosedError,
    ConfigError,
    KeyStateError,
    MembershipError,
    PeerError,
    ProtocolError,
    PslinkError,
    PslinkTimeoutError,
    QuotaError,
    ServiceError,
    ShapeMismatchError,
    UnknownJobError,
)

__version__ = "0.1.0"

ENV_TOKEN_FILE = "PSLINK_TOKEN_FILE"


def connect(job=None, rank=None, num_workers=None, master=None, **options) -> Agent:
    agent = _connect(job, rank, num_workers, master, **options)
    path = _os.environ.get(ENV_TOKEN_FILE)
    if path:
        _share_token(path, agent.token)
    return agent


connect.__doc__ = (_connect.__doc__ or "") + """
    Under an elastic ``pslink launch`` (which sets ``PSLINK_TOKEN_FILE``), the job's token is
    written there once, so that the launcher can start a replacement under the rank of a
    worker that died (pMaster asks a rank that was in the job for the token)."""


def _share_token(path: str, token: bytes) -> None:
    if _os.path.exists(path):
        return
    tmp = f"{path}.{_os.getpid()}"
    fd = _os.open(tmp, _os.O_WRONLY | _os.O_CREAT | _os.O_TRUNC, 0o600)
    with _os.fdopen(fd, "w") as f:
        f.write(token.hex())
    _os.replace(tmp, path)  # whole or not at all: the launcher never reads half a token

__all__ = [
    "Agent",
    "Handle",
    "connect",
    "AbortedError",
    "AuthError",
    "ClosedError",
    "ConfigError",
    "KeyStateError",
    "MembershipError",
    "PeerError",
    "ProtocolError",
    "PslinkError",
    "PslinkTimeoutError",
    "QuotaError",
    "ServiceError",
    "ShapeMismatchError",
    "UnknownJobError",
    "__version__",
]
