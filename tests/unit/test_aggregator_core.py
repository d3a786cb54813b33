"""The Aggregator's round logic, driven directly: no sockets, no threads, no sleeps."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pslink.core.aggregator.core import AggregatorCore
from pslink.core.aggregator.tasks import Request, Summer
from pslink.core.memory import BufferPool
from pslink.core.wire.protocol import Op
from pslink.errors import (
    AbortedError,
    AuthError,
    ClosedError,
    KeyStateError,
    MembershipError,
    ShapeMismatchError,
    UnknownJobError,
)

TOKEN = b"secret-token-123"


def jobinfo(job="j", workers=2, mode="sum", optimizer=None, sync="bsp"):
    return {"job": job, "token": TOKEN, "membership": {"ranks": list(range(workers)), "epoch": 0},
            "mode": mode, "optimizer": optimizer, "sync": sync}


def spec(key="w", part=0, shape=(6,), span=None, dtype="float32", needs_init=True, declared_by=0, incoming=False):
    n = int(np.prod(shape))
    return {"key": key, "part": part, "shape": list(shape), "span": list(span or (0, n)), "dtype": dtype,
            "needs_init": needs_init, "declared_by": declared_by, "incoming": incoming}


class Cluster:
    """An AggregatorCore plus helpers that play the shell's part."""

    def __init__(self, workers=2, mode="sum", optimizer=None, sync="bsp", **spec_kw):
        self.core = AggregatorCore("agg-test", summer=Summer(threads=1))
        info = jobinfo(workers=workers, mode=mode, optimizer=optimizer, sync=sync)
        self.task = self.core.assign(info, [spec(**spec_kw)])[0]
        self.ids = itertools.count(1)

    def header(self, op, rank, rnd, **kw):
        t = self.task
        h = {"op": op, "id": next(self.ids), "job": t.job.job, "tok": TOKEN, "rank": rank, "key": t.key,
             "part": t.part, "rnd": rnd, "dtype": t.dtype_name, "shape": list(t.shape), "span": list(t.span)}
        h.update(kw)
        return h

    def send(self, op, rank, rnd=0, value=None, origin=None):
        header = self.header(op, rank, rnd)
        task = self.core.admit(header)
        payload = None
        if value is not None:
            payload = self.core.receive_buffer(task)
            payload[:] = value
        request = Request(origin if origin is not None else f"rank{rank}", header["id"], op, rank, rnd, payload)
        return request, self.core.handle(task, request)

    def send_payload(self, op, rank, rnd, payload):
        """As the shell sends a push it reads where it arrived: ``payload`` itself, no pooled copy."""
        header = self.header(op, rank, rnd)
        task = self.core.admit(header)
        request = Request(f"rank{rank}", header["id"], op, rank, rnd, payload)
        return request, self.core.handle(task, request)


def test_bsp_rounds_sum_exactly_over_many_rounds():
    c = Cluster(workers=3, shape=(1000,), needs_init=False)
    rng = np.random.default_rng(0)
    for r in range(1, 51):
        pushes = [rng.integers(-1000, 1000, 1000).astype(np.float32) for _ in range(3)]
        replies = []
        for rank in (2, 0, 1):  # arrival order must not matter
            request, out = c.send(Op.PUSHPULL, rank, r, pushes[rank])
            replies += out
        results = [x for x in replies if x.payload is not None]
        assert len(results) == 3 and all(x.error is None for x in replies)
        for x in results:
            assert x.round == r and x.n == 3
            np.testing.assert_array_equal(x.payload, pushes[0] + pushes[1] + pushes[2])


def test_a_pull_waits_for_its_round_and_round_zero_is_the_initial_value():
    c = Cluster(workers=2)
    init = np.arange(6, dtype=np.float32)
    _, replies = c.send(Op.INIT, 0, 0, init)
    assert [r.error for r in replies] == [None]
    _, replies = c.send(Op.PULL, 1, 0)
    np.testing.assert_array_equal(replies[0].payload, init)
    _, replies = c.send(Op.PUSH, 0, 1, np.ones(6))
    assert len(replies) == 1 and replies[0].payload is None  # just the ack
    _, replies = c.send(Op.PULL, 0, 1)
    assert replies == []  # round 1 is open: rank 1 has not pushed
    _, replies = c.send(Op.PUSH, 1, 1, np.full(6, 2.0))
    ack, result = replies
    assert ack.payload is None and result.origin == "rank0" and result.round == 1
    np.testing.assert_array_equal(result.payload, np.full(6, 3.0))


def test_rounds_close_in_order_when_a_worker_runs_ahead():
    c = Cluster(workers=2, needs_init=False)
    for r in (1, 2, 3):
        c.send(Op.PUSH, 0, r, np.full(6, float(r)))
    _, replies = c.send(Op.PULL, 0, 3)
    assert replies == []
    c.send(Op.PUSH, 1, 1, np.full(6, 10.0))
    assert c.task.closed == 1
    c.send(Op.PUSH, 1, 2, np.full(6, 20.0))
    _, replies = c.send(Op.PUSH, 1, 3, np.full(6, 30.0))
    result = [r for r in replies if r.payload is not None][0]
    assert result.round == 3
    np.testing.assert_array_equal(result.payload, np.full(6, 33.0))


def test_requests_before_init_are_queued_not_failed():
    c = Cluster(workers=2)
    _, a = c.send(Op.INIT, 1, 0)  # rank 1 declares first
    _, b = c.send(Op.PUSHPULL, 1, 1, np.full(6, 5.0))
    _, d = c.send(Op.PULL, 1, 0)
    assert a == b == d == [] and len(c.task.before_init) == 3
    init = np.arange(6, dtype=np.float32)
    _, replies = c.send(Op.INIT, 0, 0, init)
    # rank 0's init, then the queued requests in their order: rank 1's init, its push-pull (still
    # waiting for rank 0's push, so no reply yet) and its pull of round 0
    assert [r.origin for r in replies] == ["rank0", "rank1", "rank1"]
    np.testing.assert_array_equal(replies[2].payload, init)
    _, replies = c.send(Op.PUSHPULL, 0, 1, np.ones(6))
    assert {r.origin for r in replies} == {"rank0", "rank1"}
    np.testing.assert_array_equal(replies[0].payload, np.full(6, 6.0))


def test_sum_mode_key_declared_by_a_push_starts_at_zero():
    c = Cluster(workers=1, needs_init=False)
    _, replies = c.send(Op.PULL, 0, 0)
    np.testing.assert_array_equal(replies[0].payload, np.zeros(6))


@pytest.mark.parametrize("rank, rnd, error, match", [
    (5, 1, MembershipError, "rank 5 is not a member"),
    (0, 70, KeyStateError, "more than 64 rounds ahead"),
])
def test_bad_pushes_are_refused_with_a_reason(rank, rnd, error, match):
    c = Cluster(workers=2, needs_init=False)
    c.send(Op.PUSH, 0, 1, np.ones(6))
    _, replies = c.send(Op.PUSH, rank, rnd, np.ones(6))
    assert isinstance(replies[0].error, error)
    assert match in str(replies[0].error)


