"""Where an Agent's keys live: :class:`KeyLookup` asks pMaster (one batched LOOKUP) for the keys
this Agent does not know yet and keeps what it answers in the Agent's key table."""

from __future__ import annotations

from typing import Any

from pslink.core.agent.keys import KeyInfo
from pslink.core.agent.master_link import MasterLink
from pslink.core.wire.protocol import Op

_INTENTS = {Op.INIT: "init", Op.PULL: "pull"}  # what pMaster is told a new key is for (else "push")


class KeyLookup:
    """The LOOKUP of new keys into ``keys`` (the Agent's table), through ``master``. Shared by the
    Sender (a request's keys) and the TaskRequests (a key's optimizer state, joining), so that
    neither has to go through the other."""

    def __init__(self, keys: dict[Any, KeyInfo], master: MasterLink):
        self.keys, self.master = keys, master

    def infos(self, op: Op, keys: list, shapes: list | None = None) -> list[KeyInfo]:
        """Key infos for ``keys``, asking pMaster for those not known yet. ``shapes``: each key's
        ``(shape, dtype)`` as this worker uses it, or None (declared by whoever knows it)."""
        intent = _INTENTS.get(op, "push")
        missing = []
        for i, key in enumerate(keys):
            if key in self.keys:
                continue
            item = {"key": key, "intent": intent}
            shape = shapes[i] if shapes is not None else None
            if shape is not None:
                item.update(shape=[int(d) for d in shape[0]], dtype=shape[1])
            missing.append(item)
        if missing:
            body = self.master.call_again_if_cut(Op.LOOKUP, items=missing)
            for spec in body["keys"]:
                self.keys.setdefault(spec["key"], KeyInfo(spec))
        return [self.keys[k] for k in keys]
