"""The Horovod-compatible API: collectives, DistributedOptimizer and join, on ranks that are
threads of this process sharing an in-process service (one Session per rank)."""

from __future__ import annotations

import itertools
import threading
import warnings

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")

import pslink.torch as hvd  # noqa: E402
from pslink.core.observe import timeline as pslink_timeline  # noqa: E402
from pslink.errors import ConfigError, PeerError, ShapeMismatchError  # noqa: E402
from pslink.torch.horovod import Horovod  # noqa: E402
from tests.helpers import on_sessions, serving  # noqa: E402

_jobs = itertools.count()


@pytest.fixture(scope="module")
def service():
    yield from serving("tcp")


def on_ranks(service, size: int, fn, timeout: float = 60.0) -> list:
    """Run ``fn(api)`` for ranks 0..size-1 of a fresh job, each on its own thread: ``api`` is
    Horovod's API over that rank's own Session (``api.session``)."""
    cluster, transports = service

    def body(rank, session):
        api = Horovod(lambda: session)
        api.session = session
        return fn(api)

    return on_sessions(f"hvd-{next(_jobs)}", size, cluster.address, transports, body, timeout)


# -- allreduce --------------------------------------------------------------------------------------


def test_allreduce_averages_sums_and_keeps_the_input(service):
    def body(s):
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (s.rank() + 1)
        average = s.allreduce(x, name="x")
        total = s.allreduce(x, name="x-sum", op=hvd.Sum)
        return x, average, total

    for rank, (x, average, total) in enumerate(on_ranks(service, 3, body)):
        base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        torch.testing.assert_close(x, base * (rank + 1))  # out of place
        torch.testing.assert_close(average, base * 2)
        torch.testing.assert_close(total, base * 6)


def test_allreduce_handles_dtypes_scalars_views_and_scale_factors(service):
    def body(s):
        r = s.rank() + 1
        bf16 = s.allreduce(torch.full((4,), float(r), dtype=torch.bfloat16), name="bf16", op=hvd.Sum)
        ints = s.allreduce(torch.tensor([3, 7]) * r, name="ints")  # average of integers truncates
        scalar = s.allreduce(torch.tensor(float(r)), name="scalar")
        wide = torch.arange(12, dtype=torch.float64).reshape(3, 4) * r
        column = wide[:, 1]  # not contiguous: staged
        s.allreduce_async_(column, name="column", op=hvd.Sum).wait()
        scaled = s.allreduce(torch.ones(2) * r, name="scaled", prescale_factor=2.0, postscale_factor=10.0)
        fp16 = s.allreduce(torch.full((3,), 0.5 * r), name="fp16", compression=hvd.Compression.fp16)
        return bf16, ints, scalar, wide, scaled, fp16

    for bf16, ints, scalar, wide, scaled, fp16 in on_ranks(service, 2, body):
        assert bf16.dtype == torch.bfloat16
        torch.testing.assert_close(bf16, torch.full((4,), 3.0, dtype=torch.bfloat16))
        torch.testing.assert_close(ints, torch.tensor([4, 10]))
        assert scalar.shape == () and scalar.item() == 1.5
        assert wide[:, 1].tolist() == [3.0, 15.0, 27.0]  # 1+2, 5+10, 9+18
        assert wide[:, 0].tolist() in ([0.0, 4.0, 8.0], [0.0, 8.0, 16.0])  # the rest untouched
        torch.testing.assert_close(scaled, torch.full((2,), 30.0))  # (2*1 + 2*2) / 2 * 10
        assert fp16.dtype == torch.float32
        torch.testing.assert_close(fp16, torch.full((3,), 0.75))


def test_min_max_product_and_integer_scale_factors(service):
    """Horovod's other ReduceOps, equal on every rank (reduced from rows gathered in rank order),
    and pre/postscale of integer tensors (truncated toward zero, the dtype kept)."""
    def body(s):
        r = s.rank() + 1
        x = torch.tensor([[1.5 * r, -r], [4.0 / r, 2.0]])
        low = s.allreduce(x, name="min", op=hvd.Min)
        high = s.allreduce(x, name="max", op=hvd.Max)
        product = s.allreduce(torch.tensor([2, -3, 5]) + r, name="product", op=hvd.Product)
        unnamed = s.allreduce(torch.tensor([float(r)]), op=hvd.Max)  # matched by position, as every unnamed call
        ints = s.allreduce(torch.tensor([7, -7]) * r, name="scaled-ints", op=hvd.Sum, prescale_factor=0.5,
                           postscale_factor=3.0)
        return low, high, product, unnamed, ints

    for low, high, product, unnamed, ints in on_ranks(service, 3, body):
        torch.testing.assert_close(low, torch.tensor([[1.5, -3.0], [4.0 / 3, 2.0]]))
        torch.testing.assert_close(high, torch.tensor([[4.5, -1.0], [4.0, 2.0]]))
        assert product.tolist() == [3 * 4 * 5, -2 * -1 * 0, 6 * 7 * 8] and product.dtype == torch.int64
        assert unnamed.tolist() == [3.0]
        # 7*r*0.5 -> 3, 7, 10 (truncated); summed 20; *3 -> 60. -7*r*0.5 -> -3, -7, -10: -20 -> -60.
        assert ints.tolist() == [60, -60] and ints.dtype == torch.int64


