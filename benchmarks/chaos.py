"""A chaos run: jobs train while a seeded schedule kills Aggregators, pMaster and an elastic job's
workers; every job's final weights must be exact (pslink.bench.chaos says what and how).

    python benchmarks/chaos.py                       # 10 minutes, seed 0
    python benchmarks/chaos.py --minutes 1 --seed 3  # a shorter one
"""

import sys

from pslink.bench.chaos import main

if __name__ == "__main__":
    sys.exit(main())
