"""Llama-family decoder: Llama, Mistral (sliding window), Qwen2 (QKV bias), Qwen3 (q/k norm).

Parameter names mirror Hugging Face's, except that q/k/v and gate/up projections are stored
fused (qkv_proj, gate_up_proj: one matmul instead of three or two); PACKED tells the loader
which slice each checkpoint tensor fills. Tokens arrive packed as one flat batch
(tokens, hidden); the AttentionContext says where each sequence's K/V live in the paged cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionContext, PagedAttention
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.config import ModelConfig
from tokenmill.models.loading import load_packed

# checkpoint module name -> (fused module name, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.attention_bias)
        self.o_proj = Linear(q_size, [cfg.hidden_size], bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        group, index = cfg.kv_cache_slot(layer_idx)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, index,
            sliding_window=cfg.sliding_window_for(layer_idx), cache_group=group,
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
        ctx: AttentionContext,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)  # (tokens, heads, head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = self.attn(q, k, v, ctx)  # (tokens, heads, head_dim)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], cfg.mlp_bias)
        self.down_proj = Linear(inter, [cfg.hidden_size], cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, ctx):
        """x: this layer's input before the residual add (the previous layer's output)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )
        self.cfg = cfg
        self._stack: list[torch.Tensor] | None = None  # weights for the C++ decode stack
        self._windows: list[int] = []  # its per-layer sliding windows (0: none)

    def forward(self, input_ids, positions, ctx) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (tokens, hidden)
        if self._decode_stack_applies(x, ctx):
            return self._decode_stack(x, positions, ctx)
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary_emb, ctx)
        return self.norm(x, residual)[0]

    def _decode_stack_applies(self, x: torch.Tensor, ctx: AttentionContext) -> bool:
        """One C++ call for all layers: decode-only steps on a cache in the model's dtype."""
        return (ops.decode_stack_available(x) and not ctx.prefills
                and ctx.num_decode_tokens == x.shape[0] and ctx.kv_cache.lossless(x.dtype)
                and ctx.window_ctx is None and not self.cfg.mlp_bias)

    def _decode_stack(self, x, positions, ctx) -> torch.Tensor:
        if self._stack is None:
            none = torch.empty(0, dtype=x.dtype, device=x.device)
            self._stack = []
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                self._stack += [
                    layer.input_layernorm.weight, a.qkv_proj.packed_weight(),
                    none if a.qkv_proj.bias is None else a.qkv_proj.bias,
                    a.o_proj.packed_weight(), layer.post_attention_layernorm.weight,
                    m.gate_up_proj.packed_weight(), m.down_proj.packed_weight(),
                    a.q_norm.weight if hasattr(a, "q_norm") else none,
                    a.k_norm.weight if hasattr(a, "k_norm") else none,
                ]
            self._windows = [layer.self_attn.attn.sliding_window or 0 for layer in self.layers]
        cfg, cache = self.cfg, ctx.kv_cache
        return ops.decode_stack(
            x, positions, self.rotary_emb.cos_sin, self._stack, self._windows, self.norm.weight,
            cache.k[0], cache.v[0], ctx.slot_mapping, ctx.decode_block_tables,
            ctx.decode_seq_lens, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, self.norm.eps, self.layers[0].self_attn.attn.scale,
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = Linear(cfg.hidden_size, [cfg.vocab_size], bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)  # (tokens, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # float32 logits from float32 accumulators, also for bf16 models (see ops.linear)
        return self.lm_head(hidden, out_fp32=True)  # (rows, vocab)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed(self, weights, PACKED)
