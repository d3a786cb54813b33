"""Agent requests about a task rather than its rounds: the optimizer state kept on the service
(for checkpoints), and joining a job that is running.

Joining. A worker that registers while its job runs (elastic scaling, or replacing one that left)
comes into each key at the first round no worker has started: it asks every part where the key
is (``JOIN`` with round 0), then joins every part at ``max(started) + 1``. A part where that round
closed meanwhile refuses, and the worker asks again, so all parts of a key take the same round.
Its first pull of a key then returns the round before: the current value.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from pslink.core.agent.handle import Handle, Handles
from pslink.core.agent.keys import KeyInfo, PartInfo, as_array, check_key
from pslink.core.agent.requests import PartRequest, Requests
from pslink.core.agent.seat import Seat
from pslink.core.agent.lookup import KeyLookup
from pslink.core.agent.master_link import MasterLink
from pslink.core.wire.protocol import Op, encode
from pslink.errors import ConfigError, PslinkError, PslinkTimeoutError, ShapeMismatchError

log = logging.getLogger("pslink.core.agent.agent")

JOIN_ATTEMPTS = 50  # rounds keep closing while a worker asks where to come in: it asks again


class TaskRequests:
    """Requests about tasks for the worker in ``seat``: ``keys`` is the Agent's key table and
    ``lookup`` its way to learn keys from pMaster. ``late``: the worker registered while its job
    ran (it joins every key before it uses it)."""

    def __init__(self, seat: Seat, keys: dict[object, KeyInfo], lookup: KeyLookup, requests: Requests,
                 handles: Handles, master: MasterLink, *, late: bool):
        self.seat, self.keys, self.lookup = seat, keys, lookup
        self.requests, self.handles, self.master = requests, handles, master
        self.late = late
        self.joined: set = set()  # keys a late worker has joined

    def optimizer_state(self, keys: Sequence | None = None, timeout: float | None = None) -> dict:
        """The service's optimizer state (optimizer mode), for checkpoints: ``{key: {name: array
        of the key's shape, or an int}}`` (SGD: ``momentum_buffer``; Adam: ``exp_avg``,
        ``exp_avg_sq`` and ``step``; ``{}`` for a key not stepped yet). ``keys`` defaults to every
        key this Agent has used. Take it between rounds (once this worker's pushes are done and
        the others' rounds closed), when it is exactly what the next step will use."""
        keys = list(self.keys) if keys is None else [check_key(k) for k in keys]
        infos = self.lookup.infos(Op.PULL, keys)
        states: dict = {info.key: {} for info in infos}
        handle = self.handles.new("optimizer_state", keys, states, sum(len(info.parts) for info in infos))
        for info in infos:
            for part in info.parts:
                self.send_state(handle, Op.STATE_GET, info, part, states[info.key])
        return handle.wait(timeout)

    def set_optimizer_state(self, states: dict, timeout: float | None = None) -> None:
        """Replace the service's optimizer state of the keys in ``states`` (as returned by
        :meth:`optimizer_state`, e.g. from a checkpoint); ``{}`` for a key resets it. Call it
        between rounds; every worker may call it with the same states."""
        if not isinstance(states, dict):
            raise ConfigError(f"optimizer states are a dict {{key: {{name: array or int}}}}, got {type(states).__name__}")
        keys = [check_key(k) for k in states]
        infos = self.lookup.infos(Op.PULL, keys)
        handle = self.handles.new("set_optimizer_state", keys, None, sum(len(info.parts) for info in infos))
        for info in infos:
            state = states[info.key]
            if not isinstance(state, dict):
                raise ConfigError(f"key {info.key!r}: its optimizer state must be a dict, got {type(state).__name__}")
            arrays, scalars = {}, {}
            for name, value in state.items():
                if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                    scalars[str(name)] = int(value)
                    continue
                array, dtype = as_array(value, info.key)
                if array.shape != info.shape or dtype != info.dtype_name:
                    raise ShapeMismatchError(f"key {info.key!r}: optimizer state {name!r} has shape {array.shape} "
                                             f"{dtype}, but the key has {info.describe()}", key=info.key)
                arrays[str(name)] = np.ascontiguousarray(array).reshape(-1)
            for part in info.parts:
                self.send_state(handle, Op.STATE_SET, info, part, (arrays, scalars))
        handle.wait(timeout)

    def send_state(self, handle: Handle, op: Op, info: KeyInfo, part: PartInfo, state, moves: int = 0,
                    round_: int = 0) -> None:
        """One part of a request about the task, not its rounds: STATE_GET (``state``: the dict
        its arrays and numbers go into), STATE_SET (``state``: the key's flat arrays and
        numbers) or JOIN (``state``: the dict its answers go into, by part; ``round_`` 0 asks)."""
        aggregator, address = part.where
        handle._waiting_on[aggregator] = address
        try:
            link = self.requests.link(aggregator, address)
        except PslinkError as exc:
            self.handles.complete(handle, exc)
            return
        nbytes = (part.stop - part.start) * info.dtype.itemsize
        request = PartRequest(handle, link, nbytes, None, state, False, op, info, part, round_, None, None, moves)
        rid = self.requests.add(request)
        fields = dict(id=rid, **self.seat.fields(), key=info.key, part=part.index, rnd=round_,
                      dtype=info.dtype_name, shape=list(info.shape), span=[part.start, part.stop])
        frames = [encode(op, **fields)]
        if op == Op.STATE_SET:
            arrays, scalars = state
            frames = [encode(op, **fields, names=list(arrays), scalars=scalars)]
            frames += [flat[part.start : part.stop] for flat in arrays.values()]
        self.requests.transmit(rid, request, frames)

    @staticmethod
    def state_arrived(request: PartRequest, header: dict, payloads: list) -> None:
        """A part's STATE_GET answer (its slice of each array, and its numbers) or JOIN answer."""
        body, info, part, into = header.get("body") or {}, request.info, request.part, request.array
        if request.op == Op.JOIN or request.op == Op.WAITING:
            into[part.index] = body
            return
        for name, data in zip(body.get("names", []), payloads):
            full = into.get(name)
            if full is None:
                full = into[name] = np.zeros(info.shape, info.dtype)  # parts never stepped stay zero
            full.reshape(-1)[part.start : part.stop] = np.frombuffer(data, info.dtype)
        for name, value in (body.get("scalars") or {}).items():
            into[name] = max(value, into.get(name, value))

    def abort_key(self, info: KeyInfo, error: PslinkError, failed_round: int | None = None) -> None:
        """Tell the key's Aggregators, so the other workers waiting on it fail now, not later:
        the rounds up to ``failed_round`` only (the key goes on), or the key for good."""
        extra = {} if failed_round is None else {"rnd": failed_round}
        for part in info.parts:
            try:
                link = self.requests.link(part.aggregator, part.address)
                link.conn.send([encode(Op.ABORT, id=0, **self.seat.fields(), key=info.key, part=part.index,
                                       msg=error.message, code=error.code, **extra)])
            except PslinkError:
                pass

    def explain_wait(self, handle: Handle, timeout: float = 2.0) -> str:
        """For a timed-out ``handle``: ask the Aggregators of its first keys whom the rounds it
        waits for still wait for, in words ("" if they cannot say within ``timeout``)."""
        infos = [self.keys[k] for k in handle.keys[:4] if k in self.keys]
        if handle.op == "waiting" or not infos:
            return ""
        answers: dict = {info.key: {} for info in infos}
        asking = self.handles.new("waiting", [info.key for info in infos], None, sum(len(i.parts) for i in infos))
        for info in infos:
            for part in info.parts:
                self.send_state(asking, Op.WAITING, info, part, answers[info.key], round_=handle.round or info.round)
        try:
            asking.wait(timeout)
        except PslinkError:
            pass  # whatever came back still says something
        said = []
        for key, parts in answers.items():
            if not parts:
                continue
            round_ = max(body.get("round", 0) for body in parts.values())
            waiting = sorted({r for body in parts.values() for r in body.get("waiting", ())})
            pushed = sorted(set.intersection(*(set(body.get("pushed", ())) for body in parts.values())))
            if waiting:
                said.append(f"round {round_} of key {key!r} waits for rank(s) {waiting} (pushed: {pushed})")
            elif all(body.get("closed", 0) >= round_ for body in parts.values()):
                said.append(f"round {round_} of key {key!r} has closed (its answer is on the way or was lost)")
            else:
                said.append(f"round {round_} of key {key!r} has every push (it waits for its slot in the "
                            "Aggregator's cycle, its replicas or a migration)")
        return ("; " + "; ".join(said)) if said else ""

    # -- joining a running job -------------------------------------------------------------------

    def join_all(self, timeout: float | None = None) -> list:
        """Come into every key the job has (a worker added to a running job, before it trains:
        so it takes part in the very next round of each). Returns the keys."""
        body = self.master.call_again_if_cut(Op.JOB_KEYS)
        for spec in body["keys"]:
            self.keys.setdefault(spec["key"], KeyInfo(spec))
        self.seat.update_members(body.get("membership"))
        infos = [self.keys[spec["key"]] for spec in body["keys"]]
        self.join(infos, timeout)
        return [info.key for info in infos]

    def membership(self) -> dict:
        """The job's members now, from pMaster: ``{"ranks": [...], "epoch": n}``."""
        body = self.master.call_again_if_cut(Op.JOB_KEYS, keys=False)
        self.seat.update_members(body.get("membership"))
        return dict(self.seat.members)

    def join(self, infos: list[KeyInfo], timeout: float | None = None) -> None:
        """Make sure this worker contributes to ``infos`` (it joined the job while it ran)."""
        pending = [info for info in infos if info.key not in self.joined]
        for _ in range(JOIN_ATTEMPTS):
            if not pending:
                return
            answers = self._ask_join(pending, {}, timeout)
            joining: dict = {}
            for info in pending:
                froms = {a["member_from"] for a in answers[info.key].values()}
                if None not in froms and len(froms) == 1:  # a member already (the key is newer than us)
                    info.round = froms.pop() - 1
                    self.joined.add(info.key)
                else:
                    joining[info.key] = max(a["started"] for a in answers[info.key].values()) + 1
            pending = [info for info in pending if info.key in joining]
            if not pending:
                return
            answers = self._ask_join(pending, joining, timeout)
            for info in pending:
                if all(a.get("ok") for a in answers[info.key].values()):
                    info.round = joining[info.key] - 1
                    self.joined.add(info.key)
                    log.info("agent %s: joined key %r at round %d", self.seat, info.key, joining[info.key])
            pending = [info for info in pending if info.key not in self.joined]
        raise PslinkTimeoutError(f"rank {self.seat.rank} of job {self.seat.job!r} could not join key(s) "
                                 f"{[i.key for i in pending]}: their rounds kept closing while it asked")

    def _ask_join(self, infos: list[KeyInfo], rounds: dict, timeout: float | None) -> dict:
        answers: dict = {info.key: {} for info in infos}
        handle = self.handles.new("join", [i.key for i in infos], answers, sum(len(i.parts) for i in infos))
        for info in infos:
            for part in info.parts:
                self.send_state(handle, Op.JOIN, info, part, answers[info.key], round_=rounds.get(info.key, 0))
        return handle.wait(timeout)
