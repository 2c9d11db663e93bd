"""How K and V are stored in the paged cache: plain floats, or quantized with one scale per
token per KV head (group size = head_dim).

    format     element   per (token, head) extra     bytes/element at head_dim 64
    float32    4 B       -                           4
    bfloat16   2 B       -                           2
    float16    2 B       -                           2
    int8       1 B       fp16 scale                  1.03   (symmetric, round to nearest)
    fp8_e4m3   1 B       fp16 scale                  1.03   (amax scaled to 448)
    int4       0.5 B     fp16 scale + fp16 minimum   0.56   (asymmetric, two per byte)

A format turns (tokens, heads, head_dim) into a tuple of "parts", each shaped
(tokens, heads, width), which the cache stores side by side, and back.
"""

from __future__ import annotations

import torch

_SCALE = torch.float16
_MIN_SCALE = 2.0**-14  # smallest normal fp16: keeps scales representable


class KVFormat:
    name = "float"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = str(dtype).replace("torch.", "")

    @property
    def quantized(self) -> bool:
        return False

    def part_specs(self, head_dim: int) -> list[tuple[int, torch.dtype]]:
        """(width, dtype) of each stored part for one (token, head)."""
        return [(head_dim, self.dtype)]

    def bytes_per_head(self, head_dim: int) -> int:
        return sum(w * d.itemsize for w, d in self.part_specs(head_dim))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.to(self.dtype),)

    def decode(self, parts: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
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

    def part_specs(self, head_dim):
        return [(head_dim, torch.int8), (1, _SCALE)]

    def encode(self, x):
        scale = _absmax_scale(x, 127.0)
        q = (x.float() / scale.float()).round().clamp(-127, 127).to(torch.int8)
        return q, scale

    def decode(self, parts, dtype):
        q, scale = parts
        return (q.float() * scale.float()).to(dtype)


class Fp8Format(KVFormat):
    def __init__(self) -> None:
        self.dtype, self.name = torch.float8_e4m3fn, "fp8_e4m3"

    @property
    def quantized(self) -> bool:
        return True

    def part_specs(self, head_dim):
        return [(head_dim, torch.float8_e4m3fn), (1, _SCALE)]

    def encode(self, x):
        scale = _absmax_scale(x, 448.0)
        q = (x.float() / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q, scale

    def decode(self, parts, dtype):
        q, scale = parts
        return (q.float() * scale.float()).to(dtype)


class Int4Format(KVFormat):
    def __init__(self) -> None:
        self.dtype, self.name = torch.uint8, "int4"

    @property
    def quantized(self) -> bool:
        return True

    def part_specs(self, head_dim):
        if head_dim % 2:
            raise ValueError(f"int4 KV cache needs an even head_dim, got {head_dim}")
        return [(head_dim // 2, torch.uint8), (1, _SCALE), (1, _SCALE)]

    def encode(self, x):
        x = x.float()
        lo = x.amin(-1, keepdim=True)
        scale = ((x.amax(-1, keepdim=True) - lo) / 15.0).clamp(min=_MIN_SCALE).to(_SCALE)
        lo = lo.to(_SCALE)
        q = ((x - lo.float()) / scale.float()).round().clamp(0, 15).to(torch.uint8)
        packed = q[..., 0::2] | (q[..., 1::2] << 4)  # two 4-bit values per byte
        return packed, scale, lo

    def decode(self, parts, dtype):
        packed, scale, lo = parts
        q = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # (.., head_dim)
        return (q.float() * scale.float() + lo.float()).to(dtype)


# The one registry of KV formats: config validation, the CLI and `kv-memory` list these names.
KV_FORMATS = {
    "float32": lambda: KVFormat(torch.float32),
    "bfloat16": lambda: KVFormat(torch.bfloat16),
    "float16": lambda: KVFormat(torch.float16),
    "fp8_e4m3": Fp8Format,
    "int8": Int8Format,
    "int4": Int4Format,
}


def kv_format(name: str | torch.dtype) -> KVFormat:
    if isinstance(name, torch.dtype):
        name = str(name).replace("torch.", "")
    if name not in KV_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_FORMATS)}; "
                         f"got {name!r}")
    return KV_FORMATS[name]()
