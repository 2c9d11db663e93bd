"""Quantizing float weights at load, round to nearest (LLM(model, quantization=...)):

  int8       per output channel, symmetric: q = round(w / s) in [-127, 127], s = max |w| / 127
             (code q + 128, m = -128 s)
  int4       groups of 32 along k, asymmetric: q = round((w - lo) / s) in [0, 15],
             s = (hi - lo) / 15, m = lo
  int4-g128  the same with groups of 128 (each group's s, m repeated over its four blocks)
Scales are rounded to float16 first and the codes computed from the rounded scales, so the
dequantized weight is exactly d * code + m.
"""

from __future__ import annotations

import torch

from tokenmill.quantization import BLOCK, BlockQuant

METHODS = ("int8", "int4", "int4-g128")


def quantize(weight: torch.Tensor, method: str) -> BlockQuant:
    if method not in METHODS:
        raise ValueError(f"quantization {method!r} is not supported; supported: "
                         f"{', '.join(METHODS)} (and GGUF files keep their own)")
    w = weight.detach().float()
    n, k = w.shape
    group = k if method == "int8" else 128 if method == "int4-g128" else BLOCK
    if k % BLOCK or k % group:
        raise ValueError(f"{method} needs the input width ({k}) to be a multiple of {group}")
    g = w.reshape(n, k // group, group)
    if method == "int8":
        d = (g.abs().amax(-1) / 127).half()
        q = torch.round(g / _nonzero(d)[..., None]).clamp(-127, 127) + 128
        m = -128 * d.float()
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        d = ((hi - lo) / 15).half()
        m = lo.half().float()
        q = torch.round((g - m[..., None]) / _nonzero(d)[..., None]).clamp(0, 15)
    per_block = group // BLOCK
    d = d.repeat_interleave(per_block, dim=1)
    m = m.half().repeat_interleave(per_block, dim=1)
    return BlockQuant(q.to(torch.uint8).reshape(n, k), d, m, 8 if method == "int8" else 4)


def _nonzero(d: torch.Tensor) -> torch.Tensor:
    d = d.float()
    return torch.where(d == 0, torch.ones_like(d), d)
