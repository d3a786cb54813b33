"""Fixtures shared by the test packages."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers import serving

# MXNet must load before TensorFlow in one process (TensorFlow first, then MXNet, aborts), and
# test modules import TensorFlow as they are collected: load MXNet first, whatever subset runs.
if importlib.util.find_spec("mxnet") is not None:
    import mxnet  # noqa: F401


@pytest.fixture(scope="module")
def inproc_cluster():
    """(service, transports): pMaster and two Aggregators on threads, over in-process transports,
    for every test of a module."""
    yield from serving("inproc")


@pytest.fixture(scope="module")
def tcp_cluster():
    """(service, transports): pMaster and two Aggregators on threads, over TCP, for every test of
    a module."""
    yield from serving("tcp")


@pytest.fixture(scope="session")
def redis_server():
    """One throwaway redis-server for the session (skips, naming it, where there is none)."""
    from tests.redis_server import UnixRedis

    server = UnixRedis()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server):
    """A Redis URL with nothing in it yet."""
    redis_server.flush()
    return redis_server.url()
