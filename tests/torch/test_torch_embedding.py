"""pslink.torch.Embedding / EmbeddingBag: the table on the service trains as torch's own
embedding does when its gradient is averaged over the workers and SGD steps it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI installs it)")

import pslink  # noqa: E402
import pslink.torch as pt  # noqa: E402
from pslink.errors import ConfigError  # noqa: E402
from tests.helpers import run_workers  # noqa: E402

VOCAB, DIM, LR, STEPS, WORKERS = 50, 6, 0.5, 6, 2


@pytest.fixture(scope="module")
def cluster(inproc_cluster):
    return inproc_cluster


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    ids = torch.randint(0, VOCAB, (4, 5), generator=g)
    target = torch.randn(4, DIM, generator=g)
    return ids, target


def loss_of(out, target):
    return ((out.sum(1) if out.dim() == 3 else out) - target).pow(2).mean()


def reference(kind):
    """torch's own module on one process: every worker's gradient averaged, then an SGD step."""
    table = pslink.core.tables.initial_rows(np.arange(VOCAB, dtype=np.uint64), DIM, np.dtype(np.float32),
                                            ["normal", 0.0, 1.0], 3)
    module = torch.nn.Embedding(VOCAB, DIM) if kind == "embedding" else torch.nn.EmbeddingBag(VOCAB, DIM, mode="mean")
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(table))
    for step in range(STEPS):
        grads = []
        for rank in range(WORKERS):
            module.zero_grad()
            ids, target = batch(rank, step)
            loss_of(module(ids), target).backward()
            grads.append(module.weight.grad.clone())
        with torch.no_grad():
            module.weight -= LR * ((grads[0] + grads[1]) / WORKERS)
    return module.weight.detach()


@pytest.mark.parametrize("kind", ["embedding", "bag"])
def test_a_table_on_the_service_trains_as_torchs_embedding_with_averaged_gradients(cluster, kind):
    service, transports = cluster

    def worker(rank):
        with pslink.connect(f"emb-{kind}", rank, WORKERS, master=service.address, transports=transports) as agent:
            options = dict(agent=agent, seed=3, optimizer={"name": "sgd", "lr": LR})
            module = pt.Embedding(VOCAB, DIM, **options) if kind == "embedding" else \
                pt.EmbeddingBag(VOCAB, DIM, mode="mean", **options)
            for step in range(STEPS):
                ids, target = batch(rank, step)
                loss_of(module(ids), target).backward()
            module.wait()
            with torch.no_grad():
                return module.table.pull(np.arange(VOCAB)).wait()

    expected = reference(kind).numpy()
    for rows in run_workers(WORKERS, worker):
        np.testing.assert_allclose(rows, expected, rtol=1e-5, atol=1e-6)


def test_padding_rows_read_as_zeros_and_bad_indices_are_named(cluster):
    service, transports = cluster
    with pslink.connect("emb-pad", 0, 1, master=service.address, transports=transports) as agent:
        module = pt.Embedding(10, 3, padding_idx=0, agent=agent, optimizer={"name": "sgd", "lr": 1.0})
        ids = torch.tensor([[0, 1, 0, 2]])
        out = module(ids)
        assert (out[0, 0] == 0).all() and (out[0, 2] == 0).all() and (out[0, 1] != 0).any()
        out.sum().backward()
        module.wait()
        assert (module(ids)[0, 0] == 0).all()
        with pytest.raises(IndexError, match=r"index 10 is out of range \[0, 10\)"):
            module(torch.tensor([3, 10]))
        with pytest.raises(ConfigError, match="mode 'median'"):
            pt.EmbeddingBag(10, 3, mode="median", agent=agent)
        with torch.no_grad():  # evaluation pushes nothing: the rows stay as they are
            before = module.table.pull([1, 2]).wait()
            module(ids)
        assert np.array_equal(module.table.pull([1, 2]).wait(), before)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_horovods_optimizer_gathers_sparse_gradients_and_sparse_adam_steps_as_one_process(cluster, sparse_as_dense):
    """nn.Embedding(sparse=True) under pslink.torch.DistributedOptimizer: each rank's sparse
    gradient is gathered (never densified, so SparseAdam takes it) and averaged; with
    ``sparse_as_dense`` it is averaged dense and given back sparse, as Horovod does, so that
    SparseAdam takes it too."""
    from pslink.core.worker.session import Session
    from pslink.torch.optimizer import DistributedOptimizer

    service, transports = cluster

    def build():
        torch.manual_seed(5)
        return torch.nn.Embedding(VOCAB, DIM, sparse=True)

    initial = build().weight.detach().clone()  # here: the worker threads would share torch's global generator

    def worker(rank):
        with pslink.connect(f"sparse-hvd-{sparse_as_dense}", rank, WORKERS, master=service.address, transports=transports) as agent:
            module = torch.nn.Embedding(VOCAB, DIM, sparse=True)
            with torch.no_grad():
                module.weight.copy_(initial)
            optimizer = DistributedOptimizer(Session(agent), torch.optim.SparseAdam(module.parameters(), lr=0.1),
                                             named_parameters=module.named_parameters(),
                                             sparse_as_dense=sparse_as_dense)
            for step in range(STEPS):
                optimizer.zero_grad()
                ids, target = batch(rank, step)
                loss_of(module(ids), target).backward()
                optimizer.step()
                assert module.weight.grad.is_sparse
            return module.weight.detach().clone()

    reference = build()
    optimizer = torch.optim.SparseAdam(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        grads = []
        for rank in range(WORKERS):
            reference.zero_grad()
            ids, target = batch(rank, step)
            loss_of(reference(ids), target).backward()
            grads.append(reference.weight.grad.coalesce())
        reference.weight.grad = torch.sparse_coo_tensor(
            torch.cat([g.indices() for g in grads], 1), torch.cat([g.values() for g in grads]) / WORKERS,
            reference.weight.shape)
        optimizer.step()
    for weights in run_workers(WORKERS, worker):
        torch.testing.assert_close(weights, reference.weight.detach(), rtol=1e-5, atol=1e-6)
