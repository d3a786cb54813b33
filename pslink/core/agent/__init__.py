"""The Agent: the worker-side client of the parameter service (see :mod:`pslink.core.agent.agent`)."""

from pslink.core.agent.agent import Agent

__all__ = ["Agent"]
