"""pslink: a shared, elastic parameter service for deep-learning training jobs.

    import pslink
    agent = pslink.connect(job="mnist", rank=0, num_workers=2, master="tcp://127.0.0.1:7770")
    agent.pushpull("grad", grad, average=True).wait()

See ``pslink.connect`` and the README for the service side (``pslink service up``).
"""

from pslink.core.agent import Agent
from pslink.core.agent.handle import Handle
from pslink.core.worker.connect import connect
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
