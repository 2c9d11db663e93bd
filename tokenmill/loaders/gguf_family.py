"""What a model family tells the GGUF loader: its tensor names, how llama.cpp's converter
changed the tensors, and the metadata keys only it has.

Every family keeps its GGUFFamily next to its model code (tokenmill/models/<family>.py, in a
dict GGUF keyed by GGUF architecture name); loaders/gguf.py reads the keys all families share
and asks the family for the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenmill.loaders.gguf_file import GGUFFile, field_value

# GGUF per-layer tensor names most families share -> Hugging Face module paths
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class GGUFMeta:
    """One file's metadata as a family reads it: `{arch}.*` keys and small tensors."""

    def __init__(self, reader: GGUFFile, arch: str) -> None:
        self.reader, self.arch = reader, arch
        self.tensor_names = {t.name for t in reader.tensors}

    def raw(self, key: str, default: Any = None) -> Any:
        """`{arch}.key` as stored (a list stays a list)."""
        return field_value(self.reader, f"{self.arch}.{key}", default)

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.key` as one value: a per-layer array must hold one value for all layers."""
        value = self.raw(key, default)
        if isinstance(value, list) and len(set(value)) == 1:
            value = value[0]
        if value is None or isinstance(value, list):
            raise ValueError(f"GGUF metadata {self.arch}.{key} is missing or varies per layer")
        return value

    def tensor(self, name: str) -> torch.Tensor | None:
        """A small float32 tensor that is not a weight (e.g. rope_freqs.weight), or None."""
        t = next((t for t in self.reader.tensors if t.name == name), None)
        if t is None:
            return None
        if t.data.dtype != np.float32:
            raise ValueError(f"GGUF tensor {name!r} must be F32")
        return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))


@dataclass(frozen=True)
class GGUFFamily:
    architecture: str  # the Hugging Face class this GGUF architecture loads as
    layer_names: dict[str, str] = field(default_factory=lambda: dict(LAYER_NAMES))
    # llama.cpp's converter interleaved the Q/K rows (its non-NEOX RoPE): undo it at load
    permute_qk: bool = False
    # ModelConfig fields this family reads from its own metadata keys (on top of the shared
    # ones loaders/gguf.py reads), given the shared fields read so far
    config: Callable[[GGUFMeta, dict], dict] = lambda meta, fields: {}
    # tensors read into the config (by `config`), not weights
    consumed: tuple[str, ...] = ()
    # (Hugging Face name, float tensor) -> the tensor as the Hugging Face checkpoint has it,
    # where llama.cpp's converter changed more than names, layout and permutation
    to_hf: Callable[[str, torch.Tensor], torch.Tensor] | None = None
