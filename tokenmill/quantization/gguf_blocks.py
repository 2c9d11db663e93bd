"""GGUF block formats (llama.cpp's ggml-quants) as BlockQuant, without dequantizing.

Byte layouts, per block (fp16 = IEEE half; nibble j of 16 bytes: low half of byte j for weight j,
high half for weight 16 + j):
  Q4_0 (32)  fp16 d, 16 B nibbles                     w = d * (q - 8)
  Q4_1 (32)  fp16 d, fp16 m, 16 B nibbles             w = d * q + m
  Q5_0 (32)  fp16 d, 4 B fifth bits, 16 B nibbles     w = d * (q - 16)
  Q5_1 (32)  fp16 d, fp16 m, 4 B fifth bits, 16 B     w = d * q + m
  Q8_0 (32)  fp16 d, 32 int8                          w = d * q
  Q4_K (256) fp16 d, fp16 dmin, 12 B of 6-bit (sc, mn) for 8 sub-blocks of 32, 128 B nibbles
             (64 weights per 32 bytes: low nibbles the first 32, high the next 32)
             w = d * sc * q - dmin * mn
  Q5_K (256) as Q4_K plus 32 B of fifth bits (bit 2 i / 2 i + 1 of byte j: weight j of
             sub-blocks 2 i / 2 i + 1) before the nibbles
  Q6_K (256) 128 B low nibbles, 64 B high bit pairs, 16 int8 scales (one per 16 weights),
             fp16 d                                   w = d * sc * (q - 32), q in [0, 64)
The first five convert exactly (Q8_0 as code q + 128, m = -128 d); Q4_K and Q5_K too, their
6-bit sc, mn and float16 d, dmin kept (BlockQuant.ks; the kernels pack them as they are), with
d * sc and dmin * mn also rounded to float16 for every other use (relative error <= 2**-11).
Q6_K has a scale per 16 weights. It is kept exactly (BlockQuant.q6: its 6-bit codes, int8
scales and float16 d; the kernels pack these as they are) and converted for every other use:
per block of 32 the half with the larger |sc| sets D = d * sc / 4 and keeps its codes exactly
(4 (q - 32) + 128); the other half's codes are rounded to D's grid (error <= 1/8 of its own
quantization step). Other types (Q2_K, Q3_K, IQ*, ...) return None: the loader dequantizes
those.
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q

from tokenmill.quantization import BlockQuant, QuantWeight


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block (a view: the blocks' bytes as float16 pairs)."""
    return b.view("<f2")[:, at // 2]


def _f32(b: np.ndarray, at: int) -> np.ndarray:
    return _f16(b, at).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes -> (..., 32) codes: low halves, then high halves (in torch: its loops
    take a strided view's short rows several times faster than numpy's, on all threads)."""
    with warnings.catch_warnings():  # a read-only view of the file: only read here
        warnings.simplefilter("ignore", UserWarning)
        q = torch.from_numpy(qs)
    out = torch.empty(*q.shape[:-1], 32, dtype=torch.uint8)
    torch.bitwise_and(q, 0xF, out=out[..., :16])
    torch.bitwise_right_shift(q, 4, out=out[..., 16:])
    return out.numpy()


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(..., 4) bytes -> (..., 32) bit j of the little-endian 32-bit word, as 0/16 (one byte
    per bit from the start: shifting the words made 4-byte temporaries, 30x slower)."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4), four
    bytes at a time: words w0, w1, w2 give scales 0-3 (w0 & 63 per byte), mins 0-3 (w1),
    scales 4-7 (w2's low nibbles, w0's top two bits as bits 4-5) and mins 4-7 (w2's high
    nibbles, w1's top bits)."""
    w = raw.view("<u4")
    w0, w1, w2 = w[:, 0], w[:, 1], w[:, 2]
    low6, nib, top = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x30303030)
    sc = np.stack([w0 & low6, (w2 & nib) | ((w0 >> 2) & top)], -1)
    mn = np.stack([w1 & low6, ((w2 >> 4) & nib) | ((w1 >> 2) & top)], -1)
    return tuple(t.astype("<u4", copy=False).view(np.uint8).astype(np.float32) for t in (sc, mn))


def _simple(b: np.ndarray, qtype: int):
    """32-weight formats: (codes (..., 32), d, m) per block."""
    if qtype == Q.Q4_1:
        return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)
    if qtype == Q.Q5_1:
        return _nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8]), _f16(b, 0), _f16(b, 2)
    d = _f32(b, 0)  # m = -offset * d, in float32 and rounded once
    if qtype == Q.Q8_0:  # q + 128 of an int8 q is its byte with the top bit flipped: one pass
        return b[:, 2:34] ^ np.uint8(0x80), d, -128 * d
    if qtype == Q.Q4_0:
        return _nibbles(b[:, 2:18]), d, -8 * d
    return _nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6]), d, -16 * d  # Q5_0


