"""The collectives shared by the framework adapters: keys, roots, operators, and one list of
Horovod's names that every adapter is held to."""

from __future__ import annotations

import importlib
import sys
import importlib.util

import numpy as np
import pytest

from pslink.core.worker import collectives
from pslink.core.worker.collectives import HOROVOD_GAPS, HOROVOD_MODULE_NAMES, HOROVOD_NAMES, MAX_KEY_LENGTH, Zeros, service_key
from pslink.errors import ConfigError


def test_keys_join_their_parts_and_stay_within_the_service_limit():
    assert service_key("allreduce", "w") == "allreduce/w"
    assert service_key("tf.var", "dense/kernel", "float32", (2, 3)) == "tf.var/dense/kernel/float32/(2, 3)"
    long = service_key("grad", "x" * 400)
    assert len(long) == MAX_KEY_LENGTH and long.startswith("grad/xxx")
    assert service_key("grad", "x" * 400) == long  # the same on every rank
    assert service_key("grad", "x" * 401) != long  # and distinct for distinct names


@pytest.mark.parametrize("root", [-1, 3, True, 1.0, "0", None])
def test_a_root_outside_the_job_is_refused_naming_the_call(root):
    with pytest.raises(ConfigError, match=r"broadcast_object: root_rank must be an int in \[0, 3\)"):
        collectives.check_root(root, 3, "broadcast_object")


def test_reduce_op_follows_horovods_rules():
    assert collectives.reduce_op(None) is collectives.Average
    assert collectives.reduce_op(None, average=True) is collectives.Average
    assert collectives.reduce_op(None, average=False) is collectives.Sum
    assert collectives.reduce_op(collectives.Sum) is collectives.Sum
    with pytest.raises(ConfigError, match="not both"):
        collectives.reduce_op(collectives.Sum, average=True)
    with pytest.raises(ConfigError, match="Adasum is not supported"):
        collectives.reduce_op(collectives.Adasum)
    with pytest.raises(ConfigError, match="Average, Sum, Min, Max or Product, got 'max'"):
        collectives.reduce_op("max")
    # Min, Max and Product only where the adapter reduces them itself (torch's, from gathered rows).
    with pytest.raises(ConfigError, match="op=Max is not supported here"):
        collectives.reduce_op(collectives.Max)
    assert collectives.reduce_op(collectives.Product, elementwise=True) is collectives.Product


def test_pslink_errors_are_runtime_errors_as_horovods_are():
    import pslink.torch as hvd
    from pslink.errors import PeerError, PslinkTimeoutError, ShapeMismatchError

    for error in (ShapeMismatchError("x"), PeerError("x"), PslinkTimeoutError("x"), ConfigError("x")):
        assert isinstance(error, RuntimeError) and isinstance(error, hvd.HorovodInternalError)
    assert isinstance(PeerError("x"), ConnectionError) and isinstance(ConfigError("x"), ValueError)


def test_non_roots_push_read_only_zeros_cut_from_one_buffer():
    zeros = Zeros()
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)]
    assert collectives.broadcast_pushes(arrays, rank=1, root=1, zeros=zeros) == arrays
    pushed = collectives.broadcast_pushes(arrays, rank=0, root=1, zeros=zeros)
    assert [p.shape for p in pushed] == [(2, 3), (4,)] and not any(p.any() for p in pushed)
    assert not pushed[0].flags.writeable
    assert np.shares_memory(pushed[0], pushed[1])  # one buffer per dtype, not one per tensor


def _pushpull_of(contributions: dict):
    """A PushPull in which the other ranks' contributions to each key are known in advance (the
    gathers push every element's bits as integers: so are the contributions summed here)."""

    def pushpull(key, array, out):
        out[...] = array + sum(collectives.bits_of(np.ascontiguousarray(c)) for c in contributions.get(key, []))
        return out

    return pushpull


def test_gathers_and_broadcasts_push_bits_so_negative_zero_and_nan_payloads_survive():
    row = np.array([-0.0, np.float32(np.nan), 1.5], np.float32)
    row.view(np.int32)[1] |= 0x7  # a NaN with a payload
    pushed = []

    def pushpull(key, array, out):  # the sum of this rank's push and another rank's zeros
        pushed.append(array.dtype)
        out[...] = array + np.zeros_like(array)
        return out

    gathered, rows = collectives.gather_rows(pushpull, "x", row.reshape(1, 3), 0, 1)
    assert gathered.tobytes() == row.tobytes() and list(rows) == [1]
    assert all(dtype.kind in "iu" for dtype in pushed)
    assert collectives.bits_of(row).dtype == np.int32 and np.shares_memory(collectives.bits_of(row), row)
    with pytest.raises(ValueError, match="contiguous"):
        collectives.bits_of(np.zeros((4, 4), np.float32)[:, 1])


