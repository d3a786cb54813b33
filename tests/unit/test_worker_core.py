"""The worker layer's pure pieces (no service): keys, roots, Horovod's reductions and scale
rules, the board's verdicts (checks at the call, join), operations in flight, and the one list of
Horovod's names every adapter is held to."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading

import numpy as np
import pytest

from pslink.core.worker import board as boards
from pslink.core.worker import collectives, horovod, reduction
from pslink.core.worker.board import Board, Call
from pslink.core.worker.collectives import MAX_KEY_LENGTH, Zeros, service_key
from pslink.core.worker.horovod import HOROVOD_GAPS, HOROVOD_MODULE_NAMES, HOROVOD_NAMES
from pslink.core.worker.pending import Pending, PendingGroup, Progress
from pslink.core.worker.session import Session, board_batch
from pslink.errors import ConfigError, MismatchError, PslinkError, ShapeMismatchError

# -- keys and roots --------------------------------------------------------------------------------


def test_keys_join_their_parts_and_stay_within_the_service_limit():
    assert service_key("allreduce", "w") == "allreduce/w"
    long = service_key("grad", "x" * 400)
    assert len(long) == MAX_KEY_LENGTH and long.startswith("grad/xxx")
    assert service_key("grad", "x" * 400) == long  # the same on every rank
    assert service_key("grad", "x" * 401) != long  # and distinct for distinct names


@pytest.mark.parametrize("root", [-1, 3, True, 1.0, "0", None])
def test_a_root_outside_the_job_is_refused_naming_the_call(root):
    with pytest.raises(ConfigError, match=r"broadcast_object: root_rank must be an int in \[0, 3\)"):
        collectives.check_root(root, 3, "broadcast_object")
    assert collectives.check_root(np.int64(2), 3, "x") == 2


def test_non_roots_push_read_only_zeros_cut_from_one_buffer():
    zeros = Zeros()
    a, b = zeros.like(np.ones((2, 3), np.float32)), zeros.like(np.ones(4, np.float32))
    assert a.shape == (2, 3) and not a.any() and not a.flags.writeable
    assert np.shares_memory(a, b)  # one buffer per dtype, not one per tensor


def test_bits_are_views_so_negative_zero_and_nan_payloads_survive_a_sum_with_zeros():
    row = np.array([-0.0, np.float32(np.nan), 1.5], np.float32)
    row.view(np.int32)[1] |= 0x7  # a NaN with a payload
    bits = collectives.bits_of(row)
    assert bits.dtype == np.int32 and np.shares_memory(bits, row)
    assert (bits + np.zeros_like(bits)).tobytes() == row.tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        collectives.bits_of(np.zeros((4, 4), np.float32)[:, 1])


def test_alltoall_splits_and_pieces():
    assert collectives.alltoall_splits("a", 6, 3, None) == [2, 2, 2]
    with pytest.raises(ConfigError, match="do not split evenly over 4 ranks"):
        collectives.alltoall_splits("a", 6, 4, None)
    with pytest.raises(ConfigError, match=r"splits \[1, 1\] must be 3 counts"):
        collectives.alltoall_splits("a", 6, 3, [1, 1])
    # rank 1's pieces when rank 0 sends [1, 2] and rank 1 sends [0, 3]: 2 rows of rank 0's, 3 of its own
    assert collectives.alltoall_pieces([[1, 2], [0, 3]], 1) == [(1, 2), (3, 3)]
    assert collectives.scatter_share(5, 3, 0) == (0, 2) and collectives.scatter_share(5, 3, 2) == (4, 1)


# -- reductions and scale factors -------------------------------------------------------------------


def test_reduce_op_follows_horovods_rules():
    assert reduction.reduce_op(None) is reduction.Average
    assert reduction.reduce_op(None, average=True) is reduction.Average
    assert reduction.reduce_op(None, average=False) is reduction.Sum
    assert reduction.reduce_op(reduction.Adasum) is reduction.Adasum
    with pytest.raises(ConfigError, match="not both"):
        reduction.reduce_op(reduction.Sum, average=True)
    with pytest.raises(ConfigError, match="got 'max'"):
        reduction.reduce_op("max")


def test_scale_factors_follow_horovods_cpu_rules_per_dtype():
    # integers: in float64, truncated toward zero, the dtype kept
    assert reduction.scale(np.array([7, -7, 3], np.int32), 0.5).tolist() == [3, -3, 1]
    # float16: float32 math, one rounding back (the factor is not rounded to half first)
    half = np.array([1.0, 3.0], np.float16)
    factor = 0.3333333
    expected = (half.astype(np.float32) * np.float32(factor)).astype(np.float16)
    assert reduction.scale(half.copy(), factor).tobytes() == expected.tobytes()
    # float32: the factor in float32
    single = np.array([1.0, 2.0], np.float32)
    assert reduction.scale(single.copy(), 0.1).tobytes() == (single * np.float32(0.1)).tobytes()
    out = np.empty(2, np.float32)
    assert reduction.scale(single, 2.0, out) is out and out.tolist() == [2.0, 4.0] and single.tolist() == [1, 2]


def test_integer_averages_truncate_and_floats_average_on_the_service():
    assert reduction.service_averages(reduction.Average, np.dtype(np.float32))
    assert not reduction.service_averages(reduction.Average, np.dtype(np.int64))
    assert not reduction.service_averages(reduction.Sum, np.dtype(np.float32))
    summed = np.array([9, -9, 15], np.int32)  # 3 + 6, -3 - 6, 5 + 10 over 2 ranks
    assert reduction.finish_average(summed, 2, 1.0, averaged=False).tolist() == [4, -4, 7]


def test_gathered_reductions_reduce_rows_in_rank_order():
    rows = np.array([[1, 6, 3], [4, 2, 5]], np.int64)
    assert reduction.reduce_rows(rows, reduction.Min).tolist() == [1, 2, 3]
    assert reduction.reduce_rows(rows, reduction.Max).tolist() == [4, 6, 5]
    assert reduction.reduce_rows(rows, reduction.Product).tolist() == [4, 12, 15]
    assert reduction.reduce_rows(rows, reduction.Band).tolist() == [0, 2, 1]
    assert reduction.reduce_rows(rows, reduction.Bxor).tolist() == [5, 4, 6]
    with pytest.raises(ConfigError, match="integer"):
        reduction.reduce_rows(rows.astype(np.float32), reduction.Bor)


def test_adasum_adds_orthogonal_gradients_and_averages_parallel_ones():
    orthogonal = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    assert reduction.adasum(orthogonal).tolist() == [1.0, 2.0]
    parallel = np.array([[2.0, 2.0], [2.0, 2.0]], np.float64)
    assert reduction.adasum(parallel).tolist() == [2.0, 2.0]
    # four ranks: pairs first, then the pairs' results (Horovod's tree)
    four = np.array([[1, 0], [0, 1], [1, 0], [0, 1]], np.float64)
    assert reduction.adasum(four).tolist() == [1.0, 1.0]
    with pytest.raises(ConfigError, match="floating-point"):
        reduction.adasum(np.ones((2, 2), np.int32))


# -- the board ------------------------------------------------------------------------------------------


def test_a_call_survives_its_row():
    call = Call(boards.ALLREDUCE, "layer/w" * 10, "float16", (3, 4, 5), "sum", -1, 0.25, 4.0)
    assert boards.decode(boards.encode(call, joined_at=7)) == (call, 7)
    assert boards.decode(boards.encode(None)) == (None, 0)
    with pytest.raises(ValueError, match="at most 256 bytes"):
        boards.encode(Call(boards.ALLREDUCE, "x" * 300))


def _round(*rows) -> np.ndarray:
    """A board round's sum: each rank's row (a Call, or (Call or None, joined_at))."""
    out = np.zeros((len(rows), boards.WIDTH), np.int64)
    for rank, row in enumerate(rows):
        call, joined = row if isinstance(row, tuple) else (row, 0)
        out[rank] = boards.encode(call, joined)
    return out


def _allreduce(name="x", dtype="float32", shape=(3,), op="average", **other) -> Call:
    return Call(boards.ALLREDUCE, name, dtype, shape, op, **other)


def test_calls_that_agree_are_decided_quietly_whatever_the_order():
    board = Board(rank=0, size=2)
    decided, done = board.read(_round(_allreduce("a"), _allreduce("b")))
    assert decided == [] and done is None  # each name has one rank's call so far
    decided, _ = board.read(_round(_allreduce("b"), _allreduce("a")))
    assert sorted(v.name for v in decided) == ["a", "b"] and not any(v.error for v in decided)


def test_another_dtype_or_shape_is_a_shape_mismatch_anything_else_a_mismatch_on_every_rank():
    verdicts = []
    for rank in (0, 1):
        board = Board(rank, 2)
        decided, _ = board.read(_round(_allreduce(dtype="int32"), _allreduce(dtype="float32")))
        verdicts.append(decided[0].error)
    assert all(isinstance(e, ShapeMismatchError) for e in verdicts)
    assert str(verdicts[0]) == str(verdicts[1])  # the same words on every rank
    assert "rank 0: allreduce (3,) int32 op=average; rank 1: allreduce (3,) float32" in str(verdicts[0])
    root = Board(0, 2).read(_round(Call(boards.BROADCAST, "b", "float32", (3,), "", 0),
                                   Call(boards.BROADCAST, "b", "float32", (3,), "", 1)))[0][0].error
    assert isinstance(root, MismatchError) and not isinstance(root, ShapeMismatchError)
    assert "root_rank=0" in str(root) and "root_rank=1" in str(root)
    scaled = Board(0, 2).read(_round(_allreduce(prescale=2.0), _allreduce()))[0][0].error
    assert isinstance(scaled, MismatchError) and "prescale_factor=2" in str(scaled)


def test_a_joined_rank_mirrors_summed_allreduces_and_the_others_fail_what_join_cannot_run():
    joined, calling = Board(0, 2), Board(1, 2)
    for board in (joined, calling):
        board.read(_round((None, 1), None))  # rank 0 joins in round 1
    rows = _round((None, 1), _allreduce("s"))
    (mine,), _ = joined.read(rows)
    (theirs,), _ = calling.read(rows)
    assert mine.mirror and mine.error is None and mine.absent == (0,)
    assert not theirs.mirror and theirs.error is None
    rows = _round((None, 1), Call(boards.ALLGATHER, "g", "float32", (2,)))
    (mine,), _ = joined.read(rows)
    (theirs,), _ = calling.read(rows)
    assert mine.mirror  # it takes part (its row says it joined), so the key's rounds stay paired
    assert isinstance(theirs.error, MismatchError) and "rank(s) [0] have joined" in str(theirs.error)


def test_join_ends_on_every_rank_in_one_round_naming_the_last_to_join():
    boards_ = [Board(r, 3) for r in range(3)]
    rounds = [_round((None, 1), None, None), _round((None, 1), (None, 2), None),
              _round((None, 1), (None, 2), (None, 3))]
    ends = [[b.read(r)[1] for r in rounds] for b in boards_]
    for seen in ends:
        assert seen[:2] == [None, None] and seen[2].last == 2
    ties = Board(0, 2)
    assert ties.read(_round((None, 4), (None, 4)))[1].last == 1  # joined together: the highest


def _batch_round(*ranks) -> np.ndarray:
    """A board round's sum as Sessions send it: per rank, a list of its calls (its rows)."""
    out = np.zeros((len(ranks), board_batch(len(ranks)), boards.WIDTH), np.int64)
    for rank, calls in enumerate(ranks):
        for slot, call in enumerate(calls):
            out[rank, slot] = boards.encode(call)
    return out


