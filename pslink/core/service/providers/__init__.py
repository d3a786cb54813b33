"""Providers start and stop Aggregators for pMaster: ``local`` (subprocesses) and ``thread``
(in this process, for tests and embedding)."""

from pslink.core.service.providers.base import Provider
from pslink.core.service.providers.local import LocalProvider
from pslink.core.service.providers.thread import ThreadProvider

__all__ = ["Provider", "LocalProvider", "ThreadProvider"]
