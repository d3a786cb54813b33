"""The latency of Horovod's ``allreduce`` of a small tensor through pslink: 50 warm-up calls, then
300 timed ``hvd.allreduce(torch.ones(1024), name="x")`` (4 KiB), each waited for; each rank prints
its median in microseconds. Run under ``pslink launch -n 2``; compare two versions of pslink side
by side with ``benchmarks/before_after.sh`` (docs/benchmarks.md, issue 48).

    python -m pslink.cli launch -n 2 python benchmarks/hvd_latency.py
"""

import statistics
import time

import torch

import pslink.torch as hvd

hvd.init()
tensor = torch.ones(1024)
for _ in range(50):
    hvd.allreduce(tensor, name="x")
times = []
for _ in range(300):
    started = time.perf_counter()
    hvd.allreduce(tensor, name="x")
    times.append(time.perf_counter() - started)
print(f"rank {hvd.rank()}: median {statistics.median(times) * 1e6:.0f} us", flush=True)
hvd.shutdown()
