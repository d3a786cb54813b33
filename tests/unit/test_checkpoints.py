"""Checkpoint files of parts: layout, round trip on a local disk and through fsspec, settings."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.core import checkpoints
from pslink.core.master.records import validate_settings
from pslink.errors import ConfigError, KeyStateError

STATE = {"closed": 10, "last_n": 2, "rounds_closed": 10, "arrays": ["value", "opt:momentum_buffer"],
         "scalars": {}, "open": [], "members": [[0, 1], {}], "epoch": 1, "init_rank": 0}


def test_a_part_round_trips_through_a_local_directory_and_replaces_atomically(tmp_path):
    path = checkpoints.part_path(str(tmp_path), "job/a", "layer.0/weight", 3)
    assert path == f"{tmp_path}/job%2Fa/layer.0%2Fweight/part-3.npz"  # names cannot climb directories
    arrays = [np.arange(5, dtype=np.float32), np.full(5, 0.5, np.float32)]
    checkpoints.write(path, STATE, arrays)
    checkpoints.write(path, dict(STATE, closed=15), [a + 1 for a in arrays])  # the newer replaces it
    state, got = checkpoints.read(path)
    assert state["closed"] == 15 and state["arrays"] == STATE["arrays"]
    np.testing.assert_array_equal(got[0], arrays[0] + 1)
    assert [p.name for p in (tmp_path / "job%2Fa" / "layer.0%2Fweight").iterdir()] == ["part-3.npz"]


def test_a_part_round_trips_through_an_fsspec_url():
    path = checkpoints.part_path("memory://pslink-test", "j", 7, 0)
    checkpoints.write(path, STATE, [np.ones(3, np.float64), np.zeros(3, np.float64)])
    state, arrays = checkpoints.read(path)
    assert state["closed"] == 10 and arrays[0].dtype == np.float64 and arrays[0].tolist() == [1, 1, 1]


def test_a_missing_checkpoint_is_a_key_state_error_naming_the_path(tmp_path):
    with pytest.raises(KeyStateError, match="no checkpoint at .*part-0.npz"):
        checkpoints.read(checkpoints.part_path(str(tmp_path), "j", "w", 0))


def test_the_writer_keeps_only_the_newest_snapshot_of_a_part_and_writes_it(tmp_path):
    writer = checkpoints.CheckpointWriter("agg-test")
    path = checkpoints.part_path(str(tmp_path), "j", "w", 0)
    for closed in (5, 10, 15):
        writer.submit(path, dict(STATE, closed=closed), [np.full(2, closed, np.float32), np.zeros(2, np.float32)])
    writer.flush()
    state, arrays = checkpoints.read(path)
    assert state["closed"] == 15 and arrays[0].tolist() == [15, 15]
    assert writer.failed == 0 and 1 <= writer.written <= 3


def test_checkpoint_settings_are_checked():
    settings = validate_settings({"optimizer": {"type": "sgd", "lr": 0.1}, "checkpoint": "/tmp/x",
                                  "checkpoint_every": 5})
    assert settings["checkpoint"] == "/tmp/x" and settings["checkpoint_every"] == 5
    # A sum-mode job's checkpoints hold its tables (its tensors' parts keep nothing between rounds).
    assert validate_settings({"checkpoint": "/tmp/x"})["checkpoint"] == "/tmp/x"
    with pytest.raises(ConfigError, match="checkpoint needs sync 'bsp' or 'ssp'"):
        validate_settings({"checkpoint": "/tmp/x", "sync": "asp"})
    with pytest.raises(ConfigError, match="checkpoint_every needs checkpoint"):
        validate_settings({"optimizer": {"type": "sgd", "lr": 0.1}, "checkpoint_every": 5})
    with pytest.raises(ConfigError, match="fsspec cannot write nosuchscheme:// URLs"):
        validate_settings({"optimizer": {"type": "sgd", "lr": 0.1}, "checkpoint": "nosuchscheme://bucket/x"})
    with pytest.raises(ConfigError, match="checkpoint must be a directory or an fsspec URL"):
        validate_settings({"optimizer": {"type": "sgd", "lr": 0.1}, "checkpoint": ""})
