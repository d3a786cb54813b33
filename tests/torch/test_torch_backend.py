"""``init_process_group("pslink")``: every collective against gloo's result on real processes
(2 and 3 ranks), DDP without a hook against DDP over gloo, and a bad call failing every rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")
pytest.importorskip("torch.distributed", reason="torch was built without torch.distributed")

pytestmark = pytest.mark.integration
# A refusal comes "at once": well within the group's timeout (60 s, backend_worker.TIMEOUTS), which
# is what a refusal that waited would take; not a speed figure (a loaded machine takes seconds).
AT_ONCE = 20.0

WORKER = os.path.join(os.path.dirname(__file__), "backend_worker.py")
CLI = [sys.executable, "-m", "pslink.cli", "launch"]


def launch(case: str, ranks: int, scratch, timeout: float = 150.0) -> list[dict]:
    done = subprocess.run(CLI + ["-n", str(ranks), sys.executable, WORKER, case, str(scratch)], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PSLINK_TIMEOUT="60"))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [torch.load(scratch / f"rank{rank}.pt") for rank in range(ranks)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.dtype.itemsize == 1
                                                                     else a.contiguous().view(-1).view(torch.uint8),
                                                                     b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_collective_gives_what_gloo_gives(tmp_path, ranks):
    results = launch("collectives", ranks, tmp_path)
    for rank, result in enumerate(results):
        assert result["backend"] == "pslink"
        ours, theirs = result["pslink"], result["gloo"]
        assert set(ours) == set(theirs) and len(ours) == 4 * 16 + 1  # 16 collectives x 4 dtypes, sparse
        for name, expected in theirs.items():
            got = ours[name]
            reordered = ranks > 2 and any(k in name for k in ("SUM", "PRODUCT", "reduce-"))
            if reordered and got.dtype == torch.bfloat16:
                # Three bfloat16 values: gloo rounds to bfloat16 after each of its ring's steps, the
                # service adds in float32 and rounds once: equal within bfloat16's rounding.
                torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=0.1)
            elif reordered and got.dtype.is_floating_point:
                # Three floats summed or multiplied: gloo's ring and pslink combine them in other orders.
                torch.testing.assert_close(got, expected, msg=lambda m, name=name: f"rank {rank} {name}: {m}")
            else:
                assert same_bits(got, expected), f"rank {rank} {name}: {got} != {expected}"


    # A subgroup of ranks 0 and 1 (new_group(backend="pslink")) is a job of its own.
    for rank, result in enumerate(results[:2]):
        sub = result["subgroup"]
        assert (sub["size"], sub["rank"]) == (2, rank) and same_bits(sub["pslink"], sub["gloo"])
        from tests.torch.backend_worker import data

        assert same_bits(sub["gathered"], torch.stack([data(r, torch.float32, seed=21) for r in (0, 1)]))
    assert all("subgroup" not in result for result in results[2:])


@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_without_a_hook_equals_ddp_over_gloo(tmp_path, ranks):
    results = launch("ddp", ranks, tmp_path)
    for rank, result in enumerate(results):
        ours, theirs = result["pslink"], result["gloo"]
        for step, (a, b) in enumerate(zip(ours["grads"], theirs["grads"], strict=True)):
            for x, y in zip(a, b, strict=True):
                if ranks == 2:
                    assert torch.equal(x, y), f"rank {rank} step {step}: gradients differ"
                else:
                    torch.testing.assert_close(x, y)
        for x, y in zip(ours["weights"], theirs["weights"], strict=True):
            if ranks == 2:
                assert torch.equal(x, y), f"rank {rank}: weights differ"
            else:
                torch.testing.assert_close(x, y)
    for x, y in zip(results[0]["pslink"]["weights"], results[-1]["pslink"]["weights"], strict=True):
        assert torch.equal(x, y)  # every rank holds the same model


@pytest.mark.parametrize("ranks", [2, 3])
def test_fsdp2_trains_a_transformer_as_over_gloo(tmp_path, ranks):
    """FSDP2 reduce-scatters gradients and all-gathers shards. With 2 ranks a sum is a + b in any
    order, so both backends give the same bits; with 3, gloo's ring adds in another order than the
    service (rank order), so results agree within float rounding (SGD: Adam would divide a near-zero
    gradient's rounding by its own size and turn it into a step of the learning rate)."""
    results = launch("fsdp", ranks, tmp_path)
    for rank, result in enumerate(results):
        ours, theirs = result["pslink"], result["gloo"]
        assert len(ours["weights"]) == len(theirs["weights"]) > 10
        for x, y in zip(ours["losses"] + ours["weights"], theirs["losses"] + theirs["weights"], strict=True):
            if ranks == 2:
                assert torch.equal(x, y), f"rank {rank}: FSDP2 over pslink differs from gloo"
            else:
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    for x, y in zip(results[0]["pslink"]["weights"], results[-1]["pslink"]["weights"], strict=True):
        assert torch.equal(x, y)  # the gathered model is the same on every rank


def test_two_ddp_models_with_the_hook_share_one_agent_and_train_as_over_gloo(tmp_path):
    """A GAN: generator and discriminator each under DDP with the hook, in one process. Before,
    the second ``connect()`` failed (a rank registers once: "needs its token")."""
    results = launch("gan", 2, tmp_path)
    for rank, result in enumerate(results):
        for variant in ("job", "group"):
            ours = result[variant]
            assert ours["one_agent"] and ours["names"] == ["ddp", "ddp2"], (rank, variant, ours["names"])
            for x, y in zip(ours["weights"], result["gloo"]["weights"], strict=True):
                assert torch.equal(x, y), f"rank {rank}, hook joined by {variant}: weights differ from gloo's"
        assert result["group"]["backend_agent"] and not result["job"]["backend_agent"]


def test_mismatched_shapes_fail_every_rank_within_a_second(tmp_path):
    results = launch("mismatch", 2, tmp_path)
    for rank, result in enumerate(results):
        assert result["error"] == "PslinkBackendError", result
        assert "disagree" in result["message"], result["message"]
        assert "rank 0: allreduce (4,) float32" in result["message"] and "rank 1: allreduce (5,) float32" \
            in result["message"], result["message"]
        assert result["seconds"] < AT_ONCE, result


def test_uneven_all_to_all_splits_that_do_not_match_fail_every_rank_naming_them(tmp_path):
    results = launch("badsplits", 2, tmp_path)
    for result in results:
        assert result["error"] == "PslinkBackendError", result
        assert "rank 1 sends 1 rows to rank 0, which expects 2" in result["message"], result["message"]
        assert result["seconds"] < AT_ONCE and torch.equal(result["after"], torch.full((2,), 2.0))


def test_a_recv_of_another_size_than_its_send_fails_both_ranks_at_once(tmp_path):
    results = launch("badrecv", 2, tmp_path)
    for result in results:
        assert result["error"] == "PslinkBackendError", result
        assert "rank 0 sends 3 elements of float32 with tag 0, rank 1 receives 4 elements of float32" \
            in result["message"], result["message"]
        assert result["seconds"] < AT_ONCE and torch.equal(result["after"], torch.arange(3.0))


def test_a_collective_some_rank_never_calls_fails_after_the_groups_timeout(tmp_path):
    results = launch("stall", 2, tmp_path)
    waited = results[0]
    assert waited["error"] == "PslinkBackendError", waited
    assert "not done within 3 s" in waited["message"] and "rank 0" in waited["message"]
    assert 3.0 <= waited["seconds"] < 6.0, waited
