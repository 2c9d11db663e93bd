"""How the bf16 dot-product GEMM prefetches the weights of a call of up to 4 rows.

Such a call (a decode step's GEMMs, the LM head) reads every weight panel once with little
arithmetic between loads. Larger calls prefetch the next 16 KiB chunk of a panel into L2 so
that its read overlaps their tiles' arithmetic; for a 1-row call on a 2-vCPU Zen 4 with the
weights in huge pages that prefetch made the stream 1.2-1.4x slower than prefetchnta (or no
prefetch), which leave the hardware prefetchers to run at the read limit (docs/performance.md,
"Stop 59"). What the hints do differs between CPUs, so the choice is measured once per (CPU,
kernel build, threads): a 1-row GEMM over a weight twice the last-level cache with each hint,
in alternation; nta must win by 5%. Cached next to the GEMM plan and logged.
TOKENMILL_STREAM_PREFETCH=l2 or =nta forces it. Only the AVX512-BF16 and AMX builds have the
dot-product GEMM; the results are the same bits either way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from tokenmill.kernels.gemm_plan import best_time, read_json, write_json
from tokenmill.kernels.lib import KernelLib

logger = logging.getLogger("tokenmill")

MARGIN = 1.05
DOT_ISAS = ("avx512_bf16", "amx")
HINTS = ("l2", "nta")


def forced() -> str | None:
    mode = os.environ.get("TOKENMILL_STREAM_PREFETCH", "auto")
    if mode not in ("auto", *HINTS):
        raise ValueError(f"TOKENMILL_STREAM_PREFETCH must be auto, l2 or nta, got {mode!r}")
    return None if mode == "auto" else mode


def weight_bytes() -> int:
    """Twice the last-level cache (as the C library reports it), 64-256 MiB."""
    l3 = 0
    if "SC_LEVEL3_CACHE_SIZE" in os.sysconf_names:
        l3 = max(0, os.sysconf("SC_LEVEL3_CACHE_SIZE"))
    return min(max(2 * l3, 64 << 20), 256 << 20)


def measure(lib: KernelLib, nbytes: int | None = None) -> dict[str, float]:
    """Best seconds of a 1-row bf16 GEMM over `nbytes` of weights with each hint."""
    k = 1024
    n = (nbytes or weight_bytes()) // (2 * k) // lib.panel_rows * lib.panel_rows
    w = lib.pack(torch.full((n, k), 0.01, dtype=torch.bfloat16))
    x = torch.full((1, k), 0.5, dtype=torch.bfloat16)
    times = dict.fromkeys(HINTS, float("inf"))
    for _ in range(3):
        for hint in HINTS:
            lib.set_stream_prefetch(hint == "nta")
            times[hint] = min(times[hint], best_time(lambda: lib.linear(x, w)))
    return times


def choose(lib: KernelLib, machine: str, cache: Path) -> str:
    """Set and return the hint for this library: forced, cached (per `machine`, the GEMM
    planner's CPU, build and torch, and the thread count), or measured now."""
    hint = forced()
    if hint is None and lib.isa not in DOT_ISAS:
        return "l2"  # no dot-product GEMM in this build: nothing to choose
    if hint is None:
        key = f"{machine}|{torch.get_num_threads()} threads"
        times = read_json(cache).get(key)
        if not (isinstance(times, dict) and set(times) == set(HINTS)):
            times = measure(lib)
            write_json(cache, {key: times}, "the prefetch choice")
            logger.info("bf16 GEMM of up to 4 rows: prefetch into L2 %.2f ms, nta %.2f ms",
                        times["l2"] * 1e3, times["nta"] * 1e3)
        hint = "nta" if times["nta"] * MARGIN < times["l2"] else "l2"
    lib.set_stream_prefetch(hint == "nta")
    return hint
