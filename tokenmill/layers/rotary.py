"""Rotary position embeddings (RoPE), "rotate half" layout as in Hugging Face Llama.

cos/sin of a position are computed once in float32, one column per frequency (rotate-half
uses each twice: a table of rotary_dim columns held every value twice), into a table of
max_positions rows whose memory the OS maps as rows are written: the first FILL_CHUNK
positions at once, later ones a chunk at a time as the engine's steps reach them (ensure();
the model runner calls it each step). Gemma-3's two tables at 32,768 positions took 128 MiB;
a conversation of 4,096 tokens now makes 8 MiB of them resident.
Supports the default, linear and Llama-3 frequency scalings, GGUF's per-frequency divisors
(rope_freqs), Phi-3's LongRoPE, and partial rotary embeddings (RoPE on each head's first
rotary_dim dims only, the rest passed through: Phi-4-mini).

LongRoPE divides each frequency by a factor from one of two sets and scales cos/sin by an
attention factor. The set is chosen once, for the table: the long factors when the table
(the engine's max_model_len) reaches past original_max_position_embeddings, else the short
ones, as llama.cpp does for its context size. transformers instead switches per forward
call by the sequence's length (recomputing the whole cache when it crosses over), so the two
agree on every sequence when max_model_len is within the original length, and beyond it on
sequences longer than the original length.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.layers import ops

FILL_CHUNK = 4096  # positions of the table computed at a time
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "longrope", "yarn")


def _rope_type(scaling: dict | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_inv_freq(dim: int, base: float, scaling: dict | None,
                  max_positions: int | None = None) -> torch.Tensor:
    """Inverse frequencies of the dim rotated dims of a head (dim/2,); max_positions (the
    table's length) picks LongRoPE's factor set."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (base**exponents)  # (dim/2,)
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":  # GGUF's rope_freqs: one divisor per frequency (llama.cpp)
        return _divided(inv_freq, scaling["factors"], "rope_freqs")
    if rope_type == "longrope":
        long = (max_positions or 0) > scaling["original_max_position_embeddings"]
        key = "long_factor" if long else "short_factor"
        return _divided(inv_freq, scaling[key], f"LongRoPE {key}")
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, dim, base, scaling)
    raise ValueError(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) low frequencies, extrapolated (kept) high ones,
    a linear ramp between the dims that turn beta_fast and beta_slow times over the original
    length (transformers' and DeepSeek's formula)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    dims = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = (dims - low) / ((high - low) or 0.001)
    extrapolate = 1 - ramp.clamp(0, 1)
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos/sin are multiplied by: LongRoPE's attention factor (given, or the paper's
    sqrt(1 + ln(factor) / ln(original length)) for factor = max / original length), YaRN's
    (given, or mscale(factor, mscale) / mscale(factor, mscale_all_dim)), else 1."""
    if _rope_type(scaling) == "yarn":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
        if m and m_all:
            return yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
        return yarn_mscale(factor)
    if _rope_type(scaling) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _divided(inv_freq: torch.Tensor, factors, what: str) -> torch.Tensor:
    factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
    if factors.shape != inv_freq.shape:
        raise ValueError(f"{what} has {factors.numel()} factors, expected {inv_freq.numel()} "
                         f"(rotary dims / 2)")
    return inv_freq / factors


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
    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim  # the dims rotated (the table has half as many)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary dims {self.rotary_dim} must be even and at most the "
                             f"head dim {head_dim}")
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self.ops = ops.current()
        # on the CPU even while the model is built on the meta device (where these ops run
        # PyTorch's Python decompositions, whose first use imported ~1 s of sympy)
        self.inv_freq = rope_inv_freq(self.rotary_dim, base, scaling, max_positions)
        self.factor = rope_attention_factor(scaling)
        self.register_buffer("cos_sin", self._table("cpu"), persistent=False)

    def _table(self, device) -> torch.Tensor:
        """(2, max_positions, rotary_dim / 2): cos, sin; rows from self.filled on unwritten."""
        table = torch.empty(2, self.max_positions, self.rotary_dim // 2, device=device)
        self.filled = 0
        if table.device.type != "meta":
            self._fill(table, FILL_CHUNK)
        return table

    def reset_buffers(self) -> None:
        """A new table after the module was materialized from the meta device."""
        self.cos_sin = self._table(self.cos_sin.device)

    def ensure(self, positions: int) -> None:
        """Rows [0, positions) of the table computed (whole chunks of FILL_CHUNK)."""
        if positions > self.filled:
            self._fill(self.cos_sin, positions)

    def _fill(self, table: torch.Tensor, positions: int) -> None:
        # each chunk the same computation, wherever a table stops: a row's values do not
        # depend on how far the table was filled
        end = min(self.max_positions, -(-positions // FILL_CHUNK) * FILL_CHUNK)
        for start in range(self.filled, end, FILL_CHUNK):
            stop = min(start + FILL_CHUNK, self.max_positions)
            rows = torch.arange(start, stop, dtype=torch.int64, device="cpu").float()
            freqs = rows[:, None] * self.inv_freq[None, :]  # (rows, rotary_dim / 2)
            chunk = torch.stack((freqs.cos(), freqs.sin()))
            if self.factor != 1.0:
                chunk = chunk * self.factor
            table[:, start:stop] = chunk.to(table.device)
        self.filled = max(self.filled, end)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (tokens, heads, head_dim), k: (tokens, kv_heads, head_dim), positions: (tokens,)
        r = self.rotary_dim
        if r == self.head_dim:
            return self.ops.rope(q, k, self.cos_sin, positions)
        q_rot, k_rot = self.ops.rope(q[..., :r], k[..., :r], self.cos_sin, positions)
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