def test_grouped_allreduce_and_allgather_and_allgather_async(service):
    def body(s):
        r = s.rank() + 1
        tensors = [torch.full((3,), float(r)), torch.arange(4) * r, torch.tensor(2.0 * r)]
        averaged = s.grouped_allreduce_async_([t.clone() for t in tensors], name="group").wait()
        summed = s.grouped_allreduce_async_([t.clone() for t in tensors], op=hvd.Sum).wait()  # unnamed: by position
        gathered = s.grouped_allgather_async([torch.full((r, 2), float(r)), torch.tensor([r])], name="g").wait()
        alone = s.allgather_async(torch.tensor([10 * r]), name="ga")
        return averaged, summed, gathered, alone.wait()

    for averaged, summed, gathered, alone in on_ranks(service, 2, body):
        torch.testing.assert_close(averaged[0], torch.full((3,), 1.5))
        assert averaged[1].tolist() == [0, 1, 3, 4]  # integers: the sum divided, truncated
        assert averaged[2].shape == () and averaged[2].item() == 3.0
        assert summed[1].tolist() == [0, 3, 6, 9] and summed[2].item() == 6.0
        assert gathered[0].tolist() == [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]] and gathered[1].tolist() == [1, 2]
        assert alone.tolist() == [10, 20]


def test_a_name_in_flight_is_refused_until_it_is_done(service):
    tried = threading.Event()  # rank 1 pushes only once rank 0 tried again: rank 0's first cannot be done by then

    def body(s):
        if s.rank() == 1:
            assert tried.wait(30)
        first = s.allreduce_async_(torch.ones(2), name="busy", op=hvd.Sum)
        if s.rank() == 0:
            try:
                with pytest.raises(ConfigError, match="an operation named 'busy' is in flight on rank 0"):
                    s.allreduce_async_(torch.ones(2), name="busy")
            finally:
                tried.set()
        first.wait()
        return s.allreduce(torch.ones(2), name="busy", op=hvd.Sum)  # done: the name is free again

    for again in on_ranks(service, 2, body):
        assert again.tolist() == [2.0, 2.0]


def test_collectives_are_differentiable_as_horovods(service):
    """allreduce's gradient is the allreduce of the gradients; allgather's, this rank's rows of
    their average; broadcast's, their average on the root and zeros elsewhere (Horovod's rules)."""
    from pslink.torch import autograd

    def body(s):
        r = s.rank() + 1
        x = torch.full((2,), float(r), requires_grad=True)
        summed = autograd.allreduce(s.session, x, "d-sum", hvd.Sum, hvd.Compression.none, 1.0, 1.0)
        (summed * r).sum().backward()  # d/dx_r of sum_k k * (x_1 + x_2): the sum of the weights, 3
        g = torch.ones(r, 2, requires_grad=True)
        gathered = autograd.allgather(s.session, g, "d-gather")  # 3 rows: rank 0's one, rank 1's two
        (gathered * torch.arange(3.0).reshape(3, 1) * r).sum().backward()
        b = torch.full((3,), float(r), requires_grad=True)
        (autograd.broadcast(s.session, b, 1, "d-bcast") * r).sum().backward()
        plain = autograd.allreduce(s.session, torch.ones(1), "d-plain", hvd.Sum, hvd.Compression.none, 1.0, 1.0)
        return summed.grad_fn is not None, x.grad, g.grad, b.grad, plain.grad_fn

    results = on_ranks(service, 2, body)
    for rank, (has_grad_fn, x_grad, g_grad, b_grad, plain_grad_fn) in enumerate(results):
        assert has_grad_fn and plain_grad_fn is None
        assert x_grad.tolist() == [3.0, 3.0]
        # d/dg of sum_k k * rowweights: rows [0, 1, 2] weighted by k = 1, 2; averaged: 1.5 x row index
        expected_rows = [[0.0, 0.0]] if rank == 0 else [[1.5, 1.5], [3.0, 3.0]]
        assert g_grad.tolist() == expected_rows
        assert b_grad.tolist() == ([1.5] * 3 if rank == 1 else [0.0] * 3)  # the root's: average of 1, 2


