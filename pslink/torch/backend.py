"""``torch.distributed`` on the service: ``dist.init_process_group("pslink")``.

Registered on ``import pslink.torch``. Every group (the default one and each ``new_group``) is a
pslink job of its own ranks; its name comes from ``PSLINK_JOB`` (``pslink launch`` sets it) or,
under torchrun, from the group's rank 0 through the rendezvous store PyTorch passes in. The
service is ``PSLINK_MASTER`` (default ``tcp://127.0.0.1:7770``).

Each group's collectives are the worker layer's Session's (:mod:`pslink.core.worker.session`,
the one Horovod's APIs use), in its *ordered* form: torch.distributed's ranks make the same
collectives in the same order, so the n-th call of every rank is one operation, checked on the
Session's board (a rank that called something else, or with another shape or dtype, fails every
rank's call at once, naming each rank's) and keyed by its signature (a training loop reuses a few
keys). This module only maps torch.distributed's calls onto them:

- ``all_reduce`` of every op (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR), ``broadcast``,
  ``all_gather`` (into lists or one tensor), ``all_to_all`` (even, uneven with every rank's
  splits checked against what the others expect, and of lists), ``reduce_scatter``;
- ``reduce``: an allreduce the root keeps; ``gather``: an allgather the root keeps; ``scatter``:
  a broadcast of the root's list, each rank keeping its slice;
- sparse ``all_reduce`` (SUM, as gloo): every rank's indices and values gathered, summed here;
- ``send`` / ``recv``: each pair of ranks a 2-worker job of its own (:mod:`pslink.torch.point_to_point`);
- ``recv`` from any source: a receive offered to every other rank (:mod:`pslink.torch.point_to_point`);
- ``barrier``: pMaster's barrier of the job; ``monitored_barrier``: gloo's, on point-to-point
  messages (``dist.monitored_barrier`` runs for gloo only: :func:`monitored_barrier` is the call).

Tensors travel as host views of their memory where they can (:class:`~pslink.torch.tensors.HostView`);
every collective returns a :class:`~pslink.torch.works.Work` whose future completes when its
answers came, or fails at the group's timeout.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from pslink.core.config import ENV_JOB
from pslink.core.agent import Agent
from pslink.core.worker.connect import connect as connect_agent
from pslink.core.worker.pending import Pending, PendingGroup
from pslink.core.worker.reduction import Average, Band, Bor, Bxor, Max, Min, Product, ReduceOp, Sum
from pslink.core.worker.session import Session
from pslink.errors import PslinkError, PslinkTimeoutError
from pslink.torch.point_to_point import Pairs
from pslink.torch.tensors import HostView
from pslink.torch.works import Collective, Deadlines, PslinkBackendError, Work, all_of, single, then_finish

NAME = "pslink"
_OPS = {
    dist.ReduceOp.SUM: Sum, dist.ReduceOp.AVG: Average, dist.ReduceOp.PRODUCT: Product, dist.ReduceOp.MIN: Min,
    dist.ReduceOp.MAX: Max, dist.ReduceOp.BAND: Band, dist.ReduceOp.BOR: Bor, dist.ReduceOp.BXOR: Bxor,
}


class ProcessGroupPslink(dist.ProcessGroup):
    """One torch.distributed group as one pslink job (its ranks the job's workers)."""

    def __init__(self, agent: Agent, rank: int, size: int, timeout: float):
        super().__init__(rank, size)
        self.agent = agent
        self.session = Session(agent, ordered=True, unattended=True)
        self.timeout = timeout
        self._deadlines = Deadlines()
        self._pairs = Pairs(agent.job, rank, size, timeout, self._deadlines)
        self._barriers = itertools.count()
        self._barrier_lock = threading.Lock()
        self._barrier_threads: list[threading.Thread] = []
        self._group_name = ""
        # The session closes at exit at the latest (before the interpreter goes down), not after,
        # and its threads are joined: a thread that completes a torch future, or drops the last
        # reference to one, while the interpreter goes down is stopped inside torch's frames, and
        # the process aborts ("terminate called without an active exception").
        self._close = weakref.finalize(self, _close, self._deadlines, self._pairs, self.session,
                                       self._barrier_threads)

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

    def _work(self, what: str, start: Callable[[], Pending | PendingGroup], finish: Callable[[object], object]):
        """A Work for the Session's call ``start()`` makes: its future completes with
        ``finish(result)`` (copying results into torch's tensors) once the call ended, or fails,
        with a RuntimeError naming ``what``, on the call's error or at the group's timeout."""
        future = torch.futures.Future()
        collective = Collective(future, f"{what} not done within {self.timeout:g} s (job {self.agent.job!r}, rank "
                                        f"{self.rank()}): has another rank died, stalled or called something else?")
        try:
            pending = start()
        except PslinkError as exc:
            future.set_exception(PslinkBackendError(f"{what}: {exc.message}"))
            return Work(future)

        def ended(_) -> None:
            error = pending.exception() if isinstance(pending, Pending) else _group_error(pending)
            if error is not None:
                message = error.message if isinstance(error, PslinkError) else repr(error)
                collective.fail(PslinkBackendError(f"{what}: {message}"))
                return
            try:
                collective.succeed(finish(pending.wait(0)))
            except Exception as exc:  # the copy back failed: the work must still complete
                collective.fail(exc if isinstance(exc, RuntimeError) else PslinkBackendError(f"{what}: {exc!r}"))

        self._deadlines.add(time.monotonic() + self.timeout, collective)
        _when_ended(pending, ended)
        return Work(future)

    def _op(self, op, what: str) -> ReduceOp:
        reduce = _OPS.get(getattr(op, "op", op))
        if reduce is None:
            raise PslinkBackendError(f"{what}: reduce op {op} is not supported by the pslink backend")
        return reduce

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size():
            raise PslinkBackendError(f"{what}: root rank {root} is not in [0, {self.size()})")

    # -- allreduce, reduce ------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        tensor = single(tensors, "allreduce")
        if tensor.is_sparse:
            return self._sparse_allreduce(tensor, op)
        what = f"allreduce ({_name_of(op)}) of {tuple(tensor.shape)} {tensor.dtype}"
        return self._allreduce(tensor, self._op(op, what), what, tensors)

    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp, what: str, result):
        view = HostView(tensor, what)
        return self._work(what, lambda: self.session.allreduce(view.array, view.array, op=op),
                          lambda _: (view.finish(), result)[1])

    def _sparse_allreduce(self, tensor: torch.Tensor, op):
        """A sparse COO tensor summed (as gloo does): every rank's indices and values gathered
        (ranks bring different numbers of entries), summed and coalesced here, the same on every
        rank. Done before it returns, also when asked for asynchronously."""
        what = f"allreduce of a sparse {tuple(tensor.shape)} {tensor.dtype}"
        if getattr(op, "op", op) != dist.ReduceOp.SUM:
            raise PslinkBackendError(f"{what}: only SUM is supported for sparse tensors, not {_name_of(op)}")
        mine = tensor.coalesce()
        indices = HostView(mine.indices().t().contiguous(), what)
        values = HostView(mine.values().contiguous(), what)
        try:
            (all_indices, _), (all_values, _) = self.session.grouped_allgather(
                [indices.array, values.array]).wait(self.timeout)
        except PslinkError as exc:
            raise PslinkBackendError(f"{what}: {exc.message}") from None
        summed = torch.sparse_coo_tensor(torch.from_numpy(all_indices).t(),
                                         torch.from_numpy(all_values).to(tensor.dtype), tensor.shape)
        tensor.copy_(summed.coalesce())
        future = torch.futures.Future()
        future.set_result([tensor])
        return Work(future)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return all_of([self.allreduce([t], _allreduce_options(op)) for t in tensors], tensors)

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

        return then_finish(self._allreduce(reduced, self._op(op, what), what, [reduced]), finish)

    # -- broadcast, scatter -----------------------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], opts=None):
        root = opts.rootRank if opts is not None else 0
        tensor = single(tensors, "broadcast")
        what = f"broadcast from rank {root} of {tuple(tensor.shape)} {tensor.dtype}"
        self._check_root(root, what)
        view = HostView(tensor, what)
        return self._work(what, lambda: self.session.broadcast(view.array, root, view.array),
                          lambda _: (view.finish(), tensors)[1])

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        """The root's list, one tensor to each rank: a broadcast of the root's tensors laid end to
        end (the others send zeros), each rank keeping its slice."""
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
        whole = torch.zeros(size * n, dtype=output.dtype)
        if self.rank() == root:
            whole.copy_(torch.cat([p.detach().reshape(-1).to("cpu") for p in pieces]))
        view = HostView(whole, what)
        rank = self.rank()

        def finish(_):
            view.finish()
            output.copy_(whole[rank * n : (rank + 1) * n].reshape(output.shape))
            return outputs

        return self._work(what, lambda: self.session.broadcast(view.array, root, view.array), finish)

    # -- allgather, gather --------------------------------------------------------------------------

    def _allgather(self, tensor: torch.Tensor, what: str, finish: Callable[[torch.Tensor], object]):
        """Every rank's ``tensor``, stacked in rank order, to ``finish``."""
        view = HostView(tensor.detach().reshape(1, *tensor.shape), what)
        size = self.size()

        def gathered(result):
            rows, _ = result
            return finish(torch.from_numpy(rows).to(tensor.dtype).reshape(size, *tensor.shape))

        return self._work(what, lambda: self.session.allgather(view.array), gathered)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        tensor = single(inputs, "allgather")
        outputs = single(output_lists, "allgather")
        what = f"allgather of {tuple(tensor.shape)} {tensor.dtype}"
        if len(outputs) != self.size():
            raise PslinkBackendError(f"{what}: {len(outputs)} output tensors for {self.size()} ranks")

        def finish(rows: torch.Tensor):
            for out, row in zip(outputs, rows):
                out.copy_(row.reshape(out.shape))
            return output_lists

        return self._allgather(tensor, what, finish)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts=None):  # noqa: A002
        what = f"all_gather_into_tensor of {tuple(input.shape)} {input.dtype}"
        if output.numel() != input.numel() * self.size():
            raise PslinkBackendError(f"{what}: the output has {output.numel()} elements, "
                                     f"{input.numel() * self.size()} expected")

        def finish(rows: torch.Tensor):
            output.view(-1).copy_(rows.reshape(-1))
            return [output]

        return self._allgather(input, what, finish)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        """``output_lists[r][i]``: rank r's ``inputs[i]``."""
        if any(len(outputs) != len(inputs) for outputs in output_lists) or len(output_lists) != self.size():
            raise PslinkBackendError(f"all_gather_coalesced of {len(inputs)} tensors: the outputs are "
                                     f"{[len(o) for o in output_lists]} lists, {self.size()} of {len(inputs)} "
                                     "expected")
        works = [self.allgather([[outputs[i] for outputs in output_lists]], [tensor])
                 for i, tensor in enumerate(inputs)]
        return all_of(works, output_lists)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        works = [self._allgather_base(output, tensor) for output, tensor in zip(outputs, inputs, strict=True)]
        return all_of(works, outputs)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts=None):
        """Every rank's tensor to the root's list (through an allgather: the others drop it)."""
        root = opts.rootRank if opts is not None else 0
        tensor = single(inputs, "gather")
        what = f"gather to rank {root} of {tuple(tensor.shape)} {tensor.dtype}"
        self._check_root(root, what)
        outputs = output_lists[0] if output_lists else []
        if self.rank() == root and len(outputs) != self.size():
            raise PslinkBackendError(f"{what}: {len(outputs)} output tensors on the root for {self.size()} ranks")

        def finish(rows: torch.Tensor):
            if self.rank() == root:
                for out, row in zip(outputs, rows):
                    out.copy_(row.reshape(out.shape))
            return output_lists

        return self._allgather(tensor, what, finish)

    # -- reduce_scatter -----------------------------------------------------------------------------

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts=None):
        output = single(outputs, "reduce_scatter")
        inputs = single(input_lists, "reduce_scatter")
        whole = torch.cat([t.reshape(-1) for t in inputs])
        return self._reduce_scatter(output, whole, opts, "reduce_scatter")

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts=None):  # noqa: A002
        return self._reduce_scatter(output, input.reshape(-1), opts, "reduce_scatter_tensor")

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        works = [self._reduce_scatter_base(output, tensor, opts) for output, tensor in zip(outputs, inputs,
                                                                                          strict=True)]
        return all_of(works, outputs)

    def _reduce_scatter(self, output: torch.Tensor, whole: torch.Tensor, opts, name: str):
        """Each rank's share (its row of ``whole`` laid out as one row per rank) of the sum:
        the Session's reducescatter for SUM and AVG, an allreduce of the whole for the others."""
        what = f"{name} of {tuple(whole.shape)} {whole.dtype}"
        size, n, rank = self.size(), output.numel(), self.rank()
        if whole.numel() != n * size:
            raise PslinkBackendError(f"{what}: the input has {whole.numel()} elements, {n * size} expected")
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
        rows = whole.detach().reshape(size, n)
        if op in (Sum, Average):
            view = HostView(rows, what)

            def finish_share(share: np.ndarray):
                output.view(-1).copy_(torch.from_numpy(share).to(output.dtype).reshape(-1))
                return [output]

            return self._work(what, lambda: self.session.reducescatter(view.array, op=op), finish_share)
        reduced = rows.clone()

        def finish_whole(_):
            output.view(-1).copy_(reduced[rank])
            return [output]

        return then_finish(self._allreduce(reduced, op, what, [reduced]), finish_whole)

    # -- all_to_all ---------------------------------------------------------------------------------

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                      input_split_sizes: list[int], opts=None):
        """all_to_all_single: rows of dim 0, evenly or by the splits given (each rank's checked
        against what the others expect, on every rank, before a row is sent)."""
        what = f"all_to_all_single of {tuple(input.shape)} {input.dtype}"
        size = self.size()
        if input.dim() == 0 or output.dim() == 0 or tuple(input.shape[1:]) != tuple(output.shape[1:]):
            raise PslinkBackendError(f"{what}: input {tuple(input.shape)} and output {tuple(output.shape)} must split "
                                     "along dim 0 into rows of one shape")
        in_splits = list(input_split_sizes) or None
        out_splits = list(output_split_sizes) or [output.shape[0] // size] * size
        if in_splits is None and input.shape[0] % size:
            raise PslinkBackendError(f"{what}: {input.shape[0]} rows do not split evenly over {size} ranks")
        for label, splits, rows in (("input", in_splits, input.shape[0]), ("output", out_splits, output.shape[0])):
            if splits is not None and (len(splits) != size or sum(splits) != rows or min(splits) < 0):
                raise PslinkBackendError(f"{what}: {label} splits {splits} must be {size} sizes >= 0 adding up to "
                                         f"its {rows} rows")
        view = HostView(input.detach(), what)

        def finish(result):
            received, _ = result
            output.copy_(torch.from_numpy(received).to(output.dtype).reshape(output.shape))
            return [output]

        return self._work(what, lambda: self.session.alltoall(view.array, in_splits, expect=out_splits), finish)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts=None):
        """``all_to_all`` of tensor lists: the uneven all-to-all of their flattened concatenation."""
        what = f"all_to_all of {len(inputs)} tensors"
        dtypes = {t.dtype for t in list(inputs) + list(outputs)}
        if len(dtypes) > 1:
            raise PslinkBackendError(f"{what}: every tensor must have one dtype, got {sorted(map(str, dtypes))}")
        flat_in = torch.cat([t.detach().reshape(-1).to("cpu") for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype)
        work = self.alltoall_base(flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs])

        def finish(_):
            for out, piece in zip(outputs, torch.split(flat_out, [t.numel() for t in outputs])):
                out.copy_(piece.reshape(out.shape))
            return outputs

        return then_finish(work, finish)

    # -- point to point, barrier --------------------------------------------------------------------

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

        with self._barrier_lock:  # numbered in the order the barriers are called, on every rank alike
            name = f"torch-barrier-{next(self._barriers)}"
            thread = threading.Thread(target=wait, args=(name,), name="pslink-barrier", daemon=True)
            self._barrier_threads[:] = [t for t in self._barrier_threads if t.is_alive()]
            self._barrier_threads.append(thread)
        thread.start()
        return Work(future)

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier, on point-to-point messages: every rank but 0 tells rank 0 it
        arrived, then waits for its word; rank 0 waits up to ``timeout`` (a timedelta or seconds;
        the group's by default) for them in rank order and fails naming the first that did not
        come (``wait_all_ranks``: every one, each given ``timeout`` from the start), and tells
        the ranks that came, now or later, which then fail too, naming it. Errors worded as
        gloo's. torch's ``dist.monitored_barrier`` refuses every backend but gloo by its name
        before it calls this: call it on the group, or :func:`monitored_barrier`."""
        seconds = _seconds(timeout, self.timeout, "monitored_barrier")
        rank, size = self.rank(), self.size()
        # The n-th monitored barrier is the n-th message of each (one key each, however many
        # barriers): a rank that comes late to one is answered there, by the word it was missed.
        arrive, release = "monitored-barrier/arrive", "monitored-barrier/release"
        if rank != 0:
            verdict = torch.zeros(size, dtype=torch.int64)  # rank 0's: 1 for each rank that did not pass
            works = [self._pairs.send([torch.tensor([rank])], 0, arrive), self._pairs.recv([verdict], 0, release)]
            try:
                for work in works:
                    work.wait()
            except RuntimeError as exc:
                raise PslinkBackendError(_not_released(rank, str(exc))) from None
            if verdict.any():
                failed = ", ".join(str(r) for r in verdict.nonzero().flatten().tolist())
                raise PslinkBackendError(_not_released(rank, f"rank 0: rank(s) {failed} failed to pass monitoredBarrier "
                                                             f"in {_ms(seconds)} ms"))
            return
        arrivals = {peer: self._pairs.recv([torch.zeros(1, dtype=torch.int64)], peer, arrive) for peer in range(1, size)}
        started = time.monotonic()  # after joining the pairs' jobs (the first time, this rank's cost)
        passed, failed = [], {}  # failed: rank -> the error its arrival ended with ("" if none came in time)
        error = None
        for peer, arrival in arrivals.items():
            left = started + seconds - time.monotonic()
            if left <= 0 and not wait_all_ranks:  # (gloo's words, its time up before it asked this rank)
                processed = (f"Successfully processed ranks: {', '.join(map(str, passed))}" if passed
                             else "No ranks successfully processed in monitoredBarrier.")
                outcome = f"Rank 0 timed out in monitoredBarrier after {_ms(seconds)} ms.\n{processed}"
            else:
                outcome = _ended_within(arrival, left)
            if outcome is None:
                passed.append(peer)
                continue
            failed[peer] = outcome
            if not wait_all_ranks:
                error = f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {_ms(seconds)} ms"
                if outcome:
                    error += f"\n Original exception: \n{outcome}"
                break
        if failed and error is None:
            error = (f"[Rank 0]: Ranks {', '.join(map(str, sorted(failed)))} failed to pass monitoredBarrier in "
                     f"{_ms(seconds)} ms")
        verdict = torch.zeros(size, dtype=torch.int64)
        verdict[list(failed)] = 1
        if error is not None:
            # Each rank that came, or comes late, is told: it fails now, not at its own timeout.
            for peer, arrival in arrivals.items():
                arrival.get_future().add_done_callback(functools.partial(self._tell, peer, release, verdict))
            raise PslinkBackendError(error)
        # Every rank came and waits for this: a rendezvous each, given the timeout again.
        releases = {peer: self._pairs.send([verdict.clone()], peer, release) for peer in arrivals}
        released = time.monotonic()
        for peer, work in releases.items():
            outcome = _ended_within(work, max(released + max(seconds, 1.0) - time.monotonic(), 0))
            if outcome is not None:
                raise PslinkBackendError(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier in {_ms(seconds)} ms"
                                         + (f"\n Original exception: \n{outcome}" if outcome else ""))

    def _tell(self, peer: int, release: str, verdict: torch.Tensor, arrival: torch.futures.Future) -> None:
        """Sends a rank that came to a failed monitored barrier the ranks that did not (from the
        group's thread: this runs where its arrival completed, maybe the Agent's I/O thread)."""
        try:
            arrival.value()
        except RuntimeError:  # (how a pslink work fails)
            return  # did not come: not waiting for word either
        try:
            self._pairs.sender.submit(self._pairs.send, [verdict.clone()], peer, release)
        except RuntimeError:
            pass  # the group was shut down meanwhile: the rank fails at its timeout

    def shutdown(self) -> None:
        self._close()


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``torch.distributed.monitored_barrier(group, timeout, wait_all_ranks)`` for a pslink group
    too: torch's checks the group's backend *name* and refuses every one but gloo, before it
    calls the group's ``monitored_barrier`` (which a pslink group has: see
    :meth:`ProcessGroupPslink.monitored_barrier`). Any other group goes to torch's."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return  # as torch's: a rank not in the group passes
    target = group if group is not None else dist.group.WORLD
    if not isinstance(target, ProcessGroupPslink):
        return _torch_monitored_barrier(group, timeout, wait_all_ranks)
    return target.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


_torch_monitored_barrier = dist.monitored_barrier


def _seconds(timeout, default: float, what: str) -> float:
    if timeout is None:
        return default
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise PslinkBackendError(f"{what}: timeout must be a datetime.timedelta or seconds >= 0, got {timeout!r}")
    return float(seconds)


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _not_released(rank: int, why: str) -> str:
    return (f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for send/recv "
            f"from rank 0. Please check rank 0 logs for faulty rank.\n Original exception: \n{why}")


def _ended_within(work: Work, seconds: float) -> str | None:
    """None if ``work`` succeeded within ``seconds``; else its error, or "" if it did not end."""
    ended = threading.Event()
    work.get_future().add_done_callback(lambda _: ended.set())
    if not ended.wait(max(seconds, 0.0)):
        return ""
    try:
        work.get_future().value()
    except RuntimeError as exc:  # (how a pslink work fails)
        return str(exc) or repr(exc)
    return None


def _close(deadlines: Deadlines, pairs: Pairs, session: Session, barriers: list[threading.Thread]) -> None:
    deadlines.close()
    pairs.close()
    session.close()  # (fails a barrier still waiting: its thread ends)
    for thread in list(barriers):
        thread.join(timeout=1)


def _when_ended(pending: Pending | PendingGroup, callback: Callable[[object], None]) -> None:
    """``callback(pending)`` once a Pending (or every Pending of a group) ended."""
    items = pending.items if isinstance(pending, PendingGroup) else [pending]
    left = [len(items)]
    lock = threading.Lock()

    def one_ended(_) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback(pending)

    for item in items:
        item.add_done_callback(one_ended)


def _group_error(group: PendingGroup) -> BaseException | None:
    return next((e for e in (item.exception() for item in group.items) if e is not None), None)


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
