"""The int4 KV variants benchmarks/kv_quality.py --ablation compares (quality only: each stores
its values quantized and dequantized again, in float32, so no kernel is involved). The final
format is layers/kv_quant.py's Int4Format (rotated, groups of 16, clipped)."""

from __future__ import annotations

import torch

from tokenmill.layers.kv_quant import _MIN_SCALE, _SCALE, Int4Format, KVFormat, rotation


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

    rotated = False

    def __init__(self, k_fn, v_fn) -> None:
        self.dtype, self.name, self.k_fn, self.v_fn, self._calls = torch.float32, "sim", k_fn, \
            v_fn, 0

    @property
    def quantized(self) -> bool:
        return True

    def encode(self, x):  # KVCache.store encodes K, then V, for every layer
        fn = self.k_fn if self._calls % 2 == 0 else self.v_fn
        self._calls += 1
        return (fn(x).float(),)


def _sim(group, bits, rotate, k=None):
    v_fn = lambda x: fake_quant(x, group, bits, rotate)  # noqa: E731
    return lambda: Simulated(k or v_fn, v_fn)


_final = Int4Format()
_final_fn = lambda x: _final.decode(_final.encode(x), torch.float32)  # noqa: E731
_int8 = lambda x: fake_quant(x, 64, 8, False)  # noqa: E731

# name -> (format factory, bytes per value at head_dim 64)
VARIANTS = {
    "int4 per head (the old format)": (_sim(64, 4, False), 0.5625),
    "int4 groups of 16": (_sim(16, 4, False), 0.75),
    "int4 rotated, per head": (_sim(64, 4, True), 0.5625),
    "int4 rotated, groups of 32": (_sim(32, 4, True), 0.625),
    "int4 rotated, groups of 16": (_sim(16, 4, True), 0.75),
    "int4 rotated, 16, clipped (final)": (lambda: Simulated(_final_fn, _final_fn), 0.75),
    "K int8 / V int4 final": (lambda: Simulated(_int8, _final_fn), (1.03 + 0.75) / 2),
    "int3 rotated, groups of 32": (_sim(32, 3, True), 0.5),
    "int2 rotated, groups of 16": (_sim(16, 2, True), 0.5),
}
