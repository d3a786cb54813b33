"""Port of ps-lite's tests/test_kv_app.cc: push known values R times, pull, check the sum.

Every worker pushes the same values to the same keys ``--repeat`` times, so once every worker
is done the servers' stores hold ``repeat x workers x values``; each worker pulls and checks.
Keys are spread over the whole key space, so with several servers every server gets a slice.
``--variable`` gives each key its own number of values (ps-lite's ``lens``). The servers run
``KVServerDefaultHandle``, so ``--server-mode service`` serves the same workers with the shared
Aggregator pool and no server processes::

    pslink launch --pslite -s 2 -n 2 python examples/pslite/kv_app.py --repeat 50
    pslink launch --pslite -n 2 --server-mode service python examples/pslite/kv_app.py
"""

import argparse
import sys

import numpy as np

from pslink import pslite as ps


def start_server() -> None:
    if not ps.is_server():
        return
    server = ps.KVServer(0)
    server.set_request_handle(ps.KVServerDefaultHandle())
    ps.register_exit_callback(server.close)


def run_worker(args) -> bool:
    if not ps.is_worker():
        return True
    kv = ps.KVWorker(0, 0)
    num = args.num_keys
    keys = [ps.kMaxKey // num * i for i in range(num)]
    rng = np.random.default_rng(7)  # the same values on every worker
    lens = rng.integers(1, 5, num).astype(np.int32) if args.variable else None
    total = int(lens.sum()) if lens is not None else num * args.width
    vals = rng.integers(0, 1000, total).astype(np.float32)

    timestamps = []
    for i in range(args.repeat):
        timestamps.append(kv.push(keys, vals, lens))
        if i > 10:  # at most ~10 pushes in flight, as the original
            kv.wait(timestamps[-10])
    for ts in timestamps:
        kv.wait(ts)
    ps.barrier(0, ps.kWorkerGroup)  # every worker's pushes are in before anyone pulls

    rets, rlens = [], []
    kv.wait(kv.pull(keys, rets, rlens if args.variable else None))
    expected = vals * args.repeat * ps.num_workers()
    error = float(np.abs(np.asarray(rets, np.float32) - expected).sum())
    print(f"worker {ps.my_rank()}: {num} keys, {total} values, error {error / args.repeat}")
    if args.variable and rlens != lens.tolist():
        print(f"pulled lengths {rlens[:8]}... differ from the pushed {lens.tolist()[:8]}...")
        return False
    return error / args.repeat < 1e-5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-keys", type=int, default=10)
    parser.add_argument("--width", type=int, default=1, help="values per key")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--variable", action="store_true", help="1..4 values per key, with lens")
    args = parser.parse_args()
    start_server()
    ps.start()
    ok = run_worker(args)
    ps.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