def test_gather_rows_concatenates_uneven_rows_in_rank_order():
    # Rank 1 of 3 brings 2 rows; ranks 0 and 2 bring 1 and 3 (their rows arrive through the sum).
    shapes_key = service_key("allgather", "x", "shapes")
    others_shapes = np.zeros((3, 1 + collectives.MAX_GATHER_DIMS), np.int64)
    others_shapes[0, :3] = [2, 1, 2]
    others_shapes[2, :3] = [2, 3, 2]
    data_key = service_key("allgather", "x", "6x2")
    others = np.zeros((6, 2), np.float32)
    others[0] = [1, 1]
    others[3:] = 3
    pushpull = _pushpull_of({shapes_key: [others_shapes], data_key: [others]})
    gathered, rows = collectives.gather_rows(pushpull, "x", np.full((2, 2), 2, np.float32), rank=1, size=3)
    assert rows.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(gathered[:, 0], [1, 2, 2, 3, 3, 3])


def test_gather_rows_names_every_ranks_shape_when_trailing_dimensions_differ():
    shapes_key = service_key("allgather", "x", "shapes")
    others_shapes = np.zeros((2, 1 + collectives.MAX_GATHER_DIMS), np.int64)
    others_shapes[1, :3] = [2, 4, 5]
    pushpull = _pushpull_of({shapes_key: [others_shapes]})
    with pytest.raises(Exception, match=r"rank 0 has shape \(2, 3\), rank 1 has shape \(4, 5\)"):
        collectives.gather_rows(pushpull, "x", np.zeros((2, 3), np.float32), rank=0, size=2)


# -- one list of Horovod's names, for every adapter -------------------------------------------------


def _import_adapter(name: str):
    framework = {"pslink.torch": "torch", "pslink.tf": "tensorflow", "pslink.tf.keras": "tensorflow",
                 "pslink.tf.keras.callbacks": "tensorflow", "pslink.mxnet.horovod": "mxnet"}[name]
    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed (CI installs it)")
    if framework == "mxnet" and "tensorflow" in sys.modules and "mxnet" not in sys.modules:
        pytest.skip("TensorFlow is loaded in this process already, and MXNet imported after it segfaults")
    if framework == "tensorflow" and importlib.util.find_spec("mxnet") is not None:
        importlib.import_module("mxnet")  # MXNet before TensorFlow in one process, or MXNet segfaults later
    return importlib.import_module(name)


@pytest.mark.parametrize("adapter", sorted(HOROVOD_GAPS))
def test_each_adapter_exports_horovods_names_but_its_listed_gaps(adapter):
    module = _import_adapter(adapter)
    public = set(module.__all__)
    gaps = set(HOROVOD_GAPS[adapter])
    shared = HOROVOD_NAMES if adapter != "pslink.tf.keras.callbacks" else frozenset()
    expected = shared | HOROVOD_MODULE_NAMES[adapter]
    assert not expected - public - gaps, f"{adapter} lacks Horovod names not listed as gaps"
    assert not gaps & public, f"{adapter} now offers {gaps & public}: take them off HOROVOD_GAPS"
    assert all(hasattr(module, name) for name in module.__all__)


def test_gaps_are_horovod_names_and_each_adapter_is_listed():
    for adapter, gaps in HOROVOD_GAPS.items():
        assert set(gaps) <= HOROVOD_NAMES | HOROVOD_MODULE_NAMES[adapter], adapter
        assert all(reason for reason in gaps.values())
    assert set(HOROVOD_GAPS) == set(HOROVOD_MODULE_NAMES) == {
        "pslink.torch", "pslink.tf", "pslink.tf.keras", "pslink.tf.keras.callbacks", "pslink.mxnet.horovod"}


@pytest.mark.parametrize("adapter", ["pslink.torch", "pslink.tf"])
def test_the_shared_names_are_the_shared_objects(adapter):
    module = _import_adapter(adapter)
    for name in ("Average", "Sum", "Adasum", *collectives.NOT_BUILT):
        assert getattr(module, name) is getattr(collectives, name), name
    assert not any(getattr(module, name)() for name in collectives.NOT_BUILT)
