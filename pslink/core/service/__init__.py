"""A whole service (pMaster and its pool), the providers that start Aggregators, and the control
client the command line uses."""

from pslink.core.service.service import Service

__all__ = ["Service"]
