"""One quantized GEMM on Q6_K weights, packed two ways in the same run: as the file has it (6-bit
codes, an int8 scale per 16 weights: what the engine packs) and as its 8-bit conversion (8-bit
codes, one scale per 32: what stop 66 packed). The two alternate in every repetition, each
cycling through copies of its weight that together exceed the last-level cache (decode streams
its weights from memory), so the machine's swings in bandwidth hit both alike. The codes are
random: the arithmetic does not depend on their values. On the AVX2 tiles 6-bit calls widen
their codes from the row count the engine chose for this machine (kernels/q6_widen.py).

    python benchmarks/q6k_gemm.py [--shapes 11008x4096,5632x2048] [--rows 1,4,16,64,512]
        [--isa avx2] [--repeats 9]

Prints a table (ms per GEMM and the speed ratio) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import emit_json, machine, print_table  # noqa: E402

COPIES_BYTES = 96 << 20  # per form: more than the L3 of the machines measured (32 MiB)


def packed(lib, n: int, k: int, exact: bool):
    """A random (n, k) Q6_K weight, packed as it is (exact) or as its 8-bit conversion."""
    from tokenmill.kernels.q6_widen import q6_weight

    if exact:
        return q6_weight(lib, n, k)
    d = (torch.rand(n, k // 32) * 1e-2).half()
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    return lib.qpack_parts([(codes, d, d * -128)], 8)


def main() -> None:
    from tokenmill.kernels import load_cpu_kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="11008x4096,5632x2048,2048x5632")
    ap.add_argument("--rows", default="1,2,4,8,16,64,512")
    ap.add_argument("--isa", default=None, help="a kernel build this CPU runs (default: best)")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    lib = load_cpu_kernels(args.isa)
    from tokenmill.kernels.gemm_plan import GemmPlanner
    widen = GemmPlanner.for_lib(lib).choose_q6_widen()  # as the engine runs (AVX2 tiles)
    torch.manual_seed(0)
    rows_out = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        copies = max(2, COPIES_BYTES // (n * k))
        forms = {name: [packed(lib, n, k, name == "6-bit") for _ in range(copies)]
                 for name in ("8-bit", "6-bit")}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            times = {name: [] for name in forms}
            for rep in range(args.repeats + 1):  # the first round warms up
                for name, ws in forms.items():
                    t = time.perf_counter()
                    for w in ws:
                        lib.linear(x, w)
                    if rep:
                        times[name].append((time.perf_counter() - t) / len(ws))
            ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            rows_out.append({"shape": shape, "rows": rows, "8-bit ms": ms["8-bit"],
                             "6-bit ms": ms["6-bit"], "speed 6/8": ms["8-bit"] / ms["6-bit"]})
    info = machine()
    info["kernels"] = lib.isa
    info["q6_widen_rows"] = widen
    print(f"{info['cpu']}, kernels {lib.isa}, {info['threads']} threads; median of "
          f"{args.repeats}, forms alternating"
          + (f"; 6-bit codes widened from {widen} rows" if widen else ""))
    print_table(rows_out, ["shape", "rows", "8-bit ms", "6-bit ms", "speed 6/8"])
    emit_json({"benchmark": "q6k_gemm", **info, "results": rows_out})


if __name__ == "__main__":
    main()
