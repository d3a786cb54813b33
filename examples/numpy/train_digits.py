"""Train an MLP on scikit-learn's digits with one worker per process, through a running service.

In one terminal:   pslink service up
In two others:     python examples/numpy/train_digits.py --job digits --rank 0 --num-workers 2
                   python examples/numpy/train_digits.py --job digits --rank 1 --num-workers 2

Add ``--mode optimizer`` (on both) to have the Aggregators run momentum SGD instead of the workers.
Every option can also come from the environment that ``pslink launch`` sets (PSLINK_JOB,
PSLINK_RANK, PSLINK_NUM_WORKERS, PSLINK_MASTER). The training loop itself, a dozen lines around
``agent.pushpull_many``, is ``pslink.demo.digits.train``.
"""

import sys

from pslink.demo.digits import main

if __name__ == "__main__":
    sys.exit(main())
