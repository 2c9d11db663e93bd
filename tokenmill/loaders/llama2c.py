"""llama2.c legacy checkpoints (`run.c`'s .bin format) loaded into the Llama model.

Layout: a header of 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
vocab_size, seq_len; a negative vocab_size means the classifier is not shared with the
embedding), then float32 arrays in this order: token_embedding, rms_att, wq, wk, wv, wo, rms_ffn,
w1, w2, w3, rms_final, freq_cis_real, freq_cis_imag, and wcls when unshared. Weights are stored
as (out, in) like nn.Linear; Q/K rows are in the interleaved RoPE order and get reordered.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenmill.loaders import build_model, resolve_dtype
from tokenmill.loaders.permute import unpermute_rope_rows
from tokenmill.models.config import ModelConfig

HEADER = struct.Struct("<7i")
NEW_FORMAT_MAGIC = 0x616B3432  # "ak42": llama2.c's versioned export, not the legacy layout


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int  # negative: unshared classifier
    seq_len: int

    @property
    def shared_classifier(self) -> bool:
        return self.vocab_size > 0

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every float32 array in file order."""
        d, h, n, v = self.dim, self.hidden_dim, self.n_layers, abs(self.vocab_size)
        kv = d // self.n_heads * self.n_kv_heads
        half_head = d // self.n_heads // 2
        out = [("token_embedding", (v, d)), ("rms_att", (n, d)), ("wq", (n, d, d)),
               ("wk", (n, kv, d)), ("wv", (n, kv, d)), ("wo", (n, d, d)), ("rms_ffn", (n, d)),
               ("w1", (n, h, d)), ("w2", (n, d, h)), ("w3", (n, h, d)), ("rms_final", (d,)),
               ("freq_cis_real", (self.seq_len, half_head)),
               ("freq_cis_imag", (self.seq_len, half_head))]
        return out if self.shared_classifier else out + [("wcls", (v, d))]

    @property
    def file_size(self) -> int:
        return HEADER.size + 4 * sum(math.prod(shape) for _, shape in self.arrays())

    def validate(self, path: str) -> None:
        sizes = (self.dim, self.hidden_dim, self.n_layers, self.n_heads, self.n_kv_heads,
                 abs(self.vocab_size), self.seq_len)
        if min(sizes) <= 0 or self.dim % self.n_heads or self.n_heads % self.n_kv_heads or (
                self.dim // self.n_heads) % 2:
            raise ValueError(f"{path!r} is not a llama2.c checkpoint (implausible header: "
                             f"{', '.join(f'{k}={v}' for k, v in vars(self).items())})")


def read_header(path: str) -> Llama2cHeader:
    with open(path, "rb") as f:
        raw = f.read(HEADER.size)
    if len(raw) < HEADER.size:
        raise ValueError(f"{path!r} is too short to be a llama2.c checkpoint")
    values = HEADER.unpack(raw)
    if values[0] == NEW_FORMAT_MAGIC:
        raise ValueError(f"{path!r} uses llama2.c's versioned export format; only the legacy "
                         "format (export.py --version 0) is supported")
    header = Llama2cHeader(*values)
    header.validate(path)
    return header


def is_llama2c_checkpoint(path: str) -> bool:
    """True when the header is plausible and the file has exactly the size it implies."""
    try:
        return read_header(path).file_size == os.path.getsize(path)
    except ValueError:
        return False


def llama2c_config(h: Llama2cHeader) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=abs(h.vocab_size), hidden_size=h.dim,
        intermediate_size=h.hidden_dim, num_hidden_layers=h.n_layers,
        num_attention_heads=h.n_heads, num_key_value_heads=h.n_kv_heads,
        head_dim=h.dim // h.n_heads, max_position_embeddings=h.seq_len,
        rms_norm_eps=1e-5, rope_theta=10000.0,  # fixed in run.c
        tie_word_embeddings=h.shared_classifier, torch_dtype="float32",
        bos_token_id=1, eos_token_ids=[2],
    )


# llama2.c array -> Hugging Face parameter name ("{}" = layer index) for per-layer arrays.
_LAYER_NAMES = {
    "rms_att": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "rms_ffn": "post_attention_layernorm.weight",
    "w1": "mlp.gate_proj.weight", "w2": "mlp.down_proj.weight", "w3": "mlp.up_proj.weight",
}
_GLOBAL_NAMES = {"token_embedding": "model.embed_tokens.weight",
                 "rms_final": "model.norm.weight", "wcls": "lm_head.weight"}


def llama2c_weights(path: str, h: Llama2cHeader) -> Iterator[tuple[str, torch.Tensor]]:
    data = np.memmap(path, dtype="<f4", mode="r", offset=HEADER.size)
    offset = 0
    for name, shape in h.arrays():
        count = math.prod(shape)
        array = torch.from_numpy(np.array(data[offset:offset + count]).reshape(shape))
        offset += count
        if name in _GLOBAL_NAMES:
            yield _GLOBAL_NAMES[name], array
        elif name in _LAYER_NAMES:
            for layer in range(h.n_layers):
                yield f"model.layers.{layer}.{_LAYER_NAMES[name]}", _fix_rope(name, array[layer], h)


def _fix_rope(name: str, weight: torch.Tensor, h: Llama2cHeader) -> torch.Tensor:
    if name == "wq":
        return unpermute_rope_rows(weight, h.n_heads)
    if name == "wk":
        return unpermute_rope_rows(weight, h.n_kv_heads)
    return weight


def load_llama2c(path: str, dtype: str, device: torch.device,
                 max_positions: int | None) -> tuple[nn.Module, ModelConfig, torch.dtype]:
    h = read_header(path)
    size = os.path.getsize(path)
    if size != h.file_size:
        raise ValueError(f"{path!r} is not a valid llama2.c checkpoint: its header implies "
                         f"{h.file_size} bytes, the file has {size}")
    cfg = llama2c_config(h)
    torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)
    model = build_model(cfg, torch_dtype, device, max_positions or cfg.max_position_embeddings)
    model.load_weights(llama2c_weights(path, h))
    return model, cfg, torch_dtype
