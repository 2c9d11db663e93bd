"""Rotary position embeddings (RoPE), "rotate half" layout as in Hugging Face Llama.

cos/sin for every position up to max_positions are computed once in float32; a step gathers the
rows of its token positions. Supports the default, linear and Llama-3 frequency scalings, and
GGUF's per-frequency divisors (rope_freqs).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.layers import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)  # (head_dim/2,)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":  # GGUF's rope_freqs: one divisor per frequency (llama.cpp)
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors, expected "
                             f"{inv_freq.numel()} (head_dim / 2)")
        return inv_freq / factors
    raise ValueError(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self.ops = ops.current()
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        # on the CPU even while the model is built on the meta device (where these ops run
        # PyTorch's Python decompositions, whose first use imported ~1 s of sympy)
        inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.int64, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # (positions, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (positions, head_dim)
        return torch.stack((emb.cos(), emb.sin()))  # (2, positions, head_dim)

    def reset_buffers(self) -> None:
        """Recompute the table after the module was materialized from the meta device."""
        self.cos_sin = self._table().to(self.cos_sin.device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (tokens, heads, head_dim), k: (tokens, kv_heads, head_dim), positions: (tokens,)
        return self.ops.rope(q, k, self.cos_sin, positions)
