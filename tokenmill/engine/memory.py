"""Host memory the engine can count on, and what it uses: available memory (the kernel's
MemAvailable, lowered by a cgroup limit), the process's resident and peak resident bytes, the
start-up checks that refuse a model or KV budget that cannot fit, and the plan logged at start."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

MiB = 2**20
GiB = 2**30
# Memory the process needs besides weights and KV cache (PyTorch, activations of a step,
# tokenizer): the start-up check keeps this much free.
RUNTIME_RESERVE = 512 * MiB


class NotEnoughMemory(ValueError):
    """A model, KV budget or context that cannot fit, found at start instead of by an OOM kill."""


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _proc_field(path: str, field: str) -> int | None:
    """A 'Field:  123 kB' line of /proc/meminfo or /proc/self/status, in bytes."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, then v1); None without one."""
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        cap, used = _read_int(limit), _read_int(usage)
        if cap is not None and used is not None and cap < 2**60:
            return max(0, cap - used)
    return None


def available_memory(device: torch.device | None = None) -> int:
    """Bytes that can still be allocated: free GPU memory for CUDA; on the host MemAvailable
    (free pages plus reclaimable page cache, not MemFree alone) or the cgroup's headroom if
    that is smaller."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    avail = _proc_field("/proc/meminfo", "MemAvailable")
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = _cgroup_headroom()
    return avail if cgroup is None else min(avail, cgroup)


def rss() -> int:
    """Resident bytes of this process now (0 where /proc is missing)."""
    return _proc_field("/proc/self/status", "VmRSS") or 0


def peak_rss() -> int:
    """The most resident bytes this process held (since start or the last reset_peak_rss)."""
    peak = _proc_field("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Start VmHWM over at the current RSS (Linux's clear_refs 5); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def check_model_fits(path: str, device: torch.device) -> None:
    """Refuse a model whose files alone exceed the available memory, before reading them."""
    if device.type != "cpu":
        return
    from tokenmill.loaders.hf import safetensors_files

    try:  # a folder: the shards the loader will read (never a .bin beside them)
        files = safetensors_files(path) if os.path.isdir(path) else [path]
    except ValueError:
        return  # no weights: the loader says so
    size = sum(os.path.getsize(f) for f in files)
    avail = available_memory(device)
    if size + RUNTIME_RESERVE > avail:
        raise NotEnoughMemory(
            f"the model's weights ({gib(size)} in {path}) do not fit in the available memory "
            f"({gib(avail)}, with {gib(RUNTIME_RESERVE)} kept for the runtime): free memory "
            f"or use a smaller or more quantized model")


def check_kv_budget(budget: int, device: torch.device) -> None:
    """Refuse an explicit KV budget larger than what is left (the pool is mapped lazily, so
    an oversized one would be accepted at start and end in an out-of-memory kill later)."""
    avail = available_memory(device)
    reserve = RUNTIME_RESERVE if device.type == "cpu" else 0
    if budget + reserve > avail:
        raise NotEnoughMemory(
            f"kv_cache_memory ({gib(budget)}) is more than the available memory "
            f"({gib(avail)}, with {gib(reserve)} kept for the runtime): pass a smaller "
            f"--kv-cache-memory / kv_cache_memory, at most {gib(max(0, avail - reserve))}")


@dataclass(frozen=True)
class MemoryReport:
    """What the engine holds after start-up (logged once, kept as LLMEngine.memory)."""

    model: int  # resident growth from reading the weights to the end of start-up (weights,
    # their packed forms, tokenizer)
    kv_budget: int  # bytes of KV pages the cache may fill (mapped on first use on the CPU)
    kv_tokens: int
    kv_bytes_per_token: int
    max_model_len: int
    rss: int  # process resident bytes once started
    peak_rss: int  # the most resident bytes during start-up
    available: int  # what the machine still had available once started

    @property
    def max_full_sequences(self) -> int:
        """Sequences of max_model_len tokens the cache holds at once."""
        return self.kv_tokens // self.max_model_len

    def describe(self) -> str:
        return (f"memory: model {gib(self.model)} resident, KV cache budget "
                f"{gib(self.kv_budget)} ({self.kv_tokens} tokens x {self.kv_bytes_per_token} "
                f"bytes, {self.max_full_sequences} sequences of max_model_len "
                f"{self.max_model_len}; pages resident as they are used), process RSS "
                f"{gib(self.rss)} (start-up peak {gib(self.peak_rss)}), "
                f"{gib(self.available)} still available")
