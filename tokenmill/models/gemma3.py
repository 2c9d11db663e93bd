"""Gemma 3 (text): Llama-shaped attention with q/k norms and a GeGLU MLP, plus Gemma's own
touches: four norms per layer (before and after attention and MLP), RMSNorm weights used as
(1 + w), embeddings scaled by sqrt(hidden), a softmax scale of query_pre_attn_scalar ** -0.5,
and 5 local (sliding-window) layers to every global one, each kind with its own RoPE base.

The local and global layers keep their K/V in two block pools (ModelConfig.kv_cache_groups):
the local layers' blocks older than the window are freed, so their cache stays flat however
long the sequence grows. Norm weights are stored as (1 + w), the multiplier itself, so the
ordinary RMSNorm kernels run them; Hugging Face checkpoints store w (load_weights adds the 1)
and llama.cpp's converter already added it (the GGUF family takes it off again, so both
sources hand load_weights the Hugging Face values). Decode-only steps run all layers in the
fused C++ decode step (layers/fused_decode.py: Gemma's extra norms, GeGLU, each layer's RoPE
table and KV pool), the same kernels in the same order as the Python layers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionContext, last_layer_rows
from tokenmill.layers.fused_decode import DecoderLayerWeights, DecoderWeights, fused_step
from tokenmill.layers.linear import embedding
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loaders.gguf_family import LAYER_NAMES, QK_NORM_NAMES, GGUFFamily, GGUFMeta
from tokenmill.models.config import ModelConfig, as_list
from tokenmill.models.llama import (
    PACKED,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
)
from tokenmill.models.loading import load_packed


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.is_sliding = cfg.sliding_window_for(layer_idx) is not None
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x, residual, positions, rotary, ctx, keep=None):
        """x: the previous layer's output, not yet added to the residual stream; keep: the
        rows to run past attention (AttentionContext.rows_to_keep), else all."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, rotary, ctx, keep))
        if keep is not None:
            residual = residual[keep]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta,
                                          cfg.rope_scaling)
        self.rotary_emb_local = RotaryEmbedding(cfg.head_dim, max_positions,
                                                cfg.rope_local_theta or cfg.rope_theta, None)
        self.embed_scale = cfg.hidden_size**0.5
        self.cfg = cfg
        self.ops = ops.current()
        self._fused = None  # the fused decode step, built at the first decode-only step

    def forward(self, input_ids, positions, ctx: AttentionContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (tokens, hidden)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded as transformers does
        fused = self._fused_decoder(x, ctx)
        if fused is not None:
            return fused(x, positions, ctx)
        residual, keep = None, last_layer_rows(ctx, x)
        for i, layer in enumerate(self.layers):
            rotary = self.rotary_emb_local if layer.is_sliding else self.rotary_emb
            x, residual = layer(x, residual, positions, rotary, ctx,
                                keep if i == len(self.layers) - 1 else None)
        return self.norm(x, residual)[0]

    def _fused_decoder(self, x: torch.Tensor, ctx: AttentionContext):
        return fused_step(self, x, ctx)

    def fused_decode_weights(self) -> DecoderWeights:
        """This model's weights, named, for the fused decode step (layers/fused_decode.py)."""
        cfg = self.cfg
        layers = [DecoderLayerWeights(
            input_norm=layer.input_layernorm.weight, qkv=layer.self_attn.qkv_proj,
            q_norm=layer.self_attn.q_norm.weight, k_norm=layer.self_attn.k_norm.weight,
            o=layer.self_attn.o_proj, post_norm=layer.post_attention_layernorm.weight,
            gate_up=layer.mlp.gate_up_proj, down=layer.mlp.down_proj,
            window=layer.self_attn.attn.sliding_window or 0,
            pre_ffn_norm=layer.pre_feedforward_layernorm.weight,
            post_ffn_norm=layer.post_feedforward_layernorm.weight,
            cos_sin=(self.rotary_emb_local if layer.is_sliding else self.rotary_emb).cos_sin,
            pool=layer.self_attn.attn.cache_group, pool_layer=layer.self_attn.attn.layer_idx)
            for layer in self.layers]
        return DecoderWeights(
            layers, self.norm.weight, self.rotary_emb.cos_sin, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, self.norm.eps,
            self.layers[0].self_attn.attn.scale, "gelu_tanh")


class Gemma3ForCausalLM(LlamaForCausalLM):
    model_class = Gemma3Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden, out_fp32=True)  # (rows, vocab) float32
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face tensors; norm weights w become the multiplier 1 + w."""
        load_packed(self, ((name, tensor + 1 if name.endswith("norm.weight") else tensor)
                           for name, tensor in weights), PACKED)


MODELS = {"Gemma3ForCausalLM": Gemma3ForCausalLM}

# Gemma's chat format, for GGUF files that ship no template (llama.cpp detects it by name)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def config_from_hf(arch: str, cfg: dict) -> ModelConfig:
    """transformers 5 keeps one rope_parameters entry per layer type; 4.x had rope_theta,
    rope_local_base_freq and rope_scaling (the global layers')."""
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional attention is not a causal LM")
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        max_position_embeddings=cfg.get("max_position_embeddings", 131072),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)),
        rope_local_theta=local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)),
        rope_scaling=scaling or None,
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        attention_bias=cfg.get("attention_bias", False),
        qk_norm=True,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh"),
        layer_types=cfg.get("layer_types") or _layer_types(
            cfg["num_hidden_layers"], cfg.get("sliding_window_pattern", 6)),
        sliding_window=cfg.get("sliding_window"),
        attention_scale=cfg.get("query_pre_attn_scalar", cfg["head_dim"]) ** -0.5,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=as_list(cfg.get("eos_token_id")),
        chat_template=CHAT_TEMPLATE,
    )


def _layer_types(layers: int, pattern: int) -> list[str]:
    """Every pattern-th layer global, the others local (Gemma 3: 5 local, then 1 global)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(layers)]


# ---- GGUF ---------------------------------------------------------------------------------
def _gguf_config(meta: GGUFMeta, fields: dict) -> dict:
    """Keys llama.cpp does not store for gemma3 are its hard-coded values: every 6th layer
    global, local RoPE base 10000, softmax scale 1/sqrt(head_dim) (1/sqrt(hidden/heads) for
    the 62-layer 27B)."""
    layers, head_dim = fields["num_hidden_layers"], fields["head_dim"]
    if layers == 62:
        head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    return dict(
        qk_norm=True,
        hidden_act="gelu_pytorch_tanh",
        layer_types=_layer_types(layers, 6),
        sliding_window=meta.get("attention.sliding_window"),
        rope_local_theta=meta.raw("rope.freq_base_swa", 10_000.0),
        attention_scale=head_dim**-0.5,
        final_logit_softcapping=meta.raw("final_logit_softcapping"),
        rms_norm_eps=meta.get("attention.layer_norm_rms_epsilon", 1e-6),
        chat_template=CHAT_TEMPLATE,
    )


def _gguf_to_hf(name: str, tensor):
    """llama.cpp's converter stored every norm weight as 1 + w: hand back w."""
    return tensor - 1 if name.endswith("norm.weight") else tensor


GGUF = {"gemma3": GGUFFamily(
    "Gemma3ForCausalLM",
    {**LAYER_NAMES, **QK_NORM_NAMES, "attn_norm": "input_layernorm",
     "post_attention_norm": "post_attention_layernorm",
     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    config=_gguf_config, to_hf=_gguf_to_hf)}
