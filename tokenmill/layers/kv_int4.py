"""The int4 KV cache format: K quantized per channel over each block, V rotated and symmetric
per token. Measured on SmolLM2-135M (benchmarks/kv_quality.py --ablation): per-token keys lose
most (a few channels are large for every token, and a per-token scale set by them leaves the
others a level or two); per-channel keys hold them.

K, per (block, KV head), over the block's block_size tokens: each channel's range [lo, hi]
(shrunk by the first of KCLIP that gives the least squared error), lo stored as an int8 code of
the head's largest |lo| / 127 (rounded down, so the range only grows), the step s = (hi - lo)
/ 15 as a uint8 code of the head's largest step / 255 (rounded up); the tokens' 4-bit codes
q = round((k - lo) / s). Params of a (block, head): D int8 minimum codes, D uint8 step codes,
the fp16 minimum unit, the fp16 step unit: 2 D + 4 bytes. Codes: byte j of a row holds value j
(low nibble) and value j + D / 2 (high).

V, per token and KV head: rotated (x @ H, H the normalized Hadamard matrix: every direction
gets a share of the few large values), one fp16 scale s (the head's max |y| / 7.5, shrunk by
the first of VSHRINK that gives the least squared error), codes round(y / s + 7.5) in [0, 15],
read back as (q - 7.5) s. Attention rotates its output back (out @ H^T): softmax weights sum
rows, so the rotation commutes with them.
"""

from __future__ import annotations

import torch

from tokenmill.layers.kv_quant import _MIN_SCALE, _SCALE, KVFormat, rotation

KCLIP = (1.0, 0.9, 0.8, 0.7)
VSHRINK = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
_TINY = 2.0**-24  # the smallest fp16 subnormal: a unit that is never zero


def half_up(x: torch.Tensor) -> torch.Tensor:
    """x rounded to an fp16 value not below it (so a range divided by it fits its codes)."""
    h = x.to(_SCALE)
    up = torch.nextafter(h, torch.full_like(h, float("inf")))
    return torch.where(h.float() < x, up, h).float()


def pack(q: torch.Tensor) -> torch.Tensor:
    """(..., D) codes in [0, 15] -> (..., D / 2) bytes: value j low, value j + D / 2 high."""
    q = q.to(torch.uint8)
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat((packed & 0xF, packed >> 4), dim=-1).float()


class Int4Format(KVFormat):
    staged = True
    v_rotated = True
    # K's params (2 head_dim + 4 bytes per block and head) spread over 32 tokens: 70.1 bytes
    # per token and head at head_dim 64 (3.65x bf16) instead of 74.25 over 16 (3.45x); measured
    # perplexity +0.7 % / +1.6 % (prose / code) against +1.0 % / +1.0 % (kv_quality.py)
    default_block_size = 32

    def __init__(self) -> None:
        self.dtype, self.name = torch.uint8, "int4"
        self._rotations: dict = {}

    @property
    def quantized(self) -> bool:
        return True

    def part_specs(self, head_dim, kind="k"):
        if head_dim % 32:
            raise ValueError(f"int4 KV cache needs head_dim a multiple of 32, got {head_dim}")
        return [(head_dim // 2, torch.uint8)] + ([(1, _SCALE)] if kind == "v" else [])

    def block_specs(self, head_dim, kind="k"):
        return [(2 * head_dim + 4, torch.uint8)] if kind == "k" else []

    def rotation(self, head_dim: int, device: torch.device) -> torch.Tensor:
        key = (head_dim, str(device))
        if key not in self._rotations:
            self._rotations[key] = rotation(head_dim).to(device)
        return self._rotations[key]

    # ---- V: per token ---------------------------------------------------------------------
    def encode(self, x, kind="v"):
        if kind != "v":
            raise ValueError("int4 K is quantized per block: encode_blocks")
        y = x.float() @ self.rotation(x.shape[-1], x.device)
        amax = y.abs().amax(-1, keepdim=True)
        best = err = None
        for shrink in VSHRINK:
            s = (amax * shrink / 7.5).clamp(min=_MIN_SCALE).to(_SCALE).float()
            q = (y / s + 7.5).round().clamp(0, 15)
            e = ((q - 7.5) * s - y).double().square().sum(-1, keepdim=True)
            if best is None:
                best, err = (q, s), e
            else:
                take = e < err
                best = (torch.where(take, q, best[0]), torch.where(take, s, best[1]))
                err = torch.minimum(e, err)
        return pack(best[0]), best[1].to(_SCALE)

    def decode(self, parts, dtype, kind="v"):
        packed, scale = parts
        y = (unpack(packed) - 7.5) * scale.float()
        return (y @ self.rotation(y.shape[-1], y.device).T).to(dtype)

    # ---- K: per block ---------------------------------------------------------------------
    def encode_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (blocks, block_size, heads, D) -> codes (blocks, block_size, heads, D / 2) and
        params (blocks, heads, 2 D + 4) uint8."""
        y = x.float()
        amin, amax = y.amin(1, keepdim=True), y.amax(1, keepdim=True)
        lo = hi = err = None
        for c in KCLIP:
            lo_c, hi_c = amin * c, amax * c
            s = ((hi_c - lo_c) / 15).clamp(min=_MIN_SCALE)
            z = ((y - lo_c) / s).round().clamp(0, 15) * s + lo_c
            e = (z - y).double().square().sum(1, keepdim=True)
            if lo is None:
                lo, hi, err = lo_c, hi_c, e
            else:
                take = e < err
                lo, hi = torch.where(take, lo_c, lo), torch.where(take, hi_c, hi)
                err = torch.minimum(e, err)
        lo, hi = lo[:, 0], hi[:, 0]  # (blocks, heads, D)
        lunit = (lo.abs().amax(-1, keepdim=True) / 127).clamp(min=_TINY).to(_SCALE).float()
        lcode = torch.floor(lo / lunit).clamp(-128, 127)
        lo_q = lcode * lunit
        step = ((hi - lo_q) / 15).clamp(min=_MIN_SCALE)
        sunit = half_up(step.amax(-1, keepdim=True) / 255)
        scode = torch.ceil(step / sunit).clamp(1, 255)
        q = ((y - lo_q[:, None]) / (scode * sunit)[:, None]).round().clamp(0, 15)
        units = torch.cat((lunit, sunit), -1).to(_SCALE).view(torch.uint8)
        params = torch.cat((lcode.to(torch.int8).view(torch.uint8), scode.to(torch.uint8),
                            units), -1)
        return pack(q), params

    def decode_blocks(self, codes: torch.Tensor, params: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
        """codes (..., block_size, heads, D / 2), params (..., heads, 2 D + 4) -> K values."""
        d = codes.shape[-1] * 2
        lo, step = block_params(params, d)
        return (unpack(codes) * step[..., None, :, :] + lo[..., None, :, :]).to(dtype)


def block_params(params: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., heads, 2 D + 4) uint8 -> each channel's minimum and step, (..., heads, D)."""
    units = params[..., 2 * d:].contiguous().view(_SCALE).float()
    lo = params[..., :d].view(torch.int8).float() * units[..., :1]
    step = params[..., d:2 * d].float() * units[..., 1:]
    return lo, step
