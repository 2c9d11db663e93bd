"""Memory for the weights the kernels stream, in transparent huge pages.

A decode step reads every packed weight once; at 4 KiB pages a 100-500 MB model crosses a page
(and, in a virtual machine, a two-level page walk) every 64 cache lines. Here packed weights
are carved from anonymous mappings advised with MADV_HUGEPAGE (2 MiB pages where the kernel's
`transparent_hugepage` setting is `madvise` or `always`): small tensors share 32 MiB chunks,
a large one gets a mapping of its own. llama.cpp gets the same from its mmap of the model file
where the page cache holds it in huge folios. On a 2-vCPU Zen 4 (KVM) decode ran 1.10x (the
default Q4_1 file) to 1.29x (Gemma-3-270M in BF16) faster (docs/performance.md, "Stop 59").

A chunk's memory is returned when the last tensor carved from it is freed (the tensors hold
the mapping). Untouched parts of a chunk are never resident. Fresh mappings do not reuse what
the heap holds freed (a load's temporaries, rows dropped once packed: host_memory.py keeps
freed memory for reuse), so each new mapping first gives the heap's free pages back to the OS
(malloc_trim): the default model's start-up peak 443 -> 410 MiB. TOKENMILL_HUGE_PAGES=0 turns this
off (plain torch.empty); so does a platform without MADV_HUGEPAGE.

Each tensor's pages are faulted in as it is carved, in one madvise(MADV_POPULATE_WRITE) call
(Linux 5.14+; elsewhere they fault on first write, as before), not by the packing threads'
first writes. Loading the default model on a 2-vCPU Zen 3 (KVM), fresh processes alternating:
LLM() 0.77-0.96 -> 0.60-0.74 s in one series (4 KiB pages: 0.61-0.74), 0.74-0.86 -> 0.68-0.83 s
in a later one; how much depends on the guest's free memory (docs/performance.md, "Stop 64").
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import torch

from tokenmill.host_memory import release_freed_memory

PAGE = 2 << 20  # the huge page size on x86-64 and most arm64 kernels
CHUNK = 32 << 20  # bytes a chunk of small tensors spans
ALIGN = 64  # bytes: every tensor starts on a cache line, as torch.empty's do
OWN_MAPPING = CHUNK // 4  # tensors from this size get a mapping of their own
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_madvise = _libc_madvise()


def enabled() -> bool:
    return os.environ.get("TOKENMILL_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def _mapping(nbytes: int) -> torch.Tensor | None:
    """A 2 MiB-aligned uint8 tensor of nbytes over fresh anonymous memory advised for huge
    pages; None where the kernel refuses the advice."""
    release_freed_memory()  # what the heap holds free, before taking fresh memory
    mm = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages
        mm.close()
        return None
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping while any view lives
    start = -whole.data_ptr() % PAGE
    return whole[start:start + nbytes]


class WeightArena:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self.refused = False  # the kernel refused MADV_HUGEPAGE once: plain tensors since
        self.populates = _madvise is not None  # until the kernel refuses MADV_POPULATE_WRITE

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D tensor of numel elements, in huge pages where possible."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if self.refused or not enabled() or nbytes == 0:
            return torch.empty(numel, dtype=dtype)
        with self._lock:
            if nbytes >= OWN_MAPPING:
                raw = _mapping((nbytes + PAGE - 1) // PAGE * PAGE)
            else:
                if self._chunk is None or self._used + nbytes > self._chunk.numel():
                    self._chunk, self._used = _mapping(CHUNK), 0
                raw = None if self._chunk is None else self._chunk[self._used:self._used + nbytes]
                self._used += (nbytes + ALIGN - 1) // ALIGN * ALIGN
            if raw is None:
                self.refused, self._chunk = True, None
                return torch.empty(numel, dtype=dtype)
            raw = raw[:nbytes]
            self._populate(raw)
        return raw.view(dtype)

    def _populate(self, t: torch.Tensor) -> None:
        """Fault in the pages holding t (the whole huge pages it touches) now, in one call."""
        if not self.populates:
            return
        start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
        end = -(-(t.data_ptr() + t.numel()) // mmap.PAGESIZE) * mmap.PAGESIZE
        if _madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
            self.populates = False  # an older kernel (EINVAL): pages fault on first write


ARENA = WeightArena()