def test_reducescatter_and_alltoall_as_horovod_splits(service):
    def body(s):
        r = s.rank()
        x = torch.arange(10.0).reshape(5, 2) * (r + 1)  # 5 rows over 3 ranks: 2, 2, 1
        mine = s.reducescatter(x, name="rs", op=hvd.Sum)
        mean = s.reducescatter(x)  # unnamed: matched by position
        even = s.alltoall(torch.arange(6) + 10 * r)  # two elements to each rank; unnamed
        rows = torch.arange(4 * 2).reshape(4, 2) + 100 * r
        splits = [[1, 2, 1], [0, 0, 4], [2, 1, 1]][r]
        got, counts = s.alltoall(rows, splits=splits, name="uneven")
        with pytest.raises(ConfigError, match="splits \\[1, 1\\] must be 3 counts"):
            s.alltoall(rows, splits=[1, 1], name="bad")
        return mine, mean, even, got, counts

    full = torch.arange(10.0).reshape(5, 2) * 6  # (1 + 2 + 3) x
    starts = {0: (0, 2), 1: (2, 2), 2: (4, 1)}
    for r, (mine, mean, even, got, counts) in enumerate(on_ranks(service, 3, body)):
        start, n = starts[r]
        torch.testing.assert_close(mine, full[start : start + n])
        torch.testing.assert_close(mean, full[start : start + n] / 3)
        assert even.tolist() == [2 * r + 10 * k + d for k in range(3) for d in range(2)]
        sent = [[1, 2, 1], [0, 0, 4], [2, 1, 1]]
        assert counts.tolist() == [sent[k][r] for k in range(3)]
        expected = []
        for k in range(3):
            first = sum(sent[k][:r])
            expected += [[2 * i + 100 * k, 2 * i + 1 + 100 * k] for i in range(first, first + sent[k][r])]
        assert got.tolist() == expected


