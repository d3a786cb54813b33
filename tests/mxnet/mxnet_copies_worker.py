"""One worker of test_kvstore_copies.py: the pslink kvstore's zero-copy path against numpy.

Run by `pslink launch -n 2 python mxnet_copies_worker.py OUT_DIR SCENARIO`; writes
OUT_DIR/SCENARIO-RANK.json (or .npz for the Trainer's weights).
"""

from __future__ import annotations

import json
import os
import sys

import mxnet as mx
import numpy as np

import pslink.mxnet  # noqa: F401 - registers 'pslink'

#: (dtype, shape) of the keys the sums scenario checks
CASES = [("float32", (7,)), ("float32", (33, 65)), ("float64", (5, 4)), ("float16", (100,)),
         ("int32", (3, 3)), ("int64", (2, 2, 2))]


def value(rank: int, case: int, step: int) -> np.ndarray:
    """What a worker pushes (the other worker recomputes it)."""
    dtype, shape = CASES[case]
    rng = np.random.default_rng(1000 * step + 10 * case + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-1000, 1000, shape).astype(dtype)


def expected(case: int, step: int) -> np.ndarray:
    return value(0, case, step) + value(1, case, step)


def same(array, wanted: np.ndarray) -> bool:
    got = array.asnumpy()
    return got.dtype == wanted.dtype and got.shape == wanted.shape and bool(np.array_equal(got, wanted))


def sums(out: str) -> None:
    kv = mx.kv.create("pslink")
    rank = kv.rank
    record = {}
    keys = [f"case{i}" for i in range(len(CASES))]
    kv.init(keys, [mx.nd.zeros(shape, dtype=dtype) for dtype, shape in CASES])
    # Which path each key takes: every one without copies.
    record["lent"] = [kv._lent(kv._keys[k], [mx.nd.zeros(s, dtype=d)], [mx.nd.zeros(s, dtype=d)]) is not None
                      for k, (d, s) in zip(keys, CASES)]

    # 1: in place, one call per key; the result is complete when pushpull returns.
    arrays = [mx.nd.array(value(rank, i, 1), dtype=CASES[i][0]) for i in range(len(CASES))]
    for key, array in zip(keys, arrays):
        kv.pushpull(key, array)
    record["in_place"] = [same(a, expected(i, 1)) for i, a in enumerate(arrays)]

    # 2: into another array, all keys in one call.
    arrays = [mx.nd.array(value(rank, i, 2), dtype=CASES[i][0]) for i in range(len(CASES))]
    outs = [mx.nd.ones(s, dtype=d) for d, s in CASES]
    kv.pushpull(keys, arrays, out=outs)
    record["out"] = [same(o, expected(i, 2)) for i, o in enumerate(outs)]
    record["value_kept"] = [same(a, value(rank, i, 2)) for i, a in enumerate(arrays)]

    # 3: deferred, the value still being computed by MXNet's engine when pushpull takes it.
    # (Queued behind a long product, on MXNet's one CPU worker thread, each value is not there yet.)
    arrays = []
    busy = mx.nd.ones((1500, 1500))
    with kv.deferred():
        mx.nd.dot(busy, busy)
        for i, key in enumerate(keys):
            late = mx.nd.array(value(rank, i, 3), dtype=CASES[i][0]) * 1  # written by the engine, later
            kv.pushpull(key, late)
            arrays.append(late)
    record["deferred"] = [same(a, expected(i, 3)) for i, a in enumerate(arrays)]

    # 4: pull into a fresh array: the last round's sum.
    outs = [mx.nd.zeros(s, dtype=d) for d, s in CASES]
    kv.pull(keys, out=outs)
    record["pull"] = [same(o, expected(i, 3)) for i, o in enumerate(outs)]

    # 5: the copying path gives the same bytes.
    kv.zero_copy = False
    arrays = [mx.nd.array(value(rank, i, 4), dtype=CASES[i][0]) for i in range(len(CASES))]
    for key, array in zip(keys, arrays):
        kv.pushpull(key, array)
    record["copied"] = [same(a, expected(i, 4)) for i, a in enumerate(arrays)]
    kv.zero_copy = True

    # 6: a reader queued on the result right after pushpull sees the sum, not the value.
    big = mx.nd.array(value(rank, 1, 5))
    kv.pushpull("case1", big)
    doubled = big * 2
    record["read_after"] = same(doubled, expected(1, 5) * 2)
    # 7: one key twice in one deferral: two rounds, each result in its own array.
    first, second = (mx.nd.array(value(rank, 0, step)) for step in (6, 7))
    with kv.deferred():
        kv.pushpull("case0", first)
        kv.pushpull("case0", second)
    record["twice"] = same(first, expected(0, 6)) and same(second, expected(0, 7))
    with open(os.path.join(out, f"sums-{rank}.json"), "w") as f:
        json.dump(record, f)
    kv.close()


def trainer(out: str, on_kvstore: bool) -> None:
    from mxnet import autograd, gluon

    kv = mx.kv.create("pslink")
    rank = kv.rank
    mx.random.seed(7)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(64, activation="relu", in_units=32), gluon.nn.Dense(48, activation="relu"),
            gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    params = net.collect_params()
    trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kvstore=kv,
                            update_on_kvstore=on_kvstore)
    rng = np.random.default_rng(rank)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(4):
        x = mx.nd.array(rng.standard_normal((16, 32)).astype(np.float32))
        y = mx.nd.array(rng.integers(0, 10, 16).astype(np.float32))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(16)
    mode = "service" if on_kvstore else "workers"
    np.savez(os.path.join(out, f"trainer-{mode}-{os.environ.get('PSLINK_MXNET_ZERO_COPY', '1')}-{rank}.npz"),
             **{name: p.data().asnumpy() for name, p in params.items()})
    kv.close()


if __name__ == "__main__":
    directory, scenario = sys.argv[1], sys.argv[2]
    if scenario == "sums":
        sums(directory)
    else:
        trainer(directory, on_kvstore=scenario == "trainer-service")
