"""``torch.distributed`` on the service: ``dist.init_process_group("pslink")``.

Registered on ``import pslink.torch``. Every group (the default one and each ``new_group``) is a
pslink job of its own ranks; its name comes from ``PSLINK_JOB`` (``pslink launch`` sets it) or,
under torchrun, from the group's rank 0 through the rendezvous store PyTorch passes in. The
service is ``PSLINK_MASTER`` (default ``tcp://127.0.0.1:7770``).

How each collective travels (numpy views of the tensors, staged through host memory for CUDA,
bfloat16 and bool as :mod:`pslink.torch.tensors` does):

- ``allreduce`` SUM and AVG: a push-pull of the group's key for that signature (operation, dtype,
  size); the n-th call of a signature on every rank is round n of its key, so keys do not grow
  with the number of calls. MIN, MAX, PRODUCT and the bitwise ops: every rank's tensor gathered,
  then reduced here in rank order (exact, the same on every rank).
- ``broadcast``, ``allgather``, ``alltoall``: rows of a buffer that only one rank fills, summed
  as integers of the tensor's width: a sum of one value and zeros is that value bit for bit
  (a float sum would turn -0.0 into 0.0).
- ``reduce_scatter``: an allreduce of the whole input, of which each rank keeps its part;
  ``reduce``: an allreduce into a copy the root keeps; ``gather``: an allgather the root keeps;
  ``scatter``: the root's list as integer bits, each rank keeps its slice.
- ``alltoall`` with uneven splits (and of tensor lists): the splits first, then one allgather
  padded to the longest input.
- ``send`` / ``recv``: each pair of ranks a 2-worker job of its own
  (:class:`pslink.torch.backend_parts.Pairs`).
- ``barrier``: pMaster's barrier of the job.

Before the data, each collective's signature (sequence number, operation, size, dtype) goes through
a small key of the group, so ranks that call different collectives, or one with other shapes,
fail at once on every rank with a :class:`PslinkBackendError` (a ``RuntimeError``) naming each
rank's call, instead of waiting on keys the others never push.
"""

from __future__ import annotations

import datetime
import itertools
import os
import threading
import time
import uuid
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from pslink.core.config import ENV_JOB
from pslink.core.agent import Agent
from pslink.core.worker.connect import connect as connect_agent
from pslink.core.worker.collectives import bits_of
from pslink.errors import PslinkError, PslinkTimeoutError
from pslink.torch.backend_parts import (Collective, Pairs, PslinkBackendError, Work, all_of, dtype_code,
                                        numpy_of, single, tensor_of, then_finish)
from pslink.torch.ddp import _Deadlines, _Pending
from pslink.torch.tensors import HostView

NAME = "pslink"
_OPS = {
    dist.ReduceOp.SUM: 1, dist.ReduceOp.AVG: 2, dist.ReduceOp.PRODUCT: 3, dist.ReduceOp.MIN: 4,
    dist.ReduceOp.MAX: 5, dist.ReduceOp.BAND: 6, dist.ReduceOp.BOR: 7, dist.ReduceOp.BXOR: 8,
}
_KINDS = ["allreduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "reduce", "gather", "scatter",
          "alltoallv"]


