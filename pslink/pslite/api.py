"""ps-lite's free functions (Start, Finalize, MyRank, ...) acting on a default node.

ps-lite keeps one Postoffice per process; pslink keeps the node an object
(:class:`~pslink.pslite.node.Node`) and these functions act on a default one, built from the
environment (DMLC_* variables) the first time anything needs it, so ps-lite programs port line
for line. After :func:`finalize` the next call builds a fresh default node.
"""

from __future__ import annotations

import threading
from typing import Callable

from pslink.pslite.config import Config
from pslink.pslite.node import Node
from pslink.pslite.scheduler import ALL_GROUPS, Range

_lock = threading.Lock()
_default: Node | None = None


def default_node() -> Node:
    """The process's default node (built from the environment on first use)."""
    global _default
    with _lock:
        if _default is None or _default.closed:
            _default = Node(Config.from_env())
        return _default


def set_default_node(node: Node | None) -> None:
    """Make ``node`` the one the free functions and apps without ``node=`` use."""
    global _default
    with _lock:
        _default = node


def start(customer_id: int = 0, do_barrier: bool = True) -> None:
    """Join the deployment; blocks until every node registered (ps-lite's Start)."""
    default_node().start(customer_id, do_barrier)


def finalize(customer_id: int = 0, do_barrier: bool = True) -> None:
    """Leave: with a barrier over every node, then teardown and exit callbacks (ps-lite's Finalize)."""
    default_node().finalize(customer_id, do_barrier)


def barrier(customer_id: int = 0, group: int = ALL_GROUPS) -> None:
    default_node().barrier(customer_id, group)


def num_workers() -> int:
    return default_node().num_workers


def num_servers() -> int:
    return default_node().num_servers


def my_rank() -> int:
    return default_node().my_rank()


def is_worker() -> bool:
    return default_node().is_worker


def is_server() -> bool:
    return default_node().is_server


def is_scheduler() -> bool:
    return default_node().is_scheduler


def register_exit_callback(callback: Callable[[], None]) -> None:
    default_node().register_exit_callback(callback)


def server_key_ranges() -> list[Range]:
    return default_node().server_key_ranges()


# ps-lite's CamelCase names, for line-for-line ports.
Start, Finalize, Barrier = start, finalize, barrier
NumWorkers, NumServers, MyRank = num_workers, num_servers, my_rank
IsWorker, IsServer, IsScheduler = is_worker, is_server, is_scheduler
RegisterExitCallback = register_exit_callback
