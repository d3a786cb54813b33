"""The pslink kvstore's zero-copy path (values sent from, and results received into, the NDArrays'
own memory; gluon.Trainer's pushpulls issued together and settled once) gives exactly the numbers
of the copying path: the sums numpy computes, and a Trainer's weights bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

mx = pytest.importorskip("mxnet", reason="MXNet 1.9.1 is not installed (CI installs it: pip install '.[mxnet]')")

import pslink.mxnet  # noqa: E402, F401
from pslink.core.service import Service  # noqa: E402
from pslink.mxnet.kvstore import _view  # noqa: E402
from tests.mxnet.mxnet_copies_worker import CASES  # noqa: E402
from tests.mxnet.mxnet_procs import HERE, launch  # noqa: E402

WORKER = HERE / "mxnet_copies_worker.py"


@pytest.fixture(scope="module")
def service():
    with Service(aggregators=2) as s:
        yield s


def test_a_view_is_the_ndarrays_memory_and_keeps_it_alive():
    array = mx.nd.arange(12, dtype="float32").reshape((3, 4))
    view = _view(array, np.dtype("float32"), writable=True)
    view[1, 2] = -5
    assert array[1, 2].asscalar() == -5
    del array
    mx.nd.ones((64, 64)).wait_to_read()  # memory freed too early would likely be reused here
    assert view[1, 2] == -5 and view.sum() == sum(range(12)) - 6 - 5
    read = _view(mx.nd.ones(5), np.dtype("float32"), writable=False)
    assert not read.flags.writeable and read.tolist() == [1.0] * 5


def test_no_view_where_the_memory_is_not_one_dense_cpu_array_of_the_keys_dtype():
    assert _view(mx.nd.ones(4, dtype="float16"), np.dtype("float32"), writable=False) is None
    assert _view(mx.nd.ones(4, ctx=mx.cpu_pinned()), np.dtype("float32"), writable=True) is None
    assert _view(mx.nd.ones((4, 2)).tostype("row_sparse"), np.dtype("float32"), writable=False) is None


@pytest.mark.integration
def test_zero_copy_results_equal_the_numpy_sums(service, tmp_path):
    code, out = launch(WORKER, [tmp_path, "sums"], service.address, job="copies-sums")
    assert code == 0, out
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"sums-{rank}.json").read_text())
        assert seen["lent"] == [True] * len(CASES), seen
        for what in ("in_place", "out", "value_kept", "deferred", "pull", "copied"):
            assert seen[what] == [True] * len(CASES), (what, seen)
        assert seen["read_after"] is True
        assert seen["twice"] is True


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["workers", "service"])
def test_a_trainers_weights_are_the_same_bit_for_bit_with_and_without_copies(service, tmp_path, monkeypatch, mode):
    for zero_copy in ("0", "1"):
        monkeypatch.setenv("PSLINK_MXNET_ZERO_COPY", zero_copy)
        code, out = launch(WORKER, [tmp_path, f"trainer-{mode}"], service.address, job=f"copies-{mode}-{zero_copy}")
        assert code == 0, out
    for rank in (0, 1):
        copied = np.load(tmp_path / f"trainer-{mode}-0-{rank}.npz")
        lent = np.load(tmp_path / f"trainer-{mode}-1-{rank}.npz")
        assert sorted(copied.files) == sorted(lent.files)
        for name in copied.files:
            assert np.array_equal(copied[name], lent[name]), name
    initial = np.load(tmp_path / f"trainer-{mode}-1-0.npz")
    assert all(np.isfinite(initial[n]).all() for n in initial.files)
