"""A worker for tests/torch/test_torch_backend.py, run by ``pslink launch -n N``.

    python backend_worker.py collectives SCRATCH  # every collective over pslink and over gloo
    python backend_worker.py ddp SCRATCH          # DDP (no hook) over pslink and over gloo
    python backend_worker.py gan SCRATCH          # two DDP models with the hook in one process
    python backend_worker.py fsdp SCRATCH         # FSDP2 (fully_shard) over pslink and over gloo
    python backend_worker.py mismatch SCRATCH     # ranks pass different shapes to one allreduce
    python backend_worker.py badsplits SCRATCH    # an uneven all_to_all whose splits do not match
    python backend_worker.py badrecv SCRATCH      # a recv of another size than its send
    python backend_worker.py anysource SCRATCH    # recv from any source, over pslink and over gloo
    python backend_worker.py anysource_errors SCRATCH  # one of another size, one nobody sends
    python backend_worker.py monitored SCRATCH    # monitored_barrier passed, and missed by some rank
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pslink.torch  # noqa: F401 - registers the backend

DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]


def data(rank: int, dtype: torch.dtype, shape=(3, 5), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def collectives(rank: int, size: int, groups: dict) -> dict:
    results = {}
    for name, group in groups.items():
        out = results[name] = {}
        for dtype in DTYPES:
            d = str(dtype).replace("torch.", "")
            ops = [dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT]
            for op in ops:
                t = data(rank, dtype, seed=1)
                dist.all_reduce(t, op=op, group=group)
                out[f"allreduce-{op}-{d}"] = t
            t = data(rank, dtype, seed=2)
            dist.broadcast(t, src=size - 1, group=group)
            out[f"broadcast-{d}"] = t
            gathered = [torch.empty((3, 5), dtype=dtype) for _ in range(size)]
            dist.all_gather(gathered, data(rank, dtype, seed=3), group=group)
            out[f"allgather-{d}"] = torch.stack(gathered)
            into = torch.empty((3 * size, 5), dtype=dtype)
            dist.all_gather_into_tensor(into, data(rank, dtype, seed=4), group=group)
            out[f"allgather-into-{d}"] = into
            scattered = torch.empty((2, 5), dtype=dtype)
            dist.reduce_scatter_tensor(scattered, data(rank, dtype, (2 * size, 5), seed=5), group=group)
            out[f"reduce-scatter-tensor-{d}"] = scattered
            pieces = [data(rank, dtype, (2, 5), seed=6 + r) for r in range(size)]
            one = torch.empty((2, 5), dtype=dtype)
            dist.reduce_scatter(one, pieces, group=group)
            out[f"reduce-scatter-{d}"] = one
            swapped = torch.empty((2 * size, 5), dtype=dtype)
            dist.all_to_all_single(swapped, data(rank, dtype, (2 * size, 5), seed=9), group=group)
            out[f"alltoall-{d}"] = swapped
            work = dist.all_reduce(data(rank, dtype, seed=10), group=group, async_op=True)
            work.wait()
            root = 1 % size
            t = data(rank, dtype, seed=11)
            dist.reduce(t, dst=root, group=group)  # the root's result; the others' left as they were
            out[f"reduce-{d}"] = t if rank == root else torch.zeros_like(t)
            gathered = [torch.empty((3, 5), dtype=dtype) for _ in range(size)] if rank == root else None
            dist.gather(data(rank, dtype, seed=12), gathered, dst=root, group=group)
            out[f"gather-{d}"] = torch.stack(gathered) if rank == root else torch.zeros(1, dtype=dtype)
            pieces = [data(r, dtype, (2, 5), seed=13) for r in range(size)] if rank == root else None
            one = torch.empty((2, 5), dtype=dtype)
            dist.scatter(one, pieces, src=root, group=group)
            out[f"scatter-{d}"] = one
            # uneven: rank r sends r + d + 1 rows to rank d (rows of 5)
            sends = [rank + dst + 1 for dst in range(size)]
            receives = [src + rank + 1 for src in range(size)]
            swapped = torch.empty((sum(receives), 5), dtype=dtype)
            dist.all_to_all_single(swapped, data(rank, dtype, (sum(sends), 5), seed=14), receives, sends, group=group)
            out[f"alltoall-uneven-{d}"] = swapped
            received = [torch.empty((2, 2), dtype=dtype) for _ in range(size)]  # gloo takes equal sizes only
            dist.all_to_all(received, [data(rank, dtype, (2, 2), seed=15 + dst) for dst in range(size)], group=group)
            out[f"alltoall-list-{d}"] = torch.cat(received)
            # a ring of point-to-point messages, each rank to the next
            right, left = (rank + 1) % size, (rank - 1) % size
            got = torch.empty((3, 5), dtype=dtype)
            requests = [dist.isend(data(rank, dtype, seed=16), right, group=group, tag=7),
                        dist.irecv(got, left, group=group, tag=7)]
            for request in requests:
                request.wait()
            out[f"p2p-{d}"] = got
        # sparse: rank r holds entries at r, r + 2 and 5 (ranks bring different numbers of them)
        sparse = torch.sparse_coo_tensor([[rank, rank + 2, 5][: 2 + rank % 2]], [1.5, -2.0, 3.25][: 2 + rank % 2],
                                         (8,))
        dist.all_reduce(sparse, group=group)
        out["allreduce-sparse"] = sparse.to_dense()
        dist.barrier(group=group)
    return results


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def ddp(rank: int, size: int, groups: dict) -> dict:
    results = {}
    base = model()
    for name, group in groups.items():
        net = DDP(copy.deepcopy(base), process_group=group, bucket_cap_mb=0.01)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        grads = []
        for step in range(6):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
            optimizer.step()
        results[name] = {"grads": grads, "weights": [p.detach().clone() for p in net.parameters()]}
    return results


def transformer() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    return torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.TransformerEncoder(layer, 2),
                               torch.nn.Linear(32, 50))


def fsdp(rank: int, size: int, groups: dict) -> dict:
    """FSDP2: each encoder layer and the whole model sharded over the group (its all-gathers and
    reduce-scatters), trained with SGD; the full weights gathered at the end (a functional
    all-gather, as DTensor does it)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    results = {}
    for name, group in groups.items():
        net = transformer()
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in net[1].layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(4):
            x = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1000 * step + rank))
            loss = torch.nn.functional.cross_entropy(net(x).reshape(-1, 50), x.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        results[name] = {"losses": losses, "weights": [p.full_tensor().detach().clone() for p in net.parameters()]}
    return results


def gan(rank: int, size: int, groups: dict) -> dict:
    """Two DDP models in one process (a GAN's generator and discriminator), each with the hook:
    joined by ``connect(job=...)`` (one Agent, two key scopes) and by ``connect()`` on the pslink
    default group (its Agent); and the same over gloo with no hook."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    discriminator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    results = {}
    for variant in ("job", "group", "gloo"):
        g = DDP(copy.deepcopy(generator), process_group=groups["gloo"])
        d = DDP(copy.deepcopy(discriminator), process_group=groups["gloo"])
        states = []
        if variant != "gloo":
            for net in (g, d):
                state = pslink.torch.connect(job=os.environ["PSLINK_JOB"]) if variant == "job" \
                    else pslink.torch.connect()
                net.register_comm_hook(state, pslink.torch.comm_hook)
                states.append(state)
        g_opt, d_opt = torch.optim.SGD(g.parameters(), lr=0.05), torch.optim.SGD(d.parameters(), lr=0.05)
        for step in range(4):
            noise = torch.Generator().manual_seed(100 * step + rank)
            real, z = torch.randn(8, 4, generator=noise) + 2, torch.randn(8, 8, generator=noise)
            fake = g(z)
            labels = torch.cat([torch.ones(8, 1), torch.zeros(8, 1)])
            d_opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(d(torch.cat([real, fake.detach()])), labels).backward()
            d_opt.step()
            g_opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(d(fake), torch.ones(8, 1)).backward()
            g_opt.step()
        results[variant] = {"weights": [p.detach().clone() for p in list(g.parameters()) + list(d.parameters())],
                            "names": [s.name for s in states],
                            "one_agent": len({id(s.agent) for s in states}) == 1,
                            "backend_agent": bool(states) and states[0].agent is dist.group.WORLD.agent}
        for state in states:
            state.close()
    return results


def mismatch(rank: int, size: int, groups: dict) -> dict:
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4 + rank), group=groups["pslink"])
    except RuntimeError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def stall(rank: int, size: int, groups: dict) -> dict:
    """Rank 1 never calls: rank 0's all_reduce fails after the group's timeout."""
    started = time.monotonic()
    if rank == 1:
        time.sleep(TIMEOUTS["stall"] + 3)
        return {"error": None, "seconds": time.monotonic() - started}
    try:
        dist.all_reduce(torch.ones(4), group=groups["pslink"])
    except RuntimeError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


def badsplits(rank: int, size: int, groups: dict) -> dict:
    """Rank 0 expects one row too many from rank 1: every rank refuses the same all_to_all, and
    the group still works afterwards."""
    sends = [1] * size
    receives = [1] * size
    if rank == 0:
        receives[1] = 2
    started = time.monotonic()
    try:
        out = torch.empty((sum(receives), 3))
        dist.all_to_all_single(out, torch.ones((sum(sends), 3)), receives, sends, group=groups["pslink"])
    except RuntimeError as exc:
        after = torch.ones(2)
        dist.all_reduce(after, group=groups["pslink"])
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started,
                "after": after}
    return {"error": None}


def badrecv(rank: int, size: int, groups: dict) -> dict:
    """Rank 1 receives 4 floats where rank 0 sends 3: both fail at once; the pair still works
    afterwards (the mismatched data was never pushed, so it cannot pair with a later send)."""
    group = groups["pslink"]
    started = time.monotonic()
    try:
        if rank == 0:
            dist.send(torch.ones(3), 1, group=group)
        else:
            dist.recv(torch.empty(4), 0, group=group)
    except RuntimeError as exc:
        after = torch.arange(3.0) if rank == 0 else torch.zeros(3)
        (dist.send if rank == 0 else dist.recv)(after, 1 - rank, group=group)
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started,
                "after": after}
    return {"error": None}


def message(sender: int, seq: int) -> torch.Tensor:
    """A sender's seq-th message: each of another shape and dtype, its values saying whose it is."""
    dtype, shape = [(torch.float32, (4,)), (torch.int64, (2, 3)), (torch.bfloat16, (5,))][seq % 3]
    return torch.full(shape, 100 * sender + seq, dtype=dtype)


def anysource(rank: int, size: int, groups: dict) -> dict:
    """Over each group: (1) as PyTorch's suite does, every rank in turn receives from any source
    (recv, then irecv) the two messages each other rank sends it; (2) rank 0 receives one message
    from any source, then each rank's others by name: every rank's in the order it sent them,
    of three shapes and dtypes; (3) rank 0 receives from any source with tag 8, then 9, rank 1
    having sent 9 first. Returns what was received and the source ranks reported."""
    results = {}
    for name, group in groups.items():
        got = results[name] = {"turns": [], "mixed": [], "tags": []}
        for receiver in range(size):
            if rank != receiver:
                for seq in range(2):
                    dist.send(torch.full((10,), 100.0 * rank + seq), receiver, group=group)
                continue
            for i in range(2 * (size - 1)):
                received = torch.full((10,), -1.0)
                if i % 2 == 0:
                    source = dist.recv(received, group=group)
                else:
                    work = dist.irecv(received, group=group)
                    work.wait()
                    source = work._source_rank()
                got["turns"].append((source, received))
        if rank == 0:
            first = torch.empty(4)
            source = dist.recv(first, group=group, tag=5)
            got["mixed"].append((source, first))
            for sender in range(1, size):
                for seq in range(1 if sender == source else 0, 3):
                    like = message(sender, seq)
                    received = torch.full_like(like, -1)
                    reported = dist.recv(received, sender, group=group, tag=5)
                    got["mixed"].append((reported, received))
            for tag in (8, 9):
                received = torch.empty(2)
                got["tags"].append((tag, dist.recv(received, group=group, tag=tag), received))
        else:
            works = [dist.isend(message(rank, seq), 0, group=group, tag=5) for seq in range(3)]
            if rank == 1:
                works += [dist.isend(torch.full((2,), 9.0), 0, group=group, tag=9),
                          dist.isend(torch.full((2,), 8.0), 0, group=group, tag=8)]
            for work in works:
                work.wait()
        dist.barrier(group=group)
    return results


def anysource_errors(rank: int, size: int, groups: dict) -> dict:
    """Rank 0 receives 4 elements from any source where rank 1 sends 3: rank 0's receive fails
    naming rank 1 and both sizes, rank 1's send completes, and the pair still works afterwards.
    Then rank 0 receives from any source with a tag nobody sends, in a group with a timeout of 3 s:
    it fails then."""
    group, result = groups["pslink"], {}
    short = dist.new_group(backend="pslink", timeout=datetime.timedelta(seconds=3))
    started = time.monotonic()
    if rank == 0:
        try:
            dist.recv(torch.empty(4), group=group, tag=3)
        except RuntimeError as exc:
            result["mismatch"] = {"error": type(exc).__name__, "message": str(exc),
                                  "seconds": time.monotonic() - started}
        after = torch.zeros(3)
        result["after"] = (dist.recv(after, 1, group=group), after)
        started = time.monotonic()
        try:
            dist.recv(torch.empty(1), group=short, tag=4)
        except RuntimeError as exc:
            result["nobody"] = {"error": type(exc).__name__, "message": str(exc),
                                "seconds": time.monotonic() - started}
    elif rank == 1:
        dist.send(torch.ones(3), 0, group=group, tag=3)
        result["sent"] = time.monotonic() - started
        dist.send(torch.arange(3.0), 0, group=group)
    return result


def monitored(rank: int, size: int, groups: dict) -> dict:
    """monitored_barrier, each case on groups of its own (over pslink, and where gloo returns at
    all, over gloo), the ranks meeting at ``dist.barrier`` between cases: passed by every rank;
    rank 1 missing (rank 0 names it; the others, and rank 1 arriving late, learn it from rank 0);
    every rank but 0 missing, with ``wait_all_ranks`` (all named); rank 0 with a timeout of 0;
    rank 1 missing from a subgroup of ranks 0 and 1. Returns each rank's outcome: None, or the
    error's type, message and seconds."""
    from pslink.torch.backend import monitored_barrier

    second = datetime.timedelta(seconds=1)

    def outcome(call) -> dict | None:
        started = time.monotonic()
        try:
            call()
        except (RuntimeError, ValueError) as exc:
            return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
        return None

    def groups_of(ranks=None) -> dict:
        return {name: dist.new_group(ranks, backend=name) for name in ("pslink", "gloo")}

    results = {"passed": {}, "missing": {}, "all_missing": {}, "zero": {}}
    passing = groups_of()
    for name, group in passing.items():
        results["passed"][name] = [outcome(lambda g=group: g.monitored_barrier(second * 30)),
                                   outcome(lambda g=group: g.monitored_barrier(second * 30, wait_all_ranks=True)),
                                   outcome(lambda g=group: monitored_barrier(g, 30.0))]
    results["torch_refuses"] = outcome(lambda: dist.monitored_barrier(passing["pslink"], second))
    dist.barrier()
    missing = groups_of()["pslink"]
    if rank != 1:
        results["missing"]["pslink"] = outcome(lambda: missing.monitored_barrier(second))
    dist.barrier()
    if rank == 1:  # after rank 0 gave up: it is told at once
        results["late"] = outcome(lambda: missing.monitored_barrier(second))
    for name, group in groups_of().items():
        if rank == 0:
            results["all_missing"][name] = outcome(lambda g=group: g.monitored_barrier(second, wait_all_ranks=True))
        dist.barrier()
    for name, group in groups_of().items():
        if rank == 0:
            results["zero"][name] = outcome(lambda g=group: g.monitored_barrier(datetime.timedelta(0)))
        dist.barrier()
    sub = dist.new_group([0, 1], backend="pslink")
    if rank != 1:
        results["subgroup"] = outcome(lambda: monitored_barrier(sub, second))
    dist.barrier()
    return results


TIMEOUTS = {"stall": 3}


def main() -> None:
    case, scratch = sys.argv[1], sys.argv[2]
    dist.init_process_group("pslink", timeout=datetime.timedelta(seconds=TIMEOUTS.get(case, 60)))
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    groups = {"pslink": dist.group.WORLD, "gloo": gloo}
    cases = {"collectives": collectives, "ddp": ddp, "mismatch": mismatch, "stall": stall, "badsplits": badsplits,
             "fsdp": fsdp, "gan": gan, "badrecv": badrecv, "anysource": anysource,
             "anysource_errors": anysource_errors, "monitored": monitored}
    result = cases[case](rank, size, groups)
    if case == "collectives":
        # A subgroup of ranks 0 and 1 (every rank creates it, as torch requires): a job of its own.
        sub, sub_gloo = dist.new_group([0, 1], backend="pslink"), dist.new_group([0, 1], backend="gloo")
        if rank < 2:
            ours, theirs = data(rank, torch.float32, seed=20), data(rank, torch.float32, seed=20)
            dist.all_reduce(ours, group=sub)
            dist.all_reduce(theirs, group=sub_gloo)
            gathered = [torch.empty(3, 5) for _ in range(2)]
            dist.all_gather(gathered, data(rank, torch.float32, seed=21), group=sub)
            result["subgroup"] = {"pslink": ours, "gloo": theirs, "gathered": torch.stack(gathered),
                                  "size": dist.get_world_size(sub), "rank": dist.get_rank(sub)}
    result["backend"] = dist.get_backend()
    torch.save(result, os.path.join(scratch, f"rank{rank}.pt"))
    if case not in ("mismatch", "stall", "anysource_errors"):
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
