"""What each copy and conversion of a gradient costs here, per MB: the steps of the copy budget.

    python benchmarks/copy_costs.py                 # 4 MiB (a part) and 64 MiB payloads
    python benchmarks/copy_costs.py --mib 25        # one size: DDP's bucket
    python benchmarks/copy_costs.py --quick

A gradient travels from the framework's tensor to the Aggregator's sum and back; docs/transport.md
("The copy budget") lists every step of every adapter. This script times each kind of step alone,
in one process, on the same payload size, with the real code that makes it where there is one
(the shared-memory ring's ``place`` / ``take`` / ``lend``, the Aggregator's ``Summer``, the Agent's
division on the way out of a ring) and the frameworks' own conversions where they are installed
(a framework that is not is named as skipped). Each step is repeated until it ran ``--seconds``;
the figure is the median of ``--repeats`` such runs, in ms per MB (1 MB = 2^20 bytes). Sizes up
to 32 MiB may come back to new arrays from glibc's heap, pages already touched; larger ones are
mapped fresh each time, and their first touch is what "into new memory" costs.

These are costs of one step on an idle core: in a training step they share the two cores with the
workers' compute, which is why a copy removed is worth more there than its figure here. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

MB = 1 << 20
#: facts a step's figure rests on, checked while the steps are made (printed with the table)
CHECKS: dict[str, bool] = {}


def timed(step: Callable[[], object], nbytes: int, seconds: float, repeats: int) -> float:
    """Median ms per MB of ``step`` over ``repeats`` runs of about ``seconds`` each."""
    step()  # first touch of the pages and caches: not part of the steady state
    per_mb = []
    for _ in range(repeats):
        count, started = 0, time.perf_counter()
        while True:
            step()
            count += 1
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                break
        per_mb.append(elapsed / count / (nbytes / MB) * 1e3)
    return statistics.median(per_mb)


def common_steps(nbytes: int) -> dict[str, Callable[[], object]]:
    """The path every adapter shares: Agent -> ring -> Aggregator's sum -> ring -> Agent."""
    from pslink.core.aggregator.tasks import Summer
    from pslink.core.transport.shm import ReceiveRing, SendRing

    n = nbytes // 4
    grad = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    acc = grad.copy()
    out = np.empty_like(grad)
    ring = SendRing(2 * nbytes)  # room for two payloads (a 16 MiB ring holds four 4 MiB parts)...
    reader = ReceiveRing(ring.fd, ring.capacity, "copy_costs")
    summer = Summer(threads=1)
    payload = memoryview(grad).cast("B")

    def into_ring():  # the sender's copy (Agent's push, Aggregator's reply): place() and its bookkeeping
        position = ring.place(payload)
        reader.lend(position, nbytes)
        reader.settle()

    for _ in range(2):  # ...and both their places touched once: a ring in use has its pages
        into_ring()

    # The receiver's steps read a payload where it lies in the ring (what ReceiveRing.lend hands
    # out), without placing it again each time: their rows are the receiver's cost alone.
    position = ring.place(payload)
    in_ring = np.frombuffer(reader.lend(position, nbytes), np.float32)
    return {
        "numpy copy into a reused buffer (np.copyto), for reference": lambda: np.copyto(out, grad),
        "numpy copy into new memory (np.array(a)): page faults": lambda: np.array(grad),
        "copy into a ring (Agent's push, Aggregator's reply)": into_ring,
        "copy out of a ring into a pooled buffer (Aggregator, a round's first push)":
            lambda: np.copyto(out, in_ring),
        "sum from a ring in place (Aggregator, a round's later pushes)": lambda: summer.add(acc, in_ring),
        "divide out of a ring into out= (Agent, average=True)": lambda: np.divide(in_ring, 2, out=out),
        "divide in place, a separate pass (np.divide(a, n, out=a))": lambda: np.divide(acc, 2, out=acc),
    }


