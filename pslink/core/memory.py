"""Memory settings for pslink's own server processes (an Aggregator's subprocess or Ray actor).

An Aggregator allocates and frees arrays of the same few sizes all the time: a push's buffer
when its pool is short, an optimizer's state, a migration's copy. glibc's malloc hands large
freed blocks back to the kernel (``munmap``, or trimming the top of the heap), so the next
array of that size starts from fresh pages, and each 4 KiB page costs a page fault on first
touch: about 4 us on the hosts we measured, ~4 ms per 4 MiB array. Asking malloc to keep what
it freed (a fixed 32 MiB mmap threshold and no trimming below 1 GiB) has those arrays reuse
warm pages. A server keeps its peak heap this way, as ps-lite's servers keep their buffers.

Only for processes pslink owns: a worker's malloc is its framework's business.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

import numpy as np

ENV_KEEP_FREED = "PSLINK_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks above it still go straight to the kernel
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse in this process. Returns whether it was
    set: False where there is no glibc (another libc or OS), or with ``PSLINK_KEEP_FREED_MEMORY=0``."""
    if os.environ.get(ENV_KEEP_FREED, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False  # no mallopt: not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the kernel now (glibc's ``malloc_trim``): after a job
    or keys were dropped, which :func:`keep_freed_memory` would otherwise keep for reuse. Returns
    whether anything was released (False where there is no glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


class BufferPool:
    """Arrays of one dtype and length, reused once nothing else references them."""

    __slots__ = ("dtype", "numel", "keep", "_arrays")

    def __init__(self, dtype: np.dtype, numel: int, keep: int = 4):
        self.dtype = dtype
        self.numel = numel
        self.keep = keep
        self._arrays: list[np.ndarray] = []

    def acquire(self) -> np.ndarray:
        for array in self._arrays:
            # Held only by the pool list, this loop variable and getrefcount's argument: free.
            if sys.getrefcount(array) == 3:
                return array
        array = np.empty(self.numel, self.dtype)
        if len(self._arrays) < self.keep:
            self._arrays.append(array)
        return array

    def warm(self, count: int) -> None:
        """Have ``count`` arrays ready, their pages touched. A fresh array's first write takes a
        page fault per 4 KiB (about 4 us each on the machines we measured: ~4 ms per 4 MiB), so
        a task that arrives by migration warms its buffers while the job computes, not in the
        job's next round."""
        while len(self._arrays) < min(count, self.keep):
            array = np.empty(self.numel, self.dtype)
            array.fill(0)
            self._arrays.append(array)

    def in_use(self, array: np.ndarray, known: int) -> bool:
        """True if ``array`` has holders beyond the ``known`` references the caller holds
        (its attributes and local variables), such as a reply still queued on a socket."""
        pooled = any(a is array for a in self._arrays)
        # getrefcount counts its own argument and this function's parameter as well
        return sys.getrefcount(array) - 2 - pooled > known
