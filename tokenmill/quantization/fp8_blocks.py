"""DeepSeek's FP8 checkpoints (quant_method "fp8", as DeepSeek-V3/R1 are published): each
linear weight in float8 e4m3 with one float32 scale per block of weight_block_size (128 x 128)
in `weight_scale_inv`, w = fp8 x scale. Dequantized at load to the model's dtype: tokenmill has
no FP8 GEMM; the block scales are exact, so the float weight is the checkpoint's own."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class FP8Blocks:
    parts = ("weight", "weight_scale_inv")
    required = parts

    def __init__(self, qcfg: dict) -> None:
        fmt = str(qcfg.get("fmt", "e4m3")).lower()
        if fmt != "e4m3" or qcfg.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"fp8 checkpoint with fmt {fmt!r} and activation_scheme "
                             f"{qcfg.get('activation_scheme')!r} is not supported; supported: "
                             "e4m3 weights with block scales, dynamic activations")
        self.block = tuple(qcfg.get("weight_block_size") or (128, 128))

    def convert(self, prefix: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
        w, s = t["weight"], t["weight_scale_inv"].float()
        (n, k), (bn, bk) = w.shape, self.block
        if s.shape != (-(-n // bn), -(-k // bk)):
            raise ValueError(f"{prefix}: weight_scale_inv {tuple(s.shape)} does not match a "
                             f"({n}, {k}) weight in blocks of {bn} x {bk}")
        scale = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return w.float() * scale
