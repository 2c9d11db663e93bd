"""How K and V are stored in the paged cache: plain floats, or quantized per token and KV
head.

    format     element   per (token, head) extra     bytes/element at head_dim 64
    float32    4 B       -                           4
    bfloat16   2 B       -                           2
    float16    2 B       -                           2
    int8       1 B       fp16 scale                  1.03   (symmetric, round to nearest)
    fp8_e4m3   1 B       fp16 scale                  1.03   (amax scaled to 448)
    int4       0.5 B     fp16 scale + minimum per 16 0.75   (rotated, asymmetric, clipped)

A format turns (tokens, heads, head_dim) into a tuple of "parts", each shaped
(tokens, heads, width), which the cache stores side by side, and back.
"""

from __future__ import annotations

import math

import torch

_SCALE = torch.float16
_MIN_SCALE = 2.0**-14  # smallest normal fp16: keeps scales representable


class KVFormat:
    name = "float"
    rotated = False  # whether K and V are stored rotated (see rotation())

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


def rotation(head_dim: int) -> torch.Tensor:
    """A fixed orthogonal (head_dim, head_dim) matrix: the normalized Hadamard matrix when
    head_dim is a power of two, else a seeded random orthogonal one. Rotating K (and Q) keeps
    every score (q H) . (k H) = q . k and spreads a few large channels over all of them."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h / math.sqrt(head_dim)
    g = torch.Generator().manual_seed(0)
    m = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    return torch.linalg.qr(m)[0].float()


class Int4Format(KVFormat):
    """Rotated (see rotation), then asymmetric 4-bit per group of 16 values with an fp16 scale
    and minimum each, the range clipped where that lowers the group's squared error. Codes:
    byte j holds value j (low nibble) and value j + head_dim / 2 (high nibble). Measured on
    SmolLM2-135M (benchmarks/kv_quality.py): +12.5 % perplexity with one unrotated group per
    head, +1.6 % / +2.1 % (prose / code) like this."""

    GROUP = 16
    CLIP = (1.0, 0.95, 0.9, 0.85, 0.8)  # candidate shrinks of the group's min and max
    rotated = True

    def __init__(self) -> None:
        self.dtype, self.name = torch.uint8, "int4"
        self._rotations: dict[int, torch.Tensor] = {}

    @property
    def quantized(self) -> bool:
        return True

    def part_specs(self, head_dim):
        if head_dim % (2 * self.GROUP):
            raise ValueError(f"int4 KV cache needs head_dim a multiple of {2 * self.GROUP}, "
                             f"got {head_dim}")
        groups = head_dim // self.GROUP
        return [(head_dim // 2, torch.uint8), (groups, _SCALE), (groups, _SCALE)]

    def rotation(self, head_dim: int, device: torch.device) -> torch.Tensor:
        key = (head_dim, str(device))
        if key not in self._rotations:
            self._rotations[key] = rotation(head_dim).to(device)
        return self._rotations[key]

    def encode(self, x):
        d = x.shape[-1]
        g = (x.float() @ self.rotation(d, x.device)).unflatten(-1, (d // self.GROUP, self.GROUP))
        g = g[..., None, :]  # (..., groups, 1, GROUP): every clip candidate at once
        clip = torch.tensor(self.CLIP, device=x.device)
        a, b = torch.meshgrid(clip, clip, indexing="ij")
        lo = (g.amin(-1, keepdim=True) * a.reshape(-1, 1)).to(_SCALE).float()
        hi = g.amax(-1, keepdim=True) * b.reshape(-1, 1)
        scale = ((hi - lo) / 15.0).clamp(min=_MIN_SCALE).to(_SCALE).float()
        q = ((g - lo) / scale).round_().clamp_(0, 15)
        err = (q * scale + lo - g).square_().sum(-1)  # (..., groups, candidates)
        best = err.argmin(-1)[..., None, None]  # the first of equal errors: the widest range
        pick = lambda t: t.gather(-2, best.expand(*best.shape[:-1], t.shape[-1]))[..., 0, :]  # noqa: E731
        q = pick(q).flatten(-2).to(torch.uint8)
        packed = q[..., : d // 2] | (q[..., d // 2:] << 4)
        return packed, pick(scale)[..., 0].to(_SCALE), pick(lo)[..., 0].to(_SCALE)

    def decode(self, parts, dtype):
        packed, scale, lo = parts
        q = torch.cat((packed & 0xF, packed >> 4), dim=-1).float()  # (.., head_dim)
        d = q.shape[-1]
        x = q.unflatten(-1, (d // self.GROUP, self.GROUP)) * scale.float()[..., None] \
            + lo.float()[..., None]
        return (x.flatten(-2) @ self.rotation(d, q.device).T).to(dtype)


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