def test_a_repeated_push_is_answered_and_added_once():
    """A resend (lost reply) or a duplicated message: the same rank's push of the same round."""
    c = Cluster(workers=2, needs_init=False)
    c.send(Op.PUSH, 0, 1, np.ones(6))
    _, replies = c.send(Op.PUSH, 0, 1, np.ones(6))  # again, while the round is open
    assert [(r.error, r.round, r.dropped) for r in replies] == [(None, 1, False)]
    _, replies = c.send(Op.PUSHPULL, 1, 1, np.full(6, 2.0))
    np.testing.assert_array_equal(replies[0].payload, np.full(6, 3.0))  # 1 + 2, not 1 + 1 + 2
    _, replies = c.send(Op.PUSHPULL, 1, 1, np.full(6, 2.0))  # again, after the round closed
    assert replies[0].error is None and replies[0].round == 1
    np.testing.assert_array_equal(replies[0].payload, np.full(6, 3.0))
    init = Cluster(workers=2)
    init.send(Op.INIT, 0, 0, np.arange(6))
    init.send(Op.PUSH, 0, 1, np.ones(6))
    _, replies = init.send(Op.INIT, 0, 0, np.arange(6))  # the init resent after round 1 began
    assert replies[0].error is None
    _, replies = init.send(Op.INIT, 1, 0, np.full(6, 9.0))  # another rank's late init with a value
    assert replies[0].error is None and init.task.init_rank == 0  # ... answered, changing nothing
    assert not np.any(init.task.value == 9.0)


def test_waiting_is_bounded():
    from pslink.core.aggregator import core as aggregation

    c = Cluster(workers=1, needs_init=False)
    _, replies = c.send(Op.PULL, 0, 500)
    assert "more than 64 rounds after" in str(replies[0].error)
    c = Cluster(workers=1)
    c.task.before_init.extend([None] * (aggregation.MAX_BEFORE_INIT - 1))
    _, replies = c.send(Op.PULL, 0, 0)
    assert replies == []  # the last place in the queue
    _, replies = c.send(Op.PULL, 0, 0)
    assert "already wait for rank 0's init" in str(replies[0].error)


def test_stale_push_and_superseded_pull():
    c = Cluster(workers=1, needs_init=False)
    c.send(Op.PUSH, 0, 1, np.ones(6))
    c.send(Op.PUSH, 0, 2, np.ones(6))
    _, replies = c.send(Op.PUSH, 0, 2, np.ones(6))  # a closed round's push again: answered, not added
    assert replies[0].error is None and c.task.closed == 2
    _, replies = c.send(Op.PULL, 0, 2)
    np.testing.assert_array_equal(replies[0].payload, np.ones(6))
    _, replies = c.send(Op.PULL, 0, 1)
    assert "replaced it" in str(replies[0].error)


def test_admission_checks_credential_job_key_and_shape():
    c = Cluster(workers=2)
    with pytest.raises(AuthError, match="wrong credential for job 'j' from rank 1"):
        c.core.admit(c.header(Op.PUSH, 1, 1, tok=b"guess"))
    with pytest.raises(UnknownJobError, match="serves no job 'other'"):
        c.core.admit(c.header(Op.PUSH, 1, 1, job="other"))
    with pytest.raises(KeyStateError, match="does not hold part 0 of key 'v'"):
        c.core.admit(c.header(Op.PUSH, 1, 1, key="v"))
    with pytest.raises(ShapeMismatchError) as info:
        c.core.admit(c.header(Op.PUSH, 1, 1, shape=[7], span=[0, 7]))
    assert "rank 1 sent shape (7,) float32, but the key has shape (6,) float32 (declared by rank 0)" in str(info.value)
    assert info.value.details["shapes"] == [[7], [6]]


def test_abort_fails_every_waiter_and_every_later_request():
    c = Cluster(workers=2, needs_init=False)
    c.send(Op.PUSHPULL, 0, 1, np.ones(6))  # rank 0 waits for rank 1
    error = ShapeMismatchError("key 'w': rank 1 pushed shape (7,)")
    replies = c.core.abort(c.task, error)
    assert [r.origin for r in replies] == ["rank0"] and replies[0].error is error
    _, later = c.send(Op.PULL, 1, 0)
    assert later[0].error is error
    replies = c.core.abort_key("j", "w", AbortedError("again"))
    assert replies == []


def test_failed_rounds_fail_their_requests_and_the_key_goes_on():
    c = Cluster(workers=2, needs_init=False)
    c.send(Op.PUSHPULL, 0, 1, np.ones(6))  # rank 0 waits for rank 1, whose round-1 push was refused
    error = ShapeMismatchError("key 'w': rank 1 uses shape (7,)")
    replies = c.core.fail_rounds(c.task, error, 1)
    assert [r.origin for r in replies] == ["rank0"] and replies[0].error is error
    assert c.task.closed == 1 and c.task.poisoned is None and not c.task.rounds
    _, late = c.send(Op.PUSHPULL, 1, 1, np.ones(6))  # a late request of the failed round
    assert late[0].error is error
    c.send(Op.PUSHPULL, 0, 2, np.full(6, 2.0))
    _, closed = c.send(Op.PUSHPULL, 1, 2, np.full(6, 3.0))
    assert {r.origin for r in closed} == {"rank0", "rank1"} and all(r.error is None for r in closed)
    np.testing.assert_array_equal(c.task.value, np.full(6, 5.0))
    assert c.core.fail_rounds(c.task, error, 2) == []  # round 2 closed already: nothing waits on it


def test_a_key_aborted_before_its_assignment_never_completes_a_round_even_alone():
    """The flake of test_mxnet_errors' shape conflict: rank 0 declares a key whose Aggregator is
    still starting (assignment deferred); rank 1 declares it with another shape (pMaster aborts the
    key, but no Aggregator holds it yet) and leaves the job. The Aggregator then registers and is
    assigned the key with rank 0 the only member. The ABORT that used to follow the ASSIGN came on
    pMaster's connection, rank 0's init and push-pull on its own: when they came first, the round
    closed with rank 0 alone and rank 0 saw no error. The ASSIGN now carries the abort."""
    from pslink.core.master.records import KeySpec, PartSpec

    key = KeySpec("w", (6,), "float32", declared_by=0, needs_init=True, parts=[PartSpec(0, (0, 6), "agg-test")])
    key.aborted = ShapeMismatchError("key 'w' of job 'j': rank 1 uses shape (3, 2) float32, but rank 0 declared "
                                     "it as shape (6,) float32", job="j", key="w", shapes=[[3, 2], [6]], ranks=[1, 0])
    core = AggregatorCore("agg-test", summer=Summer(threads=1))
    alone = dict(jobinfo(workers=2), membership={"ranks": [0], "epoch": 1})  # rank 1 left
    (task,) = core.assign(alone, key.task_specs("agg-test"))
    c = Cluster.__new__(Cluster)  # the helpers, on this core and task
    c.core, c.task, c.ids = core, task, itertools.count(1)
    for op, rnd in ((Op.INIT, 0), (Op.PUSHPULL, 1)):
        _, (reply,) = c.send(op, 0, rnd, np.ones(6))
        assert isinstance(reply.error, ShapeMismatchError), op
        assert "(3, 2)" in reply.error.message and reply.error.details["ranks"] == [1, 0]
    assert task.closed == 0 and not task.rounds and core.set_job(alone) == []


