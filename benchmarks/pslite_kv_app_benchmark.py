"""Port of ps-lite's tests/test_kv_app_benchmark.cc to pslink.pslite, line for line.

One worker pushes 10,000,000 keys of one float each in one Push (keys spread over the key space,
plus the worker's rank), once, timed; then pulls them once, timed. The server's handle answers a
push with nothing and a pull with as many zeros as keys (ps-lite's EmptyHandler: its "in-place
memory reuse" branch is never taken there, as nothing fills its map). Prints ps-lite's two lines
(``Push average time cost: ...ms``, ``Pull ...``), which benchmarks/pslite_bench.py reads beside
the C++ program's::

    pslink launch --pslite -s 1 -n 1 python benchmarks/pslite_kv_app_benchmark.py
"""

import sys
import time

import numpy as np

from pslink import pslite as ps

mem_map: dict = {}


def empty_handler(req_meta: ps.KVMeta, req_data: ps.KVPairs, server: ps.KVServer) -> None:
    if req_meta.push:
        server.response(req_meta, ps.KVPairs())
        return
    res = mem_map.get(0)
    if res is None:
        print("init...", file=sys.stderr)
        res = ps.KVPairs()
    else:
        print("in-place memory reuse", file=sys.stderr)
    res.keys = req_data.keys
    res.vals = np.zeros(req_data.keys.size, np.float32)
    server.response(req_meta, res)


def start_server() -> None:
    if not ps.is_server():
        return
    server = ps.KVServer(0)
    server.set_request_handle(empty_handler)
    ps.register_exit_callback(server.close)


def run_worker() -> None:
    if not ps.is_worker():
        return
    kv = ps.KVWorker(0, 0)
    num = 10_000_000
    rank = ps.my_rank()
    keys = np.arange(num, dtype=np.uint64) * np.uint64(ps.kMaxKey // num) + np.uint64(rank)
    vals = np.random.default_rng(rank + 7).integers(0, 1000, num).astype(np.float32)
    repeat = 1

    start = time.perf_counter()
    for _ in range(repeat):
        kv.wait(kv.push(keys, vals))
    print(f"num = {num}, Push average time cost: {(time.perf_counter() - start) * 1e3:.3f}ms", flush=True)

    start = time.perf_counter()
    rets = np.empty(num, np.float32)  # the C++ std::vector<float>: values land in it, not in Python floats
    for _ in range(repeat):
        kv.wait(kv.pull(keys, rets))
    print(f"num = {num}, Pull average time cost: {(time.perf_counter() - start) * 1e3:.3f}ms", flush=True)


def main() -> int:
    ps.start()
    start_server()
    run_worker()
    ps.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