def test_rounds_pair_whatever_calls_each_rank_put_in_them():
    # rank 0 sent its three calls in one round (a wait dragged on); rank 1 sent one, then two
    board = Board(0, 2)
    decided, _ = board.read(_batch_round([_allreduce("a"), _allreduce("b"), _allreduce("a")], [_allreduce("a")]))
    assert [(v.name, v.occurrence) for v in decided] == [("a", 1)]
    decided, _ = board.read(_batch_round([], [_allreduce("b"), _allreduce("a", dtype="int32")]))
    assert [(v.name, v.occurrence, type(v.error)) for v in decided] == [("b", 1, type(None)),
                                                                          ("a", 2, ShapeMismatchError)]


def test_a_joining_rank_mirrors_at_once_what_waits_only_for_it_as_every_rank_decides_later():
    step = Call(boards.STEP, "optimizer.0")
    rows = _batch_round([step], [])  # rank 0 stepped a round ahead of rank 1, which then joins
    joining, stepping = Board(1, 2), Board(0, 2)
    assert joining.read(rows) == ([], None) and stepping.read(rows) == ([], None)
    joining.own_joined = True
    (early,) = joining.decide()
    assert early.mirror and early.error is None and (early.name, early.occurrence) == ("optimizer.0", 1)
    mark = _batch_round([], [])
    mark[1, 0] = boards.mark_joined(mark[1, 0], 1)
    (later,), _ = stepping.read(mark)  # the others decide it when they read the joined mark
    assert (later.name, later.occurrence, later.absent, later.error) == ("optimizer.0", 1, (1,), None)
    assert joining.read(mark) == ([], None)  # decided once


