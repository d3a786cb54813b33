"""ps-lite compatibility: ps-lite's API and semantics over pslink.

A ps-lite program ports line for line::

    from pslink import pslite as ps

    def start_server():
        if not ps.is_server():
            return
        server = ps.KVServer(0)
        server.set_request_handle(ps.KVServerDefaultHandle())

    def run_worker():
        if not ps.is_worker():
            return
        kv = ps.KVWorker(0, 0)
        keys, vals = [1, 3], [1.1, 1.2, 3.1, 3.2]
        kv.wait(kv.push(keys, vals))
        out = []
        kv.wait(kv.pull(keys, out))

    start_server()
    ps.start()
    run_worker()
    ps.finalize()

and runs with ``pslink launch --pslite -s 1 -n 2 python prog.py`` (a scheduler, servers and
workers, with ps-lite's ``DMLC_*`` environment), or under ps-lite's own launcher. With
``--server-mode service`` the workers are served by the shared Aggregator pool instead of the
program's servers. See docs/pslite.md.
"""

from pslink.pslite.api import (
    Barrier,
    Finalize,
    IsScheduler,
    IsServer,
    IsWorker,
    MyRank,
    NumServers,
    NumWorkers,
    RegisterExitCallback,
    Start,
    barrier,
    default_node,
    finalize,
    is_scheduler,
    is_server,
    is_worker,
    my_rank,
    num_servers,
    num_workers,
    register_exit_callback,
    server_key_ranges,
    set_default_node,
    start,
)
from pslink.pslite.config import Config
from pslink.pslite.kv import KVMeta, KVPairs, default_slicer
from pslink.pslite.kv_server import KVServer, KVServerDefaultHandle
from pslink.pslite.kv_worker import KVWorker
from pslink.pslite.node import Node
from pslink.pslite.scheduler import ALL_GROUPS, K_MAX_KEY, SCHEDULER, SERVER_GROUP, WORKER_GROUP, Range
from pslink.pslite.simple import SimpleApp, SimpleData

#: ps-lite's constants: node groups and the largest key.
kScheduler, kServerGroup, kWorkerGroup, kMaxKey = SCHEDULER, SERVER_GROUP, WORKER_GROUP, K_MAX_KEY

__all__ = [
    "ALL_GROUPS", "Barrier", "Config", "Finalize", "IsScheduler", "IsServer", "IsWorker", "K_MAX_KEY", "KVMeta",
    "KVPairs", "KVServer", "KVServerDefaultHandle", "KVWorker", "MyRank", "Node", "NumServers", "NumWorkers",
    "Range", "RegisterExitCallback", "SCHEDULER", "SERVER_GROUP", "SimpleApp", "SimpleData", "Start",
    "WORKER_GROUP", "barrier", "default_node", "default_slicer", "finalize", "is_scheduler", "is_server",
    "is_worker", "kMaxKey", "kScheduler", "kServerGroup", "kWorkerGroup", "my_rank", "num_servers", "num_workers",
    "register_exit_callback", "server_key_ranges", "set_default_node", "start",
]
