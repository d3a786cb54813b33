"""The memory behind hvd.allreduce's new tensors (pslink.torch.tensors.ResultPool): a dropped
result's buffer is handed out again, one that anything still sees never is."""

from __future__ import annotations

import gc
import itertools

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")

from pslink.torch.horovod import Horovod  # noqa: E402
from pslink.torch.tensors import RESULTS, ResultPool  # noqa: E402
from tests.helpers import on_sessions, serving  # noqa: E402

MIB = 1 << 20
_jobs = itertools.count()


def test_a_dropped_result_is_reused_and_a_live_one_or_its_view_or_array_never():
    pool = ResultPool(smallest=MIB)
    like = torch.ones(MIB // 4)
    first, second = pool.empty_like(like), pool.empty_like(like)
    assert first.data_ptr() != second.data_ptr()
    first_ptr = first.data_ptr()
    del first
    third = pool.empty_like(like)
    assert third.data_ptr() == first_ptr  # dropped: its memory comes back
    view, array = second[10:], third.numpy()
    second_ptr = second.data_ptr()
    del second, third
    fourth = pool.empty_like(like)  # both pooled buffers are still seen (a view, an array)
    assert fourth.data_ptr() not in (first_ptr, second_ptr)
    assert fourth.shape == like.shape and fourth.dtype == like.dtype and fourth.is_contiguous()
    del view, array, fourth
    gc.collect()
    assert pool.empty_like(like).data_ptr() in (first_ptr, second_ptr)


def test_small_odd_dtype_and_over_the_limit_results_are_plain_torch_tensors():
    pool = ResultPool(smallest=MIB, limit_bytes=3 * MIB)
    small = pool.empty_like(torch.ones(16))
    bf16 = pool.empty_like(torch.ones(MIB, dtype=torch.bfloat16))
    assert small.shape == (16,) and bf16.dtype == torch.bfloat16
    assert small.untyped_storage().resizable() and bf16.untyped_storage().resizable()  # not pooled
    assert pool._bytes == 0
    kept = [pool.empty_like(torch.ones(MIB // 4)) for _ in range(2)]  # 2 MiB pooled
    assert pool._bytes == 2 * MIB
    big = pool.empty_like(torch.ones(MIB // 2))  # 2 MiB more would pass the 3 MiB limit
    assert big.untyped_storage().resizable() and pool._bytes == 2 * MIB
    del kept
    pool.empty_like(torch.ones(MIB // 2))  # the free ones are let go to make room
    assert pool._bytes == 2 * MIB


@pytest.fixture(scope="module")
def service():
    yield from serving("tcp")


def test_results_kept_across_calls_keep_their_values(service):
    """A training loop's ``result = hvd.allreduce(t)`` and one that keeps every result: each
    holds its own call's average, bit for bit as torch's own division."""
    cluster, transports = service
    calls = 5

    def body(rank, session):
        api = Horovod(lambda: session)
        kept = []
        for call in range(calls):
            tensor = torch.full((MIB // 4,), float(rank + 1 + 10 * call))
            kept.append(api.allreduce(tensor, name="pooled"))
            if call % 2:
                last = api.allreduce(tensor, name="pooled")  # dropped at once: its buffer comes back
                assert torch.equal(last, kept[-1])
                del last
        return kept

    for kept in on_sessions(f"results-{next(_jobs)}", 2, cluster.address, transports, body, 60.0):
        for call, result in enumerate(kept):
            expected = (torch.full((MIB // 4,), 1.0 + 10 * call) + torch.full((MIB // 4,), 2.0 + 10 * call)) / 2
            assert torch.equal(result, expected), f"call {call}: {result[:3]}"
    assert RESULTS._bytes <= RESULTS.limit_bytes
