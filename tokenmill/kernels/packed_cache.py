"""A GGUF file's packed weights kept on disk, so that later loads map them from the page cache
instead of packing them again (llama.cpp maps its file the same way; it does not repack).

The first load of a file of `MIN_FILE_BYTES` or more packs its quantized matrices (packed.py,
qpack_gguf_parts) straight into a cache file under $TOKENMILL_HOME/packed, one after another
(a shared mapping of the whole file, as long as the packed weights can be: each tensor's range
allocated and faulted in as it is taken), and writes the index last; a later load with the
same key maps the whole file once (MAP_PRIVATE: the weights are only ever read) and hands out
each tensor where the index says, after checking that the same tensors arrive in the same
order with the same sizes (else it packs the rest itself). The key: the model file (path, size,
mtime, inode), the kernels' source and ISA, tokenmill's Python sources, the tensor-parallel
rank; a new cache replaces the model file's older ones (of another key).
On a virtual machine that backs fresh memory at ~0.45 GB/s (docs/performance.md, "Stop 68") the
7B Q4_K_M file's packed weights took ~9 s to fault in; mapped from the page cache they take
milliseconds. The file's pages must map as 2 MiB pages for decode to read them as fast as the
arena's (kernels/weight_arena.py): the file system must cache them in large folios (ext4 and xfs
on recent kernels), which a probe checks once a process; else nothing is cached.
No cache is written where it would leave less than 1 GiB or 5% of the disk free.
TOKENMILL_PACKED_CACHE=0 turns the cache off (so does TOKENMILL_HUGE_PAGES=0); deleting the
folder is always safe.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger("tokenmill")

MIN_FILE_BYTES = 64 << 20  # the built-in models (98 and 253 MB) and up: 0.13-0.64 s a start
ALIGN = 64  # bytes: every tensor starts on a cache line, as in the arena
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23
VERSION = 1
_current: contextvars.ContextVar[PackedCache | None] = contextvars.ContextVar(
    "packed_cache", default=None)


def current() -> PackedCache | None:
    return _current.get()


@contextlib.contextmanager
def loading(model_file: str, lib, rank: tuple[int, int] = (0, 1)):
    """Packs of `lib` for the model in `model_file` go through its cache while this is open."""
    cache = PackedCache.open(model_file, lib, rank) if enabled(model_file) else None
    token, complete = _current.set(cache), False
    try:
        yield cache
        complete = True
    finally:
        _current.reset(token)
        if cache is not None:
            cache.close(complete)


def enabled(model_file: str) -> bool:
    """On unless TOKENMILL_PACKED_CACHE=0, or the weights are not in huge pages at all
    (TOKENMILL_HUGE_PAGES=0)."""
    from tokenmill.kernels import weight_arena

    return (os.environ.get("TOKENMILL_PACKED_CACHE", "1") != "0" and weight_arena.enabled()
            and os.path.getsize(model_file) >= MIN_FILE_BYTES and _large_folios())


class PackedCache:
    def __init__(self, data: Path, index: Path) -> None:
        self.data, self.index = data, index
        self.entries: list = []  # [key, offset, nbytes] each: read (a hit), or written
        self.hit = self.broken = False
        self._next = 0  # a hit: the entry the next take() must match
        self._mapping: mmap.mmap | None = None
        self._whole: torch.Tensor | None = None  # the file's mapping, as a tensor
        self._fd: int | None = None  # a miss: the file being written
        self._end = 0
        self.model: list = []  # [model file, rank]: a new cache replaces its older ones

    @classmethod
    def open(cls, model_file: str, lib, rank: tuple[int, int]) -> PackedCache:
        st = os.stat(model_file)
        key = hashlib.sha256(json.dumps([
            VERSION, os.path.abspath(model_file), st.st_size, st.st_mtime_ns, st.st_ino,
            st.st_dev, lib.source_hash, lib.isa, _python_sources(), list(rank)]).encode())
        stem = folder() / key.hexdigest()[:32]
        cache = cls(stem.with_suffix(".bin"), stem.with_suffix(".json"))
        cache.model = [os.path.abspath(model_file), list(rank)]
        try:
            # packed weights take at most ~3% more than the file's (4.625 bits a weight for
            # Q4_K's 4.5): reserve more, unwritten (a sparse file costs nothing)
            if not cache._map() and _room_for(st.st_size):
                cache._create(st.st_size + st.st_size // 8 + (64 << 20))
            elif not cache.hit:
                cache.broken = True
        except OSError:  # a read-only or full disk: pack as if there were no cache
            cache.broken = True
        return cache

    def _map(self) -> bool:
        """A hit: the whole data file mapped once, its pages mapped from the page cache."""
        try:
            entries = json.loads(self.index.read_text())["entries"]
            fd = os.open(self.data, os.O_RDONLY)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        try:
            size = os.fstat(fd).st_size
            if not (isinstance(entries, list) and entries and all(
                    isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                    and all(isinstance(v, int) and v >= 0 for v in e[1:]) for e in entries)
                    and size >= max(e[1] + e[2] for e in entries)):
                return False  # not an index this code wrote, or a file cut short
            self._mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._mapping.madvise(mmap.MADV_HUGEPAGE)
        self._mapping.madvise(MADV_POPULATE_READ)
        self._whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.entries, self.hit = entries, True
        logger.info("packed weights mapped from %s", self.data)
        return True

    def _create(self, reserve: int) -> None:
        self.data.parent.mkdir(parents=True, exist_ok=True)
        _drop_abandoned(self.data.parent)
        self._tmp = self.data.with_name(f"{self.data.name}.{os.getpid()}.tmp")
        self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, reserve)
        self._mapping = mmap.mmap(self._fd, reserve, flags=mmap.MAP_SHARED)
        self._mapping.madvise(mmap.MADV_HUGEPAGE)
        self._whole = torch.frombuffer(self._mapping, dtype=torch.uint8)

    def take(self, key: str, nbytes: int) -> tuple[torch.Tensor, bool] | None:
        """Memory for the next packed tensor (`key`: what its bytes follow from), and whether
        it already holds them; None where the cache cannot serve it (pack into the arena)."""
        if self.broken:
            return None
        if self.hit:
            entry = self.entries[self._next] if self._next < len(self.entries) else None
            if entry is None or entry[0] != key or entry[2] != nbytes:
                self.broken = True  # not the tensors the cache holds: pack from here on
                return None
            self._next += 1
            return self._whole[entry[1]:entry[1] + nbytes], True
        offset = -(-self._end // ALIGN) * ALIGN
        page = offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            if offset + nbytes > len(self._mapping):
                raise OSError("the reserve is full")
            os.posix_fallocate(self._fd, offset, nbytes)  # a full disk fails here, not on a write
            self._mapping.madvise(MADV_POPULATE_WRITE, page, offset + nbytes - page)
        except OSError:
            self.broken = True
            return None
        self.entries.append([key, offset, nbytes])
        self._end = offset + nbytes
        return self._whole[offset:offset + nbytes], False

    def close(self, complete: bool = True) -> None:
        """After a load that packed: the data file cut to what it holds and put in place, then
        its index (a later load takes the cache only once the index exists); nothing is kept
        of a load that did not complete."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.broken or not self.entries or not complete:
                self._tmp.unlink(missing_ok=True)
                return
            os.ftruncate(fd, self._end)  # nothing past it is ever read
            os.replace(self._tmp, self.data)  # the mapping goes on reading the same file
            tmp = self.index.with_name(f"{self.index.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": VERSION, "model": self.model,
                                       "entries": self.entries}))
            os.replace(tmp, self.index)
            self._drop_older()
            logger.info("packed weights of %s kept in %s (%.0f MiB): later loads map them "
                        "(TOKENMILL_PACKED_CACHE=0: off)", self.model[0], self.data,
                        self._end / 2**20)
        except OSError:
            self._tmp.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def _drop_older(self) -> None:
        """Remove the caches of the same model file and rank under other keys (an older
        tokenmill, or the file since changed)."""
        for index in self.index.parent.glob("*.json"):
            if index == self.index:
                continue
            try:
                if json.loads(index.read_text()).get("model") == self.model:
                    index.unlink()
                    index.with_suffix(".bin").unlink(missing_ok=True)
            except (OSError, ValueError, AttributeError):
                continue


