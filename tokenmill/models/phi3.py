"""Phi-3 and Phi-4 (Hugging Face Phi3ForCausalLM, GGUF architecture `phi3`): the Llama layer
(RMSNorm, SiLU gate|up, no biases), so the model is models/llama.py's. What differs is config:

- the checkpoint stores q|k|v and gate|up already fused (self_attn.qkv_proj, mlp.gate_up_proj,
  in the order tokenmill fuses them), which load whole into the fused layers;
- partial rotary embeddings (partial_rotary_factor, 0.75 in Phi-4-mini): RoPE on each head's
  first rotary_dim dims only; those models decode on the Python layers (the fused C++ decode
  step rotates whole heads);
- LongRoPE scaling (rope_type "longrope", formerly "su": the 128k Phi-3 and Phi-4-mini), one
  divisor per frequency from a short or a long set, and cos/sin scaled by an attention factor.
  The set is fixed for the engine, as llama.cpp fixes it for its context: the long factors when
  max_model_len exceeds original_max_position_embeddings, else the short ones (rotary.py).
  transformers switches by the current sequence length instead (short up to the original
  length, then everything recomputed with the long set), so with a max_model_len past the
  original length, sequences shorter than it run with other rotations than transformers';
- a sliding window over all layers where the config sets one (Phi-3-mini-4k: 2047), as
  transformers applies it. llama.cpp ignores phi3 windows ("Phi SWA is currently disabled").

GGUF files (llama.cpp's convert_hf_to_gguf.py, Phi3MiniModel) keep the fused tensors as
attn_qkv and ffn_up (gate|up), the rotated dims as rope.dimension_count, and LongRoPE as the
tensors rope_factors_long / rope_factors_short with rope.scaling.original_context_length and
rope.scaling.attn_factor. No Q/K rows were permuted (phi3 uses NEOX-style RoPE).
"""

from __future__ import annotations

import dataclasses

from tokenmill.loaders.gguf_family import LAYER_NAMES, GGUFFamily, GGUFMeta
from tokenmill.models import llama
from tokenmill.models.config import ModelConfig

# the model is Llama's; load_packed fills fused parameters from the whole fused tensors
MODELS = {"Phi3ForCausalLM": llama.LlamaForCausalLM}


def config_from_hf(arch: str, cfg: dict) -> ModelConfig:
    """Llama's fields, then Phi-3's RoPE: transformers 5 keeps it in rope_parameters
    (partial_rotary_factor and original_max_position_embeddings included), 4.x in rope_scaling
    with both of those at the top level; rope_scaling wins where both are set, as there."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor",
                                         cfg.get("partial_rotary_factor", 1.0)))
    base = llama.config_from_hf(arch, cfg)
    return dataclasses.replace(
        base, rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        rope_scaling=_hf_rope_scaling(rope, cfg, base.max_position_embeddings),
        rotary_dim=rotary_dim if rotary_dim != head_dim else None)


def _hf_rope_scaling(rope: dict, cfg: dict, max_positions: int) -> dict | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("longrope", "su", "yarn"):  # transformers reads su and yarn as longrope
        raise ValueError(f"Phi-3 rope type {kind!r} is not supported (only default, longrope)")
    original = (rope.get("original_max_position_embeddings")
                or cfg.get("original_max_position_embeddings") or max_positions)
    return longrope(rope["short_factor"], rope["long_factor"], original,
                    rope.get("factor") or max_positions / original, rope.get("attention_factor"))


def longrope(short: list[float], long: list[float], original: int, factor: float,
             attention_factor: float | None) -> dict:
    """LongRoPE's parameters as layers/rotary.py reads them. factor: the model's context
    over the original one, which sets the default attention factor."""
    return {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long),
            "original_max_position_embeddings": int(original), "factor": float(factor),
            "attention_factor": attention_factor}


# ---- GGUF (llama.cpp's names and metadata keys) -------------------------------------------
_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_config(meta: GGUFMeta, fields: dict) -> dict:
    """Partial rotary, LongRoPE and the sliding window (0: none, as the converter writes a
    missing one; Phi-4) from phi3's metadata and rope-factor tensors."""
    extra = {}
    rotary_dim = meta.get("rope.dimension_count", fields["head_dim"])
    if rotary_dim != fields["head_dim"]:
        extra["rotary_dim"] = rotary_dim
    window = meta.raw("attention.sliding_window")
    if window:
        extra["sliding_window"] = int(window)
    long, short = (meta.tensor(name) for name in _FACTORS)
    if (long is None) != (short is None):
        raise ValueError("GGUF phi3 file has only one of rope_factors_long, rope_factors_short")
    if long is not None:
        if fields.get("rope_scaling"):
            raise ValueError("GGUF file has both rope factors and a rope scaling type")
        original = meta.get("rope.scaling.original_context_length")
        extra["rope_scaling"] = longrope(
            short.tolist(), long.tolist(), original,
            fields["max_position_embeddings"] / original, meta.raw("rope.scaling.attn_factor"))
    return extra


GGUF = {"phi3": GGUFFamily(
    "Phi3ForCausalLM",
    {**LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    config=_gguf_config, consumed=_FACTORS)}