class ProcessGroupPslink(dist.ProcessGroup):
    """One torch.distributed group as one pslink job (its ranks the job's workers)."""

    def __init__(self, agent: Agent, rank: int, size: int, timeout: float):
        super().__init__(rank, size)
        self.agent = agent
        self.timeout = timeout
        self._seq = itertools.count()
        self._lock = threading.Lock()  # collectives are issued in one order on every rank
        self._deadlines = _Deadlines()
        self._pairs = Pairs(self)  # send and recv
        self._group_name = ""

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return NAME

    def name(self) -> str:
        return NAME

    # torch keeps a group's name in its C++ backends, which a group written in Python has none of:
    # without these, ``group.group_name`` (DeviceMesh, FSDP2, functional collectives) raises.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    # -- the machinery -----------------------------------------------------------------------------

    def _issue(self, kind: str, signature: tuple, run: Callable[[], list], finish: Callable[[], object],
               what: str):
        """Check ``signature`` with the other ranks and run the push-pulls ``run()`` returns (their
        handles); the work completes with ``finish()`` once all are done."""
        future = torch.futures.Future()
        pending = Collective(future, f"{what} not done within {self.timeout:g} s (job {self.agent.job!r}, rank "
                                   f"{self.rank()}): has another rank died, stalled or called something else?")
        try:
            with self._lock:
                seq = next(self._seq)
                handles = [self._check_order(seq, kind, signature, what, pending)] + run()
        except PslinkError as exc:
            future.set_exception(PslinkBackendError(f"{what}: {exc.message}"))
            return Work(future)
        left = [len(handles)]
        guard = threading.Lock()

        def done(handle) -> None:
            error = handle.exception()
            if error is not None:
                pending.fail(PslinkBackendError(f"{what}: {error.message}"))
                return
            with guard:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    pending.succeed(finish())
                except Exception as exc:  # the copy back failed: the work must still complete
                    pending.fail(exc if isinstance(exc, RuntimeError) else PslinkBackendError(f"{what}: {exc!r}"))

        self._deadlines.add(time.monotonic() + self.timeout, pending)
        for handle in handles:
            handle.add_done_callback(done)
        return Work(future)

    def _check_order(self, seq: int, kind: str, signature: tuple, what: str, pending: _Pending):
        """Every rank's (sequence, collective, signature) side by side: a rank that called
        something else fails every rank's work at once."""
        size, rank = self.size(), self.rank()
        mine = np.array([seq, _KINDS.index(kind) + 1, *signature], np.int64)
        table = np.zeros((size, len(mine)), np.int64)
        table[rank] = mine
        handle = self.agent.pushpull(f"order/{len(mine)}", table, out=table)

        def compare(handle) -> None:
            if handle.exception() is not None:
                return  # the collective's own callback reports it
            differ = [r for r in range(size) if not np.array_equal(table[r], mine)]
            if differ:
                calls = "; ".join(f"rank {r}: call {int(row[0])} {_KINDS[int(row[1]) - 1]} {list(map(int, row[2:]))}"
                                  for r, row in enumerate(table))
                pending.fail(PslinkBackendError(
                    f"{what}: ranks made different collective calls ({calls}; the numbers are op, elements, "
                    "dtype and root): every rank must call the same collectives, in the same order, with "
                    "tensors of the same shape and dtype"))

        handle.add_done_callback(compare)
        return handle

    def _pushpull(self, key: str, array: np.ndarray, average: bool = False):
        return self.agent.pushpull(key, array, out=array, average=average)

    def _gather(self, key: str, rows: np.ndarray) -> tuple[np.ndarray, Callable]:
        """(a (size, n) integer buffer whose row ``rank`` holds ``rows``' bits, its push-pull)."""
        bits = bits_of(np.ascontiguousarray(rows))
        table = np.zeros((self.size(), bits.size), bits.dtype)
        table[self.rank()] = bits
        return table, lambda: [self._pushpull(f"{key}/{table.dtype}/{bits.size}", table)]

    # -- collectives ------------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        tensor = single(tensors, "allreduce")
        if tensor.is_sparse:
            return self._sparse_allreduce(tensor, op)
        return self._allreduce(tensors, op, "allreduce", 0,
                               f"allreduce ({_name_of(op)}) of {tuple(tensor.shape)} {tensor.dtype}")

    def _allreduce(self, tensors: list[torch.Tensor], op, kind: str, root: int, what: str):
        code = _OPS.get(getattr(op, "op", op))
        tensor = tensors[0]
        if code is None:
            raise PslinkBackendError(f"{what}: reduce op {op} is not supported by the pslink backend")
        signature = (code, tensor.numel(), dtype_code(tensor.dtype), root)
        if code in (1, 2):
            view = HostView(tensor, what)
            average = code == 2 and view.array.dtype.kind == "f"
            key = f"allreduce/{view.array.dtype}/{tensor.numel()}" + ("/avg" if average else "")

            def finish():
                if code == 2 and not average:  # integers: summed by the service, divided here
                    view.array[...] = view.array // self.size()
                view.finish()
                return tensors

            return self._issue(kind, signature, lambda: [self._pushpull(key, view.array, average)], finish, what)
        host = tensor.detach().to("cpu").contiguous()
        table, run = self._gather("allreduce-gather", numpy_of(host))

        def finish_gathered():
            rows = tensor_of(table, host, (self.size(),) + tuple(host.shape))
            result = rows[0].clone()
            for row in rows[1:]:
                result = _REDUCERS[code](result, row)
            tensor.copy_(result)
            return tensors

        return self._issue(kind, signature, run, finish_gathered, what)

    def _sparse_allreduce(self, tensor: torch.Tensor, op):
        """A sparse COO tensor summed (as gloo does): every rank's entries gathered (counts first,
        then indices and values padded to the most entries), summed and coalesced here, the same
        on every rank. Done before it returns, also when asked for asynchronously."""
        what = f"allreduce of a sparse {tuple(tensor.shape)} {tensor.dtype}"
        if getattr(op, "op", op) != dist.ReduceOp.SUM:
            raise PslinkBackendError(f"{what}: only SUM is supported for sparse tensors, not {_name_of(op)}")
        mine = tensor.coalesce()
        indices, values = mine.indices(), mine.values()
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size())]
        self.allgather([counts], [torch.tensor([values.shape[0]])]).wait()
        most = int(max(c.item() for c in counts))
        padded_indices = torch.zeros((indices.shape[0], most), dtype=indices.dtype)
        padded_values = torch.zeros((most,) + tuple(values.shape[1:]), dtype=values.dtype)
        padded_indices[:, : indices.shape[1]] = indices
        padded_values[: values.shape[0]] = values
        all_indices = [torch.empty_like(padded_indices) for _ in range(self.size())]
        all_values = [torch.empty_like(padded_values) for _ in range(self.size())]
        self.allgather([all_indices], [padded_indices]).wait()
        self.allgather([all_values], [padded_values]).wait()
        entries = [int(c.item()) for c in counts]
        summed = torch.sparse_coo_tensor(torch.cat([i[:, :n] for i, n in zip(all_indices, entries)], dim=1),
                                         torch.cat([v[:n] for v, n in zip(all_values, entries)]), tensor.shape)
        tensor.copy_(summed.coalesce())
        future = torch.futures.Future()
        future.set_result([tensor])
        return Work(future)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None):
        works = [self.allreduce([t], _allreduce_options(opts.reduceOp if opts is not None else dist.ReduceOp.SUM))
                 for t in tensors]
        return all_of(works, tensors)

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size():
            raise PslinkBackendError(f"{what}: root rank {root} is not in [0, {self.size()})")

    def reduce(self, tensors: list[torch.Tensor], opts=None):
        """An allreduce into a copy; the root keeps the result (the others' tensors are left as
        they were). Every rank receives it on the way: a parameter service answers every push."""
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        tensor = single(tensors, "reduce")
        what = f"reduce ({_name_of(op)}) to rank {root} of {tuple(tensor.shape)} {tensor.dtype}"
        self._check_root(root, what)
        reduced = tensor.detach().clone()

        def finish(_):
            if self.rank() == root:
                tensor.copy_(reduced)
            return tensors

        return then_finish(self._allreduce([reduced], op, "reduce", root, what), finish)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        """Every rank's tensor to the root's list (through an all-gather: the others drop it)."""
        root = opts.rootRank if opts is not None else 0
        tensor = single(inputs, "gather")
        what = f"gather to rank {root} of {tuple(tensor.shape)} {tensor.dtype}"
        self._check_root(root, what)
        outputs = output_lists[0] if output_lists else []
        if self.rank() == root and len(outputs) != self.size():
            raise PslinkBackendError(f"{what}: {len(outputs)} output tensors on the root for {self.size()} ranks")
        host = tensor.detach().to("cpu").contiguous()
        table, run = self._gather("gather", numpy_of(host))

        def finish():
            if self.rank() == root:
                for out, row in zip(outputs, table):
                    out.copy_(tensor_of(row, host, out.shape))
            return output_lists

        return self._issue("gather", (tensor.numel(), dtype_code(tensor.dtype), root, 0), run, finish, what)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        """The root's list, one tensor to each rank: the root pushes the integer bits of them all
        (the others zeros), the sum is the root's bits, each rank keeps its slice."""
        root = opts.rootRank if opts is not None else 0
        output = single(outputs, "scatter")
        what = f"scatter from rank {root} of {tuple(output.shape)} {output.dtype}"
        self._check_root(root, what)
        pieces = input_lists[0] if input_lists else []
        size, n = self.size(), output.numel()
        if self.rank() == root and (len(pieces) != size or any(p.numel() != n or p.dtype != output.dtype
                                                                for p in pieces)):
            raise PslinkBackendError(f"{what}: the root needs {size} tensors of {n} {output.dtype} elements, got "
                                     f"{[(p.numel(), p.dtype) for p in pieces]}")
        host = output.detach().to("cpu").contiguous()
        width = bits_of(numpy_of(host)).dtype
        bits = np.zeros(size * n, width)
        if self.rank() == root:
            bits[...] = np.concatenate([bits_of(numpy_of(p.detach().to("cpu").contiguous())) for p in pieces])
        key = f"scatter/{bits.dtype}/{bits.size}"

        def finish():
            rank = self.rank()
            output.copy_(tensor_of(bits[rank * n : (rank + 1) * n], host))
            return outputs

        return self._issue("scatter", (n, dtype_code(output.dtype), root, 0), lambda: [self._pushpull(key, bits)],
                           finish, what)

    def broadcast(self, tensors: list[torch.Tensor], opts=None):
        root = opts.rootRank if opts is not None else 0
        tensor = single(tensors, "broadcast")
        what = f"broadcast from rank {root} of {tuple(tensor.shape)} {tensor.dtype}"
        self._check_root(root, what)
        host = tensor.detach().to("cpu").contiguous()
        bits = bits_of(numpy_of(host))
        bits = bits.copy() if self.rank() == root else np.zeros(bits.shape, bits.dtype)
        key = f"broadcast/{bits.dtype}/{bits.size}"

        def finish():
            if self.rank() != root:
                tensor.copy_(tensor_of(bits, host))
            return tensors

        return self._issue("broadcast", (tensor.numel(), dtype_code(tensor.dtype), root, 0),
                           lambda: [self._pushpull(key, bits)], finish, what)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        tensor = single(inputs, "allgather")
        outputs = single(output_lists, "allgather")
        what = f"allgather of {tuple(tensor.shape)} {tensor.dtype}"
        if len(outputs) != self.size():
            raise PslinkBackendError(f"{what}: {len(outputs)} output tensors for {self.size()} ranks")
        host = tensor.detach().to("cpu").contiguous()
        table, run = self._gather("allgather", numpy_of(host))

        def finish():
            for out, row in zip(outputs, table):
                out.copy_(tensor_of(row, host))
            return outputs

        return self._issue("allgather", (tensor.numel(), dtype_code(tensor.dtype), 0, 0), run, finish, what)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts=None):  # noqa: A002
        what = f"all_gather_into_tensor of {tuple(input.shape)} {input.dtype}"
        if output.numel() != input.numel() * self.size():
            raise PslinkBackendError(f"{what}: the output has {output.numel()} elements, "
                                     f"{input.numel() * self.size()} expected")
        host = input.detach().to("cpu").contiguous()
        table, run = self._gather("allgather", numpy_of(host))

        def finish():
            output.view(-1).copy_(tensor_of(table, host, (-1,)))
            return [output]

        return self._issue("allgather", (input.numel(), dtype_code(input.dtype), 0, 0), run, finish, what)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        """``output_lists[r][i]``: rank r's ``inputs[i]``."""
        if any(len(outputs) != len(inputs) for outputs in output_lists) or len(output_lists) != self.size():
            raise PslinkBackendError(f"all_gather_coalesced of {len(inputs)} tensors: the outputs are "
                                     f"{[len(o) for o in output_lists]} lists, {self.size()} of {len(inputs)} expected")
        works = [self.allgather([[outputs[i] for outputs in output_lists]], [tensor]) for i, tensor in enumerate(inputs)]
        return all_of(works, output_lists)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        works = [self._allgather_base(output, tensor) for output, tensor in zip(outputs, inputs, strict=True)]
        return all_of(works, outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        works = [self._reduce_scatter_base(output, tensor, opts) for output, tensor in zip(outputs, inputs, strict=True)]
        return all_of(works, outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        output = single(outputs, "reduce_scatter")
        inputs = single(input_lists, "reduce_scatter")
        whole = torch.cat([t.reshape(-1) for t in inputs])
        return self._reduce_scatter(output, whole, opts, "reduce_scatter")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts=None):  # noqa: A002
        return self._reduce_scatter(output, input.reshape(-1), opts, "reduce_scatter_tensor")

    def _reduce_scatter(self, output: torch.Tensor, whole: torch.Tensor, opts, name: str):
        what = f"{name} of {tuple(whole.shape)} {whole.dtype}"
        if whole.numel() != output.numel() * self.size():
            raise PslinkBackendError(f"{what}: the input has {whole.numel()} elements, "
                                     f"{output.numel() * self.size()} expected")
        reduced = whole.detach().clone()
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        inner = self.allreduce([reduced], _allreduce_options(op))
        start = self.rank() * output.numel()

        def finish(_):
            output.view(-1).copy_(reduced[start : start + output.numel()])
            return [output]

        return then_finish(inner, finish)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                      input_split_sizes: list[int], opts=None):
        what = f"all_to_all_single of {tuple(input.shape)} {input.dtype}"
        size, rank = self.size(), self.rank()
        if input_split_sizes or output_split_sizes:
            return self._alltoallv(output, input, list(output_split_sizes), list(input_split_sizes), what)
        if input.numel() % size or output.numel() != input.numel():
            raise PslinkBackendError(f"{what}: input and output must hold the same number of elements, a multiple "
                                     f"of {size}")
        host = input.detach().to("cpu").contiguous()
        table, run = self._gather("alltoall", numpy_of(host))
        chunk = table.shape[1] // size

        def finish():
            mine = np.concatenate([table[source, rank * chunk : (rank + 1) * chunk] for source in range(size)])
            output.view(-1).copy_(tensor_of(mine, host, (-1,)))
            return [output]

        return self._issue("alltoall", (input.numel(), dtype_code(input.dtype), 0, 0), run, finish, what)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        """``all_to_all`` of tensor lists: the uneven all-to-all of their flattened concatenation."""
        what = f"all_to_all of {len(inputs)} tensors"
        dtypes = {t.dtype for t in list(inputs) + list(outputs)}
        if len(dtypes) > 1:
            raise PslinkBackendError(f"{what}: every tensor must have one dtype, got {sorted(map(str, dtypes))}")
        flat_in = torch.cat([t.detach().reshape(-1).to("cpu") for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype)
        work = self._alltoallv(flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs], what)

        def finish(_):
            for out, piece in zip(outputs, torch.split(flat_out, [t.numel() for t in outputs])):
                out.copy_(piece.reshape(out.shape))
            return outputs

        return then_finish(work, finish)

    def _alltoallv(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int],  # noqa: A002
                   in_splits: list[int], what: str):
        """All-to-all with uneven splits along dim 0. Every rank's splits (what it sends to and
        expects from each) are exchanged first, before this returns: every rank then checks the
        same table, and the data go through one all-gather padded to the longest input."""
        size, rank = self.size(), self.rank()
        row = int(np.prod(input.shape[1:], dtype=np.int64)) if input.dim() > 1 else 1
        if input.dim() == 0 or output.dim() == 0 or tuple(input.shape[1:]) != tuple(output.shape[1:]):
            raise PslinkBackendError(f"{what}: input {tuple(input.shape)} and output {tuple(output.shape)} must split "
                                     "along dim 0 into rows of one shape")
        in_splits = in_splits or [input.shape[0] // size] * size
        out_splits = out_splits or [output.shape[0] // size] * size
        for name, splits, rows in (("input", in_splits, input.shape[0]), ("output", out_splits, output.shape[0])):
            if len(splits) != size or sum(splits) != rows or min(splits) < 0:
                raise PslinkBackendError(f"{what}: {name} splits {splits} must be {size} sizes >= 0 adding up to its "
                                         f"{rows} rows")
        with self._lock:  # the splits' exchange in the order of every rank's collectives
            table = np.zeros((size, 2 * size), np.int64)
            table[rank] = in_splits + out_splits
            try:
                self.agent.pushpull(f"alltoallv-splits/{size}", table, out=table).wait()
            except PslinkError as exc:
                raise PslinkBackendError(f"{what}: exchanging the splits: {exc.message}") from None
        sends, expects = table[:, :size], table[:, size:]
        if not np.array_equal(sends, expects.T):
            bad = [(s, d) for s in range(size) for d in range(size) if sends[s, d] != expects[d, s]]
            raise PslinkBackendError(f"{what}: the splits do not match: " + "; ".join(
                f"rank {s} sends {sends[s, d]} rows to rank {d}, which expects {expects[d, s]}" for s, d in bad))
        longest = int(sends.sum(axis=1).max()) * row
        host = input.detach().to("cpu").contiguous()
        bits = bits_of(numpy_of(host))
        data = np.zeros((size, longest), bits.dtype)
        data[rank, : bits.size] = bits
        key = f"alltoallv/{data.dtype}/{longest}"

        def finish():
            starts = np.concatenate([np.zeros((size, 1), np.int64), np.cumsum(sends, axis=1)], axis=1) * row
            mine = np.concatenate([data[s, starts[s, rank] : starts[s, rank + 1]] for s in range(size)])
            output.view(-1).copy_(tensor_of(mine, host, (-1,)))
            return [output]

        return self._issue("alltoallv", (row, dtype_code(input.dtype), 0, 0), lambda: [self._pushpull(key, data)],
                           finish, what)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0):
        return self._pairs.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0):
        return self._pairs.recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0):
        return self._pairs.recv_anysource(tensors, tag)

    # PyTorch 2.13 calls these names; older releases the ones above.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        future = torch.futures.Future()
        what = f"barrier of job {self.agent.job!r} (rank {self.rank()})"

        def wait(name: str):
            try:
                self.agent.barrier(name, timeout=self.timeout)
                future.set_result([torch.zeros(0)])
            except PslinkTimeoutError as exc:
                future.set_exception(PslinkBackendError(f"{what} hit its timeout of {self.timeout:g} s: {exc.message}"))
            except PslinkError as exc:
                future.set_exception(PslinkBackendError(f"{what}: {exc.message}"))

        with self._lock:  # the barrier's number taken in the order collectives are issued, as theirs
            threading.Thread(target=wait, args=(f"torch-barrier-{next(self._seq)}",), name="pslink-barrier",
                             daemon=True).start()
        return Work(future)

    def shutdown(self) -> None:
        self._deadlines.close()
        self._pairs.close()
        self.agent.close()


