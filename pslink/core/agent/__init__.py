"""The Agent: the worker-side client of the parameter service (see :mod:`pslink.core.agent.agent`)."""

from pslink.core.agent.agent import Agent
from pslink.core.agent.connect import AGENT_OPTIONS, connect

__all__ = ["AGENT_OPTIONS", "Agent", "connect"]
