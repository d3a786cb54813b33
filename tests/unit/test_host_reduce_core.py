"""Host-local reduce's pure parts: a push that stands for several ranks (``cov``) in the
Aggregator's core and on the wire, the settings, and the host groups launchers number."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.core.config import host_reduce_settings
from pslink.core.agent.host_reduce import local_group
from pslink.core.aggregator.tasks import Request
from pslink.core.wire.protocol import Op, decode, encode
from pslink.errors import ConfigError, KeyStateError, MembershipError, ProtocolError
from tests.unit.test_aggregator_core import TOKEN, Cluster


def push(c: Cluster, rank: int, rnd: int, value, covers=None, op=Op.PUSHPULL):
    header = c.header(op, rank, rnd)
    task = c.core.admit(header)
    payload = c.core.receive_buffer(task)
    payload[:] = value
    return c.core.handle(task, Request(f"rank{rank}", header["id"], op, rank, rnd, payload, covers=covers))


def test_a_push_for_a_hosts_ranks_counts_each_of_them():
    c = Cluster(workers=4, shape=(3,), needs_init=False)
    assert push(c, 0, 1, [1, 2, 3], covers=[0, 1]) == []  # ranks 2 and 3 still to come
    assert push(c, 2, 1, [10, 20, 30], covers=[2]) == []
    replies = push(c, 3, 1, [100, 200, 300])
    assert len(replies) == 3 and {r.n for r in replies} == {4}  # the round counts four contributors
    assert all(np.array_equal(r.payload, [111, 222, 333]) for r in replies)


def test_a_covered_rank_pushing_again_on_its_own_is_answered_not_added():
    # The leader pushed for ranks 0 and 1, then was lost: rank 1 sends its push itself.
    c = Cluster(workers=2, shape=(2,), needs_init=False)
    (reply,) = push(c, 0, 1, [5, 7], covers=[0, 1])
    (again,) = push(c, 1, 1, [2, 3])
    assert again.round == 1 and np.array_equal(again.payload, [5, 7]) and again.n == 2


def test_a_covered_push_repeated_is_added_once():
    c = Cluster(workers=3, shape=(2,), needs_init=False)
    assert push(c, 0, 1, [1, 1], covers=[0, 1]) == []
    assert push(c, 0, 1, [1, 1], covers=[0, 1]) == []  # a resend, before the round closed
    replies = push(c, 2, 1, [1, 1])
    assert replies and all(np.array_equal(r.payload, [2, 2]) for r in replies)


def test_a_push_for_ranks_some_of_which_pushed_already_is_refused_naming_them():
    c = Cluster(workers=3, shape=(2,), needs_init=False)
    push(c, 1, 1, [1, 1])
    (reply,) = push(c, 0, 1, [1, 1], covers=[0, 1])
    assert isinstance(reply.error, KeyStateError) and "ranks [1] pushed it already" in str(reply.error)
    replies = push(c, 0, 1, [4, 4]) + push(c, 2, 1, [1, 1])  # nothing of the refused push was added
    assert all(np.array_equal(r.payload, [6, 6]) for r in replies if r.error is None)


def test_a_push_for_a_rank_not_in_the_job_is_refused():
    c = Cluster(workers=2, shape=(2,), needs_init=False)
    (reply,) = push(c, 0, 1, [1, 1], covers=[0, 7])
    assert isinstance(reply.error, MembershipError) and "rank 7 is not a member" in str(reply.error)


def test_optimizer_mode_averages_over_every_covered_rank():
    c = Cluster(workers=2, shape=(2,), mode="optimizer", optimizer={"type": "sgd", "lr": 1.0, "average": True})
    c.send(Op.INIT, 0, 0, [0, 0])
    (reply,) = push(c, 0, 1, [4, 8], covers=[0, 1])
    assert reply.n == 2 and np.array_equal(reply.payload, [-2, -4])  # the sum over two workers, halved


def _data_header(op=Op.PUSHPULL, **extra) -> bytes:
    return encode(op, id=1, job="j", tok=TOKEN, rank=0, key="w", part=0, rnd=1, dtype="float32", shape=[2],
                  span=[0, 2], **extra)


def test_the_wire_takes_a_list_of_distinct_ranks_on_pushes_only():
    assert decode(_data_header(cov=[0, 1]), [8])["cov"] == [0, 1]
    for bad in ([], [0, 0], [-1], ["0"], 3):
        with pytest.raises(ProtocolError, match="'cov' must be a list of distinct ranks"):
            decode(_data_header(cov=bad), [8])
    with pytest.raises(ProtocolError, match="on a push or pushpull only"):
        decode(_data_header(Op.PULL, cov=[0]), [])


def test_local_groups_are_a_hosts_consecutive_ranks():
    assert local_group(5, 1, 4) == [4, 5, 6, 7]
    assert local_group(0, 0, 2) == [0, 1]
    with pytest.raises(ConfigError, match="local rank 3 of 2"):
        local_group(3, 3, 2)


def test_host_reduce_is_on_where_a_launcher_put_several_workers_of_a_multi_host_job_on_a_host():
    assert host_reduce_settings(None, None, None, environ={}) is None  # no launcher: nothing to reduce
    env = {"PSLINK_LOCAL_RANK": "1", "PSLINK_LOCAL_SIZE": "2"}
    assert host_reduce_settings(None, None, None, environ=env) == (1, 2)
    assert host_reduce_settings(None, None, None, num_workers=4, environ=env) == (1, 2)
    # A job on this host alone: only when asked (it crosses no network; the leader's copies would cost).
    assert host_reduce_settings(None, None, None, num_workers=2, environ=env) is None
    assert host_reduce_settings(True, None, None, num_workers=2, environ=env) == (1, 2)
    assert host_reduce_settings(None, None, None, num_workers=2, environ={**env, "PSLINK_HOST_REDUCE": "1"}) == (1, 2)
    # An elastic job: only when asked, by the argument or the environment alike.
    assert host_reduce_settings(None, None, None, num_workers=4, elastic=True, environ=env) is None
    assert host_reduce_settings(None, None, None, num_workers=4, elastic=True,
                                environ={**env, "PSLINK_HOST_REDUCE": "1"}) == (1, 2)
    assert host_reduce_settings(None, None, None, environ={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}) == (0, 4)
    assert host_reduce_settings(None, None, None, environ={**env, "PSLINK_LOCAL_SIZE": "1"}) is None
    assert host_reduce_settings(False, None, None, environ=env) is None
    assert host_reduce_settings(None, None, None, environ={**env, "PSLINK_HOST_REDUCE": "0"}) is None
    assert host_reduce_settings(True, 0, 3, environ={}) == (0, 3)
    # The launcher's numbers are its worker's: another job or rank of the process pushes flat.
    launched = {**env, "PSLINK_JOB": "j", "PSLINK_RANK": "3"}
    assert host_reduce_settings(None, None, None, "j", 3, environ=launched) == (1, 2)
    assert host_reduce_settings(None, None, None, "j.set1", 3, environ=launched) is None
    assert host_reduce_settings(None, None, None, "j", 0, environ=launched) is None
    torchrun = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "5"}
    assert host_reduce_settings(None, None, None, "any", 5, environ=torchrun) == (1, 2)
    assert host_reduce_settings(None, None, None, "any", 4, environ=torchrun) is None
    with pytest.raises(ConfigError, match="PSLINK_HOST_REDUCE='maybe' must be 1 or 0"):
        host_reduce_settings(None, None, None, environ={**env, "PSLINK_HOST_REDUCE": "maybe"})
    with pytest.raises(ConfigError, match="local rank 2 is not in"):
        host_reduce_settings(None, 2, 2, environ={})
    # A launcher's numbers that do not fit (an elastic job's newcomer, numbered past the old size).
    assert host_reduce_settings(None, None, None, environ={"PSLINK_LOCAL_RANK": "2", "PSLINK_LOCAL_SIZE": "2"}) is None
    with pytest.raises(ConfigError, match="PSLINK_LOCAL_SIZE='two' must be an integer"):
        host_reduce_settings(None, None, None, environ={"PSLINK_LOCAL_RANK": "0", "PSLINK_LOCAL_SIZE": "two"})
