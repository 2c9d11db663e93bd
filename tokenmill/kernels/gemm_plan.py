"""Which GEMM runs a linear layer: tokenmill's packed-weight kernel or PyTorch's matmul
(oneDNN, on AMX where the CPU has it; MKL for float32), and up to which batch size the fused
decode step (packed GEMMs only) beats running the layers op by op.

Decided by measuring both GEMMs at first use per (CPU, kernel build, threads, dtype, weight
shape) over a ladder of row counts; the times are cached on disk next to the compiled kernels
and each decision is logged. PyTorch must win by 5%, or by 25% for bf16 on the AMX build (whose
rows are the same bits at every row count, which handing PyTorch some row counts would undo).
TOKENMILL_GEMM=packed or =torch forces one GEMM for every row count (torch also turns the
fused decode step off: it runs packed GEMMs only).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.kernels.lib import KernelLib, PackedLinear

logger = logging.getLogger("tokenmill")

NEVER = 1 << 62
ROWS = (1, 4, 16, 64, 256, 1024)  # the ladder measured
MARGIN = 1.05  # PyTorch must be this much faster to take over (noise must not flip choices)
# ... and this much where tokenmill's kernel gives a row the same bits at every row count (bf16
# on AMX tiles, gemm_amx.h): PyTorch's rows take other sums, so handing it the calls of some row
# counts would make a row's numbers depend on its step again (bf16 speculation, batching)
INVARIANT_MARGIN = 1.25
MAX_CALL_S = 0.25  # ladder points whose GEMM would take longer are not measured
# What running a decoder layer op by op costs over the fused decode step besides its GEMMs
# (Python and per-call overhead of ~15 ops; ~0.13-0.24 ms measured, docs/performance.md).
PER_OP_LAYER_S = 200e-6


@dataclass
class GemmTimes:
    """Best seconds per call of each GEMM at each measured row count."""

    rows: list[int]
    packed: list[float]
    torch: list[float]

    def torch_from_rows(self, margin: float = MARGIN) -> int:
        """The smallest measured row count from which PyTorch's matmul won (by `margin`) at
        every larger measured count (NEVER when it did not win at the largest)."""
        first = NEVER
        for rows, ours, theirs in reversed(list(zip(self.rows, self.packed, self.torch))):
            if theirs * margin >= ours:
                break
            first = rows
        return first


@dataclass
class PreparedLinear:
    packed: PackedLinear
    torch_from_rows: int  # rows from which F.linear runs instead of the packed kernel
    times: GemmTimes | None  # None when TOKENMILL_GEMM forced the choice


def forced() -> str | None:
    mode = os.environ.get("TOKENMILL_GEMM", "auto")
    if mode not in ("auto", "packed", "torch"):
        raise ValueError(f"TOKENMILL_GEMM must be auto, packed or torch, got {mode!r}")
    return None if mode == "auto" else mode


def fused_max_rows(layers: list[list[PreparedLinear]]) -> int:
    """The largest decode batch the fused step (all layers, packed GEMMs) should take: where its
    GEMM time stays below the op-by-op path's (each GEMM on its faster engine, plus the per-op
    cost of every layer), at that measured row count and every smaller one; between a winning
    and a losing ladder point the geometric middle."""
    mode = forced()
    if mode:
        return NEVER if mode == "packed" else 0
    # quantized layers have no PyTorch alternative (times None): they run the same either way
    times = [(p.times, p.torch_from_rows) for layer in layers for p in layer
             if p.times is not None]
    if not times:
        return NEVER
    best = 0
    for i, rows in enumerate(times[0][0].rows):
        if any(i >= len(t.rows) for t, _ in times):
            break
        fused = sum(t.packed[i] for t, _ in times)
        op_by_op = sum(t.torch[i] if rows >= torch_from else t.packed[i] for t, torch_from in times)
        op_by_op += PER_OP_LAYER_S * len(layers)
        if fused > op_by_op * MARGIN:
            return best * 2 if best else 0
        best = rows
    return NEVER  # it won wherever measured


class GemmPlanner:
    def __init__(self, lib: KernelLib, path: Path | None = None) -> None:
        from tokenmill.kernels import home
        from tokenmill.kernels.isa import describe_cpu

        self.lib = lib
        self.path = path or home() / "kernels" / "gemm_plan.json"
        self.machine = f"{describe_cpu()}|{lib.isa}|{lib.source_hash}|torch {torch.__version__}"
        self.table = self._read()
        from tokenmill.kernels import stream_prefetch  # (it reads and writes tables as here)

        stream_prefetch.choose(lib, self.machine, self.path.with_name("stream_prefetch.json"))
        self._q6_widen: tuple[int | None] | None = None

    def choose_q6_widen(self) -> int | None:
        """Once, when the first Q6_K weight is packed: from how many rows its GEMMs widen the
        codes (kernels/q6_widen.py; a measurement at the machine's first start). None where the
        build does not widen."""
        if self._q6_widen is None:
            from tokenmill.kernels import q6_widen

            self._q6_widen = (q6_widen.choose(self.lib, self.machine,
                                              self.path.with_name("q6_widen.json")),)
        return self._q6_widen[0]

    @staticmethod
    @functools.cache
    def for_lib(lib: KernelLib) -> GemmPlanner:
        return GemmPlanner(lib)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None,
                gated: bool = False) -> PreparedLinear:
        packed = self.lib.pack(weight, bias, gated)
        mode = forced()
        if mode:
            return PreparedLinear(packed, NEVER if mode == "packed" else 1, None)
        times = self.times(weight, bias, packed)
        invariant = self.lib.bf16_rows_invariant and weight.dtype == torch.bfloat16
        return PreparedLinear(packed, times.torch_from_rows(INVARIANT_MARGIN if invariant
                                                            else MARGIN), times)

    def times(self, weight, bias, packed: PackedLinear) -> GemmTimes:
        shape = f"{weight.shape[0]}x{weight.shape[1]}" + (" silu_mul" if packed.gated else "")
        return self.cached(f"{weight.dtype}|{shape}", f"GEMM {shape} {weight.dtype}",
                           lambda: measure(self.lib, weight, bias, packed))

    def cached(self, what: str, label: str, measure_fn) -> GemmTimes:
        """The times for `what` on this machine: from the cache, else measured now."""
        key = f"{self.machine}|{torch.get_num_threads()} threads|{what}"
        if key not in self.table:
            self.table[key] = measure_fn()
            self._write()
            rows = self.table[key].torch_from_rows()
            logger.info("%s: %s", label, "tokenmill's kernel at every size" if rows >= NEVER
                        else f"PyTorch's from {rows}, tokenmill's kernel below")
        return self.table[key]

    def _read(self) -> dict[str, GemmTimes]:
        try:
            return {k: GemmTimes(**v) for k, v in read_json(self.path).items()}
        except (TypeError, AttributeError):
            return {}

    def _write(self) -> None:
        write_json(self.path, {k: vars(v) for k, v in self.table.items()}, "the GEMM plan")


def read_json(path: Path) -> dict:
    """A table of first-start measurements cached on disk; {} when missing or unreadable."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def write_json(path: Path, entries: dict, what: str) -> None:
    """Add `entries` to the table at `path` (atomically; other processes' entries kept)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**read_json(path), **entries}, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: measure again next time
        logger.warning("cannot save %s to %s (%s)", what, path, e)


def measure(lib: KernelLib, weight, bias, packed: PackedLinear) -> GemmTimes:
    """Both GEMMs at each ladder row count, up to the count where one call would take more
    than MAX_CALL_S; a gated pack (silu_mul in its GEMM) against PyTorch's GEMM and the
    silu_mul kernel after it."""
    def theirs(x):
        y = F.linear(x, weight, bias)
        return lib.silu_mul(y) if packed.gated else y

    times = GemmTimes([], [], [])
    for rows in ROWS:
        if times.rows and max(times.packed[-1], times.torch[-1]) * rows / times.rows[-1] \
                > MAX_CALL_S:
            break
        x = torch.randn(rows, weight.shape[1], device=weight.device).to(weight.dtype)
        times.rows.append(rows)
        times.packed.append(best_time(lambda x=x: lib.linear(x, packed)))
        times.torch.append(best_time(lambda x=x: theirs(x)))
    return times


def best_time(fn, budget: float = 0.02) -> float:
    """Best time of a few calls after a warm-up, within about `budget` seconds."""
    fn()
    best, spent = float("inf"), 0.0
    for _ in range(5):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
        if spent > budget:
            break
    return best
