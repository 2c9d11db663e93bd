"""The fused decode step's contract: the named weights a model hands to the C++ decode stack
(kernels/csrc/decode_stack.cpp, which runs every decoder layer of a decode-only step in one
call), built in one place from the model's modules.

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
    """One Llama-family layer: norm -> qkv (+ q/k norm) -> RoPE -> attention -> o ->
    residual norm -> gate|up -> SiLU x up -> down."""

    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    window: int  # sliding window in tokens, 0 = none


@dataclass
class DecoderWeights:
    layers: list[DecoderLayerWeights]
    final_norm: torch.Tensor
    cos_sin: torch.Tensor  # (2, max_positions, head_dim) float32
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class FusedDecoder:
    """DecoderWeights as the C struct tm_decoder, and the call that runs it."""

    def __init__(self, lib: klib.KernelLib, w: DecoderWeights) -> None:
        self.lib = lib
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
                _ptr(layer.k_norm), p[0].packed.struct, p[1].packed.struct,
                p[2].packed.struct, p[3].packed.struct, layer.window)
        self._layers = layers
        self.struct = klib.Decoder(
            klib.DTYPES[self.dtype], len(w.layers), w.final_norm.numel(), w.heads, w.kv_heads,
            w.head_dim, w.intermediate, w.eps, w.scale,
            ctypes.cast(layers, ctypes.POINTER(klib.Layer)), _ptr(w.final_norm),
            _ptr(w.cos_sin), w.cos_sin.shape[1])

    def accepts(self, x: torch.Tensor, cache) -> bool:
        """x's batch, on this KV cache: the model's dtype, or int8 / int4 pages."""
        return (x.device.type == "cpu" and x.dtype == self.dtype and x.shape[0] <= self.max_rows
                and (cache.lossless(x.dtype) or cache.format.name in klib.KV_FORMATS))

    def __call__(self, x, positions, ctx) -> torch.Tensor:
        """x: (decodes, hidden) embeddings of a decode-only step -> the final norm's output."""
        cache = ctx.kv_cache
        fmt, st = cache.format, self.struct
        st.kv_format = klib.KV_FORMATS[fmt.name] if fmt.quantized else 0
        if fmt.quantized:  # codes (and per-token scales) of every layer, and the rotation
            st.k_scale, st.v_scale = cache.k[1].data_ptr(), cache.v[1].data_ptr()
            st.k_zero = cache.k[2].data_ptr() if len(cache.k) > 2 else None
            st.v_zero = cache.v[2].data_ptr() if len(cache.v) > 2 else None
            if fmt.rotated:
                self._rotation = fmt.rotation(self.head_dim, x.device).contiguous()
                st.kv_rotation = self._rotation.data_ptr()
        return self.lib.decode_stack(st, x, positions, cache.k[0], cache.v[0],
                                     ctx.slot_mapping, ctx.decode_block_tables,
                                     ctx.decode_seq_lens)


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if not t.is_contiguous():
        raise ValueError("fused decode weights must be contiguous")
    return t.data_ptr()