def _drop_abandoned(where: Path) -> None:
    """Remove the files being written by processes that no longer run (<name>.<pid>.tmp)."""
    for tmp in where.glob("*.tmp"):
        try:
            os.kill(int(tmp.suffixes[-2][1:]), 0)
        except (ProcessLookupError, ValueError, IndexError):
            tmp.unlink(missing_ok=True)
        except OSError:  # another user's process: alive
            continue


def _room_for(nbytes: int) -> bool:
    """Whether the disk keeps at least 1 GiB and 5% of its size free once nbytes more are
    written (a cache must not be what fills it)."""
    folder().mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(folder())
    return usage.free - nbytes >= max(1 << 30, usage.total // 20)


def folder() -> Path:
    from tokenmill.kernels import home

    return home() / "packed"


@functools.cache
def _python_sources() -> str:
    """A hash of tokenmill's Python files (what decides which tensors are packed, and how)."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _large_folios() -> bool:
    """Whether a file written here maps as 2 MiB pages (the page cache holds it in large
    folios): probed once a process with a 4 MiB file in the cache folder."""
    path = folder() / f"probe.{os.getpid()}.tmp"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(4 << 20))
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 4 << 20, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
            mapping.madvise(MADV_POPULATE_READ)
            start = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
            return _pmd_mapped_kib(start) > 0
        finally:
            mapping.close()
    except (OSError, ValueError):
        return False
    finally:
        path.unlink(missing_ok=True)


def _pmd_mapped_kib(address: int) -> int:
    """FilePmdMapped of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "FilePmdMapped:":
                return int(line.split()[1])
    return 0
