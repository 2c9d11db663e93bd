"""From how many input rows a Q6_K GEMM on the AVX2 tiles widens its codes first.

The AVX2 tiles (no VNNI) multiply Q6_K's 6-bit codes either unpacked in every row tile (the
low nibbles, then bits 4-5 from their pair bytes) or, for a call's chunk of many rows, from a
copy of each 16-row group widened to a byte a code once (widen_q6 in quant_tiles_avx2.h). Where
widening starts to pay differs between CPUs: on a Zen 5 running the AVX2 build, 16 rows widened
ran 0.8x (stop 67, which fixed 32 rows); on a Zen 3, 8-16 rows widened ran 1.06-1.26x and 4
rows 0.85-0.91x (docs/performance.md, "Stop 69"). So it is measured once per (CPU, kernel
build, threads), when the first Q6_K weight is packed: a Q6_K GEMM over a weight twice the
last-level cache at each row count of ROWS, both ways, alternating; widening starts at the
smallest of those row counts from which it wins by 5% at every larger one (NEVER when it does
not win at 64). Cached next to the GEMM plan and logged. TOKENMILL_Q6_WIDEN_ROWS=N forces N.
The results are the same bits either way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from tokenmill.kernels.gemm_plan import best_time, read_json, write_json
from tokenmill.kernels.lib import KernelLib
from tokenmill.kernels.stream_prefetch import weight_bytes

logger = logging.getLogger("tokenmill")

MARGIN = 1.05
ROWS = (4, 8, 16, 32, 64)  # a call's rows come in chunks of up to 64 (quant.cpp)
NEVER = 65
K = 4096  # the measured weight's columns (Q6_K needs a multiple of 256)


def forced() -> int | None:
    value = os.environ.get("TOKENMILL_Q6_WIDEN_ROWS", "auto")
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"TOKENMILL_Q6_WIDEN_ROWS must be auto or a row count >= 1, got {value!r}")
    return int(value)


def q6_weight(lib: KernelLib, n: int, k: int):
    """A random (n, k) Q6_K weight, packed as a file's is (codes, an int8 scale per 16, D)."""
    q6 = (torch.randint(0, 64, (n, k), dtype=torch.uint8),
          torch.randint(-128, 128, (n, k // 16), dtype=torch.int8),
          (torch.rand(n, k // 256) * 1e-3).half())
    d = torch.zeros(n, k // 32, dtype=torch.float16)  # (Q6_K reads its own scales)
    return lib.qpack_parts([(torch.zeros(n, k, dtype=torch.uint8), d, d, None, q6)], 8)


def measure(lib: KernelLib, nbytes: int | None = None, rounds: int = 2) -> dict[str, list]:
    """Best seconds of the Q6_K GEMM at each of ROWS, widened and not."""
    n = max(16, int((nbytes or weight_bytes()) / (K * 6.5625 / 8)) // 16 * 16)
    w = q6_weight(lib, n, K)
    times = {"rows": list(ROWS), "widened": [float("inf")] * len(ROWS),
             "unpacked": [float("inf")] * len(ROWS)}
    try:
        for _ in range(rounds):
            for i, rows in enumerate(ROWS):
                x = torch.randn(rows, K).bfloat16()
                for mode, setting in (("widened", rows), ("unpacked", NEVER)):
                    lib.set_q6_widen_rows(setting)
                    times[mode][i] = min(times[mode][i], best_time(lambda x=x: lib.linear(x, w)))
    finally:
        lib.set_q6_widen_rows(NEVER)
    return times


def widen_from(times: dict[str, list]) -> int:
    """The smallest measured row count from which widening won (by MARGIN) at every larger one."""
    first = NEVER
    for rows, widened, unpacked in reversed(list(zip(times["rows"], times["widened"],
                                                     times["unpacked"]))):
        if widened * MARGIN >= unpacked:
            break
        first = rows
    return first


def choose(lib: KernelLib, machine: str, cache: Path) -> int | None:
    """Set and return the row count for this library: forced, cached (per `machine`, the GEMM
    planner's CPU, build and torch, and the thread count), or measured now; None for a build
    that does not widen."""
    rows = forced()
    if rows is None and not lib.q6_widens:
        return None
    if rows is None:
        key = f"{machine}|{torch.get_num_threads()} threads"
        times = read_json(cache).get(key)
        log = logger.debug
        if not (isinstance(times, dict) and times.get("rows") == list(ROWS)
                and all(len(times.get(m, ())) == len(ROWS) for m in ("widened", "unpacked"))):
            times = measure(lib)
            write_json(cache, {key: times}, "the Q6_K widening choice")
            log = logger.info
        else:
            log = logger.debug
        rows = widen_from(times)
        log("Q6_K GEMMs widen their codes from %s rows (ms widened / unpacked: %s)",
                    rows if rows < NEVER else "no", ", ".join(
                        f"{r}: {a * 1e3:.2f}/{b * 1e3:.2f}"
                        for r, a, b in zip(times["rows"], times["widened"], times["unpacked"])))
    lib.set_q6_widen_rows(rows)
    return rows
