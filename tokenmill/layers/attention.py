"""Attention over the paged KV cache, in plain PyTorch (CPU and CUDA).

A step packs all scheduled tokens into one flat batch: first the decode tokens (one per
sequence), then each prefill chunk. New K/V are written to their cache slots; decode tokens
attend as one padded batch gathered through the block tables; each prefill chunk attends to its
sequence's history plus itself, causally. Sliding-window layers also mask keys older than the
window (a query at position i sees keys j with i - window < j <= i, as in transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import ops
from tokenmill.layers.kv_cache import KVCache
from tokenmill.layers.rotary import RotaryEmbedding


@dataclass
class PrefillChunk:
    start: int  # token range [start, end) in the packed batch
    end: int
    num_computed: int  # tokens of this sequence already in the cache before the chunk
    block_table: torch.Tensor  # (num_blocks,) int64
    stage_table: torch.Tensor | None = None  # a staged cache: each block's stage slot, or -1

    @property
    def kv_len(self) -> int:
        return self.num_computed + self.end - self.start


@dataclass
class AttentionContext:
    """Everything attention needs for one step; built by the model runner, read by every layer."""

    kv_cache: KVCache
    slot_mapping: torch.Tensor  # (tokens,) cache slot of each new token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # (decodes, max_blocks)
    decode_seq_lens: torch.Tensor | None = None  # (decodes,) kv length including the new token
    # a staged cache (int4, kv_cache.py): each new token's stage row, each decode row's own
    # block's stage slot
    stage_mapping: torch.Tensor | None = None
    decode_stages: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # rows [begin, end) of the step's prompt tokens (prefill chunks' rows before the prompt's
    # end), ascending: ops.prompt_rows
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    # The second block pool's view (same tokens, its own cache, slots and tables) for models
    # whose sliding-window layers keep their K/V apart from the full-attention layers'.
    window_ctx: AttentionContext | None = None
    # the rows whose output the step uses (ascending; None: all of them): set by the runner
    output_rows: list[int] | None = None
    _masks: dict = field(default_factory=dict)

    def rows_to_keep(self, tokens: int) -> list[int] | None:
        """The rows a model's last layer runs on past its attention (K/V stored for every
        row), compacted to the front, as llama.cpp's output ids: the output rows of a step
        with prefill chunks that uses fewer than its `tokens` rows (every decode row among
        them). None: every row runs."""
        rows, d = self.output_rows, self.num_decode_tokens
        if rows is None or not self.prefills or len(rows) >= tokens:
            return None
        return rows if list(rows[:d]) == list(range(d)) else None

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """(decodes, 1, 1, kv_len) bool: which gathered slots each decode query may attend."""
        if window not in self._masks:
            lens = self.decode_seq_lens[:, None]  # (decodes, 1)
            width = self.decode_block_tables.shape[1] * self.kv_cache.block_size
            pos = torch.arange(width, device=lens.device)[None, :]  # (1, kv_len)
            allowed = pos < lens
            if window is not None:
                allowed &= pos >= lens - window
            self._masks[window] = allowed[:, None, None, :]
        return self._masks[window]


def last_layer_rows(ctx, x: torch.Tensor) -> torch.Tensor | None:
    """The rows of x (a step's rows) the last layer runs past its attention
    (AttentionContext.rows_to_keep) as an index on x's device, or None: all."""
    rows = ctx.rows_to_keep(x.shape[0]) if isinstance(ctx, AttentionContext) else None
    return None if rows is None else torch.tensor(rows, dtype=torch.int64, device=x.device)


def chunk_mask(
    num_computed: int, num_new: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """(new, kv_len) bool causal mask of a prefill chunk that starts after num_computed tokens."""
    q_pos = torch.arange(num_computed, num_computed + num_new, device=device)[:, None]
    k_pos = torch.arange(num_computed + num_new, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_idx: int,
        sliding_window: int | None = None,
        scale: float | None = None,
        cache_group: int = 0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx  # this layer's index within its cache group's KVCache
        self.cache_group = cache_group
        self.sliding_window = sliding_window
        self.scale = scale if scale is not None else head_dim**-0.5
        self.ops = ops.current()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
        rotary: RotaryEmbedding | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim). With `rotary`, q
        and k are rotated here (at `positions`), where the ops can fuse that with the cache
        write."""
        if self.cache_group:
            ctx = ctx.window_ctx
        fused = rotary is not None and self.ops.rope_store(q, k, v, rotary, positions,
                                                           ctx.kv_cache, self.layer_idx,
                                                           ctx.slot_mapping, ctx.stage_mapping)
        if fused:
            q, k = fused
        else:
            if rotary is not None:
                q, k = rotary(positions, q, k)
            self.ops.kv_store(ctx.kv_cache, self.layer_idx, k, v, ctx.slot_mapping,
                              ctx.stage_mapping)
        nd, chunks = ctx.num_decode_tokens, ctx.prefills
        if not nd and len(chunks) == 1 and chunks[0].end - chunks[0].start == q.shape[0]:
            return self._prefill(q, k, v, chunks[0], ctx)  # one prompt chunk: no copy
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], ctx)
        for chunk in ctx.prefills:
            out[chunk.start : chunk.end] = self._prefill(q, k, v, chunk, ctx)
        return out

    def _sdpa(self, q, k, v, mask=None, causal=False) -> torch.Tensor:
        """q: (..., heads, len, head_dim), k/v: (..., kv_heads, kv_len, head_dim). KV heads are
        repeated for GQA and inputs made 4-D: on CPU that is what PyTorch's flash kernel takes
        (3-D or enable_gqa inputs fall back to the ~3x slower math path)."""
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = q[None], k[None], v[None]
        if self.num_heads != self.num_kv_heads:
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=self.scale)
        return out[0] if squeeze else out

    def _decode(self, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        cache = ctx.kv_cache
        if not cache.quantized:  # the C++ kernel reads the blocks in place, no gather copy
            k, v = cache.k[0][self.layer_idx], cache.v[0][self.layer_idx]
            out = self.ops.decode_attention(q.contiguous(), k, v, ctx.decode_block_tables,
                                            ctx.decode_seq_lens, self.sliding_window,
                                            self.scale)
            if out is not None:
                return out
        else:  # quantized pages read in place
            out = self._on_quantized_pages(self.ops.decode_attention_quant, q, cache,
                                           ctx.decode_block_tables, ctx.decode_seq_lens,
                                           ctx.decode_stages)
            if out is not None:
                return out
        k, v = cache.gather(self.layer_idx, ctx.decode_block_tables, q.dtype)
        if cache.staged:  # each row's own block from the stage
            bs = cache.block_size
            own = (ctx.decode_seq_lens - 1) // bs
            rows = torch.arange(bs, device=q.device)
            k[torch.arange(len(own), device=q.device)[:, None], own[:, None] * bs + rows] = \
                cache.staged_rows(self.layer_idx, ctx.decode_stages, q.dtype)
        q = q[:, :, None, :]  # (decodes, heads, 1, head_dim)
        k = k.transpose(1, 2)  # (decodes, kv_heads, kv_len, head_dim)
        v = v.transpose(1, 2)
        out = self._sdpa(q, k, v, mask=ctx.decode_mask(self.sliding_window))
        return out[:, :, 0, :]

    def _unrotate(self, out: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """A kernel reading a rotated V gives a rotated output: rotate it back (gather decodes
        V whole)."""
        if not cache.format.v_rotated:
            return out
        rot = cache.format.rotation(out.shape[-1], out.device)
        return (out.float() @ rot.T).to(out.dtype)

    def _on_quantized_pages(self, kernel, q, cache, *where, keep_dtype=False):
        """A quantized-page kernel on this layer, float32 q (or q's dtype: keep_dtype), the
        output rotated back where V is stored rotated; None where the ops have no such
        kernel."""
        dtype = q.dtype if keep_dtype else torch.float32
        out = kernel(q.to(dtype), cache, self.layer_idx, *where, self.sliding_window,
                     self.scale)
        return None if out is None else self._unrotate(out, cache).to(q.dtype)

    def _prefill(self, q, k, v, chunk: PrefillChunk, ctx: AttentionContext) -> torch.Tensor:
        cache = ctx.kv_cache
        if cache.quantized:  # dequantized a tile at a time, no float copy of the history
            out = self._on_quantized_pages(self.ops.prefill_attention_quant,
                                           q[chunk.start : chunk.end], cache,
                                           chunk.block_table, chunk.stage_table,
                                           chunk.num_computed, keep_dtype=True)
            if out is not None:
                return out
        elif cache.lossless(q.dtype):  # the paged kernel reads the blocks in place
            out = self.ops.prefill_attention(
                q[chunk.start : chunk.end], cache.k[0][self.layer_idx],
                cache.v[0][self.layer_idx], chunk.block_table, chunk.num_computed,
                self.sliding_window, self.scale)
            if out is not None:
                return out
        q = q[chunk.start : chunk.end].transpose(0, 1)  # (heads, new, head_dim)
        if chunk.num_computed == 0 and cache.lossless(q.dtype):
            k = k[chunk.start : chunk.end]  # the whole history is this chunk: use it directly
            v = v[chunk.start : chunk.end]
        else:  # through the cache (a lossy one always: prefill sees the numbers decode sees)
            k, v = cache.gather(self.layer_idx, chunk.block_table[None, :], q.dtype)
            k, v = k[0, : chunk.kv_len], v[0, : chunk.kv_len]
        if cache.staged:
            return self._prefill_staged(q, k, v, chunk, cache)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # (kv_heads, kv_len, head_dim)
        num_new = chunk.end - chunk.start
        window = self.sliding_window
        if chunk.num_computed == 0 and (window is None or num_new <= window):
            out = self._sdpa(q, k, v, causal=True)
        else:
            mask = chunk_mask(chunk.num_computed, num_new, self.sliding_window, q.device)
            out = self._sdpa(q, k, v, mask=mask)
        return out.transpose(0, 1)  # (new, heads, head_dim)

    def _prefill_staged(self, q, k, v, chunk: PrefillChunk, cache: KVCache) -> torch.Tensor:
        """The reference for a staged cache: the chunk's queries a block at a time, each
        group seeing its own block from the stage and earlier blocks quantized."""
        bs, first = cache.block_size, chunk.num_computed
        mask = chunk_mask(first, chunk.end - chunk.start, self.sliding_window, q.device)
        out = torch.empty_like(q)  # (heads, new, head_dim)
        v = v.transpose(0, 1)
        for b in range(first // bs, (chunk.kv_len - 1) // bs + 1):
            lo, hi = max(b * bs, first) - first, min((b + 1) * bs, chunk.kv_len) - first
            own = k.clone()
            rows = cache.staged_rows(self.layer_idx, chunk.stage_table[b:b + 1], q.dtype)[0]
            own[b * bs: (b + 1) * bs] = rows[: min(bs, chunk.kv_len - b * bs)]
            out[:, lo:hi] = self._sdpa(q[:, lo:hi], own[: first + hi].transpose(0, 1),
                                       v[:, : first + hi], mask=mask[lo:hi, : first + hi])
        return out.transpose(0, 1)
