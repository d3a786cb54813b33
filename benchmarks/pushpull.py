"""Push/pull/pushpull benchmark with raw loopback baselines; same as ``pslink bench pushpull``.

    python benchmarks/pushpull.py            # the full run recorded in docs/benchmarks.md
    python benchmarks/pushpull.py --quick    # a smoke run
    python benchmarks/pushpull.py --many-keys # 500 small tensors a step, against DDP over gloo
"""

import sys

from pslink.bench.pushpull import main

if __name__ == "__main__":
    sys.exit(main())
