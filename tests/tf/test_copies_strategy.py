"""The strategy's reductions through its graph path (buckets pushed as backward produces them,
sums received into reused buffers) and its eager path equal numpy's sum and mean of the workers'
values, for several shapes and dtypes, bucketed or not; and how the buckets are made."""

from __future__ import annotations

import sys

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("tensorflow", reason="TensorFlow is not installed (CI installs it: pip install '.[tf]')")

import tf_harness

from pslink.core.worker.buckets import LEAST_SHARE
from pslink.tf.strategy import buckets

sys.path.insert(0, str(tf_harness.HERE))
import tf_copies_worker as worker


def expected(step: int) -> list[np.ndarray]:
    per_rank = [worker.values(rank, step) for rank in range(worker.WORKERS)]
    made = []
    for i, (_, dtype, reduction) in enumerate(worker.SPECS):
        arrays = [values[i] for values in per_rank]
        if dtype == "bfloat16":  # carried as float32: rounded to bfloat16 before and after
            import tensorflow as tf

            arrays = [tf.cast(tf.cast(a, tf.bfloat16), tf.float32).numpy() for a in arrays]
            total = arrays[0] + arrays[1]
            result = total / np.float32(worker.WORKERS) if reduction == "mean" else total
            made.append(tf.cast(tf.cast(result, tf.bfloat16), tf.float32).numpy())
            continue
        total = arrays[0] + arrays[1]
        if reduction == "sum":
            made.append(total)
        elif np.issubdtype(total.dtype, np.integer):
            made.append(total // worker.WORKERS)  # MEAN of integers rounds down, as the strategy's
        else:
            made.append(total / total.dtype.type(worker.WORKERS))
    return made


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("copies")
    outcome = tf_harness.launch([sys.executable, str(tf_harness.HERE / "tf_copies_worker.py"), str(outdir)],
                                timeout=180)
    assert outcome.code == 0 and not outcome.timed_out, outcome.describe()
    return [np.load(outdir / f"copies_rank{rank}.npz") for rank in range(worker.WORKERS)]


@pytest.mark.parametrize("step", range(worker.STEPS))
def test_graph_reductions_equal_numpy_bit_for_bit_on_every_rank(results, step):
    for got in results:
        for i, want in enumerate(expected(step)):
            np.testing.assert_array_equal(got[f"graph{step}_{i}"], want, err_msg=f"value {i} {worker.SPECS[i]}")


def test_eager_reductions_equal_numpy_bit_for_bit(results):
    for got in results:
        for i, want in enumerate(expected(0)):
            np.testing.assert_array_equal(got[f"eager_{i}"], want, err_msg=f"value {i} {worker.SPECS[i]}")


def test_the_graph_path_made_several_buckets_and_one(results):
    for got in results:
        counts = list(got["buckets"])
        assert max(counts) > 1 and min(counts) == 1, counts  # the means are bucketed, the sums are not


def test_buckets_hold_every_value_once_last_values_first():
    sizes = [1 << 18, 10, 1 << 18, 1 << 18, 5, 1 << 20]  # 1 MiB, 40 B, 1 MiB, 1 MiB, 20 B, 4 MiB
    made = buckets(sizes, [4] * len(sizes), 16 << 20)
    assert sorted(i for bucket in made for i in bucket) == list(range(len(sizes)))
    assert made == [[5], [0, 1, 2, 3, 4]]  # 4 MiB: over a third of the total (7 MiB) on its own


def test_a_small_model_is_one_bucket_and_the_fusion_threshold_caps_one():
    assert buckets([1000] * 10, [4] * 10, 16 << 20) == [list(range(10))]  # under LEAST_SHARE: one request
    made = buckets([LEAST_SHARE] * 6, [1] * 6, LEAST_SHARE)
    assert made == [[i] for i in reversed(range(6))]
    assert buckets([], [], 0) == []
