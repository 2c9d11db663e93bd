"""Test helper: write small GGUF files the way llama.cpp's converter does (HF names -> GGUF
names, Q/K rows permuted for `llama`, chosen tensor types)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
# where each K-quant block keeps its fp16 scale(s): random bytes there could be inf/NaN
_K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


# each family's names where they differ from the Llama ones
FAMILY_NAMES = {
    "qwen3": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"},
    "gemma3": {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{FAMILY_NAMES.get(arch, {}).get(module) or _LAYER[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp's interleaved rows (its convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator,
                  scales: tuple[float, float] = (1e-4, 2e-3)) -> np.ndarray:
    """Random but finite quantized bytes: (rows, bytes per row) uint8, the float16 scales drawn
    from `scales`."""
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _K_SCALES[qtype]:
        scale = rng.uniform(*scales, size=(rows, cols // block)).astype(np.float16)
        data[:, :, offset:offset + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def encode(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype in _K_SCALES:  # gguf-py cannot quantize K types: use random valid blocks
        return random_blocks_like(values, qtype, rng)
    return quantize(values.astype(np.float32), qtype)


def random_blocks_like(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random valid K-quant blocks whose dequantized weights spread as `values` do. With fixed
    scale ranges the K types' weights ran 7-15x the model's own (Q4_K's 6-bit scales times 4-bit
    codes reached ~1 against ~0.02), and a tiny random model compounded that into logit errors
    that depended on each build's roundings (the scalar build moved one test's logits 9.4%)."""
    data = random_blocks(qtype, values.shape[0], values.shape[1], rng)
    factor = float(values.std()) / float(dequantize(data, qtype).std())
    block = data.reshape(values.shape[0], -1, GGML_QUANT_SIZES[qtype][1])
    for offset in _K_SCALES[qtype]:  # the fp16 super-block scales (d, and dmin where there is one)
        scale = block[:, :, offset:offset + 2].copy().view(np.float16)
        block[:, :, offset:offset + 2] = (scale * factor).astype(np.float16).view(np.uint8)
    return data


def write_gguf(path: Path, arch: str, cfg, state: dict[str, torch.Tensor],
               types: dict[str, Q] | None = None, seed: int = 0, extra=None) -> None:
    """cfg: a transformers config. types: GGUF tensor-name suffix (e.g. 'attn_q.weight') -> type;
    unlisted tensors are F32. extra(writer): adds the family's own keys and tensors. Gemma 3's
    norm weights are stored as 1 + w, as llama.cpp's converter does."""
    rng = np.random.default_rng(seed)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    rope = rope.get("full_attention", rope)
    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if extra is not None:
        extra(w)
    for hf, tensor in state.items():
        name, values = gguf_name(hf, arch), tensor.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            values = values + 1
        if arch == "llama" and name.endswith("attn_q.weight"):
            values = llama_cpp_permute(values, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            values = llama_cpp_permute(values, cfg.num_key_value_heads)
        qtype = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, encode(values, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
