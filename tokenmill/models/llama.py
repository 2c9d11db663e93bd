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
from tokenmill.layers.attention import AttentionContext, PagedAttention, last_layer_rows
from tokenmill.layers.fused_decode import DecoderLayerWeights, DecoderWeights, fused_step
from tokenmill.layers.linear import Linear, embedding
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loaders.gguf_family import LAYER_NAMES, QK_NORM_NAMES, GGUFFamily, GGUFMeta
from tokenmill.models.config import ModelConfig, as_list
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
            sliding_window=cfg.sliding_window_for(layer_idx), scale=cfg.attention_scale,
            cache_group=group,
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
        ctx: AttentionContext, keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """keep: the rows whose output is wanted (AttentionContext.rows_to_keep), else all."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)  # (tokens, heads, head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn(q, k, v, ctx, rotary, positions)  # (tokens, heads, head_dim)
        out = out.reshape(tokens, self.num_heads * self.head_dim)
        return self.o_proj(out if keep is None else out[keep])


# gated MLP activations: config name -> op (act(gate) * up; the fused step's name less _mul)
GATED_ACTIVATIONS = {"silu": "silu_mul", "swish": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul",
                     "gelu_tanh": "gelu_tanh_mul"}


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; supported: "
                             f"{', '.join(GATED_ACTIVATIONS)}")
        inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [inter, inter], cfg.mlp_bias)
        self.down_proj = Linear(inter, [cfg.hidden_size], cfg.mlp_bias)
        self.act = GATED_ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj.gated = self.act == "silu_mul"  # the GEMM may apply it (linear_act)
        self.ops = ops.current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.linear_act(x, self.gate_up_proj, self.act))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, ctx, keep=None):
        """x: this layer's input before the residual add (the previous layer's output); keep:
        the rows to run past attention (AttentionContext.rows_to_keep), else all."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        if keep is None:
            h = self.self_attn(h, positions, rotary, ctx)
        else:
            h, residual = self.self_attn(h, positions, rotary, ctx, keep), residual[keep]
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
        )
        self.cfg = cfg
        self.ops = ops.current()
        self._fused = None  # the fused decode step, built at the first decode-only step

    def forward(self, input_ids, positions, ctx) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (tokens, hidden)
        fused = self._fused_decoder(x, ctx)
        if fused is not None:
            return fused(x, positions, ctx)
        keep = last_layer_rows(ctx, x)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rotary_emb, ctx,
                                keep if i == len(self.layers) - 1 else None)
        return self.norm(x, residual)[0]

    def _fused_decoder(self, x: torch.Tensor, ctx: AttentionContext):
        """All layers in one kernel call, for decode-only steps (layers/fused_decode.py)."""
        return fused_step(self, x, ctx)

    def fused_decode_weights(self) -> DecoderWeights | None:
        """This model's weights, named, for the fused decode step (layers/fused_decode.py);
        None with partial rotary embeddings (the C++ step rotates whole heads)."""
        cfg = self.cfg
        if self.rotary_emb.rotary_dim != cfg.head_dim:
            return None
        layers = [DecoderLayerWeights(
            input_norm=layer.input_layernorm.weight, qkv=layer.self_attn.qkv_proj,
            q_norm=_weight_of(layer.self_attn, "q_norm"),
            k_norm=_weight_of(layer.self_attn, "k_norm"),
            o=layer.self_attn.o_proj, post_norm=layer.post_attention_layernorm.weight,
            gate_up=layer.mlp.gate_up_proj, down=layer.mlp.down_proj,
            window=layer.self_attn.attn.sliding_window or 0,
            pool=layer.self_attn.attn.cache_group, pool_layer=layer.self_attn.attn.layer_idx)
            for layer in self.layers]
        return DecoderWeights(
            layers, self.norm.weight, self.rotary_emb.cos_sin, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, self.norm.eps,
            self.layers[0].self_attn.attn.scale,
            GATED_ACTIVATIONS[cfg.hidden_act].removesuffix("_mul"))


def _weight_of(module: nn.Module, name: str) -> torch.Tensor | None:
    child = getattr(module, name, None)
    return None if child is None else child.weight


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel  # the decoder stack under the LM head (Gemma 3 has its own)

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, max_positions or cfg.max_position_embeddings)
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
        # float32 logits from float32 accumulators, also for bf16 models (see KernelOps.linear)
        return self.lm_head(hidden, out_fp32=True)  # (rows, vocab)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_packed(self, weights, PACKED)


MODELS = {arch: LlamaForCausalLM for arch in (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")}


def config_from_hf(arch: str, cfg: dict) -> ModelConfig:
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    if rope.get("rope_type", "default") != "default":
        scaling = rope
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
        mlp_bias=cfg.get("mlp_bias", False),
        qk_norm=arch == "Qwen3ForCausalLM",
        hidden_act=cfg.get("hidden_act", "silu"),
        layer_types=_layer_types(arch, cfg),
        sliding_window=_sliding_window(arch, cfg),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=as_list(cfg.get("eos_token_id")),
    )


def _sliding_window(arch: str, cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        return None
    return window


def _layer_types(arch: str, cfg: dict) -> list[str] | None:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
        first_sliding = cfg.get("max_window_layers", 0)
        return [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
    return None


# ---- GGUF (llama.cpp's names and metadata keys) -------------------------------------------
def _llama_gguf_config(meta: GGUFMeta, fields: dict) -> dict:
    """Llama 3.x files carry Llama-3 RoPE scaling as rope_freqs: one divisor per frequency
    (llama.cpp divides each RoPE frequency by it). A Mistral file may carry a sliding window."""
    extra = {}
    factors = meta.tensor("rope_freqs.weight")
    if factors is not None:
        if fields.get("rope_scaling"):
            raise ValueError("GGUF file has both rope_freqs and a rope scaling type")
        extra["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors.tolist()}
    window = meta.raw("attention.sliding_window")
    if window:
        extra["sliding_window"] = int(window)
    return extra


GGUF = {
    "llama": GGUFFamily("LlamaForCausalLM", permute_qk=True, config=_llama_gguf_config,
                        consumed=("rope_freqs.weight",)),
    "qwen2": GGUFFamily("Qwen2ForCausalLM", config=lambda meta, fields: {"attention_bias": True}),
    "qwen3": GGUFFamily("Qwen3ForCausalLM", {**LAYER_NAMES, **QK_NORM_NAMES},
                        config=lambda meta, fields: {"qk_norm": True}),
}
