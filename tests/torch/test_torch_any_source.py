"""``recv`` from any source and ``monitored_barrier`` on the pslink backend, on real processes
(2 and 3 ranks): what is received and the source ranks reported, as over gloo; a monitored
barrier some rank misses fails naming it, worded as gloo's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")
pytest.importorskip("torch.distributed", reason="torch was built without torch.distributed")

from tests.torch.backend_worker import message
from tests.torch.test_torch_backend import launch

pytestmark = pytest.mark.integration


def each_senders_messages(received: list) -> dict[int, list[int]]:
    """``{source rank: the sequence numbers of its messages, in the order received}``, checking
    that every message says it came from the rank reported as its source."""
    by_source: dict[int, list[int]] = {}
    for source, tensor in received:
        values = tensor.view(-1).float().unique().tolist()
        assert len(values) == 1 and int(values[0]) // 100 == source, (source, tensor)
        by_source.setdefault(source, []).append(int(values[0]) % 100)
    return by_source


@pytest.mark.parametrize("ranks", [2, 3])
def test_recv_from_any_source_takes_each_senders_messages_in_order_as_gloo_does(tmp_path, ranks):
    results = launch("anysource", ranks, tmp_path)
    others = lambda rank: [r for r in range(ranks) if r != rank]
    for rank, result in enumerate(results):
        for backend in ("pslink", "gloo"):
            got = result[backend]
            # Every rank in turn received 2 messages from each other rank, by recv and irecv.
            assert each_senders_messages(got["turns"]) == {r: [0, 1] for r in others(rank)}, (backend, rank)
        if rank == 0:
            for backend in ("pslink", "gloo"):
                got = result[backend]
                # One from any source, then the rest by name: each rank's 3, in order, each of its
                # shape and dtype (the first from any source was offered to every rank).
                assert each_senders_messages(got["mixed"]) == {r: [0, 1, 2] for r in others(0)}, backend
                for source, tensor in got["mixed"]:
                    seq = int(tensor.view(-1)[0].item()) % 100
                    expected = message(source, seq)
                    assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (backend, tensor)
                # Tags: rank 1 sent tag 9 first; a receive with tag 8 took the one with tag 8.
                assert [(tag, source, tensor.tolist()) for tag, source, tensor in got["tags"]] == \
                    [(8, 1, [8.0, 8.0]), (9, 1, [9.0, 9.0])], backend


@pytest.mark.parametrize("ranks", [2, 3])
def test_recv_from_any_source_of_another_size_fails_naming_the_sender_and_one_never_sent_times_out(tmp_path, ranks):
    results = launch("anysource_errors", ranks, tmp_path)
    receiver = results[0]
    assert receiver["mismatch"]["error"] == "PslinkBackendError", receiver
    assert ("recv from any source (tag 3) of (4,) torch.float32: rank 1 sent 3 elements of float32 with tag 3"
            in receiver["mismatch"]["message"]), receiver["mismatch"]["message"]
    assert receiver["mismatch"]["seconds"] < 20.0, receiver  # not at the group's timeout (60 s)
    assert results[1]["sent"] < 20.0  # the send was taken
    source, after = receiver["after"]
    assert source == 1 and torch.equal(after, torch.arange(3.0))  # the pair still works
    nobody = receiver["nobody"]
    assert nobody["error"] == "PslinkBackendError" and "not matched within 3 s" in nobody["message"], nobody
    assert "did another rank send to rank 0 with tag 4?" in nobody["message"], nobody
    assert 3.0 <= nobody["seconds"] < 15.0, nobody


@pytest.mark.parametrize("ranks", [2, 3])
def test_monitored_barrier_passes_and_names_the_ranks_that_missed_it_as_gloo_does(tmp_path, ranks):
    results = launch("monitored", ranks, tmp_path)
    for rank, result in enumerate(results):
        assert result["passed"]["pslink"] == [None, None, None] == result["passed"]["gloo"], (rank, result["passed"])
        # torch's own call refuses every backend but gloo by name (so pslink has the call).
        refused = result["torch_refuses"]
        assert refused["error"] == "ValueError" and "only implemented for GLOO" in refused["message"], refused
    rank0 = results[0]
    missing = rank0["missing"]["pslink"]
    assert missing["error"] == "PslinkBackendError", missing
    assert missing["message"].startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms"), missing
    assert 1.0 <= missing["seconds"] < 20.0, missing  # (the group's timeout: 60 s)
    for rank, result in enumerate(results[2:], start=2):  # they came: rank 0 tells them
        told = result["missing"]["pslink"]
        assert told["message"].startswith(f"Rank {rank} successfully reached monitoredBarrier, but received errors "
                                          "while waiting for send/recv from rank 0"), told
        assert "rank(s) 1 failed to pass monitoredBarrier" in told["message"] and told["seconds"] < 20.0, told
    late = results[1]["late"]  # rank 1, arriving after rank 0 gave up
    assert late["message"].startswith("Rank 1 successfully reached monitoredBarrier"), late
    assert "rank(s) 1 failed" in late["message"] and late["seconds"] < 20.0, late
    # wait_all_ranks names every rank that did not come; a timeout of 0 fails rank 0 itself: as gloo,
    # whose first line is the same.
    names = ", ".join(str(r) for r in range(1, ranks))
    for backend in ("pslink", "gloo"):
        all_missing, zero = rank0["all_missing"][backend], rank0["zero"][backend]
        assert all_missing["message"].startswith(f"[Rank 0]: Ranks {names} failed to pass monitoredBarrier in 1000 ms"), \
            (backend, all_missing)
        assert zero["message"].startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 0 ms"), (backend, zero)
        assert "Rank 0 timed out in monitoredBarrier after 0 ms" in zero["message"], (backend, zero)
    assert all(r["all_missing"] == {} and r["zero"] == {} for r in results[1:])
    # A subgroup of ranks 0 and 1 that rank 1 misses; rank 2 (not in it) passes at once.
    assert rank0["subgroup"]["message"].startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier"), rank0
    assert all(result["subgroup"] is None for result in results[2:])