def test_an_aborted_key_stays_failed_when_the_members_it_waits_for_leave():
    c = Cluster(workers=2, needs_init=False)
    c.send(Op.PUSHPULL, 0, 1, np.ones(6))  # rank 0 waits for rank 1
    # pMaster assigns the key again, aborted (after a restart, say): what waits fails.
    aborted = dict(spec(needs_init=False), aborted=["aborted", "key 'w' was aborted", {"key": "w"}])
    (task,) = c.core.assign(jobinfo(workers=2), [aborted])
    assert task is c.task and isinstance(task.poisoned, AbortedError)
    (failed,) = c.core.abort(task, task.poisoned)  # as the shell does for a poisoned task it is assigned
    assert failed.origin == "rank0" and isinstance(failed.error, AbortedError)
    # Even pushes the task still held (a copy of an open round) close nothing once rank 1 leaves.
    from pslink.core.aggregator.tasks import _Round

    round_ = c.task.rounds[1] = _Round(0.0)
    round_.contributors, round_.acc = {0}, np.ones(6, np.float32)
    assert c.core.set_job(dict(jobinfo(workers=2), membership={"ranks": [0], "epoch": 1})) == []
    assert c.task.closed == 0
    _, (reply,) = c.send(Op.PUSHPULL, 0, 2, np.ones(6))
    assert isinstance(reply.error, AbortedError)


def test_dropping_a_job_fails_what_waits():
    c = Cluster(workers=2)
    c.send(Op.PULL, 1, 0)  # waits for init
    replies = c.core.drop_job("j")
    assert isinstance(replies[0].error, ClosedError) and not c.core.tasks


def test_requests_of_a_vanished_peer_are_forgotten():
    c = Cluster(workers=2, needs_init=False)
    c.send(Op.PUSHPULL, 0, 1, np.ones(6), origin="gone")
    c.core.fail_origin("gone")
    _, replies = c.send(Op.PUSH, 1, 1, np.ones(6))
    assert [r.origin for r in replies] == ["rank1"]  # only the ack: nobody else to answer


def test_first_push_becomes_the_accumulator_without_a_copy():
    c = Cluster(workers=2, needs_init=False)
    request, _ = c.send(Op.PUSH, 0, 1, np.ones(6))
    first_buffer = request.payload
    _, replies = c.send(Op.PUSHPULL, 1, 1, np.full(6, 2.0))
    assert c.task.value is first_buffer
    np.testing.assert_array_equal(first_buffer, np.full(6, 3.0))


def test_buffer_pool_reuses_only_unreferenced_arrays():
    pool = BufferPool(np.dtype("float32"), 4, keep=2)
    a = pool.acquire()
    b = pool.acquire()
    assert a is not b
    view = memoryview(a)  # as a reply still queued on a socket would hold it
    del b
    c = pool.acquire()
    assert c is not a  # a is still referenced (by `a` and the view)
    del a, c
    d = pool.acquire()
    assert d is not view.obj  # the viewed array stays busy while the view lives
    del view, d
    assert pool.acquire() is pool._arrays[0]


def test_optimizer_mode_applies_sgd_to_the_averaged_gradient():
    c = Cluster(workers=2, mode="optimizer", optimizer={"type": "sgd", "lr": 0.5})
    w0 = np.arange(6, dtype=np.float32)
    c.send(Op.INIT, 0, 0, w0)
    c.send(Op.PUSHPULL, 0, 1, np.full(6, 1.0))
    _, replies = c.send(Op.PUSHPULL, 1, 1, np.full(6, 3.0))
    result = [r for r in replies if r.payload is not None][0]
    np.testing.assert_allclose(result.payload, w0 - 0.5 * 2.0)  # mean gradient 2


def test_optimizer_steps_a_copy_while_old_weights_are_still_being_sent():
    c = Cluster(workers=1, mode="optimizer", optimizer={"type": "sgd", "lr": 1.0})
    c.send(Op.INIT, 0, 0, np.zeros(6))
    _, replies = c.send(Op.PUSHPULL, 0, 1, np.ones(6))
    in_flight = replies[-1].payload  # a zero-copy send would still reference this array
    snapshot = in_flight.copy()
    c.send(Op.PUSHPULL, 0, 2, np.ones(6))
    np.testing.assert_array_equal(in_flight, snapshot)  # untouched
    np.testing.assert_array_equal(c.task.value, np.full(6, -2.0))


def test_an_optimizer_set_after_init_steps_the_rounds_after_the_switch_and_sums_the_ones_before():
    """MXNet's dist_sync: set_optimizer after init and pushes. The switch names, per key, the last
    round that stays a sum (the caller's pushes); a round of it still open when the switch
    arrives closes as a sum, and the next one steps the sum as weights."""
    c = Cluster(workers=2, mode="sum")
    c.send(Op.INIT, 0, 0, np.ones(6))
    c.send(Op.PUSH, 0, 1, np.full(6, 2.0))
    c.send(Op.PUSH, 1, 1, np.full(6, 3.0))  # round 1 closed: the value is its sum, 5
    c.send(Op.PUSH, 0, 2, np.full(6, 1.0))  # round 2 open: rank 0 pushed, then set the optimizer
    switch = dict(jobinfo(mode="optimizer", optimizer={"type": "sgd", "lr": 0.5}), sum_through=[["w", 2]])
    assert c.core.set_job(switch) == []
    _, replies = c.send(Op.PUSHPULL, 1, 2, np.full(6, 1.0))
    assert [r.payload for r in replies if r.payload is not None][0].tolist() == [2.0] * 6  # a sum, as before
    c.send(Op.PUSH, 0, 3, np.full(6, 1.0))
    _, replies = c.send(Op.PUSHPULL, 1, 3, np.full(6, 3.0))
    # Round 3 steps the weights (round 2's sum) with the mean gradient 2: 2 - 0.5 * 2.
    assert [r.payload for r in replies if r.payload is not None][0].tolist() == [1.0] * 6
    assert c.task.keeps_state


