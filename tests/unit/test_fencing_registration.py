"""Fencing at registration (issue 23): an Aggregator failed over while it was away (frozen, or
cut off) and back again is told which of the parts it still holds pMaster placed elsewhere; it
drops them, fails what waited on them and refuses requests for them, so that their Agents ask
pMaster. Driven by hand: pMaster's admission with a recording peer, an Aggregator's shell
without a pMaster."""

from __future__ import annotations

import numpy as np

from pslink.core.aggregator.process import Aggregator
from pslink.core.aggregator.tasks import Request
from pslink.core.master import Master
from pslink.core.transport import Transports
from pslink.core.wire.protocol import Op
from pslink.errors import FencedError
from tests.helpers import RecordingPeer

TOKEN = b"secret-token-123"


def test_pmaster_tells_an_aggregator_back_from_a_failover_what_it_must_drop():
    master = Master("inproc://pmaster-fencing", transports=Transports())
    try:
        state = master.state
        for name in ("agg-0", "agg-1"):
            state.register_aggregator(f"tcp://127.0.0.1:{9000 + int(name[-1])}", name)
            state.aggregator_joined(name)
        record = state.register_worker("j", 0, 1, None, {"servers": 2, "partition_bytes": 64})
        spec, _ = state.declare(record, 0, {"key": "w", "shape": [32], "dtype": "float32", "intent": "init"})
        spec.ready = True
        where = [p.aggregator for p in spec.parts]
        assert len(where) == 2
        held = [["j", "w", i] for i in range(len(where))] + [["gone", "w", 0], ["j", "other", 0], "junk"]
        peer = RecordingPeer()
        master.joining._admit(peer, {"id": 1, "address": "inproc://agg-0-again", "agg": "agg-0", "tasks": held,
                                     "lease": 2.5})
        (reply,) = peer.replies
        assert reply["body"]["fenced"]  # some part of it is on agg-1
        # Parts placed on another Aggregator are fenced, and those of a key of the job pMaster does not
        # have (a placement it forgot: test_restart_moves); its own, and other jobs' parts, stay.
        assert reply["body"]["fenced"] == [["j", "w", i] for i, name in enumerate(where) if name != "agg-0"] \
            + [["j", "other", 0]]
        assert state.aggregators["agg-0"].lease == 2.5
    finally:
        master.stop()


def test_an_aggregator_drops_fenced_parts_fails_their_waiters_and_refuses_their_requests():
    transports = Transports()
    aggregator = Aggregator(None, "inproc://agg-fencing", name="agg-0", transports=transports)
    try:
        info = {"job": "j", "token": TOKEN, "membership": {"ranks": [0, 1], "epoch": 0}, "mode": "sum",
                "optimizer": None, "sync": "bsp"}
        spec = {"key": "w", "part": 0, "shape": [4], "span": [0, 4], "dtype": "float32", "needs_init": False,
                "declared_by": 0}
        (task,) = aggregator.core.assign(info, [spec, dict(spec, key="v")])[:1]
        header = {"op": Op.PUSHPULL, "id": 7, "job": "j", "tok": TOKEN, "rank": 0, "key": "w", "part": 0, "rnd": 1,
                  "dtype": "float32", "shape": [4], "span": [0, 4]}
        waiting = aggregator.core.handle(task, Request("rank0", 7, Op.PUSHPULL, 0, 1, np.ones(4, np.float32)))
        assert waiting == []  # the round waits for rank 1
        sent = []
        aggregator._send_all = sent.extend
        aggregator.master.fenced_parts |= aggregator._fence([["j", "w", 0]])
        (answer,) = sent
        assert isinstance(answer.error, FencedError) and answer.origin == "rank0"
        assert ("j", "w", 0) not in aggregator.core.tasks and ("j", "v", 0) in aggregator.core.tasks
        refused = aggregator.master.fenced(aggregator.clock(), header)
        assert isinstance(refused, FencedError) and "ask pMaster" in refused.message
        assert aggregator.master.fenced(aggregator.clock(), dict(header, key="v")) is None  # the other part serves on
    finally:
        aggregator.stop()
        transports.close()
