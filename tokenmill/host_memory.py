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
import logging

logger = logging.getLogger("tokenmill")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper limit on 64-bit
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; False where there is no glibc mallopt."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
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
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0) == 1
    except (OSError, AttributeError, TypeError):
        return False
