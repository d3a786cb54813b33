"""Horovod's gathers, object collectives and barrier in pslink.tf (the shared collectives of
pslink.core.collectives), between two TensorFlow worker processes on a real service."""

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
