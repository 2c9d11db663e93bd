"""The element-wise kernels (csrc/elementwise.cpp) behind torch tensors: RMSNorm (with the
residual add), RoPE, RoPE fused with a prefill layer's cache write, the gated activations, the
row argmax, and the row sampler (csrc/sample.cpp). A mixin of KernelLib (its `_lib` and
`_sync_threads`), with the same checks before any pointer reaches C."""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_pages import _check, _ptr

DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # TM_F32, TM_BF16


class ElementwiseCalls:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        """weight * normalize(x); with add, x += add first, in place (x: the residual stream)."""
        _check(x.is_contiguous() and weight.dtype == x.dtype and weight.numel() == x.shape[-1]
               and (add is None or (add.shape == x.shape and add.dtype == x.dtype)),
               "rms_norm: contiguous x, weight and add of x's dtype and width")
        add = None if add is None else add.contiguous()
        out = torch.empty_like(x)
        h = x.shape[-1]
        self._sync_threads()
        self._lib.tm_rms_norm(DTYPES[x.dtype], x.data_ptr(), weight.contiguous().data_ptr(),
                              _ptr(add), out.data_ptr(), x.numel() // h, h, eps)
        return out

    def rope(self, x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> None:
        """In place on x: (tokens, heads, head_dim); cos_sin: (2, max_positions, head_dim / 2)
        (rotary.py)."""
        _check(x.dim() == 3 and x.is_contiguous() and cos_sin.is_contiguous()
               and cos_sin.dtype == torch.float32 and 2 * cos_sin.shape[2] == x.shape[2]
               and positions.numel() == x.shape[0], "rope: bad shapes")
        pos = positions.to(torch.int64).contiguous()
        self._sync_threads()
        self._lib.tm_rope(DTYPES[x.dtype], x.data_ptr(), *x.shape, cos_sin.data_ptr(),
                          cos_sin.shape[1], pos.data_ptr())

    def rope_store(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos_sin: torch.Tensor,
                   positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv (tokens, >= (heads + 2 kv_heads) head_dim; rows may be strided): q, k, v heads
        side by side -> rotated q (tokens, heads, head_dim) and k (tokens, kv_heads,
        head_dim), as rope() gives; rotated k and v also written to k_cache / v_cache
        (cache slots, kv_heads, head_dim) at slots."""
        D = 2 * cos_sin.shape[2]
        tokens = qkv.shape[0]
        _check(qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= (heads + 2 * kv_heads) * D
               and k_cache.shape[1:] == v_cache.shape[1:] == (kv_heads, D)
               and k_cache.is_contiguous() and v_cache.is_contiguous()
               and qkv.dtype == k_cache.dtype == v_cache.dtype and cos_sin.is_contiguous()
               and cos_sin.dtype == torch.float32 and positions.numel() == slots.numel() == tokens,
               "rope_store: bad shapes")
        pos, slots = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
        q = torch.empty(tokens, heads, D, dtype=qkv.dtype, device=qkv.device)
        k = torch.empty(tokens, kv_heads, D, dtype=qkv.dtype, device=qkv.device)
        self._sync_threads()
        self._lib.tm_rope_store(DTYPES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), tokens, heads,
                                kv_heads, D, cos_sin.data_ptr(), cos_sin.shape[1], pos.data_ptr(),
                                q.data_ptr(), k.data_ptr(), k_cache.data_ptr(),
                                v_cache.data_ptr(), slots.data_ptr())
        return q, k

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._gated(self._lib.tm_silu_mul, x)

    def gelu_tanh_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._gated(self._lib.tm_gelu_tanh_mul, x)

    def _gated(self, fn, x: torch.Tensor) -> torch.Tensor:
        """x (..., 2 * inter) = [gate | up] -> act(gate) * up (..., inter)."""
        x = x.contiguous()
        inter = x.shape[-1] // 2
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
        self._sync_threads()
        fn(DTYPES[x.dtype], x.data_ptr(), out.data_ptr(), x.numel() // (2 * inter), inter)
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        _check(x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0,
               "argmax_rows: (rows, n) float32, n > 0")
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        self._sync_threads()
        self._lib.tm_argmax_rows(x.data_ptr(), *x.shape, out.data_ptr())
        return out

    def sample_rows(self, logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of (rows, vocab) float32 logits (csrc/sample.cpp), the row's
        temperature, top-k, top-p and min-p (float32, int64, float32, float32) and uniform u
        (float32) as layers/sampler.py draws them; -1 where the caller draws (temperature 0,
        a NaN, every logit -inf)."""
        rows = logits.shape[0] if logits.dim() == 2 else -1
        params = (temperatures, top_k, top_p, min_p, u)
        _check(rows >= 0 and logits.dtype == torch.float32 and logits.shape[1] > 0
               and all(t.device.type == "cpu" for t in (logits, *params))
               and all(p.shape == (rows,) and p.is_contiguous() for p in params)
               and [p.dtype for p in params] == [torch.float32, torch.int64, torch.float32,
                                                  torch.float32, torch.float32],
               "sample_rows: (rows, vocab) float32 logits and one parameter of each per row, "
               "on the CPU")
        logits = logits.contiguous()
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        self._sync_threads()
        self._lib.tm_sample_rows(logits.data_ptr(), rows, logits.shape[1],
                                 *(p.data_ptr() for p in params), out.data_ptr())
        return out