def test_a_job_with_checkpoints_writes_each_part_at_the_switch():
    """A part lost before its first checkpoint_every round after the switch restarts from the
    weights of the switch, not from nothing (a summing part writes no checkpoint)."""
    from pslink.core.aggregator.tasks import Checkpoint

    info = dict(jobinfo(workers=1), checkpoint="/unused", checkpoint_every=50)
    c = Cluster(workers=1)
    c.core = AggregatorCore("agg-test", summer=Summer(threads=1))
    c.task = c.core.assign(info, [spec()])[0]
    _, replies = c.send(Op.INIT, 0, 0, np.full(6, 2.0))
    assert not [r for r in replies if isinstance(r, Checkpoint)]
    c.send(Op.PUSH, 0, 1, np.full(6, 3.0))
    outputs = c.core.set_job(dict(info, mode="optimizer", optimizer={"type": "sgd", "lr": 1.0}, sum_through=[["w", 1]]))
    [written] = [o for o in outputs if isinstance(o, Checkpoint)]
    assert written.task is c.task and written.round == 1
    assert written.arrays[0].tolist() == [3.0] * 6


def test_a_key_the_caller_never_pushed_switches_at_once_and_multi_precision_starts_from_the_fp16_value():
    c = Cluster(workers=1, mode="sum", dtype="float16")
    c.send(Op.INIT, 0, 0, np.full(6, 1.5))
    c.core.set_job(dict(jobinfo(workers=1, mode="optimizer",
                                optimizer={"type": "sgd", "lr": 1.0, "multi_precision": True}), sum_through=[]))
    _, replies = c.send(Op.PUSHPULL, 0, 1, np.full(6, 0.25))
    result = [r.payload for r in replies if r.payload is not None][0]
    assert result.dtype == np.float16 and result.tolist() == [1.25] * 6
    assert c.task.opt_state["weight32"].dtype == np.float32  # the master copy, made from the sum-mode value


def test_the_switch_round_travels_with_a_part_to_the_aggregator_that_promotes_or_receives_it():
    info = dict(jobinfo(mode="optimizer", optimizer={"type": "sgd", "lr": 1.0}), sum_through=[["w", 4], [9, 1]])
    core = AggregatorCore("agg-b", summer=Summer(threads=1))
    core.assign(info, [spec()])
    job = core.jobs["j"]
    assert job.sum_through == {"w": 4, 9: 1}
    assert not job.optimizes("w", 4) and job.optimizes("w", 5) and job.optimizes("other", 1)


def test_optimizer_mode_without_an_optimizer_says_so():
    c = Cluster(workers=1, mode="optimizer", optimizer=None)
    c.send(Op.INIT, 0, 0, np.zeros(6))
    _, replies = c.send(Op.PUSH, 0, 1, np.ones(6))
    assert any("no optimizer set" in str(r.error) for r in replies)


def test_init_after_use_changes_nothing_but_repeated_init_before_use_wins():
    c = Cluster(workers=1)
    c.send(Op.INIT, 0, 0, np.zeros(6))
    c.send(Op.INIT, 0, 0, np.ones(6))
    np.testing.assert_array_equal(c.task.value, np.ones(6))
    c.send(Op.PUSH, 0, 1, np.ones(6))
    _, replies = c.send(Op.INIT, 0, 0, np.zeros(6))  # the initializer's init again: a resend, answered
    assert replies[0].error is None and c.task.closed == 1
    np.testing.assert_array_equal(c.task.value, np.ones(6))  # ... and nothing changed
    # Asynchronous rounds: rank 0 initialized, trained and left before rank 1 got to its init,
    # so rank 1 (now the lowest rank) sends a value too; the key keeps what the job made of it.
    other = Cluster(workers=2, sync="asp")
    other.send(Op.INIT, 0, 0, np.zeros(6))
    other.send(Op.PUSH, 0, 1, np.ones(6))
    trained = other.task.value.copy()
    _, replies = other.send(Op.INIT, 1, 0, np.full(6, 7.0))
    assert replies[0].error is None and replies[0].round == other.task.closed >= 1
    np.testing.assert_array_equal(other.task.value, trained)
    assert other.task.init_rank == 0


def test_threaded_summer_matches_numpy():
    summer = Summer(threads=3, threshold_bytes=1024)
    acc = np.arange(100_000, dtype=np.float64)
    other = np.ones(100_000)
    expected = acc + other
    summer.add(acc, other)
    np.testing.assert_array_equal(acc, expected)
    summer.close()


def test_stats_per_job():
    c = Cluster(workers=1, needs_init=False)
    for r in (1, 2, 3):
        c.send(Op.PUSH, 0, r, np.ones(6))
    assert c.core.stats() == {"j": {"tasks": 1, "bytes": 24, "task_rounds": 3, "round": 3, "pushed_bytes": 3 * 24,
                                    "pulled_bytes": 0}}


def test_asp_applies_each_push_at_once_and_pulls_never_wait():
    c = Cluster(workers=2, sync="asp")
    c.send(Op.INIT, 0, 0, np.zeros(6))
    _, replies = c.send(Op.PUSHPULL, 0, 1, np.ones(6))  # rank 1 has not pushed: no waiting
    np.testing.assert_array_equal(replies[0].payload, np.ones(6))
    c.send(Op.PUSH, 0, 2, np.ones(6))  # rank 0 runs ahead freely
    _, replies = c.send(Op.PUSHPULL, 1, 1, np.full(6, 10.0))
    np.testing.assert_array_equal(replies[0].payload, np.full(6, 12.0))
    _, replies = c.send(Op.PULL, 1, 0)
    assert replies[0].round == 3 and replies[0].n == 1


def test_asp_optimizer_steps_per_push_with_that_push_alone():
    c = Cluster(workers=2, mode="optimizer", optimizer={"type": "sgd", "lr": 0.5}, sync="asp")
    c.send(Op.INIT, 0, 0, np.zeros(6))
    c.send(Op.PUSH, 1, 1, np.full(6, 2.0))
    _, replies = c.send(Op.PUSHPULL, 0, 1, np.full(6, 4.0))
    np.testing.assert_array_equal(replies[0].payload, np.full(6, -3.0))  # -0.5*2 then -0.5*4


def test_asp_keeps_a_value_that_a_queued_reply_still_reads():
    c = Cluster(workers=1, sync="asp", needs_init=False)
    _, replies = c.send(Op.PUSHPULL, 0, 1, np.ones(6))
    in_flight = replies[0].payload
    c.send(Op.PUSH, 0, 2, np.ones(6))
    np.testing.assert_array_equal(in_flight, np.ones(6))  # not modified under the send
    np.testing.assert_array_equal(c.task.value, np.full(6, 2.0))


# -- live migration (AutoPS Appendix B) ------------------------------------------------------------

from pslink.core.aggregator.tasks import CopyOut, Follow, Reply, WorkerDone  # noqa: E402
from pslink.errors import MovedError  # noqa: E402

