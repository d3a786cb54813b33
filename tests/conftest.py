"""Fixtures shared by the test packages."""

from __future__ import annotations

import pytest

from pslink.core.transport import Transports
from tests.helpers import start_cluster


@pytest.fixture(scope="module")
def inproc_cluster():
    """(service, transports): pMaster and two Aggregators on threads, over in-process transports,
    for every test of a module."""
    transports = Transports()
    service = start_cluster("inproc", aggregators=2, transports=transports)
    yield service, transports
    service.stop()
    transports.close()
