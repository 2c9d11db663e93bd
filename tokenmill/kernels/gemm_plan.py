"""Which GEMM runs a linear layer: tokenmill's packed-weight kernel or PyTorch's matmul
(oneDNN, on AMX where the CPU has it; MKL for float32). Decided by measuring both at first use,
per (CPU, kernel build, threads, dtype, weight shape), over a ladder of row counts: a layer
runs PyTorch's matmul from the smallest row count where that measured faster at every larger
count too. Decisions are cached on disk next to the compiled kernels and logged;
TOKENMILL_GEMM=packed or =torch forces one engine for every row count."""

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


@dataclass
class PreparedLinear:
    packed: PackedLinear
    torch_from_rows: int  # rows from which F.linear runs instead of the packed kernel


class GemmPlanner:
    def __init__(self, lib: KernelLib, path: Path | None = None) -> None:
        from tokenmill.kernels import home
        from tokenmill.kernels.isa import describe_cpu

        self.lib = lib
        self.path = path or home() / "kernels" / "gemm_plan.json"
        self.machine = f"{describe_cpu()}|{lib.isa}|{lib.source_hash}|torch {torch.__version__}"
        self.table = self._read()

    @staticmethod
    @functools.cache
    def for_lib(lib: KernelLib) -> GemmPlanner:
        return GemmPlanner(lib)

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PreparedLinear:
        packed = self.lib.pack(weight, bias)
        return PreparedLinear(packed, self.torch_from_rows(weight, bias, packed))

    def torch_from_rows(self, weight, bias, packed: PackedLinear) -> int:
        mode = os.environ.get("TOKENMILL_GEMM", "auto")
        if mode not in ("auto", "packed", "torch"):
            raise ValueError(f"TOKENMILL_GEMM must be auto, packed or torch, got {mode!r}")
        if mode != "auto":
            return NEVER if mode == "packed" else 1
        key = (f"{self.machine}|{torch.get_num_threads()} threads|{weight.dtype}|"
               f"{weight.shape[0]}x{weight.shape[1]}")
        if key not in self.table:
            self.table[key] = measure(self.lib, weight, bias, packed)
            self._write()
            rows = self.table[key]
            logger.info("GEMM %s %s: %s", tuple(weight.shape), str(weight.dtype)[6:],
                        "packed kernel at every row count" if rows >= NEVER else
                        f"PyTorch's matmul from {rows} rows, packed kernel below")
        return self.table[key]

    def _read(self) -> dict:
        try:
            return {k: int(v) for k, v in json.loads(self.path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({**self._read(), **self.table}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: measure again next time
            logger.warning("cannot save the GEMM plan to %s (%s)", self.path, e)


def measure(lib: KernelLib, weight, bias, packed: PackedLinear) -> int:
    """The smallest ladder row count from which F.linear beat the packed kernel at every
    larger measured count (NEVER when it never did). Stops climbing once PyTorch has won at
    two counts in a row."""
    wins = []
    for rows in ROWS:
        x = torch.randn(rows, weight.shape[1], device=weight.device).to(weight.dtype)
        ours = _best(lambda x=x: lib.linear(x, packed))
        theirs = _best(lambda x=x: F.linear(x, weight, bias))
        wins.append((rows, theirs * MARGIN < ours))
        if len(wins) >= 2 and wins[-1][1] and wins[-2][1]:
            break
    first = NEVER
    for rows, torch_won in reversed(wins):
        if not torch_won:
            break
        first = rows
    return first


def _best(fn, budget: float = 0.02) -> float:
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