TARGET = ("agg-new", "tcp://127.0.0.1:9999")


def migrate(c: Cluster, force=False):
    """Start a migration on ``c``; returns the target core (its task is waiting for the copy)."""
    target = AggregatorCore("agg-new", summer=Summer(threads=1))
    t = c.task
    info = {"job": t.job.job, "token": TOKEN, "membership": t.job.membership.to_wire(), "mode": t.job.mode,
            "optimizer": t.job.optimizer.to_wire() if t.job.optimizer else None, "sync": t.job.sync}
    target.assign(info, [spec(key=t.key, shape=t.shape, needs_init=t.needs_init, incoming=True)])
    outputs = c.core.moves.begin_migration((t.job.job, t.key, t.part), TARGET, force=force)
    return target, outputs


def follow_through(source: AggregatorCore, target: AggregatorCore, outputs: list) -> list:
    """Deliver what goes to a move's follower, in order, as the shell does once the source is
    quiet (its seed taken then), and confirm it to the source; returns the other outputs."""
    rest = []
    for out in outputs:
        if not isinstance(out, Follow):
            rest.append(out)
            continue
        ident = (out.task.job.job, out.task.key, out.task.part)
        if out.kind == "seed":
            out = source.moves.seed(ident)
            if out is None:
                continue
        task = target.tasks[ident]
        arrays = [a.copy() for a in out.arrays]
        (target.moves.seeded if out.kind == "seed" else target.moves.follow)(task, out.state, arrays)
        source.moves.followed(ident, out.round, None)
    return rest


def copy(out: CopyOut, target: AggregatorCore) -> list:
    task = target.tasks[(out.task.job.job, out.task.key, out.task.part)]
    return target.moves.install(task, out.state, [a.copy() for a in out.arrays])


def send_to(core: AggregatorCore, c: Cluster, op, rank, rnd, value=None):
    header = c.header(op, rank, rnd)
    task = core.admit(header)
    payload = None
    if value is not None:
        payload = core.receive_buffer(task)
        payload[:] = value
    return core.handle(task, Request(f"rank{rank}", header["id"], op, rank, rnd, payload))


def test_bsp_migration_moves_at_the_round_close_and_loses_nothing():
    c = Cluster(workers=2, needs_init=False)
    c.send(Op.PUSHPULL, 0, 1, np.full(6, 1.0))
    target, outputs = migrate(c)
    assert outputs == []  # waits for round 1 to close
    c.send(Op.PUSH, 0, 2, np.full(6, 10.0))  # rank 0 runs a round ahead: travels in the copy
    _, outputs = c.send(Op.PUSHPULL, 1, 1, np.full(6, 2.0))
    replies = [o for o in outputs if isinstance(o, Reply)]
    results = [r for r in replies if r.payload is not None]
    assert {r.origin for r in results} == {"rank0", "rank1"}
    assert all(r.moved == TARGET for r in results)  # the pull tells the new place
    np.testing.assert_array_equal(results[0].payload, np.full(6, 3.0))
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert out.state["closed"] == 1 and out.state["open"] == [[2, [0]]]
    # after the move the old place only redirects (admission answers before any payload is read)
    with pytest.raises(MovedError) as moved:
        c.send(Op.PUSH, 1, 2, np.full(6, 20.0))
    assert moved.value.details["agg"] == "agg-new" and moved.value.details["address"] == TARGET[1]
    # at the new place: rank 1's push arrives before the copy and waits for it
    assert send_to(target, c, Op.PUSHPULL, 1, 2, np.full(6, 20.0)) == []
    installed = copy(out, target)
    result = [o for o in installed if isinstance(o, Reply) and o.payload is not None]
    np.testing.assert_array_equal(result[0].payload, np.full(6, 30.0))  # 10 (copied) + 20
    c.core.moves.copy_done((c.task.job.job, c.task.key, c.task.part))
    with pytest.raises(MovedError):  # a forwarding address stays behind
        c.core.admit(c.header(Op.PULL, 0, 2))
    done = send_to(target, c, Op.PULL, 0, 2)
    assert any(isinstance(o, WorkerDone) for o in done)  # both ranks have now reached it
    np.testing.assert_array_equal([o for o in done if isinstance(o, Reply)][0].payload, np.full(6, 30.0))


def test_optimizer_state_travels_with_the_weights():
    settings = {"type": "sgd", "lr": 0.1, "momentum": 0.9}
    moved = Cluster(workers=1, mode="optimizer", optimizer=settings)
    still = Cluster(workers=1, mode="optimizer", optimizer=settings)
    for c in (moved, still):
        c.send(Op.INIT, 0, 0, np.arange(6, dtype=np.float32))
        for r in (1, 2):
            c.send(Op.PUSHPULL, 0, r, np.full(6, float(r)))
    target, outputs = migrate(moved, force=True)  # an idle BSP task moves at once when forced
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    assert "opt:momentum_buffer" in out.state["arrays"]
    copy(out, target)
    for r in (3, 4):
        expected = still.send(Op.PUSHPULL, 0, r, np.full(6, float(r)))[1][-1].payload
        got = [o for o in send_to(target, moved, Op.PUSHPULL, 0, r, np.full(6, float(r))) if isinstance(o, Reply)]
        np.testing.assert_array_equal(got[0].payload, expected)


def test_asynchronous_tasks_move_at_once():
    c = Cluster(workers=2, sync="asp", needs_init=False)
    c.send(Op.PUSH, 0, 1, np.ones(6))
    target, outputs = migrate(c)
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    copy(out, target)
    got = send_to(target, c, Op.PUSHPULL, 1, 1, np.full(6, 2.0))
    np.testing.assert_array_equal([o for o in got if isinstance(o, Reply)][0].payload, np.full(6, 3.0))


def test_an_uninitialized_task_moves_and_its_waiters_are_redirected():
    c = Cluster(workers=2)
    c.send(Op.PULL, 1, 0)  # waits for rank 0's init
    target, outputs = migrate(c)
    redirected = [o for o in outputs if isinstance(o, Reply)]
    assert isinstance(redirected[0].error, MovedError)
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    copy(out, target)
    assert send_to(target, c, Op.PULL, 1, 0) == []  # still waits, now for the init there
    got = send_to(target, c, Op.INIT, 0, 0, np.arange(6))
    assert [o.origin for o in got if isinstance(o, Reply)] == ["rank0", "rank1"]


def test_an_aborted_task_stays_aborted_where_it_moves():
    from pslink.errors import ShapeMismatchError

    c = Cluster(workers=2, needs_init=False)
    c.core.abort(c.task, ShapeMismatchError("key 'w': rank 1 uses shape (5,)", key="w", ranks=[1]))
    target, outputs = migrate(c, force=True)
    (out,) = [o for o in outputs if isinstance(o, CopyOut)]
    copy(out, target)
    (reply,) = send_to(target, c, Op.PUSHPULL, 0, 1, np.ones(6))
    assert isinstance(reply.error, ShapeMismatchError) and "(5,)" in reply.error.message
    assert reply.error.details["ranks"] == [1]


