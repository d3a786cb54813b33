"""Between torch tensors and the Agent's numpy arrays: dtypes, host staging, error messages.

A contiguous CPU tensor of a dtype the wire carries is handed to the Agent as a numpy view of its
own memory (no copy: the Agent sends from it and receives into it). Anything else (CUDA tensors,
bfloat16 or bool, non-contiguous tensors) is staged through a host buffer of the wire dtype,
pinned for CUDA so the device copies run at full speed; the buffers are kept per key and reused.
"""

from __future__ import annotations

import collections
import sys
import threading

import numpy as np
import torch

from pslink.errors import ConfigError, PslinkError, ShapeMismatchError

# torch dtype -> the dtype it travels as (the wire has no bfloat16 or bool)
_WIRE_DTYPES = {
    torch.float16: torch.float16,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
    torch.int8: torch.int8,
    torch.int16: torch.int16,
    torch.int32: torch.int32,
    torch.int64: torch.int64,
    torch.uint8: torch.uint8,
    torch.bfloat16: torch.float32,
    torch.bool: torch.uint8,
}


_AS_IS = frozenset(dtype for dtype, wire in _WIRE_DTYPES.items() if dtype == wire)


def travels_as_is(tensor: torch.Tensor) -> bool:
    """Whether the Agent can send from and receive into ``tensor``'s own memory (a contiguous
    CPU tensor of a dtype the wire carries as it is): no staging buffer."""
    return tensor.is_cpu and tensor.dtype in _AS_IS and tensor.is_contiguous()


def wire_dtype(dtype: torch.dtype, what: str) -> torch.dtype:
    """The dtype a tensor of ``dtype`` travels as; ConfigError naming ``what`` if none."""
    wire = _WIRE_DTYPES.get(dtype)
    if wire is None:
        supported = ", ".join(str(d).replace("torch.", "") for d in _WIRE_DTYPES)
        raise ConfigError(f"{what}: dtype {dtype} cannot go through pslink; supported: {supported}")
    return wire


class HostView:
    """The host array that the Agent sends from and receives into, standing for one tensor.

    ``array`` is the tensor's own memory when that is possible; otherwise a staging buffer
    holding a copy, and :meth:`finish` copies the result back into the tensor.
    """

    __slots__ = ("tensor", "staging", "array")

    def __init__(self, tensor: torch.Tensor, what: str, staging: torch.Tensor | None = None, fill: bool = True):
        """``fill``: copy the tensor's values into a staging buffer (False for a tensor that
        only receives a result)."""
        self.tensor = tensor
        wire = wire_dtype(tensor.dtype, what)
        if travels_as_is(tensor):
            self.staging = None
            self.array: np.ndarray = tensor.detach().numpy()
            return
        if staging is None or staging.shape != tensor.shape or staging.dtype != wire:
            staging = new_staging(tensor.shape, wire, pinned=tensor.is_cuda)
        if fill:
            # A blocking copy: for CUDA it waits for the kernels that produced the tensor.
            staging.copy_(tensor.detach())
        self.staging = staging
        self.array = staging.numpy()

    @property
    def zero_copy(self) -> bool:
        return self.staging is None

    def finish(self) -> torch.Tensor:
        """Make the tensor hold what the Agent wrote into ``array``; returns the tensor."""
        if self.staging is not None:
            with torch.no_grad():
                self.tensor.copy_(self.staging)  # blocking: done when this returns
        return self.tensor


def new_staging(shape, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=pinned and torch.cuda.is_available())


class StagingPool:
    """Staging buffers kept per key, so a training loop allocates (and pins) them once."""

    __slots__ = ("_buffers",)

    def __init__(self):
        self._buffers: dict = {}

    def view(self, key, tensor: torch.Tensor, what: str) -> HostView:
        view = HostView(tensor, what, self._buffers.get(key))
        if view.staging is not None:
            self._buffers[key] = view.staging
        return view

    def clear(self) -> None:
        self._buffers.clear()


