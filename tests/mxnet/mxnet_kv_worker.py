"""One worker of test_mxnet_kvstore.py: uses the kvstore API directly and records what it sees.

Run by `pslink launch -n 2 python mxnet_kv_worker.py OUT_DIR SCENARIO`; writes OUT_DIR/SCENARIO-RANK.json
(arrays as nested lists). The test compares the records with MXNet's documented results.
"""

from __future__ import annotations

import json
import os
import sys

import mxnet as mx
import numpy as np

import pslink.mxnet
from pslink.mxnet import KVStoreError

SHAPE = (2, 3)


def seen(array) -> list:
    return array.asnumpy().tolist()


def gradient(step: int, rank: int) -> np.ndarray:
    """The gradient a worker pushes at a step (the test recomputes it)."""
    return np.random.default_rng(100 * step + rank).standard_normal(SHAPE).astype(np.float32)


def dist_sync() -> dict:
    kv = mx.kv.create("pslink")  # job, rank and size from what `pslink launch` set
    rank = kv.rank
    record = {
        "class": type(kv).__name__, "type": kv.type, "rank": rank, "num_workers": kv.num_workers,
        "capable": kv.is_capable("optimizer"),
    }
    try:
        kv.is_capable("sparse")
    except ValueError as exc:
        record["unknown_capability"] = str(exc)

    # MXNet's KVStore tutorial, on 2 workers: pushes are summed over workers (and devices).
    kv.init(3, mx.nd.ones(SHAPE) * 2)
    a = mx.nd.zeros(SHAPE)
    kv.pull(3, out=a)
    record["init"] = seen(a)
    kv.push(3, mx.nd.ones(SHAPE) * 8)
    kv.pull(3, out=a)
    record["push_8"] = seen(a)
    kv.push(3, [mx.nd.ones(SHAPE)] * 4)  # one value per device: summed on the worker first
    b = [mx.nd.zeros(SHAPE), mx.nd.zeros(SHAPE)]
    kv.pull(3, out=b)  # pulled to every device
    record["push_4_devices"] = [seen(x) for x in b]

    # String keys and lists of keys.
    kv.init(["w", "b"], [mx.nd.full((4,), 2.0), mx.nd.zeros((2, 2))])
    kv.push(["w", "b"], [mx.nd.full((4,), rank + 1.0), mx.nd.ones((2, 2)) * (rank + 1) * 10])
    outs = [mx.nd.zeros((4,)), mx.nd.zeros((2, 2))]
    kv.pull(["w", "b"], out=outs)
    record["str_keys"] = [seen(x) for x in outs]

    # pushpull: into the pushed value itself, then into out.
    kv.init(5, mx.nd.zeros(SHAPE))
    value = mx.nd.full(SHAPE, rank + 1.0)
    kv.pushpull(5, value)
    record["pushpull_in_place"] = seen(value)
    out = mx.nd.zeros(SHAPE)
    kv.pushpull(5, mx.nd.ones(SHAPE) * 10, out=out)
    record["pushpull_out"] = seen(out)

    # broadcast: rank 0's value everywhere.
    outs = [mx.nd.zeros(SHAPE), mx.nd.zeros(SHAPE)]
    kv.broadcast(7, mx.nd.full(SHAPE, 10.0 + rank), out=outs)
    record["broadcast"] = [seen(x) for x in outs]

    # Integer values and int32 keys of numpy.
    kv.init(np.int32(8), mx.nd.ones((3,), dtype="int32"))
    kv.push(8, mx.nd.ones((3,), dtype="int32") * (rank + 1))
    ints = mx.nd.zeros((3,), dtype="int32")
    kv.pull(8, out=ints)
    record["int32"] = seen(ints)
    kv.barrier()
    kv.close()
    return record