def test_a_replica_of_an_aborted_key_is_promoted_aborted():
    """The key was aborted while this Aggregator held only a replica of a part (gap: aborts
    reached the parts' Aggregators, not their replicas' holders): promoted after the primary
    failed, the part refuses requests with the key's error instead of serving it afresh."""
    from pslink.errors import ShapeMismatchError

    core = AggregatorCore("agg-replica", summer=Summer(threads=1))
    core.assign(jobinfo(workers=2), [dict(spec(needs_init=False), replica=True)])
    assert core.abort_key("j", "w", ShapeMismatchError("key 'w': rank 1 uses shape (5,)", key="w")) == []
    core.moves.promote(("j", "w", 0), [])
    task = core.tasks[("j", "w", 0)]
    (reply,) = core.handle(task, Request("rank0", 1, Op.PUSHPULL, 0, 1, np.ones(6, np.float32)))
    assert isinstance(reply.error, ShapeMismatchError) and "(5,)" in reply.error.message


def test_moving_twice_or_unknown_tasks():
    c = Cluster(workers=1, needs_init=False)
    target, outputs = migrate(c, force=True)
    assert c.core.moves.begin_migration((c.task.job.job, c.task.key, 0), TARGET) == []  # already moving
    with pytest.raises(KeyStateError, match="does not hold"):
        c.core.moves.begin_migration(("j", "nope", 0), TARGET)



def test_the_source_of_a_move_whose_target_is_gone_keeps_the_part_only_if_it_never_handed_it_over():
    """pMaster's PROMOTE to the source of a move onto a lost Aggregator: a source still serving
    the part (its round had not closed) calls the move off; one that froze the part for its copy
    refuses (the target may have answered rounds since: a replica is promoted instead)."""
    c = Cluster(workers=2, needs_init=False)
    ident = (c.task.job.job, c.task.key, c.task.part)
    c.send(Op.PUSHPULL, 0, 1, np.full(6, 1.0))
    migrate(c)
    assert c.core.moves.promote(ident, []) == []  # the move is off
    _, outputs = c.send(Op.PUSHPULL, 1, 1, np.full(6, 2.0))
    assert not any(isinstance(o, CopyOut) for o in outputs)
    results = [o for o in outputs if isinstance(o, Reply) and o.payload is not None]
    assert len(results) == 2 and all(r.moved is None for r in results)  # nobody is sent away
    np.testing.assert_array_equal(results[0].payload, np.full(6, 3.0))
    migrate(c, force=True)  # frozen for its copy at once
    with pytest.raises(KeyStateError, match="handed over to agg-new"):
        c.core.moves.promote(ident, [])


# -- the source of a move dies before its copy lands -------------------------------------------------

REPLICA = ("agg-r", "tcp://127.0.0.1:9998")


def replicated_source(optimizer):
    """A source (its part replicated to a second core) and that replica's core."""
    c = Cluster(workers=2, mode="optimizer", optimizer=optimizer)
    replica = AggregatorCore("agg-r", summer=Summer(threads=1))
    t = c.task
    info = {"job": t.job.job, "token": TOKEN, "membership": t.job.membership.to_wire(), "mode": "optimizer",
            "optimizer": t.job.optimizer.to_wire(), "sync": "bsp"}
    replica.assign(info, [dict(spec(), replica=True)])
    c.task.replicas = [REPLICA]
    return c, replica


def init_replicated(c: Cluster, replica: AggregatorCore, value) -> list:
    """Rank 0 initializes the part; round 0 reaches the replica before the init is answered."""
    _, outputs = c.send(Op.INIT, 0, 0, value)
    from pslink.core.aggregator.tasks import Replicate

    (rep,) = [o for o in outputs if isinstance(o, Replicate)]
    assert rep.round == 0 and not [o for o in outputs if not isinstance(o, Replicate)]  # not answered yet
    replica.moves.replica_update({"job": c.task.job.job, "key": c.task.key, "part": c.task.part}, rep.state,
                                 [a.copy() for a in rep.arrays])
    replies = c.core.moves.replicated((c.task.job.job, c.task.key, c.task.part), 0)
    assert [(r.round, r.error) for r in replies] == [(0, None)]  # now it is
    return replies


def close_round(c: Cluster, replica: AggregatorCore, r: int, pushes) -> list:
    """Both ranks push-pull round ``r``; the round reaches the replica before any answer."""
    outputs = []
    for rank in (0, 1):
        outputs += c.send(Op.PUSHPULL, rank, r, pushes[rank])[1]
    from pslink.core.aggregator.tasks import Replicate

    (rep,) = [o for o in outputs if isinstance(o, Replicate)]
    header = {"job": c.task.job.job, "key": c.task.key, "part": c.task.part}
    replica.moves.replica_update(header, rep.state, [a.copy() for a in rep.arrays])
    ident = (c.task.job.job, c.task.key, c.task.part)
    return [o for o in outputs if not isinstance(o, Replicate)] + c.core.moves.replicated(ident, rep.round)


def test_a_replica_sends_the_copy_when_the_source_died_after_handing_the_part_over():
    """The source froze the part for its copy (the workers were told the new place) and died:
    the target holds their requests; the replica's state, which has every round the source
    answered, is the copy, and the job goes on as if nothing happened."""
    settings = {"type": "sgd", "lr": 0.1, "momentum": 0.9}
    still = Cluster(workers=2, mode="optimizer", optimizer=settings)
    c, replica = replicated_source(settings)
    ident = (c.task.job.job, c.task.key, c.task.part)
    pushes = {r: [np.full(6, float(r * 10 + rank)) for rank in (0, 1)] for r in (1, 2, 3)}
    still.send(Op.INIT, 0, 0, np.arange(6, dtype=np.float32))
    init_replicated(c, replica, np.arange(6, dtype=np.float32))
    for r in (1, 2):
        for rank in (0, 1):
            still.send(Op.PUSHPULL, rank, r, pushes[r][rank])
    close_round(c, replica, 1, pushes[1])
    target, outputs = migrate(c)
    assert outputs == []  # the move waits for round 2 to close
    outputs = close_round(c, replica, 2, pushes[2])
    assert [o for o in outputs if isinstance(o, CopyOut)]  # handed over: the copy is never sent
    assert all(o.moved == TARGET for o in outputs if isinstance(o, Reply) and o.payload is not None)
    assert send_to(target, c, Op.PUSHPULL, 0, 3, pushes[3][0]) == []  # waits at the target
    out = replica.moves.replica_copy(ident, TARGET)
    assert out.from_replica and out.target == TARGET and out.state["closed"] == 2
    copy(out, target)
    got = [o for o in send_to(target, c, Op.PUSHPULL, 1, 3, pushes[3][1]) if isinstance(o, Reply)]
    expected = [o for rank in (0, 1) for o in still.send(Op.PUSHPULL, rank, 3, pushes[3][rank])[1]][-1].payload
    assert {o.origin for o in got} == {"rank0", "rank1"}
    for reply in got:
        np.testing.assert_array_equal(reply.payload, expected)
    assert ident in replica.replicas  # it stays a replica (the target replicates to it from now on)