_REDUCERS = {
    3: torch.mul, 4: torch.minimum, 5: torch.maximum, 6: torch.bitwise_and, 7: torch.bitwise_or, 8: torch.bitwise_xor,
}


def _name_of(op) -> str:
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]


def _allreduce_options(op):
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return options


# -- creating groups ----------------------------------------------------------------------------------------


def _job_name(store, rank: int) -> str:
    """The group's job: rank 0 names it (after PSLINK_JOB when set) and tells the others through
    the group's store, which PyTorch prefixes per group. torchrun's elastic agent may hand a
    restarted group the store of the attempt before, whose name would be stale: the key carries
    the attempt (``TORCHELASTIC_RESTART_COUNT``)."""
    key = f"pslink/job/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        base = os.environ.get(ENV_JOB) or "torch"
        store.set(key, f"{base}.pg-{uuid.uuid4().hex[:12]}")
    return store.get(key).decode()


def create(store, rank: int, size: int, timeout: datetime.timedelta) -> ProcessGroupPslink:
    """torch.distributed's creator for ``backend="pslink"``."""
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    job = _job_name(store, rank)
    try:
        agent = connect_agent(job, rank, size, mode="sum", timeout=seconds)
    except PslinkError as exc:
        raise PslinkBackendError(f"init_process_group(backend='pslink'), rank {rank} of {size}: {exc.message}") \
            from None
    return ProcessGroupPslink(agent, rank, size, seconds)


def register() -> None:
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, create, devices=["cpu", "cuda"])

