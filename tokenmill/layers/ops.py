"""Hot-path operators. Each has a plain PyTorch reference (the definition) and, on CPUs with
AVX2, a C++ kernel that computes the same thing with one call instead of many small ops (see
kernels/*.cpp). tests/test_kernels.py checks that both agree.

Which path runs is decided per forward pass: a ModelRunner wraps its model calls in
`with ops.kernels(enabled):` (TOKENMILL_KERNELS=0 disables them everywhere). Tensors on other
devices or in other dtypes always take the reference path.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_kernels = None
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    from tokenmill.kernels import load_cpu_kernels

    return load_cpu_kernels() is not None


@contextlib.contextmanager
def kernels(enabled: bool):
    """Run the enclosed model code with the C++ kernels (when they built) or without."""
    global _kernels
    from tokenmill.kernels import load_cpu_kernels

    previous, _kernels = _kernels, load_cpu_kernels() if enabled else None
    try:
        yield _kernels is not None
    finally:
        _kernels = previous


def _fast(x: torch.Tensor) -> bool:
    return _kernels is not None and x.device.type == "cpu" and x.dtype in KERNEL_DTYPES


# ---- references ---------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # x: (tokens, heads, head_dim); cos_sin: (2, max_positions, head_dim) float32
    cos = cos_sin[0, positions].to(x.dtype)[:, None, :]  # (tokens, 1, head_dim)
    sin = cos_sin[1, positions].to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- dispatch -----------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _fast(x) and weight.dtype == x.dtype:
        return _kernels.rms_norm(x.contiguous(), weight, eps, None)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + x becomes the new residual stream; returns (its norm, new residual)."""
    if _fast(x) and weight.dtype == x.dtype == residual.dtype and residual.is_contiguous():
        return _kernels.rms_norm(residual, weight, eps, x.contiguous()), residual
    residual = residual + x
    return rms_norm_ref(residual, weight, eps), residual


def rope(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    if _fast(q):
        q, k = q.contiguous(), k.contiguous()
        _kernels.rope(q, cos_sin, positions)
        _kernels.rope(k, cos_sin, positions)
        return q, k
    return rope_ref(q, cos_sin, positions), rope_ref(k, cos_sin, positions)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    if _fast(x):
        return _kernels.silu_mul(x.contiguous())
    return silu_mul_ref(x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_fp32: bool = False, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, in x's dtype or, with out_fp32, in float32 straight from the
    float32 accumulators (logits: bf16 rounding would turn near-ties into exact ties). The C++
    GEMM reads `packed` (pack_weight(weight), packed here when not given) for any number of
    rows: it beat MKL on float32 (or widened bf16) weights at 256, 512 and 2,048 rows too
    (measured in docs/performance.md)."""
    if uses_packed(x, weight):
        packed = pack_weight(weight) if packed is None else packed
        return _kernels.linear(x, packed, bias, weight.shape[0], out_fp32)
    if out_fp32 and x.dtype != torch.float32:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return F.linear(x, weight, bias)


def uses_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear(x, weight) runs the C++ GEMM, which reads packed weights."""
    return _fast(x) and weight.dtype in KERNEL_DTYPES and x.dim() == 2


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window, scale):
    """q: (batch, heads, head_dim) against one layer's paged cache; None when no kernel fits
    (the caller then gathers and uses SDPA)."""
    if _fast(q) and k_cache.dtype == q.dtype:
        return _kernels.decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                         window or 0, scale)
    return None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: (rows, n) -> (rows,) int64, as x.argmax(-1) (first maximum; NaN counts as largest)."""
    if _fast(x) and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
        return _kernels.argmax_rows(x.contiguous())
    return x.argmax(-1)


def decode_stack_available(x: torch.Tensor) -> bool:
    return _fast(x)


def decode_stack(*args) -> torch.Tensor:
    """All decoder layers of a decode-only step in one C++ call (kernels/cpu_ops.cpp)."""
    return _kernels.decode_stack(*args)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (ceil(N / 16), K, 16) panels for the C++ GEMM (kernels/gemm.cpp): rows padded
    with zeros to a multiple of 16; bf16 panels interleave rows i and 8 + i in each 32-bit lane."""
    n, k = weight.shape
    panels = -(-n // 16)
    w = torch.zeros(panels * 16, k, dtype=weight.dtype, device=weight.device)
    w[:n] = weight.detach()
    if weight.dtype == torch.bfloat16:  # (P, 2, 8, K) -> (P, K, 8, 2)
        return w.view(panels, 2, 8, k).permute(0, 3, 2, 1).reshape(panels, k, 16).contiguous()
    return w.view(panels, 16, k).transpose(1, 2).contiguous()