def _k_quant(b: np.ndarray, qtype: int):
    """256-weight K formats: (codes (..., 8 * 32), d, m) per sub-block of 32."""
    d, dmin = _f32(b, 0)[:, None], _f32(b, 2)[:, None]
    sc, mn = _k_scales(b[:, 4:16])
    with warnings.catch_warnings():  # a read-only view of the file: only read here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(b)
    pairs = t[:, 48:176] if qtype == Q.Q5_K else t[:, 16:144]
    pairs = pairs.reshape(-1, 4, 1, 32)  # 4 x 32 bytes -> sub-blocks (2 i, 2 i + 1)
    codes = torch.empty(b.shape[0], 4, 2, 32, dtype=torch.uint8)
    torch.bitwise_and(pairs, 0xF, out=codes[:, :, :1])
    torch.bitwise_right_shift(pairs, 4, out=codes[:, :, 1:])
    if qtype == Q.Q5_K:
        qh, codes = t[:, 16:48], codes.view(-1, 8, 32)  # bit s of byte j: weight j of sub-block s
        for s in range(8):
            codes[:, s] |= ((qh >> s) & 1) << 4
    ks = (sc.astype(np.uint8), mn.astype(np.uint8), _f16(b, 0), _f16(b, 2))  # exact
    return codes.reshape(-1, 256).numpy(), d * sc, -(dmin * mn), ks


def _q6_k_codes(b: np.ndarray) -> np.ndarray:
    """Q6_K's 6-bit codes q in [0, 64), (blocks, 256) in weight order. Per half of 128
    weights, 64 bytes of nibbles and 32 of bit pairs; weight 32 j + l of a half (j < 4,
    l < 32) takes nibble byte l (j even) or 32 + l (j odd), its low (j < 2) or high half, and
    bits 2 j, 2 j + 1 of pair byte l (llama.cpp's dequantize_row_q6_K)."""
    with warnings.catch_warnings():  # a read-only view of the file: only read here
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(b)
    ql = t[:, :128].reshape(-1, 2, 2, 32)  # (blocks, half, j % 2, l)
    qh = t[:, 128:192].reshape(-1, 2, 1, 32)
    q = torch.empty(b.shape[0], 2, 4, 32, dtype=torch.uint8)
    torch.bitwise_and(ql, 0xF, out=q[:, :, :2])
    torch.bitwise_right_shift(ql, 4, out=q[:, :, 2:])
    for j in range(4):
        q[:, :, j] |= ((qh[:, :, 0] >> (2 * j)) & 3) << 4
    return q.reshape(-1, 256).numpy()


_Q6_K_CHUNK = 2048  # blocks (512K weights: 2 MiB in float32)


def _q6_k(b: np.ndarray, qtype: int):
    """Q6_K -> 8-bit codes per block of 32 (see the module docstring), and its exact 6-bit
    codes, int8 scales per 16 and float16 d per 256."""
    exact = (_q6_k_codes(b), b[:, 192:208].view(np.int8), _f16(b, 208))
    sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 8, 2)
    big = np.abs(sc[..., 0]) >= np.abs(sc[..., 1])  # which half sets the block's scale
    smax = np.where(big, sc[..., 0], sc[..., 1])
    ratio = np.where(smax[..., None] == 0, 0.0, sc / np.where(smax == 0, 1.0, smax)[..., None])
    # round(4 (q - 32) ratio) + 128 in float32, written over q; in chunks of blocks that stay
    # in cache (one float32 copy of a whole tensor took 4 bytes a weight of fresh memory)
    codes = torch.from_numpy(exact[0].copy())
    r4 = torch.from_numpy(4 * ratio.astype(np.float32, copy=False))[..., None]
    for s in range(0, codes.shape[0], _Q6_K_CHUNK):
        x = codes[s:s + _Q6_K_CHUNK].view(-1, 8, 2, 16).float().sub_(32)
        x.mul_(r4[s:s + _Q6_K_CHUNK]).round_().add_(128).clamp_(0, 255)
        codes[s:s + _Q6_K_CHUNK] = x.view(-1, 256)
    d = _f32(b, 208)[:, None] * smax / 4
    return codes.numpy(), d, -128 * d, exact


_SIMPLE = {Q.Q4_0: (18, 4), Q.Q4_1: (20, 4), Q.Q5_0: (22, 5), Q.Q5_1: (24, 5), Q.Q8_0: (34, 8)}
_K = {Q.Q4_K: (144, 4), Q.Q5_K: (176, 5), Q.Q6_K: (210, 8)}
NATIVE_TYPES = (*_SIMPLE, *_K)


