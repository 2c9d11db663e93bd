"""The compiled kernels (one library per instruction set, csrc/tm.h) behind a torch-tensor
interface. Every call checks what the C side trusts (shapes, dtypes, contiguity), allocates the
outputs and passes raw pointers; ctypes releases the GIL for the call, so the server's event
loop keeps streaming while a step computes."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_float, c_int, c_int64, c_void_p
from pathlib import Path

import torch

from tokenmill.kernels.elementwise import DTYPES, ElementwiseCalls
from tokenmill.kernels.isa import os_allows_amx
from tokenmill.kernels.kv_pages import KV_FORMATS, KVPageCalls, KVPages, _check, _index, _ptr  # noqa: F401
from tokenmill.kernels.packed import (  # noqa: F401
    MAX_RUNS,
    Q6_K,
    QSUPER,
    QSYM,
    QUANT_BITS,
    QUANT_GROUP,
    Linear,
    PackedLinear,
    QuantCalls,
)
from tokenmill.kernels.weight_arena import ARENA

MAX_LATENT_DIM = 1024  # DeepSeek V3's latent: 512 + 64

ABI_VERSION = 25
_P, _I = c_void_p, c_int64


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p),
                ("k_norm", c_void_p), ("pre_ffn_norm", c_void_p), ("post_ffn_norm", c_void_p),
                ("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("window", c_int64), ("cos_sin", c_void_p), ("pool", c_int64),
                ("pool_layer", c_int64)]


class KVPool(ctypes.Structure):
    _fields_ = [("k", c_void_p), ("v", c_void_p), ("num_blocks", c_int64), ("slots", c_void_p),
                ("tables", c_void_p), ("max_blocks", c_int64), ("lens", c_void_p),
                ("stage_rows", c_void_p), ("stages", c_void_p)]


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # TM_ACT_SILU, TM_ACT_GELU_TANH


class Decoder(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("num_layers", c_int64), ("hidden", c_int64),
                ("heads", c_int64), ("kv_heads", c_int64), ("head_dim", c_int64),
                ("intermediate", c_int64), ("eps", c_float), ("scale", c_float),
                ("act", ctypes.c_int32), ("layers", POINTER(Layer)), ("final_norm", c_void_p),
                ("cos_sin", c_void_p),
                ("max_positions", c_int64), ("kv_format", ctypes.c_int32),
                ("k_scale", c_void_p), ("v_scale", c_void_p), ("k_params", c_void_p),
                ("k_stage", c_void_p), ("stage_slots", c_int64), ("v_rotation", c_void_p)]


_SIGNATURES = {
    "tm_abi_version": (c_int, []),
    "tm_isa": (c_char_p, []),
    "tm_source_hash": (c_char_p, []),
    "tm_set_num_threads": (None, [c_int]),
    "tm_set_stream_prefetch": (None, [c_int]),
    "tm_panel_rows": (_I, []),
    "tm_packed_numel": (_I, [c_int, _I, _I]),
    "tm_pack_weight": (None, [c_int, _P, _I, _I, _P]),
    "tm_unpack_weight": (c_int, [c_int, _P, _I, _I, _P, _I, _P]),
    "tm_linear_fwd": (None, [c_int, _P, _I, POINTER(Linear), c_int, _P, _P, _I]),
    "tm_quant_fast": (c_int, []),
    "tm_set_q6_widen_rows": (None, [c_int64]),
    "tm_q6_widens": (c_int, []),
    "tm_qpacked_bytes": (_I, [c_int, _I, _I]),
    "tm_qpack": (None, [c_int, _P, _P, _P, _I, _I, _P]),
    "tm_qpack_super": (None, [c_int, _P, _P, _P, _P, _P, _I, _I, _P]),
    "tm_gguf_quant": (c_int, [c_int]),
    "tm_qpack_gguf": (c_int, [c_int, _P, _I, _I, _I, _P]),
    "tm_qdequantize": (c_int, [c_int, _P, _I, _I, _P, _I, _P]),
    "tm_rms_norm": (None, [c_int, _P, _P, _P, _P, _I, _I, c_float]),
    "tm_rope": (None, [c_int, _P, _I, _I, _I, _P, _I, _P]),
    "tm_rope_store": (None, [c_int, _P, _I, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P, _P]),
    "tm_silu_mul": (None, [c_int, _P, _P, _I, _I]),
    "tm_gelu_tanh_mul": (None, [c_int, _P, _P, _I, _I]),
    "tm_argmax_rows": (None, [_P, _I, _I, _P]),
    "tm_sample_rows": (None, [_P, _I, _I, _P, _P, _P, _P, _P, _P]),
    "tm_decode_attention": (None, [c_int, _P, _P, _P, _I, _I, _P, _I, _P, _I, _I, _I, _I,
                                   c_float, _P]),
    "tm_prefill_attention": (None, [c_int, _P, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, c_float,
                                    _P]),
    "tm_decode_attention_quant": (None, [_P, POINTER(KVPages), POINTER(KVPages), _I, _I, _P, _I,
                                         _P, _P, _I, _I, _I, _I, c_float, _P]),
    "tm_prefill_attention_quant": (None, [c_int, _P, _I, _I, _I, POINTER(KVPages),
                                          POINTER(KVPages), _I, _I, _P, _P, _I, _I, c_float,
                                          _P]),
    "tm_kv_store": (None, [c_int, _P, _I, _I, _I, _P, _P, _P, _I, POINTER(KVPages)]),
    "tm_decode_stack": (None, [POINTER(Decoder), _P, _I, _P, POINTER(KVPool), _I, _P, _I, _P,
                                _I, _P, _I]),
}


class KernelLib(KVPageCalls, ElementwiseCalls, QuantCalls):
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(path))
        abi = self._lib.tm_abi_version()  # first: an older library lacks newer entry points
        if abi != ABI_VERSION:
            raise ValueError(f"{path} has kernel ABI {abi}, expected {ABI_VERSION}")
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        self.isa = self._lib.tm_isa().decode()
        if self.isa == "amx" and not os_allows_amx():  # a tile instruction would be SIGILL
            raise ValueError(f"{path}: this process may not use AMX tiles (Linux refused)")
        self.source_hash = self._lib.tm_source_hash().decode()
        self.panel_rows = self._lib.tm_panel_rows()
        self.quant_fast = bool(self._lib.tm_quant_fast())
        # a bf16 GEMM row's bits do not depend on the call's row count (whole tile steps of k):
        # the AMX build runs every row count on tiles (gemm_amx.h)
        self.bf16_rows_invariant = self.isa == "amx"
        self._threads = 0

    def __repr__(self) -> str:
        return f"KernelLib({self.isa}, {self.path})"

    def _sync_threads(self) -> None:
        n = torch.get_num_threads()
        if n != self._threads:
            self._lib.tm_set_num_threads(n)
            self._threads = n

    def set_stream_prefetch(self, nta: bool) -> None:
        """How the bf16 dot-product GEMM prefetches the weights of calls of up to 4 rows:
        non-temporally (nta) or into L2 (the default); the same results either way
        (kernels/stream_prefetch.py chooses)."""
        self._lib.tm_set_stream_prefetch(int(nta))

    @property
    def q6_widens(self) -> bool:
        """Whether this build widens Q6_K groups for calls of many rows (the AVX2 tiles)."""
        return bool(self._lib.tm_q6_widens())

    def set_q6_widen_rows(self, rows: int) -> None:
        """From how many input rows of a call's 64-row chunk a Q6_K group is widened to a byte a
        code once, instead of unpacked in every row tile; the same results either way
        (kernels/q6_widen.py chooses)."""
        self._lib.tm_set_q6_widen_rows(rows)

    # ---- GEMM -------------------------------------------------------------------------------
    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
             gated: bool = False) -> PackedLinear:
        """(n, k) float32/bfloat16 weight -> this build's panel layout. gated: the weight is
        gate | up of n / 2 rows each, packed interleaved half a panel at a time so that
        linear() returns silu(gate) x up, (m, n / 2), with the rounding of running silu_mul
        on the plain product (can_gate says whether n allows it)."""
        _check(weight.dim() == 2 and weight.dtype in DTYPES, "pack: 2-D float32/bf16 weight")
        _check(not gated or self.can_gate(weight.shape[0]), "pack: gated needs n / 2 in whole "
               "half panels")
        w = weight.detach()
        if gated:  # rows: gate[0:h], up[0:h], gate[h:2h], up[h:2h], ... with h half a panel
            h = self.panel_rows // 2
            w = w.view(2, -1, h, w.shape[1]).transpose(0, 1).reshape(w.shape)
            if bias is not None:
                bias = bias.detach().view(2, -1, h).transpose(0, 1).reshape(-1)
        w = w.contiguous()
        n, k = w.shape
        dt = DTYPES[w.dtype]
        numel = self._lib.tm_packed_numel(dt, n, k)
        packed = (ARENA.empty(numel, w.dtype) if w.device.type == "cpu"
                  else torch.empty(numel, dtype=w.dtype, device=w.device))
        self._sync_threads()
        self._lib.tm_pack_weight(dt, w.data_ptr(), n, k, packed.data_ptr())
        b = None if bias is None else bias.detach().float().contiguous()
        return PackedLinear(packed, b, n, k, gated=gated)

    def unpack(self, w: PackedLinear, rows: torch.Tensor | None = None) -> torch.Tensor:
        """pack()'s inverse for a float weight: its (n, k) rows as they were given (gate |
        up for a gated pack), in the packed dtype; or those indexed by `rows` (not gated)."""
        _check(not w.bits and w.packed.dtype in DTYPES, "unpack: a float packed weight")
        _check(rows is None or not w.gated, "unpack: rows of a gated pack")
        idx = None if rows is None else _index(rows)
        out = torch.empty(w.n if idx is None else idx.numel(), w.k, dtype=w.packed.dtype)
        if idx is not None and idx.numel() == 0:
            return out
        self._sync_threads()
        _check(self._lib.tm_unpack_weight(DTYPES[w.packed.dtype], w.packed.data_ptr(), w.n, w.k,
                                          _ptr(idx), 0 if idx is None else idx.numel(),
                                          out.data_ptr()) == 0,
               f"unpack: row indices in [0, {w.n})")
        if w.gated:  # undo the interleave: gate[0:h], up[0:h], gate[h:2h], ...
            h = self.panel_rows // 2
            out = out.view(-1, 2, h, w.k).transpose(0, 1).reshape(w.n, w.k)
        return out

    def can_gate(self, n: int) -> bool:
        return n % self.panel_rows == 0

    def linear(self, x: torch.Tensor, w: PackedLinear, out_fp32: bool = False,
               prompt_rows: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """x (m, k) @ w.T + bias, in x's dtype (float32 with out_fp32: from the accumulators);
        for a gated weight silu(gate) x up of that (pack). prompt_rows: ascending row ranges
        [begin, end) of prompt tokens (see tm.h: a quantized weight's bf16 prompt rows may run
        on its dequantized bf16 form)."""
        _check(x.dim() == 2 and x.shape[1] == w.k and x.dtype in DTYPES
               and (w.bits or x.dtype == w.packed.dtype),
               f"linear: x {tuple(x.shape)} {x.dtype} vs weight ({w.n}, {w.k}) {w.packed.dtype}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], w.n // 2 if w.gated else w.n,
                          dtype=torch.float32 if out_fp32 else x.dtype, device=x.device)
        self._sync_threads()
        ranges = _row_ranges(prompt_rows, x.shape[0]) if w.bits else None
        self._lib.tm_linear_fwd(DTYPES[x.dtype], x.data_ptr(), x.shape[0], ctypes.byref(w.struct),
                                DTYPES[out.dtype], out.data_ptr(), _ptr(ranges),
                                0 if ranges is None else ranges.numel() // 2)
        return out

    # ---- attention --------------------------------------------------------------------------
    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, window, scale):
        """q: (batch, heads, head_dim) against one layer's (blocks, block_size, kv_heads,
        head_dim) cache through block_tables (batch, max_blocks); window 0 = unlimited. The
        kernel takes any head_dim (its scratch is sized at run time); the engine sends at most
        256 for K/V caches and MLA's latent rows (up to MAX_LATENT_DIM) as one shared head."""
        _check(q.dim() == 3 and k_cache.dim() == 4 and q.dtype == k_cache.dtype == v_cache.dtype
               and k_cache.is_contiguous() and v_cache.is_contiguous()
               and q.shape[2] % 8 == 0 and q.shape[2] <= MAX_LATENT_DIM
               and k_cache.shape[3] == q.shape[2],
               "decode_attention: head_dim a multiple of 8 up to 1024, caches of q's dtype")
        q = q.contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        b, h, d = q.shape
        self._sync_threads()
        self._lib.tm_decode_attention(DTYPES[q.dtype], q.data_ptr(), k_cache.data_ptr(),
                                      v_cache.data_ptr(), k_cache.shape[1], k_cache.shape[2],
                                      tables.data_ptr(), tables.shape[1], lens.data_ptr(), b, h,
                                      d, window or 0, scale, out.data_ptr())
        return out

    def prefill_attention(self, q, k_cache, v_cache, block_table, num_computed, window, scale):
        """q: (new tokens, heads, head_dim) of one sequence, at positions num_computed onward,
        causally against its paged K/V (its own K/V stored already); window 0 = unlimited."""
        _check(q.dim() == 3 and k_cache.dim() == 4 and q.dtype == k_cache.dtype == v_cache.dtype
               and k_cache.is_contiguous() and v_cache.is_contiguous()
               and k_cache.shape[3] == q.shape[2], "prefill_attention: caches of q's dtype")
        q = q.contiguous()
        table = block_table.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        n, h, d = q.shape
        self._sync_threads()
        self._lib.tm_prefill_attention(DTYPES[q.dtype], q.data_ptr(), n, h, d, k_cache.data_ptr(),
                                       v_cache.data_ptr(), k_cache.shape[1], k_cache.shape[2],
                                       table.data_ptr(), num_computed, window or 0, scale,
                                       out.data_ptr())
        return out

    def decode_stack(self, decoder: Decoder, x: torch.Tensor, positions, pools,
                     chunk_starts: list[int] | None = None,
                     prompt_rows: list[tuple[int, int]] | None = None,
                     out_rows: list[int] | None = None) -> torch.Tensor:
        """All layers of a step (see tm.h); x (batch, hidden) holds the embeddings and is
        returned holding the final norm's output. pools: per KV pool, (k_cache, v_cache,
        slots, block_tables, seq_lens, stage_rows, stages) with caches (layers, blocks,
        block_size, ...); the last two None but for an int4 cache. chunk_starts: where each
        prefill chunk starts and the last one ends (rows before the first: decode rows); the
        tables and lens hold the decode rows' and then one row per chunk. prompt_rows: as
        linear takes them, for every layer's projections. out_rows (ascending, the decode
        rows first; with chunks only): the rows whose output is returned, the only ones the
        last layer runs past its K/V."""
        x = x.contiguous().clone()
        pos = positions.to(torch.int64).contiguous()
        starts = torch.tensor(chunk_starts or [], dtype=torch.int64)
        ranges = _row_ranges(prompt_rows, x.shape[0])
        keep, structs = [], (KVPool * len(pools))()
        for i, (k_cache, v_cache, *index) in enumerate(pools):
            index = [None if t is None else t.to(torch.int64).contiguous() for t in index]
            keep += index
            slots, tables, lens, stage_rows, stages = index
            structs[i] = KVPool(k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
                                slots.data_ptr(), tables.data_ptr(), tables.shape[1],
                                lens.data_ptr(), _ptr(stage_rows), _ptr(stages))
        outs = None
        if out_rows is not None:
            decodes = chunk_starts[0] if chunk_starts else x.shape[0]
            _check(chunk_starts and list(out_rows[:decodes]) == list(range(decodes))
                   and all(a < b for a, b in zip(out_rows, out_rows[1:]))
                   and (not out_rows or out_rows[-1] < x.shape[0]),
                   "out_rows: ascending rows of a step with chunks, every decode row first")
            outs = torch.tensor(list(out_rows), dtype=torch.int64, device="cpu")
        self._sync_threads()
        self._lib.tm_decode_stack(ctypes.byref(decoder), x.data_ptr(), x.shape[0], pos.data_ptr(),
                                  structs, pools[0][0].shape[2], starts.data_ptr(),
                                  max(0, len(starts) - 1), _ptr(ranges),
                                  0 if ranges is None else ranges.numel() // 2, _ptr(outs),
                                  0 if outs is None else outs.numel())
        return x if outs is None else x[:outs.numel()]


def _row_ranges(ranges: list[tuple[int, int]] | None, rows: int) -> torch.Tensor | None:
    """Row ranges as the kernels take them (begin, end pairs, int64), checked: non-empty,
    ascending, disjoint and inside [0, rows); None for none."""
    if not ranges:
        return None
    flat = [v for r in ranges for v in r]
    _check(flat[0] >= 0 and flat[-1] <= rows and all(
        a < b if i % 2 == 0 else a <= b for i, (a, b) in enumerate(zip(flat, flat[1:]))),
        f"prompt_rows {ranges}: ascending disjoint ranges in [0, {rows})")
    return torch.tensor(flat, dtype=torch.int64)
