"""Port of ps-lite's tests/test_kv_app_multi_workers.cc: two customers (threads) per worker.

Each worker process runs two KVWorkers, customer ids 0 and 1, on two threads; each starts and
finalizes with its own customer id. Customer c's keys are offset by c, and every worker pushes
the same values, so each key ends at ``repeat x workers x value``::

    pslink launch --pslite -s 1 -n 2 python examples/pslite/kv_app_multi_workers.py
"""

import argparse
import sys
import threading

import numpy as np

from pslink import pslite as ps

failures: list[str] = []
print_lock = threading.Lock()  # two customers print: keep their lines whole


def say(line: str) -> None:
    with print_lock:
        print(line, flush=True)


def start_server() -> None:
    if not ps.is_server():
        return
    server = ps.KVServer(0)
    server.set_request_handle(ps.KVServerDefaultHandle())
    ps.register_exit_callback(server.close)


def run_worker(customer_id: int, args) -> None:
    if not ps.is_worker():
        return
    try:
        ps.start(customer_id)
        kv = ps.KVWorker(0, customer_id)
        num = args.num_keys
        keys = np.array([ps.kMaxKey // num * i + customer_id for i in range(num)], dtype=np.uint64)
        vals = np.random.default_rng(7).integers(0, 1000, num).astype(np.float32)
        timestamps = []
        for i in range(args.repeat):
            timestamps.append(kv.push(keys, vals))
            if i > 10:
                kv.wait(timestamps[-10])
        for ts in timestamps:
            kv.wait(ts)
        ps.barrier(customer_id, ps.kWorkerGroup)  # both workers' customer c pushed everything
        rets = np.zeros(num, np.float32)
        kv.wait(kv.zpull(keys, rets))
        error = float(np.abs(rets - vals * args.repeat * ps.num_workers()).sum())
        say(f"worker {ps.my_rank()} customer {customer_id}: error {error / args.repeat}")
        if error / args.repeat >= 1e-5:
            failures.append(f"customer {customer_id}: error {error}")
    except Exception as exc:  # reported below, so the process exits non-zero
        failures.append(f"customer {customer_id}: {type(exc).__name__}: {exc}")
        raise
    finally:
        ps.finalize(customer_id, True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-keys", type=int, default=10000)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    start_server()
    if not ps.is_worker():
        ps.start(0)
        ps.finalize(0, True)
    threads = [threading.Thread(target=run_worker, args=(c, args)) for c in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for failure in failures:
        say(failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
