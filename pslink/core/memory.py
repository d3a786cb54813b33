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
