"""The Horovod API against Horovod 0.28.1 over gloo: allreduce of 4 KiB / 4 MiB / 64 MiB and a
DistributedOptimizer step, alternating in one run (pslink.bench.horovod_api says what and how).

    PSLINK_BENCH_HOROVOD=/tmp/hvdlib python benchmarks/horovod_api.py          # the measured run
    PSLINK_BENCH_HOROVOD=/tmp/hvdlib python benchmarks/horovod_api.py --quick  # a smoke run
"""

import sys

from pslink.bench.horovod_api import main

if __name__ == "__main__":
    sys.exit(main())