def test_a_target_that_holds_the_replica_serves_from_it_and_a_landed_copy_wins():
    settings = {"type": "sgd", "lr": 0.1}
    c, replica = replicated_source(settings)
    ident = (c.task.job.job, c.task.key, c.task.part)
    init_replicated(c, replica, np.zeros(6, dtype=np.float32))
    close_round(c, replica, 1, [np.ones(6), np.ones(6)])
    t = c.task
    info = {"job": t.job.job, "token": TOKEN, "membership": t.job.membership.to_wire(), "mode": "optimizer",
            "optimizer": t.job.optimizer.to_wire(), "sync": "bsp"}
    replica.assign(info, [spec(incoming=True)])  # the move's target is the replica holder
    assert send_to(replica, c, Op.PULL, 0, 1) == []  # waits for the copy
    (answer,) = replica.moves.install_replica(ident)
    np.testing.assert_array_equal(answer.payload, np.full(6, -0.1, np.float32))  # round 1: -0.1 * mean(1, 1)
    assert ident not in replica.replicas and not replica.tasks[ident].incoming
    assert replica.moves.install_replica(ident) == []  # asked again, or the source's copy landed first


def test_a_replica_without_state_refuses_to_send_a_copy():
    _, replica = replicated_source({"type": "sgd", "lr": 0.1})
    with pytest.raises(KeyStateError, match="holds no replicated state"):
        replica.moves.replica_copy(("j", "w", 0), TARGET)  # no round reached it yet
    with pytest.raises(KeyStateError, match="holds no replicated state"):
        replica.moves.replica_copy(("j", "other", 0), TARGET)


def test_an_abort_fails_the_requests_that_wait_for_a_copy():
    """pMaster aborts a key whose copy will never come (its source died, no replica): what waits
    at the target is answered with the error, not left hanging."""
    c = Cluster(workers=2, needs_init=False)
    target, _ = migrate(c)
    assert send_to(target, c, Op.PUSHPULL, 0, 1, np.ones(6)) == []
    (reply,) = target.abort_key("j", "w", KeyStateError("key 'w' part 0 of job 'j': aggregator agg-test is gone"))
    assert reply.origin == "rank0" and "agg-test is gone" in reply.error.message
    assert target.tasks[("j", "w", 0)].waiting_copy == []


def test_a_round_is_averaged_once_for_every_worker_that_asks():
    c = Cluster(workers=2, needs_init=False)

    def send(rank, op, value=None, average=True):
        header = c.header(op, rank, 1)
        task = c.core.admit(header)
        payload = None
        if value is not None:
            payload = c.core.receive_buffer(task)
            payload[:] = value
        return c.core.handle(task, Request(f"rank{rank}", header["id"], op, rank, 1, payload, average=average))

    assert send(0, Op.PUSHPULL, np.full(6, 1.0)) == []
    replies = send(1, Op.PUSHPULL, np.full(6, 4.0))
    results = [r for r in replies if r.payload is not None]
    assert len(results) == 2 and all(r.averaged and r.n == 2 for r in results)
    assert results[0].payload is results[1].payload  # divided once, for both
    np.testing.assert_array_equal(results[0].payload, np.full(6, 2.5))
    np.testing.assert_array_equal(c.task.value, np.full(6, 5.0))  # the round's sum stays the sum
    (plain,) = send(0, Op.PULL, average=False)
    assert not plain.averaged and plain.payload is c.task.value
    # asynchronous rounds: the Agent divides by the n it is told, as before
    asp = Cluster(workers=2, sync="asp", needs_init=False)
    header = asp.header(Op.PUSHPULL, 0, 1)
    task = asp.core.admit(header)
    buffer = asp.core.receive_buffer(task)
    buffer[:] = 3.0
    replies = asp.core.handle(task, Request("rank0", header["id"], Op.PUSHPULL, 0, 1, buffer, average=True))
    assert replies and not any(r.averaged for r in replies)


def test_only_a_push_into_a_round_that_has_a_sum_may_be_read_where_it_arrived():
    # What the shell asks before it adds a push straight from a sender's shared-memory ring:
    # the payload is only read during handle(), then its bytes are the sender's again.
    c = Cluster(workers=3, shape=(8,), needs_init=False)
    task, core = c.task, c.core
    assert not core.adds_in_place(task, Op.PUSHPULL, 0, 1)  # the first push becomes the sum: kept
    c.send(Op.PUSHPULL, 0, 1, np.full(8, 1.0))
    assert core.adds_in_place(task, Op.PUSHPULL, 1, 1) and core.adds_in_place(task, Op.PUSH, 2, 1)
    assert not core.adds_in_place(task, Op.PUSHPULL, 0, 1)  # a repeat is not added again
    assert not core.adds_in_place(task, Op.PULL, 1, 1) and not core.adds_in_place(task, Op.INIT, 1, 1)
    assert not core.adds_in_place(task, Op.PUSHPULL, 1, 2)  # round 2 has no sum yet
    lent = np.full(8, 2.0, np.float32)
    request, _ = c.send_payload(Op.PUSHPULL, 1, 1, lent)
    lent[:] = -100.0  # the sender reuses its ring space once handle() returned
    _, replies = c.send(Op.PUSHPULL, 2, 1, np.full(8, 4.0))
    results = [r for r in replies if r.payload is not None]
    assert len(results) == 3
    for reply in results:
        np.testing.assert_array_equal(reply.payload, np.full(8, 7.0, np.float32))
    assert not core.adds_in_place(task, Op.PUSHPULL, 1, 1)  # closed
    asp = Cluster(workers=2, sync="asp", shape=(8,), needs_init=False)
    asp.send(Op.PUSH, 0, 1, np.ones(8))
    assert not asp.core.adds_in_place(asp.task, Op.PUSH, 1, 1)  # each push is applied alone


def test_an_optimizer_that_needs_whole_keys_refuses_a_part_of_one_by_name():
    lamb = {"type": "lamb", "lr": 0.01, "average": False}
    whole = Cluster(mode="optimizer", optimizer=lamb, shape=(6,))
    assert whole.task.poisoned is None
    part = Cluster(mode="optimizer", optimizer=lamb, shape=(6,), span=(0, 3))
    _, replies = part.send(Op.INIT, 0, value=np.ones(3, np.float32))
    assert "needs the whole key at once" in replies[0].error.message and "partition_bytes" in replies[0].error.message
    # A job that switches to it later poisons its split parts then.
    later = Cluster(mode="optimizer", optimizer={"type": "sgd", "lr": 0.1}, shape=(6,), span=(3, 6))
    later.core.set_job(jobinfo(mode="optimizer", optimizer=lamb))
    assert "needs the whole key" in later.task.poisoned.message


