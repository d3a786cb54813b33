"""Fixtures shared by the test packages."""

from __future__ import annotations

import pytest

from tests.helpers import serving


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
