"""Two TensorFlow worker processes train through a real service, four ways, against references.

One launch (tf_worker.py ``all``) runs Keras ``model.fit`` under ParameterServiceStrategy, a custom
loop under the strategy, the Keras DistributedOptimizer wrapper and the DistributedGradientTape;
rank 0 then trains single-process references on the combined batches. For each way: after every
epoch both workers hold bitwise the same weights (they apply the same summed gradients), those
equal the reference within float32 rounding, and the loss fell (the model learned).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow", reason="TensorFlow is not installed (CI installs it: pip install '.[tf]')")

import tf_harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WAYS = ["fit", "loop", "optimizer", "tape"]
EPOCHS = 3
LAYERS = 4  # kernel and bias of two Dense layers


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("tf-training")
    outcome = tf_harness.launch_worker("all", str(outdir), timeout=420)
    assert outcome.code == 0 and not outcome.timed_out, outcome.describe()
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} done" in outcome.output
    return outdir


def load(outdir, way):
    return [np.load(outdir / f"{way}_{who}.npz") for who in ("rank0", "rank1", "reference")]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("way", WAYS)
def test_workers_hold_the_same_weights_after_every_epoch(results, way):
    rank0, rank1, _ = load(results, way)
    # Each worker drew its own initial weights: equal weights later show rank 0's were broadcast.
    assert not np.array_equal(rank0["initial_0"], rank1["initial_0"])
    for epoch in range(EPOCHS):
        for i in range(LAYERS):
            name = f"epoch{epoch}_{i}"
            np.testing.assert_array_equal(rank0[name], rank1[name], err_msg=f"{way}: {name} differs between workers")


@pytest.mark.timeout(480)
@pytest.mark.parametrize("way", WAYS)
def test_weights_equal_single_process_training_on_the_combined_batch(results, way):
    rank0, _, reference = load(results, way)
    for i in range(LAYERS):
        np.testing.assert_array_equal(rank0[f"initial_{i}"], reference[f"initial_{i}"])
    for epoch in range(EPOCHS):
        for i in range(LAYERS):
            name = f"epoch{epoch}_{i}"
            np.testing.assert_allclose(rank0[name], reference[name], rtol=1e-4, atol=1e-5,
                                       err_msg=f"{way}: {name} is not what one process training on both "
                                               f"workers' batches gets")


@pytest.mark.timeout(480)
@pytest.mark.parametrize("way", WAYS)
def test_training_converges(results, way):
    rank0, rank1, reference = load(results, way)
    for data in (rank0, rank1, reference):
        losses = data["losses"]
        assert losses[-1] < losses[0] / 3, f"{way}: the loss went from {losses[0]:.3f} to {losses[-1]:.3f}"
    if "accuracy" in rank0:
        assert float(rank0["accuracy"]) > 0.85, f"{way}: accuracy {float(rank0['accuracy']):.3f} on the data set"


@pytest.mark.timeout(480)
def test_reported_losses_are_the_mean_over_workers(results):
    # The custom loop reduces its loss with strategy.reduce(SUM) of losses scaled by
    # num_replicas_in_sync, the tape loop with pslink.tf.allreduce, the optimizer run averages
    # Keras' logs with MetricAverageCallback: each is the loss over both workers' batches.
    for way in ("loop", "tape", "optimizer"):
        rank0, rank1, reference = load(results, way)
        np.testing.assert_array_equal(rank0["losses"], rank1["losses"])
        np.testing.assert_allclose(rank0["losses"], reference["losses"], rtol=1e-4)


def test_an_embeddings_sparse_gradient_is_reduced_as_slices_and_trains_as_one_process(tmp_path):
    outcome = tf_harness.launch([sys.executable, str(tf_harness.HERE / "tf_sparse_worker.py"), str(tmp_path)])
    assert outcome.code == 0 and not outcome.timed_out, outcome.describe()
    reference = np.load(tmp_path / "sparse_reference.npz")
    for rank in (0, 1):
        got = np.load(tmp_path / f"sparse_rank{rank}.npz")
        assert int(got["sparse"]) > 0  # the embedding's gradient went the sparse way
        for name in ("arr_0", "arr_1", "arr_2"):  # embedding, kernel, bias
            np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-6)
