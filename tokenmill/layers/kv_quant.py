"""How K and V are stored in the paged cache: plain floats, or quantized.

    format     element   extra                                       bytes per token and head
                                                                     (K + V) at head_dim 64
    float32    4 B       -                                           512
    bfloat16   2 B       -                                           256
    float16    2 B       -                                           256
    int8       1 B       fp16 scale per token and head               132  (symmetric)
    fp8_e4m3   1 B       fp16 scale per token and head               132  (amax scaled to 448)
    int4       0.5 B     K: per block and head, each channel's       74.25
                         minimum and scale (8-bit codes of two fp16
                         steps); V: fp16 scale per token and head

int8 and fp8 quantize each token's K and V per head. int4 quantizes K per channel over each
block of block_size tokens (KIVI: a few key channels are large for every token, which per-token
scales cannot hold) and V rotated (Hadamard), symmetric per token (layers/kv_int4.py). A
block's K rows wait in the model's dtype (the cache's stage) until the block is full, then the
block is quantized as a whole; attention reads a query's own block from the stage and every
earlier block quantized, so what a query sees does not depend on how the steps were cut.

A format turns (tokens, heads, head_dim) into a tuple of "parts", each shaped
(tokens, heads, width), which the cache stores side by side, and back; int4's K also has parts
per (block, head) (block_specs).
"""

from __future__ import annotations

import math

import torch

_SCALE = torch.float16
_MIN_SCALE = 2.0**-14  # smallest normal fp16: keeps scales representable


class KVFormat:
    name = "float"
    default_block_size = 16  # tokens per KV block when the user names none
    staged = False  # K rows wait in a stage until their block is full (int4)
    v_rotated = False  # V is stored rotated (see rotation()): the output is rotated back

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = str(dtype).replace("torch.", "")

    @property
    def quantized(self) -> bool:
        return False

    def part_specs(self, head_dim: int, kind: str = "k") -> list[tuple[int, torch.dtype]]:
        """(width, dtype) of each stored part for one (token, head) of K or V."""
        return [(head_dim, self.dtype)]

    def block_specs(self, head_dim: int, kind: str = "k") -> list[tuple[int, torch.dtype]]:
        """(width, dtype) of each part stored per (block, head)."""
        return []

    def bytes_per_token_head(self, head_dim: int, block_size: int | None = None) -> float:
        """K and V bytes of one token and KV head (per-block parts spread over the block;
        block_size None: this format's default)."""
        block_size = block_size or self.default_block_size
        return sum(sum(w * d.itemsize for w, d in self.part_specs(head_dim, kind))
                   + sum(w * d.itemsize for w, d in self.block_specs(head_dim, kind)) / block_size
                   for kind in ("k", "v"))

    def encode(self, x: torch.Tensor, kind: str = "k") -> tuple[torch.Tensor, ...]:
        return (x.to(self.dtype),)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype,
               kind: str = "k") -> torch.Tensor:
        return parts[0].to(dtype)


def _absmax_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    amax = x.abs().amax(-1, keepdim=True).float()  # (tokens, heads, 1)
    return (amax / qmax).clamp(min=_MIN_SCALE).to(_SCALE)


class Int8Format(KVFormat):
    def __init__(self) -> None:
        self.dtype, self.name = torch.int8, "int8"

    @property
    def quantized(self) -> bool:
        return True

    def part_specs(self, head_dim, kind="k"):
        return [(head_dim, torch.int8), (1, _SCALE)]

    def encode(self, x, kind="k"):
        scale = _absmax_scale(x, 127.0)
        q = (x.float() / scale.float()).round().clamp(-127, 127).to(torch.int8)
        return q, scale

    def decode(self, parts, dtype, kind="k"):
        q, scale = parts
        return (q.float() * scale.float()).to(dtype)


class Fp8Format(KVFormat):
    def __init__(self) -> None:
        self.dtype, self.name = torch.float8_e4m3fn, "fp8_e4m3"

    @property
    def quantized(self) -> bool:
        return True

    def part_specs(self, head_dim, kind="k"):
        return [(head_dim, torch.float8_e4m3fn), (1, _SCALE)]

    def encode(self, x, kind="k"):
        scale = _absmax_scale(x, 448.0)
        q = (x.float() / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, scale

    def decode(self, parts, dtype, kind="k"):
        q, scale = parts
        return (q.float() * scale.float()).to(dtype)


def rotation(head_dim: int) -> torch.Tensor:
    """A fixed orthogonal (head_dim, head_dim) matrix: the normalized Hadamard matrix when
    head_dim is a power of two, else a seeded random orthogonal one. Rotating K and q keeps
    every score (q H) . (k H) = q . k; rotating V rotates the attention output (rotated back
    by H^T); either spreads a few large channels over all of them."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(head_dim)
    g = torch.Generator().manual_seed(0)
    m = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    return torch.linalg.qr(m)[0].float()


def _int4() -> KVFormat:
    from tokenmill.layers.kv_int4 import Int4Format  # it builds on this module

    return Int4Format()


# The one registry of KV formats: config validation, the CLI and `kv-memory` list these names.
KV_FORMATS = {
    "float32": lambda: KVFormat(torch.float32),
    "bfloat16": lambda: KVFormat(torch.bfloat16),
    "float16": lambda: KVFormat(torch.float16),
    "fp8_e4m3": Fp8Format,
    "int8": Int8Format,
    "int4": _int4,
}


def kv_format(name: str | torch.dtype) -> KVFormat:
    if isinstance(name, torch.dtype):
        name = str(name).replace("torch.", "")
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_FORMATS)}; "
                         f"got {name!r}")
    return KV_FORMATS[name]()
