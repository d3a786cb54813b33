"""A worker of the chaos run's elastic job (:mod:`pslink.bench.chaos`), under ``pslink launch
--min-np 1 --max-np N --service MASTER``: PyTorch's elastic API over the service, replication 1.

Each step's gradient is a sum over a fixed global batch of ``SAMPLES`` samples, split over the
workers there are (each sums its share; ``hvd.allreduce(op=Sum)`` adds the shares): every world
computes the same step, and small integer gradients with a power-of-two learning rate make it
exact in float32. So the final weights after S steps are :func:`expected`'s whatever workers
came and went, if no step was lost or counted twice. The run stops at the step written in
OUT/stop (the same for every worker). Lines: ``pid P``, ``step N size S``, ``final N w...``.

    python -m pslink.bench.chaos_worker OUT
"""

from __future__ import annotations

import os
import sys

import numpy as np

SAMPLES, SIZE, LR = 8, 64, 0.125


def gradient(sample: int, step: int) -> np.ndarray:
    return (np.arange(SIZE) % 3 + (sample + step) % 5).astype(np.float32)


def expected(steps: int) -> np.ndarray:
    w = np.zeros(SIZE, np.float32)
    for step in range(steps):
        total = sum((gradient(i, step) for i in range(SAMPLES)), np.zeros(SIZE, np.float32))
        w = w - np.float32(LR) * total / np.float32(SAMPLES)
    return w


def stop_step(out: str) -> int | None:
    try:
        with open(os.path.join(out, "stop")) as f:
            return int(f.read().strip() or "0") or None
    except (OSError, ValueError):
        return None


def main(out: str) -> int:
    import torch

    import pslink.torch as hvd

    torch.set_num_threads(1)
    hvd.init(replication=1, timeout=120, heartbeat_interval=0.2)
    print(f"pid {os.getpid()}", flush=True)
    state = hvd.elastic.ObjectState(step=0, w=np.zeros(SIZE, np.float32))

    @hvd.elastic.run
    def train(state):
        while True:
            stop = stop_step(out)
            if stop is not None and state.step >= stop:
                return
            share = sum((gradient(i, state.step) for i in range(hvd.rank(), SAMPLES, hvd.size())),
                        np.zeros(SIZE, np.float32))
            total = hvd.allreduce(torch.from_numpy(share), op=hvd.Sum, name="chaos.grad").numpy()
            state.w = state.w - np.float32(LR) * total / np.float32(SAMPLES)
            state.step += 1
            print(f"step {state.step} size {hvd.size()}", flush=True)
            state.commit()

    train(state)
    print(f"final {state.step} " + " ".join(f"{v:g}" for v in state.w), flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
