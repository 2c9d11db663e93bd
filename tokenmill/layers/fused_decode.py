"""The fused step's contract: the named weights a model hands to the C++ decode stack
(kernels/csrc/decode_stack.cpp, which runs every decoder layer of a step in one call: its
decode rows and, on an unquantized cache, its prefill chunks), built in one place from the
model's modules.

The fused step is an optimization of a model, not a second model: it runs the same kernels in
the same order as the Python layers (tests/test_kernels.py checks the two agree), and a model
that cannot describe itself this way (DecoderWeights is None) runs its Python layers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokenmill.kernels import lib as klib
from tokenmill.kernels.gemm_plan import fused_max_rows
from tokenmill.layers.linear import Linear


@dataclass
class DecoderLayerWeights:
    """One layer: norm -> qkv (+ q/k norm) -> RoPE -> attention -> o -> residual norm ->
    gate|up -> act(gate) x up -> down (Llama). With pre_ffn_norm (Gemma 3): o -> post_norm ->
    residual add -> pre_ffn_norm -> MLP -> post_ffn_norm."""

    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    window: int  # sliding window in tokens, 0 = none
    pre_ffn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    cos_sin: torch.Tensor | None = None  # this layer's rotary table; None: the model's
    pool: int = 0  # the KV block pool (cache group) of this layer, and its index there
    pool_layer: int = 0


@dataclass
class DecoderWeights:
    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    cos_sin: torch.Tensor  # (2, max_positions, head_dim / 2) float32
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float
    act: str = "silu"  # klib.ACTIVATIONS


def fused_step(model, x: torch.Tensor, ctx):
    """The fused decoder of `model` (a module with `ops`, `_fused` and
    `fused_decode_weights()`) if it runs this step: one the op implementation's fused decoder
    takes (FusedDecoder.accepts); built at first use."""
    if model._fused is None:
        model._fused = model.ops.fused_decoder(model.fused_decode_weights()) or False
    return model._fused if model._fused and model._fused.accepts(x, ctx) else None


class FusedDecoder:
    """DecoderWeights as the C struct tm_decoder, and the call that runs it."""

    def __init__(self, lib: klib.KernelLib, w: DecoderWeights, prefill_len=None) -> None:
        """prefill_len(heads, kv_heads, head_dim, dtype): the key length from which the op
        by op path would not run a prefill chunk on the kernel the stack calls
        (tm_prefill_attention); None: prefill chunks run op by op."""
        self.lib = lib
        self._prefill_len = prefill_len
        self._attention = (w.heads, w.kv_heads, w.head_dim)  # prefill_len's shape arguments
        self.dtype = w.final_norm.dtype
        self.head_dim = w.head_dim
        linears = [lin for layer in w.layers for lin in (layer.qkv, layer.o, layer.gate_up,
                                                         layer.down)]
        prepared = [lin.prepared() for lin in linears]
        # the batch sizes where the fused step beats running the layers op by op
        self.max_rows = fused_max_rows([prepared[i:i + 4] for i in range(0, len(prepared), 4)])
        self._keep = [w, prepared]  # everything the struct points to stays alive
        layers = (klib.Layer * len(w.layers))()
        for i, layer in enumerate(w.layers):
            p = prepared[4 * i: 4 * i + 4]
            layers[i] = klib.Layer(
                _ptr(layer.input_norm), _ptr(layer.post_norm), _ptr(layer.q_norm),
                _ptr(layer.k_norm), _ptr(layer.pre_ffn_norm), _ptr(layer.post_ffn_norm),
                p[0].packed.struct, p[1].packed.struct, p[2].packed.struct,
                p[3].packed.struct, layer.window, _ptr(layer.cos_sin), layer.pool,
                layer.pool_layer)
        self._layers = layers
        self.num_pools = 1 + max(layer.pool for layer in w.layers)
        self.struct = klib.Decoder(
            klib.DTYPES[self.dtype], len(w.layers), w.final_norm.numel(), w.heads, w.kv_heads,
            w.head_dim, w.intermediate, w.eps, w.scale, klib.ACTIVATIONS[w.act],
            ctypes.cast(layers, ctypes.POINTER(klib.Layer)), _ptr(w.final_norm),
            _ptr(w.cos_sin), w.cos_sin.shape[1])

    def accepts(self, x: torch.Tensor, ctx) -> bool:
        """x's batch, on this step's KV caches: the model's dtype, or (one pool only and
        decode rows only) int8 / fp8 / int4 pages; prefill chunks where the op by op path
        would run the same attention kernel."""
        from tokenmill.kernels.kv_pages import supports

        if x.device.type != "cpu" or x.dtype != self.dtype or x.shape[0] > self.max_rows:
            return False
        cache = ctx.kv_cache
        if ctx.prefills:
            return self._runs_prefills(x, ctx)
        if self.num_pools == 2:
            return (ctx.window_ctx is not None and cache.lossless(x.dtype)
                    and ctx.window_ctx.kv_cache.lossless(x.dtype))
        return ctx.window_ctx is None and (
            cache.lossless(x.dtype) or (cache.quantized and supports(cache)
                                        and (cache.stage is None
                                             or cache.stage.dtype == x.dtype)))

    def _runs_prefills(self, x: torch.Tensor, ctx) -> bool:
        if self._prefill_len is None or (self.num_pools == 2) != (ctx.window_ctx is not None):
            return False
        ctxs = (ctx, ctx.window_ctx)[:self.num_pools]
        if not all(c.kv_cache.lossless(x.dtype) for c in ctxs):
            return False
        longest = max(chunk.kv_len for chunk in ctx.prefills)
        return longest < self._prefill_len(*self._attention, x.dtype)

    def __call__(self, x, positions, ctx) -> torch.Tensor:
        """x: (tokens, hidden) embeddings of a step -> the final norm's output (of the rows
        ctx.rows_to_keep names, when it names some)."""
        cache = ctx.kv_cache
        fmt, st = cache.format, self.struct
        st.kv_format = klib.KV_FORMATS[fmt.name] if fmt.quantized else 0
        if fmt.quantized:  # every layer's scales (int4: K's params and stage, V's rotation)
            st.k_scale = cache.k[1].data_ptr() if len(cache.k) > 1 else None
            st.v_scale = cache.v[1].data_ptr()
            st.k_params = cache.k_blocks[0].data_ptr() if cache.k_blocks else None
            st.k_stage = cache.stage.data_ptr() if cache.stage is not None else None
            st.stage_slots = cache.stage.shape[1] if cache.stage is not None else 0
            if fmt.v_rotated:
                self._rotation = fmt.rotation(self.head_dim, x.device).float().contiguous()
                st.v_rotation = self._rotation.data_ptr()
        if ctx.prefills:  # (an unquantized cache) chunks packed in order after the decode rows
            starts = [ctx.num_decode_tokens] + [chunk.end for chunk in ctx.prefills]
            pools = [(c.kv_cache.k[0], c.kv_cache.v[0], c.slot_mapping, *_step_tables(c),
                      None, None) for c in (ctx, ctx.window_ctx)[:self.num_pools]]
            return self.lib.decode_stack(st, x, positions, pools, starts, ctx.prompt_rows,
                                         ctx.rows_to_keep(x.shape[0]))
        pools = [(c.kv_cache.k[0], c.kv_cache.v[0], c.slot_mapping, c.decode_block_tables,
                  c.decode_seq_lens, c.stage_mapping, c.decode_stages)
                 for c in (ctx, ctx.window_ctx)[:self.num_pools]]
        return self.lib.decode_stack(st, x, positions, pools)


def _step_tables(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """One pool's block tables and lengths: its decode rows', then one row per prefill chunk
    (its blocks, its length after the chunk)."""
    rows = [chunk.block_table for chunk in ctx.prefills]
    lens = [chunk.kv_len for chunk in ctx.prefills]
    width = max(len(t) for t in rows)
    if ctx.num_decode_tokens:
        width = max(width, ctx.decode_block_tables.shape[1])
    tables = torch.zeros(ctx.num_decode_tokens + len(rows), width, dtype=torch.int64)
    lens = torch.tensor(lens, dtype=torch.int64)
    if ctx.num_decode_tokens:
        tables[:ctx.num_decode_tokens, :ctx.decode_block_tables.shape[1]] = \
            ctx.decode_block_tables
        lens = torch.cat([ctx.decode_seq_lens.to(torch.int64), lens])
    for i, t in enumerate(rows):
        tables[ctx.num_decode_tokens + i, :len(t)] = t
    return tables, lens


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("fused decode weights must be contiguous")
    return t.data_ptr()