def to_block_quant(data: np.ndarray, qtype: int, rows: int, cols: int) -> BlockQuant | None:
    """A GGUF tensor's bytes (rows, bytes per row) as BlockQuant, or None for other types."""
    if qtype not in NATIVE_TYPES:
        return None
    size, bits = _SIMPLE.get(qtype) or _K[qtype]
    blocks = np.asarray(data).reshape(-1, size)
    convert = _simple if qtype in _SIMPLE else _q6_k if qtype == Q.Q6_K else _k_quant
    codes, d, m, *ks = convert(blocks, qtype)
    shape = (blocks.shape[0], codes.shape[1] // 32)
    d, m = (np.broadcast_to(t.reshape(blocks.shape[0], -1), shape) for t in (d, m))
    q6 = None
    if qtype == Q.Q6_K:  # codes (rows, cols), int8 scales (rows, cols / 16), d (rows, cols / 256)
        q6c, q6s, q6d = ks.pop()
        q6 = (torch.from_numpy(q6c.reshape(rows, cols)),
              torch.from_numpy(np.ascontiguousarray(q6s).reshape(rows, cols // 16)),
              torch.from_numpy(np.array(q6d, np.float16).reshape(rows, cols // 256)))
    if ks:  # the K formats' integers (rows, cols / 32) and float16 scales (rows, cols / 256)
        sc, mn, dd, mm = ks[0]
        ks = (*(torch.from_numpy(np.ascontiguousarray(t).reshape(rows, cols // 32))
                for t in (sc, mn)),
              *(torch.from_numpy(np.array(t, np.float16).reshape(rows, cols // 256))
                for t in (dd, mm)))
    return BlockQuant(
        torch.from_numpy(np.ascontiguousarray(codes.reshape(rows, cols), dtype=np.uint8)),
        *(_half(t.reshape(rows, cols // 32)) for t in (d, m)), bits, ks=ks or None, q6=q6)


def _half(t: np.ndarray) -> torch.Tensor:
    """float16 (torch converts with the CPU's instructions: numpy's conversion is ~10x slower;
    both round to nearest even)."""
    t = np.ascontiguousarray(t)
    return torch.from_numpy(t if t.flags.writeable else t.copy()).to(torch.float16)


class GGUFMatrix(QuantWeight):
    """A GGUF weight matrix of a native type kept as its file's blocks: `file_blocks` (rows, bytes
    a row) uint8, a view of the mapped file, and the rows it takes from them in its own order
    (`order`: None for all, as stored; row selections and reorderings only change it). The
    kernels pack it from the blocks (tm_qpack_gguf: the packed form its BlockQuant would give,
    without writing a byte a weight of codes first); block_quant() converts it for every other
    use (the reference ops, column shards, parts stacked into one form)."""

    def __init__(self, qtype: int, file_blocks: torch.Tensor, cols: int,
                 order: torch.Tensor | None = None, source: int | None = None) -> None:
        size, bits = _SIMPLE.get(qtype) or _K[qtype]
        per_block = 32 if qtype in _SIMPLE else 256
        if (file_blocks.dim() != 2 or cols % per_block
                or file_blocks.shape[1] != cols // per_block * size):
            raise ValueError(f"GGUF {Q(qtype).name} matrix of {cols} columns: "
                             f"{tuple(file_blocks.shape)} bytes")
        self.qtype, self.file_blocks, self.cols, self.bits = qtype, file_blocks, cols, bits
        self.order = order
        self.source = source  # where its tensor's bytes start in the file (identity())

    @classmethod
    def from_file(cls, data: np.ndarray, qtype: int, cols: int,
                  source: int | None = None) -> GGUFMatrix:
        with warnings.catch_warnings():  # a read-only view of the file: only read
            warnings.simplefilter("ignore", UserWarning)
            return cls(qtype, torch.from_numpy(np.asarray(data)), cols, source=source)

    @property
    def blocks(self) -> torch.Tensor:
        """(rows, bytes a row) in this matrix's row order: the file's view, or a copy."""
        return self.file_blocks if self.order is None else self.file_blocks[self.order]

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.file_blocks.shape[0] if self.order is None else self.order.shape[0]
        return rows, self.cols

    def identity(self) -> tuple:
        """What its packed bytes follow from, within its file: type, tensor, rows taken."""
        order = None if self.order is None else hashlib.sha256(
            self.order.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
        return self.qtype, self.source, self.cols, self.shape[0], order

    def block_quant(self) -> BlockQuant:
        return to_block_quant(self.blocks.numpy(), self.qtype, *self.shape)

    def map_rows(self, fn) -> GGUFMatrix:
        """fn applied to the rows (a selection or permutation), as to the row indices."""
        order = torch.arange(self.file_blocks.shape[0]) if self.order is None else self.order
        return GGUFMatrix(self.qtype, self.file_blocks, self.cols, fn(order), self.source)

    def rows(self, index) -> GGUFMatrix:
        return self.map_rows(lambda t: t[index])

    def dequantize(self, stored_order: bool = False) -> torch.Tensor:
        return self.block_quant().dequantize(stored_order)