def test_a_joining_ranks_own_rows_read_late_keep_their_occurrences():
    call = _allreduce("t")
    board = Board(0, 2)
    board.own_joined, board.own_calls = True, {"t": 1}  # rank 0 made "t" #1 (its row unread), then joined
    (mirror,), _ = board.read(_batch_round([], [call, call]))  # rank 1's "t" #1 and #2
    assert (mirror.occurrence, mirror.absent, mirror.mirror) == (2, (0,), True)  # #1 waits for rank 0's row
    mark = _batch_round([call], [])
    mark[0, 0] = boards.mark_joined(mark[0, 0], 2)
    (both,), _ = board.read(mark)  # rank 0's own row comes: it is #1, not #3
    assert (both.occurrence, both.absent, both.error) == (1, (), None)


class _Answered:
    """An Agent handle answered already."""

    def __init__(self, result):
        self.result = result

    def done(self):
        return True

    def wait(self, timeout=None):
        return self.result

    def exception(self):
        return None

    def add_done_callback(self, fn, drive=True):
        fn(self)


class _EchoAgent:
    """Rank 0 of two whose peer makes the same calls at once: sums are twice ours, and a board
    round's peer rows are ours."""

    job, rank, num_workers, mode, sync, timeout, settings = "echo", 0, 2, "sum", "bsp", 5.0, {}

    def __init__(self):
        self.board_rounds = 0

    def pushpull(self, key, array, out=None, average=False):
        out = np.empty_like(array) if out is None else out
        if key.startswith("hvd/board"):
            self.board_rounds += 1
            out[...] = array
            out[1] = array[0]
        else:
            np.multiply(array, 2, out=out)
        return _Answered(out)

    def cancel(self, handle, error):
        raise AssertionError(error)

    def close(self, leave=True):
        pass


