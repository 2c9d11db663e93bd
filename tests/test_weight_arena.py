"""Packed weights in transparent huge pages (kernels/weight_arena.py)."""

import gc
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import weight_arena
from tokenmill.kernels.weight_arena import CHUNK, OWN_MAPPING, PAGE, WeightArena

pytestmark = pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"),
                                reason="no MADV_HUGEPAGE on this platform")


def vma_field(ptr: int, field: str) -> int:
    """A field of /proc/self/smaps for the mapping holding address ptr."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {ptr:#x}")


def resident_kib(ptr: int, nbytes: int) -> int:
    """KiB of [ptr, ptr + nbytes) backed by memory (mincore: this range alone, where smaps'
    Rss covers a whole mapping, which the kernel may have merged with a neighbouring one)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    lo, hi = ptr // page * page, -(-(ptr + nbytes) // page) * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page >> 10


def rss_kib() -> int:
    return next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith("VmRSS:"))


def test_small_tensors_share_a_chunk_without_overlap(monkeypatch):
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES", raising=False)
    arena = WeightArena()
    sizes = [(1000, torch.bfloat16), (77, torch.uint8), (4096, torch.float32), (3, torch.float16)]
    ts = [arena.empty(n, dt) for n, dt in sizes]
    for t, (n, dt) in zip(ts, sizes):
        assert t.shape == (n,) and t.dtype == dt and t.data_ptr() % 64 == 0
        assert t.untyped_storage().nbytes() > CHUNK  # a view into the shared mapping
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for i, t in enumerate(ts):  # every tensor keeps its own values
        t.copy_(torch.full_like(t, i + 1))
    assert all(bool((t == i + 1).all()) for i, t in enumerate(ts))
    base = ts[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in ts)


def test_chunk_full_starts_another_and_large_tensors_map_their_own(monkeypatch):
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES", raising=False)
    arena = WeightArena()
    big = arena.empty(OWN_MAPPING, torch.uint8)
    assert big.data_ptr() % PAGE == 0 and big.untyped_storage().nbytes() < CHUNK + 2 * PAGE
    parts = [arena.empty(OWN_MAPPING - 64, torch.uint8) for _ in range(5)]  # 4 fit a chunk
    bases = [p.untyped_storage().data_ptr() for p in parts]
    assert bases[:4] == [bases[0]] * 4 and bases[4] != bases[0]


def test_mappings_are_advised_for_huge_pages(monkeypatch):
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES", raising=False)
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.exists() or "[never]" in setting.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    t = WeightArena().empty(16 << 20, torch.uint8)
    t.fill_(1)
    assert vma_field(t.data_ptr(), "THPeligible") == 1


def test_memory_is_returned_with_the_last_tensor(monkeypatch):
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES", raising=False)
    arena = WeightArena()
    t = arena.empty(256 << 20, torch.uint8)
    t.fill_(1)
    view = t[10:20]
    del t
    gc.collect()
    before = rss_kib()
    view.fill_(2)  # still mapped while a view lives
    del view
    gc.collect()
    assert before - rss_kib() > 200 << 10


def test_off_switch_and_refusal_give_plain_tensors(monkeypatch):
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    t = WeightArena().empty(1 << 20, torch.uint8)
    assert t.untyped_storage().nbytes() == 1 << 20
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES")
    monkeypatch.setattr(weight_arena, "_mapping", lambda nbytes: None)
    arena = WeightArena()
    t = arena.empty(1 << 20, torch.uint8)
    assert arena.refused and t.untyped_storage().nbytes() == 1 << 20


def test_packed_weights_live_in_the_arena_and_compute_the_same(monkeypatch):
    from tokenmill.kernels import load_cpu_kernels

    lib = load_cpu_kernels()
    if lib is None:
        pytest.skip("no kernel library on this machine")
    w = torch.randn(96, 64).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    plain = lib.pack(w)
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES")
    arena = lib.pack(w)
    assert plain.packed.untyped_storage().nbytes() == plain.packed.numel() * 2
    assert arena.packed.untyped_storage().nbytes() > CHUNK
    assert torch.equal(lib.linear(x, arena, out_fp32=True), lib.linear(x, plain, out_fp32=True))
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    d = torch.rand(32, 2).half()
    q = lib.qpack(codes, d, -d * 8, 4)
    assert q.packed.untyped_storage().nbytes() > CHUNK
    ref = (codes.float() - 8) * d.float().repeat_interleave(32, dim=1)
    assert torch.allclose(lib.qdequantize(q), ref)


def test_each_fresh_mapping_first_trims_the_heap(monkeypatch):
    """Fresh mappings do not reuse the heap's free memory, so each gives it back first."""
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES", raising=False)
    calls = []
    monkeypatch.setattr(weight_arena, "release_freed_memory", lambda: calls.append(1) or True)
    arena = WeightArena()
    arena.empty(1000, torch.uint8)
    arena.empty(1000, torch.uint8)  # the same chunk: no new mapping
    assert len(calls) == 1
    arena.empty(OWN_MAPPING, torch.uint8)
    assert len(calls) == 2


def test_a_tensor_is_resident_as_it_is_carved_and_the_rest_of_its_chunk_is_not(monkeypatch):
    """Its pages are faulted in by one MADV_POPULATE_WRITE call (where the kernel has it), not
    by the packing threads' first writes; the chunk's untouched part stays unbacked."""
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES", raising=False)
    arena = WeightArena()
    t = arena.empty(3 << 20, torch.uint8)  # 3 MiB of a 32 MiB chunk
    if not arena.populates:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    chunk = arena._chunk
    rss = resident_kib(chunk.data_ptr(), chunk.numel())
    assert rss >= 3 << 10  # KiB: resident before anything was written
    assert rss <= (3 << 10) + 2 * (PAGE >> 10)  # at most the huge pages it touches
    assert bool((t == 0).all())  # fresh anonymous memory reads as zeros
