"""Which prefill attention runs a chunk: tokenmill's paged kernel (attention_prefill.cpp, reads
K/V in place through the block table) or PyTorch's SDPA (flash attention, with the history
gathered first). Decided like the GEMM plan: both measured at first use per (CPU, kernel
build, threads, dtype, heads, KV heads, head_dim) on fresh chunks of a ladder of lengths,
cached with the GEMM times; tokenmill's kernel runs up to the length from which SDPA was faster
at every longer measured one. TOKENMILL_PREFILL_ATTENTION=kernel or =sdpa forces one."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tokenmill.kernels.gemm_plan import MAX_CALL_S, NEVER, GemmPlanner, GemmTimes, best_time

LENGTHS = (128, 512, 2048)  # tokens of a chunk with no history


def sdpa_from_len(planner: GemmPlanner, heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """The key length (history + chunk) from which SDPA runs a prefill chunk."""
    mode = os.environ.get("TOKENMILL_PREFILL_ATTENTION", "auto")
    if mode not in ("auto", "kernel", "sdpa"):
        raise ValueError(f"TOKENMILL_PREFILL_ATTENTION must be auto, kernel or sdpa, "
                         f"got {mode!r}")
    if mode != "auto":
        return NEVER if mode == "kernel" else 0
    shape = f"{heads}x{kv_heads}x{head_dim}"
    times = planner.cached(f"prefill attention|{dtype}|{shape}",
                           f"prefill attention {shape} {dtype}",
                           lambda: measure(planner.lib, heads, kv_heads, head_dim, dtype))
    return times.torch_from_rows()


def measure(lib, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> GemmTimes:
    times = GemmTimes([], [], [])
    block, scale = 16, head_dim**-0.5
    for n in LENGTHS:
        if times.rows and max(times.packed[-1], times.torch[-1]) * (n / times.rows[-1]) ** 2 \
                > MAX_CALL_S:
            break
        q = torch.randn(n, heads, head_dim).to(dtype)
        k, v = (torch.randn(n, kv_heads, head_dim).to(dtype) for _ in range(2))
        cache_k = k.view(n // block, block, kv_heads, head_dim)
        cache_v = v.view(n // block, block, kv_heads, head_dim)
        table = torch.arange(n // block)

        def sdpa(q=q, k=k, v=v):  # what layers/attention.py does for a chunk with no history
            g = heads // kv_heads
            qt = q.transpose(0, 1)[None]
            kt = k.transpose(0, 1).repeat_interleave(g, 0)[None]
            vt = v.transpose(0, 1).repeat_interleave(g, 0)[None]
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)

        times.rows.append(n)
        times.packed.append(best_time(
            lambda q=q, ck=cache_k, cv=cache_v, t=table: lib.prefill_attention(
                q, ck, cv, t, 0, None, scale)))
        times.torch.append(best_time(sdpa))
    return times
