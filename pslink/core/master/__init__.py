"""pMaster: its state and decisions without I/O (``state``, ``jobs``, ``control``, ``placement``,
``recovery``) and the daemon that carries them out (``master``), with its durable store."""

from pslink.core.master.master import Master

__all__ = ["Master"]
