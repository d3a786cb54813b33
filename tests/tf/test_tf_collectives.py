"""Horovod's gathers, object collectives and barrier in pslink.tf (the shared collectives of
pslink.core.worker.collectives), between two TensorFlow worker processes on a real service."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorflow", reason="TensorFlow is not installed (CI installs it: pip install '.[tf]')")

import tf_harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_gathers_objects_and_barrier_give_every_worker_the_same_answers(tmp_path):
    outcome = tf_harness.launch_worker("collectives", str(tmp_path), timeout=240)
    assert outcome.code == 0 and not outcome.timed_out, outcome.describe()
    reports = [json.loads((tmp_path / f"collectives_rank{r}.json").read_text()) for r in (0, 1)]
    rows = [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # rank 0's one row, then rank 1's two
    for rank, report in enumerate(reports):
        assert report["eager"] == rows and report["traced"] == rows
        assert report["bools"] == [False, True]  # bools travel as bytes and come back as bools
        assert report["object"] == {"from": 1, "text": "x" * 10}
        assert report["objects"] == [["rank", 0, []], ["rank", 1, [0]]]
        assert report["sum"] == 3.0 and report["mean"] == 1.5
        assert report["min"] == [1.0, -1.0] and report["max"] == [2.0, 0.0]  # Horovod's Min and Max
        assert report["product"] == [2 * 3, 9] and report["grouped"] == [3.0, [1.0, 1.0]]
        assert report["cross"] == [0, 1]  # one machine, as pslink launch reports it
        assert "root_rank must be an int in [0, 2), got 2" in report["bad_root"], rank
    base = [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]]
    for rank, report in enumerate(reports):
        # reducescatter: 5 rows over 2 workers, 3 to rank 0 and 2 to rank 1 (Horovod's split)
        share = base[:3] if rank == 0 else base[3:]
        assert report["scatter_sum"] == [[3 * v for v in row] for row in share]
        assert report["scatter_mean"] == [[1.5 * v for v in row] for row in share]
        assert report["scatter_traced"] == report["scatter_sum"]
        assert report["scatter_int"] == ([[6], [12]] if rank == 0 else [[18]])  # prescaled by 2, integers
        assert report["grouped_scatter"] == [[[2 * v for v in row] for row in share],
                                             [[0.0, 2.0]] if rank == 0 else [[4.0, 6.0]]]
        # alltoall: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 2 to rank 0, 1 to itself
        expected = [[[0], [10], [11]], [1, 2]] if rank == 0 else [[[1], [2], [12]], [2, 1]]
        assert report["alltoall"] == [*expected, "int32"]
        assert report["alltoall_traced"] == expected
        assert report["alltoall_equal"] == [[0], [1]]  # without splits, Horovod returns the rows alone
        assert report["grouped_gather"] == [[0, 1, 1], [[0], [1]]]
        assert report["fp16"] == [[0.75], "float32"]  # sent as float16, exact here, back as float32
        assert report["tape_fp16"] == [[1.5, 1.5], "float32"]
        assert "3 rows do not split evenly over 2 ranks" in report["uneven"]
        assert "splits [1, 1] must be 2 counts >= 0 adding up to the tensor's 3 rows" in report["bad_splits"]
        assert "reducescatter needs a tensor of at least one dimension" in report["scalar"]
        # join: step 1 averages both (1.5 x [1, 2]); steps 2 and 3, rank 0's and rank 1's zeros (0.5 x [1, 2])
        assert report["join_last"] == 0
        assert report["join_weights"] == ([-0.25, -1.5] if rank == 0 else [0.25, -0.5])
        # process sets: {1} and {0, 1}, each a job of its own
        assert report["set_ids"] == [1, 2] and report["set_ranks"] == [[-1, 0], [0, 1]][rank]
        assert "a process set of ranks [1] exists already" in report["set_again"]
        assert report["set_both"] == [3.0] and report["set_rows"] == [0, 1, 1]
        if rank == 1:
            assert report["set_alone"] == [2.0]  # its own value: the set has it alone
        else:
            assert "rank 0 is not in ProcessSet" in report["set_alone"]
        assert report["set_removed"] == [True, False] and report["set_world"] == [3.0]
        assert report["set_closed_at_shutdown"] is True  # a set's job is left with the process's
        assert report["tf_optimizer"] == [0.25, -0.5]  # 1 - 0.5 x 1.5 x [1, 2]
        # gradients as Horovod's: an all-reduce's is the all-reduce of the upstream ones; an
        # allgather's, the upstream averaged over the workers, this worker's rows; a broadcast's, the
        # upstream averaged, to the root alone (each then times the rank + 1 the value was scaled by)
        assert report["d_sum"] == ([2.0, 2.0] if rank == 0 else [4.0, 4.0])
        assert report["d_mean"] == [1.0, 1.0]
        assert report["d_gather"] == ([1.0, 2.0] if rank == 0 else [6.0, 8.0])
        assert report["d_bcast"] == ([1.0, 1.0] if rank == 0 else [0.0, 0.0])
        # the ranks' calls disagree: Horovod's FailedPreconditionError, eagerly also pslink's error
        assert report["eager_shapes"][1:] == [True, True] and report["eager_root"][1:] == [True, True]
        assert report["traced_shapes"] == ["FailedPreconditionError", True, False]
        # warmup over 2 epochs of 2 batches from 0.2 / 2 workers to 0.2, then the schedule's 0.2 x 0.5
        assert report["lr_seen"] == [0.125, 0.15, 0.175, 0.2, 0.1, 0.1]
        assert report["lr_logged"] == [0.15, 0.2, 0.1]
        assert "TF1's tf.compat.v1.train optimizers are not offered" in report["tf1_optimizer"]
    for rank, report in enumerate(reports):  # Horovod's smaller names (tf_extras.py)
        # rank, size, local rank and size, the size of the set {0}, included in the world, in {0}, unknown set
        assert report["ops_eager"] == [rank, 2]
        assert report["ops_traced"] == [rank, 2, rank, 2, 1, 1, 1 if rank == 0 else 0, -3]
        assert report["homogeneous"] is True
        assert report["broadcast_"] == [[1.0, 2.0], [1.0, 2.0]]  # rank 1's, in place and returned
        assert report["object_fn"] == {"rank": 1}
        assert "does not support eager execution" in report["global_eager"]
        assert report["global_graph"] == 10.0 and report["global_hook"] == 21.0  # rank 0's, rank 1's
        # the shared layer's gradient averaged over [1, 2] and [2, 2]; the local one kept, halved
        assert report["partial"][0] == [1.5, 2.0]
        assert report["partial"][1] == [v / 2 for v in report["partial_plain"][1]]
        assert report["tape_sum"] == [3.0, 4.0] and report["tape_predivided"] == [1.5, 2.0]
        assert report["tape_max"] == [2.0, 2.0]  # the larger of [1, 2] and [2, 2]
        assert report["syncbn_out"] < 1e-4 and report["syncbn_dx"] < 1e-4 and report["syncbn_moving"] < 1e-4
        assert "does not support fused=True" in report["syncbn_fused"]
        assert any("traced.by.timeline" in lane for lane in report["timeline_lanes"])
        assert not any("not.traced" in lane for lane in report["timeline_lanes"])
        assert report["loaded_class"] == ["SGD", True] and report["loaded_iterations"] == 1
        assert report["loaded_iterations_after"] == 2
        assert "BestModelCheckpoint has no filepath" in report["best_unset"] and report["best_saved"]
    assert reports[0]["loaded_weights"] == reports[1]["loaded_weights"]  # one averaged step from rank 0's
    # 3 epochs of 4 batches, a commit every 2 batches and one at each epoch's end: 3 a epoch
    assert reports[0]["elastic_fit"] == reports[1]["elastic_fit"] == [3, 0, [3, 6, 9]]
    assert reports[0]["elastic_weights"] == reports[1]["elastic_weights"]  # synced, then averaged