def torch_steps(nbytes: int) -> dict[str, Callable[[], object]]:
    """DDP's copies around the hook, the staging of what the wire cannot take as it is, and
    ``hvd.allreduce``'s result (docs/torch.md)."""
    import torch

    torch.set_num_threads(1)  # as the benchmarks' workers run it: 2 workers on 2 cores
    n = nbytes // 4
    grad = torch.randn(n)
    bucket = torch.empty(n)
    in_ring = np.random.default_rng(0).standard_normal(n, dtype=np.float32)  # stands for a ring's payload
    half = torch.randn(n // 2, dtype=torch.bfloat16)  # the same bytes in bfloat16
    staged = torch.empty(n // 2)
    strided = torch.randn(2 * n)[::2]

    def fresh_result():  # torch.empty_like, then the Agent's copy out of the ring touches every page
        out = torch.empty(n)
        np.divide(in_ring, 2, out=out.numpy())
        return out

    return {
        "torch: tensor.numpy() of a contiguous CPU tensor (a view)": lambda: grad.numpy(),
        "torch: DDP, no hook: gradient into its bucket, divided on the copy": lambda: torch.mul(grad, 0.5, out=bucket),
        "torch: DDP: gradient into its bucket (with a comm hook)": lambda: bucket.copy_(grad),
        "torch: DDP: bucket back into .grad (gradient_as_bucket_view=False)": lambda: grad.copy_(bucket),
        "torch: a separate division pass (tensor.div_(n))": lambda: bucket.div_(2),
        "torch: Agent's divide out of a ring into a fresh torch.empty (page faults)": fresh_result,
        "torch: staging bfloat16 as float32 (per MB of float32)": lambda: staged.copy_(half),
        "torch: staging a non-contiguous tensor into a reused buffer": lambda: bucket.copy_(strided),
    }


def mxnet_steps(nbytes: int) -> dict[str, Callable[[], object]]:
    """The store's copying path (asnumpy out, ``target[:] =`` back) against its views (docs/mxnet.md)."""
    import mxnet as mx

    from pslink.mxnet.kvstore import _view

    grad = mx.nd.random.normal(shape=(nbytes // 4,))
    array = np.ones(nbytes // 4, np.float32)
    float32 = np.dtype("float32")

    def write_back():  # the copying path's last step: through MXNet's engine, waited for
        with mx.autograd.pause():
            grad[:] = array
        grad.wait_to_read()

    return {
        "mxnet: NDArray.asnumpy() (into new memory)": lambda: grad.asnumpy(),
        "mxnet: target[:] = numpy array (through the engine)": write_back,
        "mxnet: a read view (wait_to_read + DLPack)": lambda: _view(grad, float32, writable=False),
        "mxnet: a write view (wait_to_write + DLPack + ctypes)": lambda: _view(grad, float32, writable=True),
    }


def tf_steps(nbytes: int) -> dict[str, Callable[[], object]]:
    """How a gradient enters a ``tf.numpy_function`` and a result leaves it (docs/tf.md), and the
    conversions the strategy does not make."""
    import tensorflow as tf

    from pslink.tf import tensors

    tf.config.threading.set_intra_op_parallelism_threads(1)
    n = nbytes // 4
    grad = tf.random.uniform([n])
    out = tensors.empty([n], np.float32)
    out[:] = 1
    source = np.asarray(grad)
    empty_call = tf.function(lambda t: tf.numpy_function(lambda a: np.int32(0), [t], tf.int32))
    into_call = tf.function(lambda t: tf.numpy_function(lambda a: np.int32(a.size), [t], tf.int32))
    out_of_call = tf.function(lambda t: tf.numpy_function(lambda a: out, [t[:1]], tf.float32))
    for call in (empty_call, into_call, out_of_call):
        call(grad)
    seen = []
    tf.function(lambda t: tf.numpy_function(lambda a: np.int32(seen.append(a.ctypes.data) or 0), [t], tf.int32))(grad)
    CHECKS["tf: a numpy_function's input is the gradient's own memory (no copy)"] = seen == [source.ctypes.data]
    return {
        "tf: numpy_function call, empty (the fixed cost, per call over the MB)": lambda: empty_call(grad),
        "tf: gradient -> numpy_function input (a view; with the call's fixed cost)": lambda: into_call(grad),
        "tf: numpy_function's aligned result -> tensor (taken as is)": lambda: out_of_call(grad),
        "tf: EagerTensor.numpy() (into new memory)": lambda: grad.numpy(),
        "tf: tf.convert_to_tensor(numpy array)": lambda: tf.convert_to_tensor(out),
        "tf: a copy into a fresh out= (first touch of its pages)":
            lambda: np.copyto(tensors.empty([n], np.float32), source),
        "tf: from_dlpack of an aligned numpy array (a view)": lambda: tensors.to_tensor(out),
        "tf: tensor / n (a MEAN's divide, an op of its own)": lambda: grad / 2.0,
    }


FRAMEWORKS = (("torch", torch_steps), ("mxnet", mxnet_steps), ("tensorflow", tf_steps))  # MXNet before TF


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, action="append",
                        help="payload size in MiB, repeatable (default: 4, a part's size, and 64, past what the "
                             "allocator keeps for reuse)")
    parser.add_argument("--seconds", type=float, default=0.3, help="how long one run of a step lasts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="0.05 s runs, 3 repeats")
    parser.add_argument("--no-frameworks", action="store_true", help="only the shared path")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.repeats = 0.05, 3
    sizes = args.mib or [4.0, 64.0]
    if any(m <= 0 for m in sizes) or args.repeats < 1 or args.seconds <= 0:
        parser.error("--mib, --repeats and --seconds must be positive")

    table: dict[str, dict[str, float]] = {}
    skipped: list[str] = []
    groups = [("pslink", common_steps)] + ([] if args.no_frameworks else list(FRAMEWORKS))
    for name, make in groups:
        for mib in sizes:
            nbytes = int(mib * MB) // 8 * 8
            try:
                steps = make(nbytes)
            except ImportError as exc:
                skipped.append(f"{name} ({exc.name or exc} not installed)")
                break
            for what, step in steps.items():
                table.setdefault(what, {})[f"{mib:g}"] = timed(step, nbytes, args.seconds, args.repeats)
            del steps  # the arrays of one size go before the next size's are made

    print(f"ms per MB (1 MB = 2^20 bytes), median of {args.repeats} runs of {args.seconds:g} s each, one thread")
    print(f"{'step':78}" + "".join(f" {m:>6g}M" for m in sizes))
    for what, row in table.items():
        print(f"{what:78}" + "".join(f" {row[f'{m:g}']:7.3f}" for m in sizes))
    for what, holds in CHECKS.items():
        print(f"check: {what}: {'yes' if holds else 'NO'}")
    for name in skipped:
        print(f"skipped: {name}")
    print(json.dumps({"benchmark": "copy_costs", "mib": sizes, "ms_per_mb": table, "checks": CHECKS,
                      "skipped": skipped}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
