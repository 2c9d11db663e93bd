"""Batch-invariant kernels (`deterministic=True`, `--deterministic`): a row's numbers do not
depend on what else is in the step.

By default the kernels pick their tiling by the number of rows (a GEMM tile of 1-3 rows keeps
two accumulator sets and sums them, a larger tile one; PyTorch's GEMM takes over from a
measured row count; prefill chunks attend with a tiled kernel or SDPA), so the same token's
logits differ in the last bits between running alone, batched, in a prefill chunk or as a
decode step, and a near-tie can flip a greedy token. (The AMX build's bf16 GEMMs run every row
count on tiles and are row-invariant already; its float32 GEMMs and the plan's PyTorch choice
are not.) Here every linear layer computes each input row with the one-row micro-kernel
(tm_linear.row_invariant), and every query row of a prefill chunk attends through the
decode-attention kernel, reading the cache as a decode step at that position would.
Everything else (norms, RoPE, activations, sampling with a seeded request's own generator) is
row by row already. So temperature 0 and seeded sampling give identical tokens and logprobs
alone, batched, chunked, prefix-cached or not.

A quantized cache (int8, fp8, int4) is read the same way: its decode kernel, like the float
one, cuts a history into pieces at fixed positions in every mode (kernels/csrc/
attention_pieces.h), and each prefill row attends as that decode step would.

What it costs: prefill runs GEMMs one row at a time (still reading each weight panel from
cache) and attention without tiling; decode is unchanged. docs/performance.md has the numbers.
Needs the C++ kernels, a float32 or bfloat16 model on the CPU and a cache in the model's dtype
or quantized (head_dim a multiple of 32, at most 256).
"""

from __future__ import annotations

import torch

from tokenmill.layers.kernel_ops import KernelOps


class BatchInvariantOps(KernelOps):
    def __init__(self, lib) -> None:
        super().__init__(lib)
        self.name = f"kernels ({lib.isa}, batch-invariant)"

    def prepare_linear(self, weight, bias, gated=False):  # never gated: one GEMM path only
        from tokenmill.kernels.gemm_plan import NEVER, PreparedLinear

        q = getattr(weight, "quant", None)
        if q is None and (weight.device.type != "cpu" or weight.dim() != 2
                          or weight.dtype not in (torch.float32, torch.bfloat16)):
            return None
        if q is None:  # never PyTorch's GEMM: no measurement to make
            b = None if bias is None else bias.detach().float().contiguous()
            prepared = PreparedLinear(self.lib.pack(weight.detach(), b), NEVER, None)
        else:
            prepared = super().prepare_linear(weight, bias)
        prepared.packed.struct.row_invariant = 1
        return prepared

    def linear(self, x, layer, out_fp32=False):
        prepared = layer.prepared() if self.fits(x) and x.dim() == 2 else None
        if prepared is None:
            raise RuntimeError(f"batch-invariant mode has no kernel for a {x.dtype} input "
                               f"of shape {tuple(x.shape)} on {x.device}")
        return super().linear(x, layer, out_fp32)

    def prefill_kernel_len(self, heads, kv_heads, head_dim, dtype) -> int:
        return 0  # prefill rows attend as decode rows (below); the fused step leaves them

    def prefill_attention(self, q, k_cache, v_cache, block_table, num_computed, window, scale):
        """Each query row of the chunk as a decode step at its position (the chunk's K/V are
        in the cache already)."""
        n = q.shape[0]
        tables = block_table[None, :].expand(n, -1).contiguous()
        lens = torch.arange(num_computed + 1, num_computed + n + 1, dtype=torch.int64)
        out = self.decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, window,
                                    scale)
        if out is None:
            raise RuntimeError(f"batch-invariant mode has no attention kernel for head_dim "
                               f"{q.shape[-1]} in {q.dtype}")
        return out

    def decode_attention_quant(self, q, cache, layer, block_tables, seq_lens, stages, window,
                               scale):
        from tokenmill.kernels.kv_pages import supports

        if not supports(cache):
            raise RuntimeError(f"batch-invariant mode has no kernel for a {cache.format.name} "
                               f"cache of head_dim {cache.head_dim}")
        return self.lib.decode_attention_quant(q, cache, layer, block_tables, seq_lens, stages,
                                               window, scale)

    def prefill_attention_quant(self, q, cache, layer, block_table, stage_table, num_computed,
                                window, scale):
        """Each query row as a decode step at its position (a staged cache: the stage slot of
        the row's own block)."""
        n = q.shape[0]
        tables = block_table[None, :].expand(n, -1).contiguous()
        lens = torch.arange(num_computed + 1, num_computed + n + 1, dtype=torch.int64)
        stages = None if stage_table is None else stage_table[(lens - 1) // cache.block_size]
        out = self.decode_attention_quant(q.float(), cache, layer, tables, lens, stages, window,
                                          scale)
        return out.to(q.dtype)