def test_calls_that_agree_cost_one_board_round_per_batch_and_optimizer_steps_one_each():
    agent = _EchoAgent()
    session = Session(agent)
    array = np.ones(4, np.float32)
    assert session._batch == board_batch(session.size) == 64
    for _ in range(3 * session._batch + 1):
        assert session.allreduce(array, name="x", op=reduction.Sum).wait().tolist() == [2.0] * 4
    assert agent.board_rounds == 3  # the last call's row waits for the next batch
    session.step(0).wait()  # a step's round goes at once, with the rows waiting before it
    assert agent.board_rounds == 4 and session._board.rounds == 4 and not session._calls
    session.close()


class _LookupAgent(_EchoAgent):
    """An Agent whose first board push waits for its key's lookup: meanwhile the Agent's own
    thread completes a data push-pull in flight (whose end takes the session's lock)."""

    def __init__(self):
        super().__init__()
        self.data: list[_Handle] = []
        self.stuck = None

    def pushpull(self, key, array, out=None, average=False):
        if not key.startswith("hvd/board"):
            handle = _Handle()
            self.data.append((handle, np.multiply(array, 2, out=out)))
            return handle
        if self.stuck is None:
            driver = threading.Thread(target=lambda: [h.complete(result) for h, result in self.data])
            driver.start()
            driver.join(2)  # the lookup's answer comes once the driving thread is free again
            self.stuck = driver.is_alive()
        return super().pushpull(key, array, out, average)


