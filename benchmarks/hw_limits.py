"""This machine's physical limits: memory read bandwidth and matmul FLOP/s (float32 via MKL,
bfloat16 via PyTorch), and what they imply for a model: decode cannot beat
weight-bytes-per-token / bandwidth, prefill cannot beat 2 x params x tokens / FLOP/s.

    python benchmarks/hw_limits.py [--threads 2]
Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def best_time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # the best: a limit is what the machine can do, and on a shared host a neighbour slows
    # some repeats down (an AMX Xeon's bf16 matmul measured 680-2,990 GFLOP/s in one session)
    return min(times)


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of summing a buffer 32x larger than the L3 cache."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_time(lambda: x.sum())


def matmul_flops(dtype: torch.dtype, n: int = 1536) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_time(lambda: a @ b, repeats=5)


def measure() -> dict:
    from tokenmill.kernels.isa import describe_cpu

    bf16 = matmul_flops(torch.bfloat16, n=512)
    if bf16 > 50e9:  # a native bf16 path (AVX512-BF16, AMX): big enough to reach its peak
        bf16 = max(bf16, matmul_flops(torch.bfloat16, n=2048))
    return {
        "cpu": describe_cpu(),
        "threads": torch.get_num_threads(),
        "read_gb_s": read_bandwidth() / 1e9,
        "fp32_gflop_s": matmul_flops(torch.float32) / 1e9,
        "bf16_gflop_s": bf16 / 1e9,
    }


def decode_limit_tok_s(limits: dict, weight_bytes_per_token: int) -> float:
    return limits["read_gb_s"] * 1e9 / weight_bytes_per_token


def prefill_flops(matmul_params: int, prompt: int, layers: int = 0, heads: int = 0,
                  head_dim: int = 0) -> float:
    """One prompt's forward FLOPs: 2 per weight and token in the layers' matmuls, plus (with the
    attention's shape) its two products, Q K^T and P V, at 2 FLOPs per multiply-add for each
    query head against its own key and every key before it (causal: what a kernel computes)."""
    causal_pairs = prompt * (prompt + 1) / 2
    return 2.0 * matmul_params * prompt + 4.0 * layers * heads * head_dim * causal_pairs


def prefill_limit_tok_s(limits: dict, flops_per_prompt: float, prompt: int) -> float:
    best = max(limits["fp32_gflop_s"], limits["bf16_gflop_s"])
    return best * 1e9 / flops_per_prompt * prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    limits = measure()
    print(f"cpu                    {limits['cpu']}")
    print(f"threads                {limits['threads']}")
    print(f"memory read bandwidth  {limits['read_gb_s']:8.1f} GB/s")
    print(f"float32 matmul (MKL)   {limits['fp32_gflop_s']:8.1f} GFLOP/s")
    print(f"bfloat16 matmul        {limits['bf16_gflop_s']:8.1f} GFLOP/s (PyTorch: oneDNN on "
          "AVX512-BF16 / AMX, a slow emulated path without them)")
    print(json.dumps({"benchmark": "hw_limits", **limits}, sort_keys=True))


if __name__ == "__main__":
    main()
