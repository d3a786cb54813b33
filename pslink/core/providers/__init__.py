"""Providers start and stop Aggregators for pMaster: ``local`` (subprocesses) and ``thread``
(in this process, for tests and embedding)."""

from pslink.core.providers.base import Provider
from pslink.core.providers.local import LocalProvider
from pslink.core.providers.thread import ThreadProvider

__all__ = ["Provider", "LocalProvider", "ThreadProvider"]
