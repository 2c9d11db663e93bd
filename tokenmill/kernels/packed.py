"""A weight as the kernels take it (csrc/tm.h tm_linear): the panels of a float weight, or a
block-quantized one repacked (csrc/quant_pack.cpp) with its scales as compact as its format
allows: float16 d and m per 32 weights, d alone where m = -2^(bits-1) d (QSYM), or the GGUF K
formats' integers per 32 and float16 pair per 256 (QSUPER), Q6_K's 6-bit codes with an int8
scale per 16 and float16 D per 256 (6 | QSUPER); fused parts in runs of their own form.
QuantCalls packs and unpacks them: a mixin of KernelLib (its `_lib` and `_sync_threads`), with
the same checks before any pointer reaches C."""

from __future__ import annotations

import ctypes
import functools
from ctypes import c_int64, c_void_p

import torch

from tokenmill.kernels import packed_cache
from tokenmill.kernels.kv_pages import _check, _index, _ptr
from tokenmill.kernels.weight_arena import ARENA

QUANT_BITS = (4, 5, 8)  # block-quantized weights: TM_QI4, TM_QI5, TM_QI8 (code bits)
Q6_K = 6 | 32  # tm.h TM_QI6 | TM_QSUPER: GGUF's Q6_K as it is (BlockQuant.q6)
QSYM = 16  # tm.h TM_QSYM: added to the bits where every m = -2**(bits - 1) d (stored: d alone)
QSUPER = 32  # tm.h TM_QSUPER: d = sc D, m = -mn M (GGUF's K formats' integers, BlockQuant.ks)
QUANT_GROUP = 16  # output rows packed together (quant_layout.h kGroup)
MAX_RUNS = 4  # runs of rows of their own code width in one quantized weight (tm.h TM_MAX_RUNS)


class Linear(ctypes.Structure):
    _fields_ = [("packed", c_void_p), ("bias", c_void_p), ("n", c_int64), ("k", c_int64),
                ("quant", ctypes.c_int32), ("row_invariant", ctypes.c_int32),
                ("gated", ctypes.c_int32), ("runs", ctypes.c_int32),
                ("run_quant", ctypes.c_int32 * MAX_RUNS), ("run_end", c_int64 * MAX_RUNS)]


