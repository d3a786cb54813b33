"""TensorFlow with groups (`pslink launch --sync local:2 --groups 2`): Keras model.fit on 4
workers as 2 groups of 2, under ParameterServiceStrategy and with the Horovod API's
DistributedOptimizer, step by step against a one-process reference."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow", reason="TensorFlow is not installed (CI installs it: pip install '.[tf]')")

import tf_harness

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("way", ["strategy", "optimizer"])
def test_model_fit_as_two_groups_averages_them_every_second_step(tmp_path, way):
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (the workers train on its digits)")
    worker = tf_harness.HERE / "tf_groups_worker.py"
    outcome = tf_harness.launch([sys.executable, str(worker), way, str(tmp_path)], workers=4, timeout=240,
                                env={"PSLINK_SYNC": "local:2", "PSLINK_GROUPS": "2"})  # what --sync, --groups set
    assert outcome.code == 0 and not outcome.timed_out, outcome.describe()
    ranks = [np.load(tmp_path / f"rank{rank}.npz") for rank in range(4)]
    reference = np.load(tmp_path / "reference.npz")
    steps = len([k for k in ranks[0] if k.endswith("_0")])
    assert steps == 10
    for step in range(steps):
        for rank, weights in enumerate(ranks):
            for i in range(4):
                np.testing.assert_allclose(weights[f"step{step}_{i}"], reference[f"g{rank // 2}_step{step}_{i}"],
                                           rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}, step {step + 1}, weight {i}")
        # Within a group one model; between groups one only after a sync (every second step).
        same = [np.array_equal(ranks[0][f"step{step}_{i}"], ranks[r][f"step{step}_{i}"]) for r in (1, 2) for i in range(4)]
        assert all(same[:4]) and all(same[4:]) == (step % 2 == 1), f"step {step + 1}"
