"""Quantized weights: one form the kernels execute, and the methods that produce it.

Every weight-quantization method reduces to BlockQuant: w = d * code + m per output row and
block of 32 input columns, with unsigned codes of 4, 5 or 8 bits and float16 d, m (vLLM has one
LinearMethod per format; here each format only has to say how its bytes map to this form, and
one kernel runs them all: kernels/csrc/quant.cpp). The methods:

- GGUF blocks (gguf_blocks.py), kept from the file: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K and
  Q5_K exactly (the K formats' integer scales kept as ks), Q6_K exactly as q6 (its 6-bit codes
  and scale per 16 weights, which the kernels pack as they are) and, for every other use, with
  one of its two sub-block scales per 32 weights requantized (gguf_blocks.py states the error).
  The loader hands each matrix over as a GGUFMatrix (QuantWeight): the file's blocks, which the
  kernels pack directly (kernels/csrc/quant_gguf.cpp), converted to BlockQuant only on demand;
- on the fly from float weights (rtn.py): "int8" (per output channel, symmetric) and "int4"
  (groups of 32 or 128, asymmetric), round to nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


def _finite_f16(t: torch.Tensor) -> bool:
    """No inf or NaN: the exponent bits are not all ones (5x faster than isfinite on float16)."""
    return t.numel() == 0 or int((t.view(torch.int16) & 0x7FFF).max()) < 0x7C00


class QuantWeight:
    """A quantized checkpoint matrix as a loader hands it over: BlockQuant, or a form that
    converts to it on demand (gguf_blocks.GGUFMatrix: a GGUF file's blocks, which the kernels
    pack without the conversion). `shape`, `bits`, `perm`, rows(), map_rows() and dequantize()
    as BlockQuant's."""

    perm = None

    def block_quant(self) -> BlockQuant:
        raise NotImplementedError

    @staticmethod
    def same_order(parts: list[QuantWeight]) -> bool:
        """Whether the parts store their input columns in the same order (perm)."""
        perm = parts[0].perm
        return all((p.perm is None) == (perm is None) and (perm is None or
                                                           torch.equal(p.perm, perm))
                   for p in parts)