def test_a_replica_under_a_known_name_at_a_new_address_gets_the_state_at_once():
    """After pMaster restarts, a new Aggregator may carry the name of one lost before: the
    part's replica list names it as before, at another address. Before the fix only new names
    counted, nothing was sent, and that replica had no state when it was promoted (the chaos
    run with pMaster killed at named points lost keys so)."""
    settings = {"type": "sgd", "lr": 0.1}
    c, replica = replicated_source(settings)
    init_replicated(c, replica, np.arange(6, dtype=np.float32))
    close_round(c, replica, 1, [np.ones(6), np.full(6, 3.0)])
    t = c.task
    info = {"job": t.job.job, "token": TOKEN, "membership": t.job.membership.to_wire(), "mode": "optimizer",
            "optimizer": t.job.optimizer.to_wire(), "sync": "bsp"}
    (name, address), = t.replicas
    (task,) = c.core.assign(info, [dict(spec(), replicas=[[name, address]])])
    assert c.core.moves.catch_up(task) == []  # the same replica: it has every round
    (task,) = c.core.assign(info, [dict(spec(), replicas=[[name, "tcp://127.0.0.1:9996"]])])
    (rep,) = c.core.moves.catch_up(task)
    assert rep.round == 1


def test_a_replica_that_joins_a_part_gets_its_last_closed_round_at_once():
    """Gap (issue 23): a replica pMaster gave a part (its old one was lost) had no state until the
    next round closed; had the part's Aggregator died before that, the part had no replica with
    its state. Before the fix the ASSIGN that names the new replica sent nothing."""
    settings = {"type": "sgd", "lr": 0.1, "momentum": 0.9}
    c, replica = replicated_source(settings)
    ident = (c.task.job.job, c.task.key, c.task.part)
    init_replicated(c, replica, np.arange(6, dtype=np.float32))
    close_round(c, replica, 1, [np.ones(6), np.full(6, 3.0)])
    t = c.task
    info = {"job": t.job.job, "token": TOKEN, "membership": t.job.membership.to_wire(), "mode": "optimizer",
            "optimizer": t.job.optimizer.to_wire(), "sync": "bsp"}
    newcomer = AggregatorCore("agg-n", summer=Summer(threads=1))
    newcomer.assign(info, [dict(spec(), replica=True)])
    # The replica is lost; pMaster names the newcomer the part's replica (ASSIGN with replicas).
    (task,) = c.core.assign(info, [dict(spec(), replicas=[["agg-n", "tcp://127.0.0.1:9997"]])])
    from pslink.core.aggregator.tasks import Replicate

    (rep,) = c.core.moves.catch_up(task)
    assert isinstance(rep, Replicate) and rep.round == 1 and c.core.moves.catch_up(task) == []  # once
    header = {"job": t.job.job, "key": t.key, "part": t.part}
    newcomer.moves.replica_update(header, rep.state, [a.copy() for a in rep.arrays])
    assert c.core.moves.replicated(ident, 1) == []  # round 1 was answered already: nothing waited
    # The part's Aggregator dies before round 2: the newcomer serves it from round 1.
    assert newcomer.moves.promote(ident, []) == []
    promoted = newcomer.tasks[ident]
    assert promoted.closed == 1
    np.testing.assert_array_equal(promoted.value, c.task.value)
    assert promoted.opt_state.keys() == c.task.opt_state.keys() and c.task.opt_state  # momentum too
    for name, value in c.task.opt_state.items():
        np.testing.assert_array_equal(promoted.opt_state[name], value)


def test_a_replica_promoted_with_no_state_fails_the_rounds_past_init_instead_of_waiting_for_ever():
    """Found by the chaos run in CI: a replica that never received a round was promoted when the
    part's Aggregator died; the workers' round 1001 waited for an init that would never come (the
    job hung until its timeout, the Aggregator saying nobody had pushed). Now such a round fails
    at once, naming the loss; an init (the part died before its first one) is still served."""
    c, replica = replicated_source({"type": "sgd", "lr": 0.1})
    ident = (c.task.job.job, c.task.key, c.task.part)
    assert replica.moves.promote(ident, []) == []  # nothing had reached the replica
    blank = Cluster.__new__(Cluster)
    blank.core, blank.task, blank.ids = replica, replica.tasks[ident], itertools.count(1)
    waiting, replies = blank.send(Op.PULL, 0, 1001)  # rank 0's pull waits no longer than rank 1's push
    assert replies and replies[0].error is not None and "state is lost" in replies[0].error.message
    _, replies = blank.send(Op.PUSHPULL, 1, 1001, np.ones(6))
    assert isinstance(replies[0].error, KeyStateError) and "agg-r" in replies[0].error.message
    # Had the part died before its init, the init sets the value as on any new part.
    _, early = replicated_source({"type": "sgd", "lr": 0.1})
    early.moves.promote(ident, [])
    first = Cluster.__new__(Cluster)
    first.core, first.task, first.ids = early, early.tasks[ident], itertools.count(1)
    _, replies = first.send(Op.INIT, 0, 0, np.arange(6, dtype=np.float32))
    assert replies[0].error is None and first.task.initialized
    _, replies = first.send(Op.PUSHPULL, 0, 1, np.ones(6))
    assert replies == []  # waits for rank 1, as any round does


def test_a_replica_that_joins_while_a_round_is_on_its_way_gets_the_state_after_its_ack():
    c, replica = replicated_source({"type": "sgd", "lr": 0.1})
    ident = (c.task.job.job, c.task.key, c.task.part)
    init_replicated(c, replica, np.zeros(6, dtype=np.float32))
    from pslink.core.aggregator.tasks import Replicate

    outputs = [o for rank in (0, 1) for o in c.send(Op.PUSHPULL, rank, 1, np.ones(6))[1]]
    (first,) = [o for o in outputs if isinstance(o, Replicate)]  # on its way to the old replica
    t = c.task
    info = {"job": t.job.job, "token": TOKEN, "membership": t.job.membership.to_wire(), "mode": "optimizer",
            "optimizer": t.job.optimizer.to_wire(), "sync": "bsp"}
    (task,) = c.core.assign(info, [dict(spec(), replicas=[list(REPLICA), ["agg-n", "tcp://127.0.0.1:9997"]])])
    assert c.core.moves.catch_up(task) == []  # a round is on its way: after its ack
    after = c.core.moves.replicated(ident, first.round)
    (again,) = [o for o in after if isinstance(o, Replicate)]
    assert again.round == 1 and [o for o in after if isinstance(o, Reply) and o.payload is not None]