def test_a_board_push_that_waits_holds_no_lock_that_ending_a_call_needs():
    agent = _LookupAgent()
    session = Session(agent)
    array = np.ones(4, np.float32)
    pending = session.allreduce(array, name="x", op=reduction.Sum)
    session.step(0).wait()  # the step's board round goes at once: the board key's first push
    assert agent.stuck is False, "the Agent's thread could not end the allreduce while the board push waited"
    assert pending.wait(1).tolist() == [2.0] * 4
    session.close()


# -- operations in flight -----------------------------------------------------------------------------


class _Handle:
    """An Agent handle stand-in: completed by the test."""

    def __init__(self):
        self._done, self._error, self._result, self._callbacks = False, None, None, []
        self._event = threading.Event()

    def done(self):
        return self._done

    def exception(self):
        return self._error

    def wait(self, timeout=None):
        if not self._event.wait(timeout if timeout is not None else 5):
            raise PslinkError("timeout")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn, drive=True):
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def complete(self, result=None, error=None):
        self._result, self._error, self._done = result, error, True
        self._event.set()
        for fn in self._callbacks:
            fn(self)


def _cancel(handle, error):
    handle.complete(error=error)


def test_a_pending_takes_its_steps_as_handles_complete_and_polls_without_blocking():
    first, second = _Handle(), _Handle()

    def steps():
        a = yield first
        b = yield second
        return a + b

    progress = Progress("test")
    pending = Pending("sum", steps(), _cancel, progress)
    assert not pending.done()
    first.complete(1)
    assert not pending.done()
    second.complete(2)
    assert pending.wait(5) == 3 and pending.done()
    progress.close()


def test_a_pending_fails_with_its_operations_name_and_a_verdict_wakes_its_waiter():
    handle = _Handle()

    def steps():
        yield handle
        return "never"

    pending = Pending("allreduce 'x'", steps(), _cancel, None, inline=True)
    threading.Timer(0.05, pending.fail, [MismatchError("ranks disagree")]).start()
    with pytest.raises(MismatchError, match="^allreduce 'x': ranks disagree$"):
        pending.wait(5)
    ended = []
    pending.add_done_callback(ended.append)
    assert ended == [pending]


def test_a_waiter_returns_only_once_the_operation_finished_releasing_its_name():
    # The handle completes on another thread (the Agent's), which ends the operation: a waiter
    # that returned before its finish() ran would find the name still claimed by its next call.
    handle, releasing, finished = _Handle(), threading.Event(), []

    def finish(failed):
        assert releasing.wait(5)
        finished.append(failed)

    def steps():
        yield handle
        return "ok"

    pending = Pending("allreduce 'x'", steps(), _cancel, None, finish=finish, inline=True)
    returned = []
    waiter = threading.Thread(target=lambda: returned.append((pending.wait(5), list(finished))))
    waiter.start()
    completer = threading.Thread(target=handle.complete, args=("answer",))
    completer.start()
    waiter.join(0.2)
    assert not returned, "wait() returned while the operation's finish() had not run"
    releasing.set()
    waiter.join(5)
    completer.join(5)
    assert returned == [("ok", [False])]