def optimizer_on_service() -> dict:
    """SGD with momentum on the service: set_optimizer, lr changes, save and load."""
    kv = pslink.mxnet.PSLink(job=os.environ["PSLINK_JOB"] + "-sgd")
    rank = kv.rank
    opt = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=0.5, clip_gradient=1.0)
    kv.set_optimizer(opt)
    kv.init(0, mx.nd.array(np.arange(6, dtype=np.float32).reshape(SHAPE) / 10))
    record = {"type": kv.type, "weights": []}
    w = mx.nd.zeros(SHAPE)
    for step in range(4):
        if step == 2:
            opt.set_learning_rate(0.05)  # as Trainer.set_learning_rate does
        kv.push(0, mx.nd.array(gradient(step, rank)))
        kv.pull(0, out=w)
        record["weights"].append(seen(w))
    path = os.path.join(sys.argv[1], f"states-{rank}")
    kv.save_optimizer_states(path, dump_optimizer=True)
    # A different optimizer, then the saved one back: the service continues with lr 0.05.
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=1.0, momentum=0.9, wd=0.01, rescale_grad=0.5, clip_gradient=1.0))
    kv.load_optimizer_states(path)
    record["loaded_lr"] = kv._updater.optimizer.lr
    kv.pushpull(0, mx.nd.array(gradient(4, rank)), out=w)
    record["after_load"] = seen(w)
    kv.close()
    return record


def asynchronous() -> dict:
    """dist_async: every push is applied by itself, at once; SGD without momentum."""
    kv = mx.kv.create("pslink_async")
    record = {"type": kv.type}
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.1))
    kv.init("w", mx.nd.zeros(SHAPE))
    for _ in range(5):
        kv.push("w", mx.nd.ones(SHAPE))
    kv.barrier()  # everyone's pushes are in
    w = mx.nd.zeros(SHAPE)
    kv.pull("w", out=w)
    record["after_all_pushes"] = seen(w)
    kv.close()
    return record


def shape_conflict() -> dict:
    """The workers init one key with different shapes: each must get an error, not wait."""
    kv = mx.kv.create("pslink")
    shape = (2, 3) if kv.rank == 0 else (3, 2)
    record = {}
    try:
        kv.init(4, mx.nd.ones(shape))
        # This worker declared the key first. Its round cannot close (the other worker has no
        # such key to push), so only the service's abort of the key ends this wait.
        kv.pushpull(4, mx.nd.ones(shape))
        record["error"] = None
    except mx.base.MXNetError as exc:
        record.update(error=str(exc), cls=type(exc).__name__, key=exc.key, shapes=exc.shapes)
    kv.close()
    return record


def pulls_while_recording() -> dict:
    """MXNet's nightly dist_sync_kvstore.py --type=gluon_sparse_step_cpu: a row_sparse Parameter's
    rows are pulled (Parameter.row_sparse_data) inside autograd.record(), then stepped on the
    store; and a dense pull into an array that is in the graph, which MXNet's own store allows."""
    kv = mx.kv.create("pslink")
    rank = kv.rank
    x = mx.gluon.Parameter("x", shape=(2, 10), stype="row_sparse", grad_stype="row_sparse")
    x.initialize(ctx=mx.cpu(0), init="ones")
    trainer = mx.gluon.Trainer([x], "sgd", {"learning_rate": 1.0}, kvstore=kv)
    all_rows = mx.nd.arange(0, 2)
    with mx.autograd.record():
        w = x.row_sparse_data(all_rows)  # the first one also inits the key on the store
        y = (rank + 1) * w
        y.backward()
    trainer.step(1)
    record = {"sparse_step": seen(x.row_sparse_data(all_rows))}

    kv.init("dense", mx.nd.full(SHAPE, 5.0))
    a = mx.nd.zeros(SHAPE)
    a.attach_grad()
    with mx.autograd.record():
        kv.pull("dense", out=a)
        loss = (a * 3).sum()
    loss.backward()
    record["dense_pull"] = seen(a)
    record["dense_grad"] = seen(a.grad)
    kv.close()
    return record


def main() -> int:
    out_dir, scenario = sys.argv[1], sys.argv[2]
    scenarios = {"dist_sync": dist_sync, "optimizer": optimizer_on_service, "async": asynchronous,
                 "shape_conflict": shape_conflict, "record": pulls_while_recording}
    record = scenarios[scenario]()
    rank = int(os.environ["PSLINK_RANK"])
    with open(os.path.join(out_dir, f"{scenario}-{rank}.json"), "w") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KVStoreError as exc:
        print(f"KVStoreError: {exc}", flush=True)
        sys.exit(2)
