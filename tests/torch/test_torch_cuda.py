"""CUDA tensors go through pinned host staging buffers. Needs a CUDA device: skipped, with the
reason shown, where there is none (CI has none)."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install 'pslink[torch]')")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the CUDA staging path runs only where one is present")

import pslink  # noqa: E402
import pslink.torch  # noqa: E402
from pslink.core.transport import Transports  # noqa: E402
from pslink.core.worker.session import Session  # noqa: E402
from pslink.torch.horovod import Horovod  # noqa: E402
from pslink.torch.tensors import HostView  # noqa: E402
from tests.helpers import run_workers, start_cluster  # noqa: E402


@pytest.fixture
def cluster():
    transports = Transports()
    service = start_cluster("tcp", aggregators=1, transports=transports)
    yield service, transports
    service.stop()
    transports.close()


def test_a_cuda_tensor_is_staged_in_pinned_memory_and_copied_back():
    tensor = torch.arange(6, dtype=torch.float32, device="cuda")
    view = HostView(tensor, "test")
    assert not view.zero_copy and view.staging.is_pinned() and view.staging.device.type == "cpu"
    view.array *= 2
    assert view.finish() is tensor
    assert tensor.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


def test_allreduce_and_broadcast_of_cuda_tensors(cluster):
    service, transports = cluster

    def body(rank):
        agent = pslink.connect("cuda", rank, 2, master=service.address, transports=transports, mode="sum",
                               timeout=30.0)
        session = Session(agent)
        api = Horovod(lambda: session)
        try:
            average = api.allreduce(torch.full((1000,), float(rank + 1), device="cuda"), name="x")
            weights = torch.full((3,), float(rank), device="cuda", dtype=torch.bfloat16)
            api.broadcast_async_(weights, root_rank=1, name="w").wait()
            return average, weights
        finally:
            session.close()

    for average, weights in run_workers(2, body):
        assert average.is_cuda and weights.is_cuda and weights.dtype == torch.bfloat16
        torch.testing.assert_close(average, torch.full((1000,), 1.5, device="cuda"))
        assert weights.tolist() == [1.0, 1.0, 1.0]


def test_the_hook_on_a_cuda_model_gives_its_gradients_back(cluster, tmp_path):
    import torch.distributed as dist

    service, transports = cluster
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
        reference = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()
        reference.load_state_dict(model.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.005)
        state = pslink.torch.connect(job="cuda-ddp", master=service.address, transports=transports)
        ddp.register_comm_hook(state, pslink.torch.comm_hook)
        x = torch.randn(16, 32, device="cuda")
        for _ in range(3):
            ddp.zero_grad()
            reference.zero_grad()
            ddp(x).pow(2).sum().backward()
            reference(x).pow(2).sum().backward()
            for got, expected in zip(ddp.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(got.grad, expected.grad)
        assert all(buffer.is_pinned() for buffer in state._staging._buffers.values())
        del ddp
        state.close()
    finally:
        gc.collect()
        dist.destroy_process_group()
