"""PyTorch's ``test/distributed/test_distributed_spawn.py``, for a backend named in ``BACKEND``.

PyTorch's file is a few lines around the real suite, ``DistributedTest._DistTestBase`` in
``torch.testing._internal.distributed.distributed_test``, which every torch wheel ships: this
module is those lines, with one difference for another backend than gloo (``BACKEND=pslink``).
The suite is written for PyTorch's own backends: it picks tests (``require_backend_is_available
({"gloo"})``, "get_future is only supported on mpi, nccl and gloo") and code paths inside tests
(``if BACKEND == "mpi" or BACKEND == "gloo":`` builds the CPU model) by the backend's *name*. So
the suite runs exactly as it runs for gloo (``BACKEND=gloo`` as the tests see it), and every
``init_process_group(backend="gloo")`` of a rank makes a ``pslink`` group instead: what a user
who swaps gloo for pslink gets. Errors the tests expect word for word from gloo fail here.
Two more things such a user changes, the ranks change too: ``dist.monitored_barrier``, which
torch runs for gloo only (it checks the group's backend name before it calls the group's
``monitored_barrier``), is ``pslink.torch.backend.monitored_barrier`` (the same call, for a
pslink group too); and a test whose subject is the backend's name (``test_get_backend``: is
``dist.get_backend()`` the backend asked for?) sees the name the ranks asked for, ``pslink``.
``pslink`` registers itself on ``import pslink.torch``; the spawned ranks import this module
again, so they do too.

Run by ``torch_distributed_suite.py`` (which starts the service and counts the results); by hand:
``BACKEND=gloo WORLD_SIZE=3 TEMP_DIR=$(mktemp -d) python -m pytest benchmarks/compat/torch_distributed_spawn.py``.
"""

import functools
import os

import torch
import torch.distributed as dist

# The backend under test, kept where the ranks (spawned with this environment) find it.
BACKEND = os.environ["PSLINK_SUITE_BACKEND"] = os.environ.get("PSLINK_SUITE_BACKEND") or os.environ["BACKEND"]
if BACKEND != "gloo":
    import pslink.torch  # noqa: F401 (registers the backend, in the ranks as in this process)

    os.environ["BACKEND"] = "gloo"  # before the suite is imported: it reads BACKEND then

from torch.testing._internal import common_utils  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False


# Tests whose subject is the backend's name: they see the one the ranks asked for.
_TESTS_OF_THE_NAME = {"test_get_backend"}


def _groups_on(backend: str, test_name: str) -> None:
    """In this rank: every process group asked of gloo is made on ``backend``, and
    ``dist.monitored_barrier`` is the one that runs on it."""
    from pslink.torch.backend import monitored_barrier

    dist.monitored_barrier = monitored_barrier
    if test_name in _TESTS_OF_THE_NAME:
        distributed_test.BACKEND = backend
    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") in ("gloo", None) and not args:
            kwargs["backend"] = backend
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group


class TestDistBackendWithSpawn(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        if BACKEND != "gloo":
            _groups_on(BACKEND, test_name)
        super()._run(rank, test_name, file_name, pipe, **kwargs)


if __name__ == "__main__":
    common_utils.run_tests()
