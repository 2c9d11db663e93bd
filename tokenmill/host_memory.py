"""Keep freed host memory for reuse (glibc's malloc, CPU inference).

By default glibc serves every allocation above M_MMAP_THRESHOLD (128 KiB, adapted up to 32 MiB)
with its own mmap and gives the heap's free top back to the OS above M_TRIM_THRESHOLD, so each
step's activations arrive as fresh pages the kernel must fault in and zero: 57,000-99,000 page
faults per 2,048-token prefill step of SmolLM2-135M, none once both thresholds are raised (see
docs/performance.md). The cost is that the process keeps its peak heap, as a GPU caching
allocator does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger("tokenmill")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit
_TRIM_THRESHOLD = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (find_library runs `ldconfig -p`: ~7 ms a call, and
    loading calls release_freed_memory once per tensor)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where there is no glibc mallopt."""
    try:
        mallopt = _libc().mallopt
    except AttributeError:
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1 and ok
    if not ok:
        logger.debug("mallopt rejected the thresholds; freed memory goes back to the OS")
    return ok


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS now (glibc malloc_trim): after loading, whose
    temporaries (a quantized tensor's codes before repacking, dequantized copies) would
    otherwise stay resident under the raised thresholds. False where there is no glibc."""
    try:
        return _libc().malloc_trim(0) == 1
    except AttributeError:
        return False
