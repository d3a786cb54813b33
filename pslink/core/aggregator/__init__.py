"""The Aggregator: its decisions without I/O (``core``, ``tasks``, ``moves``, ``cycle``) and the
process that carries them out (``process``; run one with ``python -m pslink.core.aggregator``)."""

from pslink.core.aggregator.process import Aggregator

__all__ = ["Aggregator"]