def test_a_group_waits_for_every_member_in_order():
    handles = [_Handle(), _Handle()]

    def steps(h, value):
        yield h
        return value

    group = PendingGroup([Pending("a", steps(h, v), _cancel, None, inline=True) for h, v in zip(handles, "ab")])
    handles[1].complete()
    assert not group.done()
    handles[0].complete()
    assert group.done() and group.wait(1) == ["a", "b"]


# -- one list of Horovod's names, for every adapter -------------------------------------------------


def _import_adapter(name: str):
    framework = {"pslink.torch": "torch", "pslink.tf": "tensorflow", "pslink.tf.keras": "tensorflow",
                 "pslink.tf.keras.callbacks": "tensorflow", "pslink.mxnet.horovod": "mxnet"}[name]
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed (CI installs it)")
    if framework == "mxnet" and "tensorflow" in sys.modules and "mxnet" not in sys.modules:
        pytest.skip("TensorFlow is loaded in this process already, and MXNet imported after it segfaults")
    if framework == "tensorflow" and importlib.util.find_spec("mxnet") is not None:
        importlib.import_module("mxnet")  # MXNet before TensorFlow in one process, or MXNet segfaults later
    return importlib.import_module(name)


@pytest.mark.parametrize("adapter", sorted(HOROVOD_GAPS))
def test_each_adapter_exports_horovods_names_but_its_listed_gaps(adapter):
    module = _import_adapter(adapter)
    public = set(module.__all__)
    gaps = set(HOROVOD_GAPS[adapter])
    shared = HOROVOD_NAMES if adapter != "pslink.tf.keras.callbacks" else frozenset()
    expected = shared | HOROVOD_MODULE_NAMES[adapter]
    assert not expected - public - gaps, f"{adapter} lacks Horovod names not listed as gaps"
    assert not gaps & public, f"{adapter} now offers {gaps & public}: take them off HOROVOD_GAPS"
    assert all(hasattr(module, name) for name in module.__all__)


def test_gaps_are_horovod_names_and_each_adapter_is_listed():
    for adapter, gaps in HOROVOD_GAPS.items():
        assert set(gaps) <= HOROVOD_NAMES | HOROVOD_MODULE_NAMES[adapter], adapter
        assert all(reason for reason in gaps.values())
    assert set(HOROVOD_GAPS) == set(HOROVOD_MODULE_NAMES) == {
        "pslink.torch", "pslink.tf", "pslink.tf.keras", "pslink.tf.keras.callbacks", "pslink.mxnet.horovod"}


@pytest.mark.parametrize("adapter", ["pslink.torch", "pslink.tf", "pslink.mxnet.horovod"])
def test_the_shared_names_are_the_shared_objects(adapter):
    module = _import_adapter(adapter)
    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        assert getattr(module, name) is getattr(reduction, name), name
    for name in horovod.NOT_BUILT:
        assert getattr(module, name) is getattr(horovod, name), name
    assert not any(getattr(module, name)() for name in horovod.NOT_BUILT)


def test_pslink_errors_are_runtime_errors_as_horovods_are():
    from pslink.errors import PeerError, PslinkTimeoutError

    for error in (ShapeMismatchError("x"), MismatchError("x"), PeerError("x"), PslinkTimeoutError("x"),
                  ConfigError("x")):
        assert isinstance(error, RuntimeError) and isinstance(error, PslinkError)
    assert isinstance(PeerError("x"), ConnectionError) and isinstance(ConfigError("x"), ValueError)