class PackedLinear:
    """A weight in the library's panel layout (or block-quantized: `quant` 4 / 5 / 8 code bits,
    plus QSYM or QSUPER, see tm_qpack; `bits` the code bits) plus its float32 bias, as the C
    struct reads it; holds the tensors the struct points to."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, n: int, k: int,
                 quant: int = 0, gated: bool = False,
                 runs: list[tuple[int, int]] | None = None):
        self.packed, self.bias, self.n, self.k, self.quant = packed, bias, n, k, quant
        self.bits = quant & 15
        self.gated = gated  # gate|up interleaved: linear() gives silu(gate) x up (pack)
        # block-quantized rows in runs of their own quant code: (quant, end row) each, in
        # order (quant: the widest run's); None: all rows `quant`
        self.runs = runs
        self.has_q6 = any(q & 15 == 6 for q, _ in runs or [(quant, n)])  # Q6_K rows (TM_QI6)
        self.struct = Linear(packed.data_ptr(), _ptr(bias), n, k, quant, 0, int(gated))
        if runs:
            self.struct.runs = len(runs)
            for i, (b, end) in enumerate(runs):
                self.struct.run_quant[i], self.struct.run_end[i] = b, end


class QuantCalls:
    def qpack(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int,
              bias: torch.Tensor | None = None) -> PackedLinear:
        """Block-quantized (n, k) weight w = d * codes + m: codes (n, k) uint8 below 2**bits,
        d and m (n, k / 32) float16, repacked for the kernels."""
        return self.qpack_parts([(codes, d, m)], bits, bias)

    def qpack_parts(self, parts: list[tuple], bits: int | list[int],
                    bias: torch.Tensor | None = None) -> PackedLinear:
        """Parts stacked along the output rows (fused q|k|v, gate|up), each (codes, d, m) as
        for qpack, or (codes, d, m, ks) with a K format's integer scales (BlockQuant.ks), or
        (codes, d, m, ks, q6) with Q6_K's exact form (BlockQuant.q6, packed instead of the
        8-bit codes), packed where they land with no stacked copy: every part but the last
        must end on a group of 16 rows (the packed form is group after group). `bits`: one
        width for every part, or each part's own (adjacent parts of one form make one run of
        rows, tm_linear.runs)."""
        k = parts[0][0].shape[1]
        widths = list(bits) if isinstance(bits, (list, tuple)) else [bits] * len(parts)
        kss = [p[3] if len(p) > 3 else None for p in parts]
        q6s = [p[4] if len(p) > 4 and k % 256 == 0 else None for p in parts]
        parts = [p[:3] for p in parts]
        for i, ((codes, d, m), b) in enumerate(zip(parts, widths, strict=True)):
            n = codes.shape[0]
            _check(b in QUANT_BITS and k % 32 == 0 and codes.shape[1] == k
                   and codes.dtype == torch.uint8 and d.dtype == m.dtype == torch.float16
                   and d.shape == m.shape == (n, k // 32)
                   and (i == len(parts) - 1 or n % QUANT_GROUP == 0),
                   f"qpack: ({n}, {k}) {b}-bit codes with (n, k / 32) float16 scales "
                   f"(parts but the last in whole groups of {QUANT_GROUP} rows)")
        quants = [Q6_K if q6 is not None
                  else b | QSUPER if ks is not None and b in (4, 5) and k % 256 == 0
                  else b | QSYM if _symmetric(d, m, b) else b
                  for (_, d, m), b, ks, q6 in zip(parts, widths, kss, q6s)]
        specs = []  # (quant, rows, write(at)) per part
        for (codes, d, m), q, ks, q6 in zip(parts, quants, kss, q6s):
            specs.append((q, codes.shape[0], self._code_writer(q, codes, d, m, ks, q6, k)))
        return self._pack_runs(specs, k, bias)

    def qpack_gguf_parts(self, parts: list, k: int) -> PackedLinear:
        """GGUF matrices (quantization.gguf_blocks.GGUFMatrix: qtype, shape, blocks, identity())
        stacked along the output rows, packed straight from their file blocks (tm_qpack_gguf):
        the same bytes as their BlockQuant conversion through qpack_parts, without the
        conversion's copies; or mapped from the packed cache (packed_cache.py) where it holds
        them. Every part but the last must end on a group of 16 rows."""
        specs = []
        for i, part in enumerate(parts):
            q = self._lib.tm_gguf_quant(part.qtype)
            n, row_bytes = part.shape[0], part.file_blocks.shape[1]
            _check(q >= 0 and part.shape[1] == k and part.file_blocks.dtype == torch.uint8
                   and self._lib.tm_qpack_gguf(part.qtype, None, row_bytes, 0, k, None) == 0
                   and (i == len(parts) - 1 or n % QUANT_GROUP == 0),
                   f"qpack_gguf: GGUF type {part.qtype} blocks of {k} columns in {row_bytes} "
                   f"uint8 bytes a row (parts but the last in whole groups of {QUANT_GROUP} rows)")
            specs.append((q, n, functools.partial(self._gguf_write, part, k)))
        return self._pack_runs(specs, k, None, repr([k, *(p.identity() for p in parts)]))

    def _gguf_write(self, part, k: int, at: int) -> None:
        blocks = part.blocks.contiguous()
        if self._lib.tm_qpack_gguf(part.qtype, blocks.data_ptr(), blocks.shape[1],
                                   blocks.shape[0], k, at) == -2:
            raise ValueError("GGUF weight has a float16 scale that is inf or NaN")

    def _code_writer(self, q, codes, d, m, ks, q6, k):
        """write(at): one part of codes and scales packed at address `at` (qpack_parts)."""
        codes, d, m = codes.contiguous(), d.contiguous(), m.contiguous()
        n = codes.shape[0]
        if q == Q6_K:
            _check(q6[0].dtype == torch.uint8 and q6[0].shape == (n, k)
                   and q6[1].dtype == torch.int8 and q6[1].shape == (n, k // 16)
                   and q6[2].dtype == torch.float16 and q6[2].shape == (n, k // 256),
                   f"qpack: ({n}, {k}) Q6_K as uint8 codes, int8 (n, k / 16) and float16 "
                   "(n, k / 256) scales")
            c6, sc, dd = (t.contiguous() for t in q6)
            return lambda at: self._lib.tm_qpack_super(q, c6.data_ptr(), sc.data_ptr(), None,
                                                       dd.data_ptr(), None, n, k, at)
        if q & QSUPER:
            _check(all(t.dtype == torch.uint8 and t.shape == (n, k // 32) for t in ks[:2])
                   and all(t.dtype == torch.float16 and t.shape == (n, k // 256)
                           for t in ks[2:]),
                   f"qpack: ({n}, {k}) K scales as uint8 (n, k / 32) and float16 (n, k / 256)")
            sc, mn, dd, mm = (t.contiguous() for t in ks)
            return lambda at: self._lib.tm_qpack_super(q, codes.data_ptr(), sc.data_ptr(),
                                                       mn.data_ptr(), dd.data_ptr(),
                                                       mm.data_ptr(), n, k, at)
        return lambda at: self._lib.tm_qpack(q, codes.data_ptr(), d.data_ptr(), m.data_ptr(),
                                             n, k, at)

    def _pack_runs(self, specs: list[tuple], k: int, bias, key: str | None = None
                   ) -> PackedLinear:
        """Parts (quant, rows, write(at)) packed one after another into one weight; adjacent
        parts of one form make one run of rows (tm_linear.runs). With `key` (what the bytes
        follow from) an open packed cache gives the memory, and maybe the bytes already."""
        runs: list[tuple[int, int]] = []  # (quant, end row)
        row = size = 0
        for q, n, _ in specs:
            row += n
            size += self._lib.tm_qpacked_bytes(q, n, k)
            if runs and runs[-1][0] == q:
                runs[-1] = (q, row)
            else:
                runs.append((q, row))
        _check(len(runs) <= MAX_RUNS, f"qpack: at most {MAX_RUNS} runs of one quant code")
        cache = packed_cache.current() if key is not None else None
        packed, filled = (cache and cache.take(key, size)) or (ARENA.empty(size, torch.uint8),
                                                               False)
        self._sync_threads()
        at = packed.data_ptr()
        for q, n, write in specs if not filled else ():
            write(at)
            at += self._lib.tm_qpacked_bytes(q, n, k)
        b = None if bias is None else bias.detach().float().contiguous()
        widest = max((q for q, _, _ in specs), key=lambda q: q & 15)
        return PackedLinear(packed, b, row, k, widest, runs=runs if len(runs) > 1 else None)

    def qdequantize(self, w: PackedLinear, rows: torch.Tensor | None = None) -> torch.Tensor:
        """A quantized weight's rows (all, or those indexed by `rows`) in float32."""
        idx = None if rows is None else _index(rows)
        _check(w.bits in (*QUANT_BITS, 6), "qdequantize: a quantized weight")
        if w.runs:  # each run's rows, then the ones asked for
            full, at, start = torch.empty(w.n, w.k, dtype=torch.float32), w.packed.data_ptr(), 0
            for q, end in w.runs:
                self._sync_threads()
                self._lib.tm_qdequantize(q, at, end - start, w.k, None, end - start,
                                         full[start:end].data_ptr())
                at += self._lib.tm_qpacked_bytes(q, end - start, w.k)
                start = end
            _check(idx is None or bool(((idx >= 0) & (idx < w.n)).all()),
                   f"qdequantize: row indices in [0, {w.n})")
            return full if idx is None else full[idx]
        count = w.n if idx is None else idx.numel()
        out = torch.empty(count, w.k, dtype=torch.float32)
        self._sync_threads()
        _check(self._lib.tm_qdequantize(w.quant, w.packed.data_ptr(), w.n, w.k, _ptr(idx), count,
                                        out.data_ptr()) == 0,
               f"qdequantize: row indices in [0, {w.n})")
        return out


def _symmetric(d: torch.Tensor, m: torch.Tensor, bits: int) -> bool:
    """Whether every block's m is -2**(bits - 1) d (GGUF's Q4_0, Q5_0, Q8_0; exact in float16:
    a power of two times d)."""
    return torch.equal(m, d * -(1 << (bits - 1)))