def test_grouped_reducescatter_scales_and_shares_rows_as_the_single_one(service):
    def body(s):
        r = s.rank() + 1
        a = torch.arange(6.0).reshape(3, 2) * r  # 3 rows over 2 ranks: 2, 1
        b = torch.tensor([10, 20, 30, 40]) * r  # integers: scaled through float64, rounded back
        grouped = s.grouped_reducescatter([a, b], name="group", op=hvd.Sum, prescale_factor=2.0,
                                          postscale_factor=0.5)
        single = s.reducescatter(a, name="single", op=hvd.Sum, prescale_factor=3.0)
        unnamed = s.grouped_reducescatter([a, b])  # averages, matched by position
        with pytest.raises(ConfigError, match="op=Average or Sum"):
            s.grouped_reducescatter([a], name="bad", op=hvd.Max)
        with pytest.raises(ConfigError, match="at least one dimension"):
            s.grouped_reducescatter([torch.tensor(1.0)], name="scalar")
        return grouped, single, unnamed

    full_a = torch.arange(6.0).reshape(3, 2) * 3  # (1 + 2) x
    full_b = torch.tensor([10, 20, 30, 40]) * 3
    for r, (grouped, single, unnamed) in enumerate(on_ranks(service, 2, body)):
        rows_a = slice(0, 2) if r == 0 else slice(2, 3)
        rows_b = slice(0, 2) if r == 0 else slice(2, 4)
        torch.testing.assert_close(grouped[0], full_a[rows_a])  # x 2 then x 0.5
        assert grouped[1].dtype == torch.int64 and grouped[1].tolist() == full_b[rows_b].tolist()
        torch.testing.assert_close(single, full_a[rows_a] * 3)
        torch.testing.assert_close(unnamed[0], full_a[rows_a] / 2)
        assert unnamed[1].tolist() == (full_b[rows_b] // 2).tolist()


def test_sync_batch_norm_normalizes_with_the_whole_jobs_batch_as_batch_norm_on_it(service):
    """Ranks with batches of 3 and 5 samples: outputs, input gradients, the summed weight
    gradients and the running statistics equal torch's BatchNorm1d on the 8 samples at once."""
    torch.manual_seed(0)
    inputs = [torch.randn(3, 4) * 2 + 1, torch.randn(5, 4) - 3]
    upstream = [torch.randn(3, 4), torch.randn(5, 4)]

    def body(s):
        bn = hvd.SyncBatchNorm(4, momentum=0.1, session=s.session)
        x = inputs[s.rank()].clone().requires_grad_(True)
        out = bn(x)
        (out * upstream[s.rank()]).sum().backward()
        bn.eval()
        evaluated = bn(inputs[s.rank()])  # the running statistics: no collective
        return out.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var, evaluated

    results = on_ranks(service, 2, body)
    reference = torch.nn.BatchNorm1d(4, momentum=0.1)
    x = torch.cat(inputs).requires_grad_(True)
    out = reference(x)
    (out * torch.cat(upstream)).sum().backward()
    rows = [slice(0, 3), slice(3, 8)]
    for r, (got, x_grad, w_grad, b_grad, running_mean, running_var, _) in enumerate(results):
        torch.testing.assert_close(got, out.detach()[rows[r]], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x_grad, x.grad[rows[r]], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(running_mean, reference.running_mean)
        torch.testing.assert_close(running_var, reference.running_var, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[0][2] + results[1][2], reference.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[0][3] + results[1][3], reference.bias.grad, rtol=1e-4, atol=1e-5)
    reference.eval()
    torch.testing.assert_close(results[1][6], reference(inputs[1]), rtol=1e-4, atol=1e-5)


def test_sync_batch_norm_refuses_inputs_it_cannot_normalize(service):
    def body(s):
        bn = hvd.SyncBatchNorm(3, session=s.session)
        with pytest.raises(ConfigError, match="dimension 1 must be 3"):
            bn(torch.ones(2, 4))
        with pytest.raises(ConfigError, match="at least 2D"):
            bn(torch.ones(3))
        return True

    assert on_ranks(service, 2, body) == [True, True]


def test_a_timeline_started_and_stopped_at_run_time_records_what_ran_between(service, tmp_path):
    path = str(tmp_path / "timeline.json")

    def body(s):
        s.allreduce(torch.ones(2), name="before")
        written = s.session.agent.start_timeline(path, mark_cycles=True)
        for _ in range(3):  # the same key three times: three iterations, two marked starts
            s.allreduce(torch.ones(2), name="traced")
        s.session.agent.stop_timeline()
        s.allreduce(torch.ones(2), name="after")
        s.session.agent.stop_timeline()  # nothing recorded: nothing to do
        return written

    written = on_ranks(service, 2, body)
    assert written == [path, str(tmp_path / "timeline.rank1.json")]  # rank 0 writes the path itself
    for file in written:
        events = pslink_timeline.read(file)
        lanes = {e["args"]["name"] for e in events if e.get("ph") == "M"}
        assert any("traced" in lane for lane in lanes), lanes
        assert not any("before" in lane or "after" in lane for lane in lanes), lanes
        assert [e["name"] for e in events if e.get("ph") == "i"].count("CYCLE_START") == 2

    def empty(s):
        with pytest.raises(ConfigError, match="file path"):
            s.session.agent.start_timeline("")
        return True

    assert on_ranks(service, 1, empty) == [True]


def test_sparse_allreduce_gathers_indices_and_averages_values(service):
    def body(s):
        r = s.rank() + 1
        sparse = torch.sparse_coo_tensor(torch.tensor([[r, 3]]), torch.tensor([1.0 * r, 10.0]), (5,))
        averaged = s.sparse_allreduce_async(sparse, "emb").wait()
        with pytest.raises(ConfigError, match="sparse_allreduce takes a sparse tensor"):
            s.sparse_allreduce_async(torch.ones(2), "dense")
        return averaged

    for averaged in on_ranks(service, 2, body):
        assert averaged.is_sparse
        # index 1 from rank 0 (1.0), index 2 from rank 1 (2.0), index 3 from both (10 + 10): averaged over 2
        assert averaged.to_dense().tolist() == [0.0, 0.5, 1.0, 10.0, 0.0]


def test_parameter_names_and_the_warning_for_a_step_after_synchronize(service):
    def body(s):  # one rank: warnings are captured process-wide, not per thread
        model = make_model()
        optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        loss_of(model, *data(0, 0)).backward()
        optimizer.synchronize()
        with pytest.warns(UserWarning, match="skip_synchronize"):
            optimizer.step()
        loss_of(model, *data(1, 0)).backward()
        optimizer.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none here
            with optimizer.skip_synchronize():
                optimizer.step()
        return sorted(optimizer._parameter_names.values())

    assert on_ranks(service, 1, body) == [["0.bias", "0.weight", "2.bias", "2.weight"]]


def test_process_sets_reduce_among_their_ranks(service):
    """Horovod's process sets: every rank adds every set in the same order; a set's collectives
    count its ranks only; a rank outside a set may not use it; a removed set is gone."""
    def body(s):
        evens = s.add_process_set([2, 0])  # ranks 0 and 2, numbered 0 and 1 inside
        pair = s.add_process_set(hvd.ProcessSet([1, 2]))
        with pytest.raises(ConfigError, match="exists already"):
            s.add_process_set([0, 2])
        with pytest.raises(ConfigError, match="beyond the job's 3"):
            s.add_process_set([0, 5])
        out = {"ids": (evens.process_set_id, pair.process_set_id), "sizes": (evens.size(), pair.size()),
               "ranks": (evens.rank(), pair.rank()),
               "world": s.session.process_sets.session_for(hvd.global_process_set) is s.session}
        x = torch.full((2,), float(s.rank() + 1))
        for label, ps in (("evens", evens), ("pair", pair)):
            if ps.included():
                out[label] = s.allreduce(x, name="x", op=hvd.Sum, process_set=ps).tolist()
            else:
                with pytest.raises(ConfigError, match=f"rank {s.rank()} is not in ProcessSet"):
                    s.allreduce(x, name="x", op=hvd.Sum, process_set=ps)
        assert s.remove_process_set(evens) and not s.remove_process_set(evens)
        with pytest.raises(ConfigError, match="is not added"):
            s.allreduce(x, name="x", process_set=evens)
        out["world_sum"] = s.allreduce(x, name="after", op=hvd.Sum).tolist()  # the job itself is untouched
        return out

    results = on_ranks(service, 3, body)
    for rank, out in enumerate(results):
        assert out["ids"] == (1, 2) and out["sizes"] == (2, 2) and out["world"]
        assert out["ranks"] == {0: (0, -1), 1: (-1, 0), 2: (1, 1)}[rank]
        assert out.get("evens") == ([4.0, 4.0] if rank in (0, 2) else None)  # 1 + 3
        assert out.get("pair") == ([5.0, 5.0] if rank in (1, 2) else None)  # 2 + 3
        assert out["world_sum"] == [6.0, 6.0]


def test_grouped_calls_refuse_what_is_not_a_list_of_tensors(service):
    def body(s):
        with pytest.raises(ConfigError, match="grouped_allreduce takes a non-empty list of tensors"):
            s.grouped_allreduce_async_(torch.ones(2))
        with pytest.raises(ConfigError, match="grouped_allgather takes a non-empty list of tensors"):
            s.grouped_allgather_async([])
        return True

    assert on_ranks(service, 1, body) == [True]


def test_async_allreduce_and_unnamed_calls_match_by_position(service):
    def body(s):
        works = [s.allreduce_async(torch.full((5,), float(s.rank() + i))) for i in range(4)]
        return [w.wait() for w in works]

    for results in on_ranks(service, 2, body):
        for i, result in enumerate(results):
            torch.testing.assert_close(result, torch.full((5,), i + 0.5))


def test_allreduce_shapes_that_differ_fail_on_both_ranks_naming_them(service):
    def body(s):
        with pytest.raises(ShapeMismatchError) as info:
            s.allreduce(torch.zeros(3 + s.rank()), name="loss")
        return info.value.message

    for message in on_ranks(service, 2, body):
        assert "allreduce 'loss'" in message
        assert "(3,)" in message and "(4,)" in message


def test_allreduce_dtypes_that_differ_fail_naming_both_dtypes(service):
    def body(s):
        with pytest.raises(ShapeMismatchError) as info:
            s.allreduce(torch.zeros(3, dtype=torch.float32 if s.rank() == 0 else torch.int64), name="typed")
        return info.value.message

    for message in on_ranks(service, 2, body):
        # Not "rank 0 has shape (3,), rank 1 has shape (3,)": the dtypes are what differ.
        assert "(3,) float32" in message and "(3,) int64" in message, message


# -- broadcast, allgather ---------------------------------------------------------------------------


def test_broadcast_from_any_root_in_place(service):
    def body(s):
        t = torch.arange(4, dtype=torch.int64) * (s.rank() + 1)
        s.broadcast_async_(t, root_rank=1, name="t").wait()
        flags = torch.tensor([s.rank() == 0, s.rank() == 1, True])
        s.broadcast_async_(flags, root_rank=0, name="flags").wait()
        copy = s.broadcast_async(torch.full((2,), float(s.rank())), root_rank=2, name="copy").wait()
        return t, flags, copy

    for t, flags, copy in on_ranks(service, 3, body):
        assert t.tolist() == [0, 2, 4, 6]
        assert flags.tolist() == [True, False, True]
        assert copy.tolist() == [2.0, 2.0]


def test_broadcast_parameters_and_optimizer_state_make_every_rank_root_s(service):
    def body(s):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        with torch.no_grad():  # different weights everywhere
            for p in model.parameters():
                p.add_(s.rank())
        model(torch.randn(5, 4))  # BatchNorm buffers (running stats, an int64 counter) move
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (s.rank() + 1))
        if s.rank() == 1:
            model(torch.randn(3, 4)).sum().backward()
            optimizer.step()  # only the root has optimizer state
        s.broadcast_parameters(model.state_dict(), root_rank=1)
        s.broadcast_optimizer_state(optimizer, root_rank=1)
        return model.state_dict(), optimizer.state_dict()

    results = on_ranks(service, 2, body)
    (weights0, opt0), (weights1, opt1) = results
    assert weights0.keys() == weights1.keys()
    for name in weights0:
        torch.testing.assert_close(weights0[name], weights1[name], rtol=0, atol=0)
    assert opt0["param_groups"][0]["lr"] == opt1["param_groups"][0]["lr"] == 0.02
    assert opt0["state"].keys() == opt1["state"].keys() and opt0["state"]
    for index, state in opt1["state"].items():
        torch.testing.assert_close(opt0["state"][index]["exp_avg"], state["exp_avg"])


def test_broadcast_object_allgather_and_allgather_object(service):
    def body(s):
        obj = s.broadcast_object({"epoch": 7, "rank": s.rank()} if s.rank() == 0 else None, root_rank=0)
        rows = torch.full((s.rank() + 1, 2), float(s.rank()))
        gathered = s.allgather(rows, name="rows")
        names = s.allgather_object(f"host-{s.rank()}")
        return obj, gathered, names

    for obj, gathered, names in on_ranks(service, 3, body):
        assert obj == {"epoch": 7, "rank": 0}
        assert gathered.tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
        assert names == ["host-0", "host-1", "host-2"]


def test_allgather_with_different_trailing_shapes_fails_on_every_rank(service):
    def body(s):
        with pytest.raises(ShapeMismatchError) as info:
            s.allgather(torch.zeros(2, 3 + s.rank()), name="features")
        return info.value.message

    for message in on_ranks(service, 2, body):
        # The board's verdict or the gather's own shapes round, whichever comes first: both name
        # each rank's shape.
        assert "rank 0" in message and "3) float32" in message, message
        assert "rank 1" in message and "4) float32" in message, message


# -- DistributedOptimizer ---------------------------------------------------------------------------


def make_model(seed: int = 0) -> torch.nn.Module:
    """The same weights for a given seed, also when threads build models at once (a private
    generator: the global one is shared by the rank threads)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def data(step: int, rank: int, rows: int = 8):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator)


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def test_distributed_optimizer_equals_one_process_on_the_combined_batch(service):
    steps, size = 5, 2

    def body(s):
        model = make_model()
        optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
        assert isinstance(optimizer, torch.optim.SGD)
        for step in range(steps):
            optimizer.zero_grad()
            loss_of(model, *data(step, s.rank())).backward()
            optimizer.step()
        return model.state_dict()

    reference = make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        batches = [data(step, r) for r in range(size)]
        loss_of(reference, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])).backward()
        optimizer.step()
    for weights in on_ranks(service, size, body):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


def test_fused_gradients_train_bit_for_bit_as_unfused_ones(service):
    """Buckets (the default: the model's small gradients in one), Horovod's explicit groups and
    num_groups, and no fusion at all (groups=[]) give the same weights, bit for bit (2 ranks: a
    sum of two is the same in either order); a parameter backward never reaches (its gradient
    None) counts as zeros in each."""
    def body(s):
        results = {}
        for name, options in (("none", {"groups": []}), ("auto", {}), ("num_groups", {"num_groups": 2}),
                              ("groups", {"groups": "weights"})):
            model = make_model()
            model.unused = torch.nn.Parameter(torch.ones(5))
            if options.get("groups") == "weights":
                options = {"groups": [[model[0].weight, model[2].weight]]}
            optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters(), **options)
            buckets = len(optimizer._pslink.buckets)
            for step in range(4):
                optimizer.zero_grad()
                loss_of(model, *data(step, s.rank())).backward()
                optimizer.step()
            results[name] = (buckets, [p.detach().clone() for p in model.parameters()])
        return results

    for results in on_ranks(service, 2, body):
        assert {name: buckets for name, (buckets, _) in results.items()} == \
            {"none": 0, "auto": 1, "num_groups": 2, "groups": 1}
        for name in ("auto", "num_groups", "groups"):
            for a, b in zip(results[name][1], results["none"][1], strict=True):
                assert torch.equal(a, b), name


def test_buckets_hold_at_most_a_third_of_a_model_above_a_mebibyte():
    """So that backward overlaps most of the exchange: the threshold caps a bucket, and so does a
    third of the model, but not below 1 MiB (a small model stays one bucket)."""
    from pslink.torch.fusion import plan

    def buckets(count: int, nbytes: int, threshold: int) -> list[int]:
        params = [torch.nn.Parameter(torch.zeros(nbytes // 4)) for _ in range(count)]
        names = {p: f"p{i}" for i, p in enumerate(params)}
        return [len(b.params) for b in plan(params, names, threshold)]

    assert buckets(12, 256 << 10, 16 << 20) == [4, 4, 4]  # 3 MiB: thirds of 1 MiB
    assert buckets(24, 256 << 10, 16 << 20) == [8, 8, 8]  # 6 MiB: thirds of 2 MiB
    assert buckets(12, 256 << 10, 512 << 10) == [2] * 6  # the threshold is lower
    assert buckets(3, 256 << 10, 16 << 20) == [3]  # 768 KiB: one bucket of up to 1 MiB


def test_bucketed_gradients_stay_bucket_views_and_replaced_ones_are_copied_in_alike(service):
    """optimizer.zero_grad(), with set_to_none or without, zeroes the bucket in place (each .grad
    stays its bucket place, so backward adds into it); model.zero_grad() sets the gradients to
    None, backward writes fresh ones, copied into the bucket as each is final. The same weights,
    bit for bit, and after each step every .grad is its bucket place again."""
    def body(s):
        results = {}
        for how in ("optimizer", "in place", "module"):
            model = make_model()
            optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters())
            (bucket,) = optimizer._pslink.buckets
            for step in range(4):
                if how == "module":
                    model.zero_grad()
                    assert all(p.grad is None for p in model.parameters())
                else:
                    optimizer.zero_grad(set_to_none=how == "optimizer")
                    assert all(p.grad is view for p, view in zip(bucket.params, bucket.views))
                    assert not bucket.flat.any()
                loss_of(model, *data(step, s.rank())).backward()
                optimizer.step()
                assert all(p.grad is view for p, view in zip(bucket.params, bucket.views))
            results[how] = [p.detach().clone() for p in model.parameters()]
        return results

    for results in on_ranks(service, 2, body):
        for how in ("in place", "module"):
            for a, b in zip(results[how], results["optimizer"], strict=True):
                assert torch.equal(a, b), how


def test_backward_passes_per_step_sum_op_and_predivide(service):
    def body(s):
        model = make_model()
        optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                         backward_passes_per_step=2, op=hvd.Sum)
        for part in range(2):
            loss_of(model, *data(part, s.rank())).backward()
        optimizer.step()
        with pytest.raises(ConfigError, match="gradient_predivide_factor"):
            s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                 op=hvd.Sum, gradient_predivide_factor=2.0)
        return model.state_dict()

    reference = make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for part in range(2):
        for rank in range(2):
            loss_of(reference, *data(part, rank)).backward()  # Sum: grads of all passes of all ranks
    optimizer.step()
    for weights in on_ranks(service, 2, body):
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6)


def test_gradient_predivide_factor_and_fp16_compression_still_average(service):
    def body(s):
        model = make_model()
        optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                         gradient_predivide_factor=4.0, compression=hvd.Compression.fp16)
        loss_of(model, *data(0, s.rank())).backward()
        optimizer.synchronize()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with optimizer.skip_synchronize():
            optimizer.step()
        return grads

    reference = make_model()
    x = torch.cat([data(0, r)[0] for r in range(2)])
    y = torch.cat([data(0, r)[1] for r in range(2)])
    loss_of(reference, x, y).backward()
    for grads in on_ranks(service, 2, body):
        for name, p in reference.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=2e-3, atol=2e-3)  # float16 on the wire


def test_a_parameter_unused_on_one_rank_is_averaged_with_zeros(service):
    def body(s):
        model = make_model()
        extra = torch.nn.Parameter(torch.ones(3))
        params = list(model.named_parameters()) + [("extra", extra)]
        optimizer = s.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=1.0), params)
        loss = loss_of(model, *data(0, s.rank()))
        if s.rank() == 0:
            loss = loss + (extra * 2).sum()  # d/d extra = 2 on rank 0 only
        loss.backward()
        optimizer.step()
        return extra.detach().clone()

    for extra in on_ranks(service, 2, body):
        torch.testing.assert_close(extra, torch.zeros(3))  # 1 - 1.0 * (2 + 0) / 2


def test_models_that_differ_fail_naming_the_parameter_and_both_shapes(service):
    def body(s):
        model = torch.nn.Sequential(torch.nn.Linear(6, 16 + s.rank()), torch.nn.Linear(16 + s.rank(), 3))
        optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        with pytest.raises(ShapeMismatchError) as info:
            loss_of(model, *data(0, s.rank())).backward()
            optimizer.step()
        return info.value.message

    for message in on_ranks(service, 2, body):
        assert "gradient of parameter" in message
        assert any(f"'{name}'" in message for name in ("0.weight", "0.bias", "1.weight"))
        assert "rank 0 has shape" in message and "rank 1 has shape" in message


def test_optimizer_misuse_is_a_clear_error(service):
    def body(s):
        model = make_model()
        with pytest.raises(ConfigError, match="not in it"):
            s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1])
        with pytest.raises(ConfigError, match="repeated"):
            s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 [("w", p) for p in model.parameters()])
        with pytest.raises(ConfigError, match="Adasum"):
            s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
        optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        loss_of(model, *data(0, s.rank())).backward()
        with pytest.raises(RuntimeError, match="zero_grad"):
            optimizer.zero_grad()
        with pytest.raises(RuntimeError, match="backward_passes_per_step"):
            loss_of(model, *data(1, s.rank())).backward()
        optimizer.step()
        return True

    assert on_ranks(service, 2, body) == [True, True]


def test_without_named_parameters_gradients_are_keyed_by_position_with_a_warning(service):
    def body(s):  # one rank: warnings are captured process-wide, not per thread
        model = make_model()
        with pytest.warns(UserWarning, match="named_parameters"):
            optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        loss_of(model, *data(0, 0)).backward()
        optimizer.step()
        # Its four small gradients travel fused, in one bucket named by their positions ...
        [bucket] = optimizer._pslink.buckets
        fused = (bucket.names, s.session.agent.key_info(bucket.key)["shape"])
        # ... and each under its own key when no fusion is asked for (explicit groups, none); this
        # second optimizer of the session keys its gradients apart from the first one's.
        with pytest.warns(UserWarning, match="named_parameters"):
            optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=[])
        loss_of(model, *data(1, 0)).backward()
        optimizer.step()
        return fused, [s.session.agent.key_info(f"grad/optimizer1/noname.0.{i}")["shape"] for i in range(4)]

    [(fused, alone)] = on_ranks(service, 1, body)
    assert fused == (["noname.0.3", "noname.0.2", "noname.0.1", "noname.0.0"], (3 + 48 + 16 + 96,))
    assert alone == [(16, 6), (16,), (3, 16), (3,)]


def test_join_mirrors_the_remaining_steps_with_zero_gradients(service):
    batches = {0: 4, 1: 2}  # rank 1 runs out of data two steps early

    def body(s):
        model = make_model()
        optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        for step in range(batches[s.rank()]):
            optimizer.zero_grad()
            loss_of(model, *data(step, s.rank())).backward()
            optimizer.step()
        last = s.join()
        total = s.allreduce(torch.tensor([1.0]), name="after-join", op=hvd.Sum)  # all ranks active again
        return last, total.item(), model.state_dict()

    reference = make_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(4):
        optimizer.zero_grad()
        for rank in (0, 1):
            if step < batches[rank]:
                (loss_of(reference, *data(step, rank)) / 2).backward()  # averaged over both ranks
        optimizer.step()
    (last0, total0, weights0), (last1, total1, _) = on_ranks(service, 2, body)
    assert last0 == last1 == 0
    assert total0 == total1 == 2.0
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights0[name], value, rtol=1e-5, atol=1e-6)


def test_a_rank_that_joins_a_board_round_ahead_mirrors_the_steps_still_to_come(service):
    # Rank 1 sent its first rows in a round of their own (as a nudge does), rank 0 with its
    # first step: rank 1's rounds run one ahead. Joined, it must mirror rank 0's next step as
    # soon as it reads it, not wait first for a round that rank 0 sends only after that step.
    batches = {0: 4, 1: 2}
    in_join = threading.Event()

    def body(s):
        model = make_model()
        optimizer = s.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        for name in ("a", "b"):
            s.allreduce(torch.ones(1), name=name)
        if s.rank() == 1:
            s.session._send_board()
            wait_board = s.session._wait_board

            def tell_and_wait():
                in_join.set()  # its join sent what it sends before it waits
                wait_board()

            s.session._wait_board = tell_and_wait
        for step in range(batches[s.rank()]):
            if s.rank() == 0 and step == 2:
                assert in_join.wait(30)  # rank 1 is in join() before this step's row goes out
            optimizer.zero_grad()
            loss_of(model, *data(step, s.rank())).backward()
            optimizer.step()
        return s.join()

    assert on_ranks(service, 2, body) == [0, 0]


# -- the module-level API ---------------------------------------------------------------------------


HOROVOD_NAMES = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "synchronize", "poll",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather", "allgather_object", "join", "barrier",
    "DistributedOptimizer", "Average", "Sum", "Adasum", "Compression", "mpi_threads_supported", "nccl_built",
    "gloo_built", "mpi_built", "push_pull", "push_pull_async", "push_pull_inplace",
]


def test_the_module_offers_horovod_s_and_byteps_names():
    missing = [name for name in HOROVOD_NAMES if not hasattr(hvd, name)]
    assert not missing
    assert set(hvd.__all__) <= set(dir(hvd))


def test_the_module_api_needs_init_and_says_how(monkeypatch):
    for variable in ("PSLINK_JOB", "PSLINK_RANK", "PSLINK_NUM_WORKERS"):
        monkeypatch.delenv(variable, raising=False)
    assert not hvd.is_initialized()
    with pytest.raises(ConfigError, match="init"):
        hvd.rank()
    with pytest.raises(ValueError, match="init"):  # Horovod raises ValueError before init
        hvd.start_timeline("timeline.json")
    with pytest.raises(PeerError, match="no parameter service reachable"):
        hvd.init(job="nobody", rank=0, num_workers=1, master="tcp://127.0.0.1:9", connect_timeout=2.0)
    assert not hvd.is_initialized()


def test_init_with_no_job_named_anywhere_runs_one_worker_as_horovod_does(monkeypatch):
    """No launcher and no job named: a job of one worker on a service of the process's own (as
    Horovod runs as size 1 without horovodrun); shutdown and init again work."""
    for variable in ("PSLINK_JOB", "PSLINK_RANK", "PSLINK_NUM_WORKERS", "PSLINK_MASTER"):
        monkeypatch.delenv(variable, raising=False)
    hvd.init()
    try:
        assert (hvd.rank(), hvd.size()) == (0, 1)
        assert hvd.allreduce(torch.tensor([2.0, 4.0])).tolist() == [2.0, 4.0]
        hvd.shutdown()
        hvd.init()
        assert hvd.allgather(torch.tensor([[1, 2]])).tolist() == [[1, 2]]
    finally:
        hvd.shutdown()


def test_the_module_api_on_one_rank(service, monkeypatch):
    cluster, _ = service
    monkeypatch.setenv("PSLINK_LOCAL_RANK", "0")
    monkeypatch.setenv("PSLINK_LOCAL_SIZE", "1")
    hvd.init(job=f"module-{next(_jobs)}", rank=0, num_workers=1, master=cluster.address)
    try:
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_size()) == (0, 1, 0, 1, 1)
        t = torch.tensor([1.0, 2.0])
        handle = hvd.push_pull_async(t, name="pp")
        assert hvd.synchronize(handle).tolist() == [1.0, 2.0]
        assert hvd.poll(handle)
        assert hvd.allreduce(t, average=False, name="sum").tolist() == [1.0, 2.0]
        assert hvd.broadcast(t, root_rank=0, name="b").tolist() == [1.0, 2.0]
        assert hvd.broadcast_object([1, "a"]) == [1, "a"]
        assert hvd.join() == 0
        with pytest.raises(ConfigError, match="root_rank"):
            hvd.broadcast_(t, root_rank=1)
    finally:
        hvd.shutdown()
    assert not hvd.is_initialized()