class ResultPool:
    """Host memory for the new tensors that out-of-place collectives return (``hvd.allreduce``),
    reused once the caller dropped every tensor, view and array of a result.

    A fresh result's pages are faulted in by the Agent's copy out of the ring: about 0.2-0.5 ms
    per MiB more than that copy into memory already touched (``benchmarks/copy_costs.py``).
    glibc maps a buffer of more than 32 MiB anew each time, and one of 4 MiB either anew or from
    its heap depending on what the process freed before: a 4 MiB ``hvd.allreduce`` faulted in 992 of
    its result's 1024 pages on every call in some runs and none in others (issue 53). Each result
    is a tensor over a numpy array the pool keeps; the array's reference count tells when no
    tensor uses it any more (a tensor, its views, its ``.numpy()`` all keep it referenced), so a
    buffer is handed out again only when nothing can see it. Two buffers a signature (a training
    loop's ``result = hvd.allreduce(t)`` makes the next result while the last is alive), at most
    ``limit_bytes`` kept in all, the least recently used signatures' free buffers let go first.
    Results below ``smallest`` bytes come from torch as before: malloc reuses them without
    faults. The one difference a caller can see: a pooled result cannot be ``resize_()``d (its
    storage belongs to numpy), as with any tensor made by ``torch.from_numpy``."""

    PER_SIGNATURE = 2

    def __init__(self, smallest: int = 1 << 20, limit_bytes: int = 256 << 20):
        self.smallest, self.limit_bytes = smallest, limit_bytes
        self._lock = threading.Lock()
        self._buffers: collections.OrderedDict[tuple, list[np.ndarray]] = collections.OrderedDict()
        self._bytes = 0

    def empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A new contiguous tensor of ``tensor``'s shape and dtype, on its device."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.smallest or not tensor.is_cpu or tensor.dtype not in _AS_IS:
            return torch.empty_like(tensor, memory_format=torch.contiguous_format)
        signature = (tuple(tensor.shape), tensor.dtype)
        with self._lock:
            kept = self._buffers.get(signature)
            if kept is None:
                kept = self._buffers[signature] = []
            else:
                self._buffers.move_to_end(signature)
            for array in kept:
                # Referenced by the list, the loop and getrefcount's argument: nothing else holds it.
                if sys.getrefcount(array) <= 3:
                    return torch.from_numpy(array)
            result = torch.empty(tensor.shape, dtype=tensor.dtype)
            if len(kept) < self.PER_SIGNATURE and self._make_room(nbytes):
                kept.append(result.numpy())
                self._bytes += nbytes
                return torch.from_numpy(kept[-1])
            return result

    def _make_room(self, nbytes: int) -> bool:
        """(Lock held.) Let go of free buffers, least recently used signature first, until
        ``nbytes`` more fit under the limit; False if they cannot."""
        if nbytes > self.limit_bytes:
            return False
        for signature in list(self._buffers):
            if self._bytes + nbytes <= self.limit_bytes:
                break
            kept = self._buffers[signature]
            for array in [a for a in kept if sys.getrefcount(a) <= 3]:
                kept.remove(array)
                self._bytes -= array.nbytes
        return self._bytes + nbytes <= self.limit_bytes

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()
            self._bytes = 0


RESULTS = ResultPool()


def explain_mismatch(error: PslinkError, what: str, hint: str) -> PslinkError:
    """A shape mismatch reworded for ``what`` (a DDP bucket, a parameter's gradient, a tensor),
    naming both ranks and both shapes; other errors are returned as they are."""
    if not isinstance(error, ShapeMismatchError):
        return error
    shapes, ranks = error.details.get("shapes"), error.details.get("ranks")
    dtypes = error.details.get("dtypes")
    if isinstance(shapes, list) and isinstance(ranks, list) and len(shapes) == 2 and len(ranks) == 2:
        sides = f"rank {ranks[0]} has shape {tuple(shapes[0])}, rank {ranks[1]} has shape {tuple(shapes[1])}"
        if isinstance(dtypes, list) and len(dtypes) == 2 and dtypes[0] != dtypes[1]:
            sides = (f"rank {ranks[0]} has shape {tuple(shapes[0])} {dtypes[0]}, rank {ranks[1]} has shape "
                     f"{tuple(shapes[1])} {dtypes[1]}")
    else:
        sides = error.message
    message = f"{what} differs between ranks: {sides}; {hint} (service: {error.message})"
    return ShapeMismatchError(message, **error.details)