@dataclass
class BlockQuant(QuantWeight):
    """An (n, k) weight as codes (n, k) uint8 < 2**bits (bits 4, 5 or 8) and float16 d, m
    (n, k / 32)."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int
    perm: torch.Tensor | None = None  # input order the columns are stored in (act-order GPTQ)
    # GGUF's K formats exactly: d = sc D, m = -mn M with sc, mn (n, k / 32) uint8 < 64 and D, M
    # (n, k / 256) float16 (d and m above hold them rounded to float16); the kernels pack these
    ks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # GGUF's Q6_K exactly: w = sc D (q - 32) with codes q (n, k) uint8 < 64, sc (n, k / 16) int8
    # and D (n, k / 256) float16; codes, d, m above hold its 8-bit conversion for every other use
    q6: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if (self.bits not in (4, 5, 8) or k % BLOCK or self.codes.dtype != torch.uint8
                or self.d.dtype != torch.float16 or self.m.dtype != torch.float16
                or self.d.shape != (n, k // BLOCK) or self.m.shape != self.d.shape):
            raise ValueError(f"quantized weight of shape {(n, k)}: codes {self.codes.dtype}, "
                             f"scales {tuple(self.d.shape)} {self.d.dtype}, {self.bits} bits "
                             f"do not match (want k a multiple of {BLOCK}, float16 scales "
                             f"of shape {(n, k // BLOCK)}, 4, 5 or 8 bits)")
        if not (_finite_f16(self.d) and _finite_f16(self.m)):
            raise ValueError("quantized weight has scales that overflow float16")
        if self.ks is not None and (
                k % (8 * BLOCK) or any(t.shape != (n, k // BLOCK) or t.dtype != torch.uint8
                                       for t in self.ks[:2])
                or any(t.shape != (n, k // (8 * BLOCK)) or t.dtype != torch.float16
                       for t in self.ks[2:])):
            raise ValueError(f"quantized weight of shape {(n, k)}: K-format scales do not match")
        if self.q6 is not None and (
                k % (8 * BLOCK) or self.q6[0].shape != (n, k) or self.q6[0].dtype != torch.uint8
                or self.q6[1].shape != (n, k // 16) or self.q6[1].dtype != torch.int8
                or self.q6[2].shape != (n, k // 256) or self.q6[2].dtype != torch.float16):
            raise ValueError(f"quantized weight of shape {(n, k)}: Q6_K codes and scales do "
                             "not match")
        if self.bits < 8 and self.codes.numel() and int(self.codes.max()) >= 1 << self.bits:
            raise ValueError(f"{self.bits}-bit quantized weight has codes above "
                             f"{(1 << self.bits) - 1}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def block_quant(self) -> BlockQuant:
        return self

    def dequantize(self, stored_order: bool = False) -> torch.Tensor:
        """The float32 weight (the reference the kernels are tested against), its columns in
        input order (or as stored, permuted by perm)."""
        n, k = self.codes.shape
        if self.q6 is not None:  # exact
            q, sc, dd = self.q6
            scale = sc.float() * dd.float().repeat_interleave(16, 1)
            w = ((q.float().reshape(n, k // 16, 16) - 32) * scale[..., None]).reshape(n, k)
        else:
            c = self.codes.reshape(n, k // BLOCK, BLOCK).float()
            d, m = self.scales()
            w = (c * d[..., None] + m[..., None]).reshape(n, k)
        if self.perm is None or stored_order:
            return w
        return w[:, torch.argsort(self.perm)]

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """d and m (n, k / 32) in float32: from ks exactly where the weight has them (products
        of 6-bit integers and float16, exact in float32)."""
        if self.ks is None:
            return self.d.float(), self.m.float()
        sc, mn, dd, mm = self.ks
        return (sc.float() * dd.float().repeat_interleave(8, 1),
                -(mn.float() * mm.float().repeat_interleave(8, 1)))

    def rows(self, index) -> BlockQuant:
        """Some output rows (a slice, or an index tensor)."""
        return self.map_rows(lambda t: t[index])

    def map_rows(self, fn) -> BlockQuant:
        """fn applied to every per-row tensor (a row selection or permutation)."""
        ks = None if self.ks is None else tuple(fn(t) for t in self.ks)
        q6 = None if self.q6 is None else tuple(fn(t) for t in self.q6)
        return BlockQuant(fn(self.codes), fn(self.d), fn(self.m), self.bits, self.perm, ks, q6)

    @staticmethod
    def cat(parts: list[QuantWeight]) -> BlockQuant | None:
        """Stacked along the output rows (fused q|k|v, gate|up); narrower codes widen to the
        widest part's bits. None when the parts' input orders differ."""
        if not QuantWeight.same_order(parts):
            return None
        parts = [p.block_quant() for p in parts]
        perm = parts[0].perm
        bits = max(p.bits for p in parts)
        ks = None  # kept where every part has it in one code width
        if all(p.ks is not None and p.bits == bits for p in parts):
            ks = tuple(torch.cat([p.ks[i] for p in parts]) for i in range(4))
        q6 = None
        if all(p.q6 is not None for p in parts):
            q6 = tuple(torch.cat([p.q6[i] for p in parts]) for i in range(3))
        return BlockQuant(torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                          torch.cat([p.m for p in parts]), bits, perm, ks, q6)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels do to a linear layer's input: per row and block of 32, int8 codes
    round(x * 127 / max|x|) (to nearest even) and the scale max|x| / 127, in float32."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    # a true division (PyTorch's `127 / t` multiplies by a reciprocal: not the same rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xb * inv).reshape(rows, k), (amax / 127)[..., 0]


def linear_ref(x: torch.Tensor, bq: BlockQuant, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' arithmetic in PyTorch (float64): int8 activations against the codes, per
    block y += d * dx * sum(code * q) + m * dx * sum(q). Differs from dequantize-then-matmul by
    the activations' rounding (~0.5 % of the output's scale on random data)."""
    q, dx = quantize_activations(x)
    n, k = bq.shape
    if bq.q6 is not None:  # per half block: d sc D dx sum((code - 32) q)
        codes, sc, dd = bq.q6
        qh = q.double().reshape(-1, k // 16, 16)
        dots = torch.einsum("rhj,nhj->rnh", qh, codes.double().reshape(n, k // 16, 16) - 32)
        scale = sc.double() * dd.double().repeat_interleave(16, 1)  # (n, k / 16)
        y = (dots * scale[None] * dx.double().repeat_interleave(2, 1)[:, None]).sum(-1)
        return (y if bias is None else y + bias.double()).float()
    qb = q.double().reshape(-1, k // BLOCK, BLOCK)  # (rows, blocks, 32)
    cb = bq.codes.double().reshape(n, k // BLOCK, BLOCK)  # (n, blocks, 32)
    dots = torch.einsum("rbj,nbj->rnb", qb, cb)
    d, m = bq.scales()
    y = (dots * d.double()[None] * dx.double()[:, None]).sum(-1)
    y = y + (qb.sum(-1) * dx.double()) @ m.double().T
    return (y if bias is None else y + bias.double()).float()
