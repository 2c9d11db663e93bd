"""Pre-quantized Hugging Face checkpoints, read in their published layouts into BlockQuant:

  AWQ (quant_method "awq", version "gemm"; 4 bits)
    qweight int32 (in, out / 8): 8 codes per int32 along the outputs, nibble i holding output
      column 8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros int32 (in / g, out / 8) alike;
      scales (in / g, out)                         w[o, i] = s * (q - z), group i // g
  GPTQ (quant_method "gptq", 4 or 8 bits, with or without desc_act)
    qweight int32 (in * bits / 32, out): codes along the inputs, value j at bits j * bits;
      qzeros int32 (groups, out * bits / 32) along the outputs; scales (groups, out);
      g_idx (in,) the group of each input   w[o, i] = s * (q - z'), z' = z + 1 for
      checkpoint_format "gptq" (v1, the stored zero is one less), z for "gptq_v2"
  compressed-tensors (format "pack-quantized" 4/8 bits or "int-quantized" 8 bits, symmetric
    int weights, strategy "group" or "channel")
    weight_packed int32 (out, in * bits / 32) along the inputs, stored as q + 2**(bits-1);
      weight_scale (out, in / g)              w[o, i] = s * (stored - 2**(bits-1))

Groups must be multiples of 32 inputs. An act-order checkpoint (GPTQ desc_act, whose g_idx is
not i // g) is sorted by group: the layer then permutes its input (Linear.input_perm). The
zero point's product -s * z is rounded to float16 (<= 2**-11 of it); everything else is exact.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenmill.quantization import BLOCK, BlockQuant
from tokenmill.quantization.fp8_blocks import FP8_DTYPES, FP8Blocks

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
SUPPORTED = "awq (gemm, 4 bits), gptq (4/8 bits), compressed-tensors (pack-quantized / " \
            "int-quantized, symmetric int 4/8 bits), fp8 (e4m3 with block scales, dequantized)"


def unpack(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None):
    """int32 words -> their 32 / bits codes along `dim` (0: rows, 1: columns), uint8."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    p = packed.to(torch.int32)
    if dim == 1:
        vals = (p[:, :, None] >> shifts) & ((1 << bits) - 1)  # (r, c, per)
        if order is not None:
            vals = vals[:, :, torch.argsort(torch.tensor(order))]
        return vals.reshape(p.shape[0], -1).to(torch.uint8)
    vals = (p[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # (r, per, c)
    return vals.reshape(-1, p.shape[1]).to(torch.uint8)


def block_quant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | float,
                groups: torch.Tensor, bits: int, perm: torch.Tensor | None = None) -> BlockQuant:
    """codes (out, in); scale and zero (out, n_groups); groups: the group of each block of 32
    (after perm)."""
    d = scale[:, groups].float()
    z = zero[:, groups].float() if isinstance(zero, torch.Tensor) else torch.full_like(d, zero)
    return BlockQuant(codes.contiguous(), d.half(), (-d * z).half(), 8 if bits > 4 else 4,
                      perm)


def block_groups(g_idx: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The group of each block of 32 inputs, and the input permutation that makes every block
    one group (None when the inputs are already in group order)."""
    k = g_idx.numel()
    if k % BLOCK:
        raise ValueError(f"{name}: {k} inputs is not a multiple of {BLOCK}")
    perm = None
    blocks = g_idx.reshape(-1, BLOCK)
    if not bool((blocks == blocks[:, :1]).all()):
        perm = torch.argsort(g_idx, stable=True)
        blocks = g_idx[perm].reshape(-1, BLOCK)
        if not bool((blocks == blocks[:, :1]).all()):
            raise ValueError(f"{name}: quantization groups are not multiples of {BLOCK} inputs")
    return blocks[:, 0].long(), perm


class Format:
    """One checkpoint layout: which tensor names make up a quantized linear, and how they
    become a BlockQuant."""

    parts: tuple[str, ...]
    required: tuple[str, ...]

    def __init__(self, qcfg: dict) -> None:
        self.qcfg = qcfg

    def convert(self, prefix: str, t: dict[str, torch.Tensor]) -> BlockQuant:
        raise NotImplementedError


class AWQ(Format):
    parts = required = ("qweight", "qzeros", "scales")

    def __init__(self, qcfg):
        super().__init__(qcfg)
        self.bits = qcfg.get("bits", qcfg.get("w_bit", 4))
        self.group = qcfg.get("group_size", qcfg.get("q_group_size", 128))
        version = str(qcfg.get("version", "gemm")).lower()
        if self.bits != 4 or version != "gemm":
            raise ValueError(f"AWQ {version} with {self.bits} bits is not supported; "
                             f"supported: {SUPPORTED}")

    def convert(self, prefix, t):
        q = unpack(t["qweight"], 4, 1, AWQ_ORDER)  # (in, out)
        z = unpack(t["qzeros"], 4, 1, AWQ_ORDER)  # (in / g, out)
        s = t["scales"]
        k, n = q.shape
        g = self.group if self.group > 0 else k
        if s.shape != (k // g, n) or z.shape != s.shape:
            raise ValueError(f"{prefix}: AWQ scales {tuple(s.shape)} / zeros {tuple(z.shape)} do "
                             f"not match qweight ({k}, {n}) with group size {g}")
        groups, _ = block_groups(torch.arange(k) // g, prefix)
        return block_quant(q.T, s.T, z.T, groups, 4)


class GPTQ(Format):
    parts, required = ("qweight", "qzeros", "scales", "g_idx"), ("qweight", "qzeros", "scales")

    def __init__(self, qcfg):
        super().__init__(qcfg)
        self.bits, self.group = qcfg.get("bits", 4), qcfg.get("group_size", 128)
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQ with {self.bits} bits is not supported; supported: "
                             f"{SUPPORTED}")
        self.v1 = qcfg.get("checkpoint_format", "gptq") != "gptq_v2"

    def convert(self, prefix, t):
        q = unpack(t["qweight"], self.bits, 0)  # (in, out)
        z = unpack(t["qzeros"], self.bits, 1).to(torch.int32) + int(self.v1)  # (groups, out)
        s = t["scales"]
        k, n = q.shape
        g_idx = t.get("g_idx")
        if g_idx is None:
            g_idx = torch.arange(k) // (self.group if self.group > 0 else k)
        if s.shape[1] != n or z.shape != s.shape or g_idx.shape != (k,) \
                or int(g_idx.max()) >= s.shape[0]:
            raise ValueError(f"{prefix}: GPTQ scales {tuple(s.shape)} / zeros {tuple(z.shape)} / "
                             f"g_idx {tuple(g_idx.shape)} do not match qweight ({k}, {n})")
        groups, perm = block_groups(g_idx, prefix)
        codes = q.T if perm is None else q.T[:, perm]
        return block_quant(codes, s.T, z.T, groups, self.bits, perm)


class CompressedTensors(Format):
    parts = ("weight_packed", "weight", "weight_scale", "weight_shape", "weight_zero_point",
             "weight_g_idx")
    required = ("weight_scale",)

    def __init__(self, qcfg):
        super().__init__(qcfg)
        fmt = qcfg.get("format", "")
        groups = list((qcfg.get("config_groups") or {}).values())
        w = (groups[0].get("weights") or {}) if len(groups) == 1 else {}
        self.bits, self.group = w.get("num_bits"), w.get("group_size")
        ok = (fmt in ("pack-quantized", "int-quantized") and w.get("type") == "int"
              and w.get("symmetric", True) and self.bits in (4, 8)
              and w.get("strategy") in ("group", "channel")
              and (fmt == "pack-quantized" or self.bits == 8))
        if not ok:
            raise ValueError(f"compressed-tensors format {fmt!r} with weights {w or groups} is "
                             f"not supported; supported: {SUPPORTED}")
        self.ignore = set(qcfg.get("ignore") or ())

    def convert(self, prefix, t):
        if "weight_zero_point" in t and bool(t["weight_zero_point"].ne(0).any()):
            raise ValueError(f"{prefix}: asymmetric compressed-tensors weights are not supported")
        offset = 1 << (self.bits - 1)
        if "weight_packed" in t:
            codes = unpack(t["weight_packed"], self.bits, 1)
        else:  # int-quantized: int8 weights
            codes = (t["weight"].to(torch.int16) + offset).to(torch.uint8)
        if "weight_shape" in t:
            n, k = (int(v) for v in t["weight_shape"].tolist())
            codes = codes[:n, :k]
        n, k = codes.shape
        s = t["weight_scale"].reshape(n, -1)
        g_idx = t.get("weight_g_idx")
        if g_idx is None:
            g_idx = torch.arange(k) // (k // s.shape[1])
        if k % s.shape[1] or g_idx.shape != (k,):
            raise ValueError(f"{prefix}: weight_scale {tuple(s.shape)} does not match the "
                             f"({n}, {k}) weight")
        groups, perm = block_groups(g_idx, prefix)
        codes = codes if perm is None else codes[:, perm]
        return block_quant(codes, s, float(offset), groups, self.bits, perm)


FORMATS = {"awq": AWQ, "gptq": GPTQ, "compressed-tensors": CompressedTensors, "fp8": FP8Blocks}


def checkpoint_format(hf_config: dict) -> Format | None:
    """The Format of a config.json's quantization_config (None for a float checkpoint)."""
    qcfg = hf_config.get("quantization_config")
    if not qcfg:
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    if method not in FORMATS:
        raise ValueError(f"quantization method {method!r} is not supported; supported: "
                         f"{SUPPORTED}")
    return FORMATS[method](qcfg)


def read(fmt: Format, weights: Iterator[tuple[str, torch.Tensor]]
         ) -> Iterator[tuple[str, torch.Tensor | BlockQuant]]:
    """Checkpoint tensors with each quantized linear's parts replaced by one
    ('<prefix>.weight', BlockQuant); the parts (small: they are quantized) are gathered over the
    whole checkpoint first, as a linear's parts may come in any order or file."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in fmt.parts or (part == "weight" and tensor.is_floating_point()
                                     and tensor.dtype not in FP8_DTYPES):
            yield name, tensor
        else:
            pending.setdefault(prefix, {})[part] = tensor
    for prefix, parts in pending.items():
        missing = [p for p in fmt.required if p not in parts]
        if missing or not _has_codes(fmt, parts):
            raise ValueError(f"checkpoint has {', '.join(sorted(parts))} for {prefix} but not "
                             f"{', '.join(missing) or 'its codes'}")
        yield f"{prefix}.weight", fmt.convert(prefix, parts)


def _has_codes(fmt: Format, parts: dict) -> bool:
    if isinstance(fmt, CompressedTensors):
        return "weight_packed" in parts or "weight" in parts
    return True
