"""Whole ps-lite deployments inside the test process: a scheduler, servers and workers as Node
objects on threads, talking over TCP on 127.0.0.1 (no singleton, so several run per process).

Every node is closed when the run ends, also when a role function fails: a failed node closing
makes the scheduler tell everyone, so nothing waits forever; a run past ``timeout`` is a failure.
"""

from __future__ import annotations

import itertools
import threading
import traceback
from typing import Callable

from pslink.pslite import Config, KVServer, KVServerDefaultHandle, Node

_jobs = itertools.count()


def default_server(node: Node, rank: int):
    server = KVServer(0, node=node)
    server.set_request_handle(KVServerDefaultHandle())
    node.start()
    node.finalize()
    return server


def default_scheduler(node: Node, rank: int):
    node.start()
    node.finalize()


def run_nodes(num_workers: int, worker: Callable[[Node, int], object], *, num_servers: int = 1,
              server: Callable[[Node, int], object] = default_server,
              scheduler: Callable[[Node, int], object] = default_scheduler,
              mode: str = "classic", service=None, timeout: float = 60.0, expect_errors: bool = False,
              **config) -> dict:
    """Run every role's function on its own thread with its own (not yet started) node.

    Returns ``{(role, rank): result}``; with ``expect_errors`` failures are returned as the
    exception instead of failing the run.
    """
    base = dict(root_uri="127.0.0.1", num_workers=num_workers, num_servers=num_servers, mode=mode,
                timeout=20.0, start_timeout=30.0)
    if service is not None:
        base.update(master=service.address, job=f"pslite-test-{next(_jobs)}-{id(service)}")
    base.update(config)
    scheduler_node = Node(Config(role="scheduler", root_port=0, **base))
    port = int(scheduler_node.address.rsplit(":", 1)[1])
    nodes = [scheduler_node]
    nodes_lock = threading.Lock()
    results: dict = {}
    errors: list = []

    def body(role: str, rank: int, fn):
        node = None
        try:
            if role == "scheduler":
                node = scheduler_node
            else:
                node = Node(Config(role=role, root_port=port, rank=rank, **base))
                with nodes_lock:
                    nodes.append(node)
            results[(role, rank)] = fn(node, rank)
        except BaseException as exc:  # reported below
            if expect_errors:
                results[(role, rank)] = exc
            else:
                errors.append(((role, rank), traceback.format_exc()))
            if node is not None:
                node.close()  # the scheduler tells the others, so nobody waits for this node

    roles = [("scheduler", 0, scheduler)]
    if mode == "classic":
        roles += [("server", r, server) for r in range(num_servers)]
    roles += [("worker", r, worker) for r in range(num_workers)]
    threads = [threading.Thread(target=body, args=spec, name=f"{spec[0]}-{spec[1]}", daemon=True) for spec in roles]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
        hung = [t.name for t in threads if t.is_alive()]
        if hung:
            raise AssertionError(f"nodes {hung} did not finish within {timeout} s")
    finally:
        with nodes_lock:
            for node in nodes:
                node.close()
        for thread in threads:
            thread.join(10)
    if errors:
        (role, rank), tb = errors[0]
        raise AssertionError(f"{role} {rank} failed:\n{tb}")
    return results
