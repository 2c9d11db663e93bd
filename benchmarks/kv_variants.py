"""The int4 KV variants benchmarks/kv_quality.py --ablation compares (quality only: each stores
its values quantized and dequantized again, in float32, so no kernel is involved). The final
format, layers/kv_int4.py (K per channel over each block, kept in the stage until the block is
full; V rotated, symmetric), is the int4 row of kv_quality's main table. Bytes per value are
for head_dim 64 (K and V averaged); 3.5x bf16's capacity needs <= 0.571.

Also here: K and V apart (the other kept in float32), which shows where the loss is, and
KIVI-style keys quantized per channel over each 16-token block. The scoring stores chunks of
16 from position 0, so a stored chunk is one cache block, quantized before its own queries
read it: harsher than the engine, whose queries read their own block from the stage."""

from __future__ import annotations

import torch

from tokenmill.layers.kv_int4 import Int4Format
from tokenmill.layers.kv_quant import _MIN_SCALE, _SCALE, KVFormat, rotation


def fake_quant(x: torch.Tensor, group: int, bits: int, rotate: bool) -> torch.Tensor:
    """Asymmetric round-to-nearest per `group` values (fp16 scale and minimum), optionally in
    the rotated basis; the values it gives back."""
    d = x.shape[-1]
    r = rotation(d).to(x.device) if rotate else None
    y = x.float() @ r if rotate else x.float()
    g = y.unflatten(-1, (d // group, group))
    top = (1 << bits) - 1
    lo = g.amin(-1, keepdim=True).to(_SCALE).float()
    scale = ((g.amax(-1, keepdim=True) - lo) / top).clamp(min=_MIN_SCALE).to(_SCALE).float()
    y = (((g - lo) / scale).round().clamp(0, top) * scale + lo).flatten(-2)
    return y @ r.T if rotate else y


class Simulated(KVFormat):
    """Stores fn(x) in float32: K and V through their own functions."""

    def __init__(self, k_fn, v_fn) -> None:
        self.dtype, self.name, self.k_fn, self.v_fn = torch.float32, "sim", k_fn, v_fn

    @property
    def quantized(self) -> bool:
        return True

    def encode(self, x, kind="k"):
        return ((self.k_fn if kind == "k" else self.v_fn)(x).float(),)


def symmetric(x: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Rotated, symmetric round-to-nearest per `group` values (2**bits levels, no zero level,
    one fp16 scale), the scale shrunk where that lowers the group's squared error."""
    d, n = x.shape[-1], 1 << bits
    r = rotation(d).to(x.device)
    g = (x.float() @ r).unflatten(-1, (d // group, group))[..., None, :]
    shrink = torch.tensor([1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6])[:, None]
    scale = (g.abs().amax(-1, keepdim=True) * shrink / ((n - 1) / 2)).clamp(min=_MIN_SCALE)
    scale = scale.to(_SCALE).float()
    y = (((g / scale) + (n - 1) / 2).round().clamp(0, n - 1) - (n - 1) / 2) * scale
    best = (y - g).square().sum(-1).argmin(-1)[..., None, None]
    y = y.gather(-2, best.expand(*best.shape[:-1], group))[..., 0, :]
    return y.flatten(-2) @ r.T


def per_channel(x: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Asymmetric per channel over the stored tokens (one 16-token block), fp16 scale and
    minimum per channel, the range shrunk where that lowers the channel's squared error."""
    n, y, best, err = (1 << bits) - 1, x.float(), None, None
    for c in (1.0, 0.9, 0.8, 0.7):
        lo = (y.amin(0, keepdim=True) * c).to(_SCALE).float()
        s = ((y.amax(0, keepdim=True) * c - lo) / n).clamp(min=_MIN_SCALE).to(_SCALE).float()
        z = ((y - lo) / s).round().clamp(0, n) * s + lo
        e = (z - y).square().sum(0, keepdim=True)
        best, err = (z, e) if best is None else (torch.where(e < err, z, best),
                                                 torch.minimum(e, err))
    return best


def previous_int4(x: torch.Tensor) -> torch.Tensor:
    """The int4 format before the per-channel keys (6 bits a value): rotated, asymmetric per
    group of 16 with an fp16 scale and minimum, each group's (min, max) shrunk by the pair of
    (1, .95, .9, .85, .8) that gives the least squared error."""
    d = x.shape[-1]
    r = rotation(d).to(x.device)
    g = (x.float() @ r).unflatten(-1, (d // 16, 16))[..., None, :]
    clip = torch.tensor((1.0, 0.95, 0.9, 0.85, 0.8))
    a, b = torch.meshgrid(clip, clip, indexing="ij")
    lo = (g.amin(-1, keepdim=True) * a.reshape(-1, 1)).to(_SCALE).float()
    hi = g.amax(-1, keepdim=True) * b.reshape(-1, 1)
    scale = ((hi - lo) / 15.0).clamp(min=_MIN_SCALE).to(_SCALE).float()
    y = ((g - lo) / scale).round().clamp(0, 15) * scale + lo
    best = (y - g).square().sum(-1).argmin(-1)[..., None, None]
    y = y.gather(-2, best.expand(*best.shape[:-1], 16))[..., 0, :]
    return y.flatten(-2) @ r.T


def final_v(x: torch.Tensor) -> torch.Tensor:
    """int4 V as layers/kv_int4.py stores it."""
    return _final.decode(_final.encode(x, "v"), torch.float32, "v")


def final_k(x: torch.Tensor) -> torch.Tensor:
    """int4 K as layers/kv_int4.py quantizes a full block (x: one block's tokens)."""
    return _final.decode_blocks(*_final.encode_blocks(x[None]), torch.float32)[0]


def _sim(group, bits, rotate, k=None):
    v_fn = lambda x: fake_quant(x, group, bits, rotate)  # noqa: E731
    return lambda: Simulated(k or v_fn, v_fn)


def _kv(k_fn, v_fn):
    return lambda: Simulated(k_fn, v_fn)


_float = lambda x: x.float()  # noqa: E731
_final = Int4Format()
_int8 = lambda x: fake_quant(x, 64, 8, False)  # noqa: E731

# name -> (format factory, bytes per value at head_dim 64)
VARIANTS = {
    "int4 per head (the old format)": (_sim(64, 4, False), 0.5625),
    "int4 groups of 16": (_sim(16, 4, False), 0.75),
    "int4 rotated, per head": (_sim(64, 4, True), 0.5625),
    "int4 rotated, groups of 32": (_sim(32, 4, True), 0.625),
    "int4 rotated, groups of 16": (_sim(16, 4, True), 0.75),
    "int4 rotated, 16, clipped (previous)": (_kv(previous_int4, previous_int4), 0.75),
    "K int8 / V int4 previous": (lambda: Simulated(_int8, previous_int4), (1.03 + 0.75) / 2),
    "int4 rotated, 32, symmetric clipped": (_kv(*[lambda x: symmetric(x, 32, 4)] * 2), 0.5625),
    "K previous, V float": (_kv(previous_int4, _float), (0.75 + 4) / 2),
    "K float, V previous": (_kv(_float, previous_int4), (4 + 0.75) / 2),
    "K rot. sym 32, V float": (_kv(lambda x: symmetric(x, 32, 4), _float), (0.5625 + 4) / 2),
    "K float, V rot. sym 32": (_kv(_float, lambda x: symmetric(x, 32, 4)), (4 + 0.5625) / 2),
    "K float, V rot. sym 64": (_kv(_float, lambda x: symmetric(x, 64, 4)), (4 + 0.53125) / 2),
    "K float, V int3 sym 32": (_kv(_float, lambda x: symmetric(x, 32, 3)), (4 + 0.4375) / 2),
    "K per-channel/16 tok, V float": (_kv(per_channel, _float), (4 + 0.75) / 2),
    "K per-channel, V rot. sym 64": (_kv(per_channel, lambda x: symmetric(x, 64, 4)),
                                     (0.75 + 0.53125) / 2),
    "final K (own block quantized too)": (_kv(final_k, _float), (0.629 + 4) / 2),
    "final V": (_kv(_float, final_v), (4 + 0.53125) / 2),
    "final K and V (own block quantized)": (_kv(final_k, final_v), (0.629 + 0.53125) / 2),
    "int3 rotated, groups of 32": (_sim(32, 3, True), 0.5),
    "int2 rotated, groups of 16": (_sim(16, 2, True), 0.5),
}
