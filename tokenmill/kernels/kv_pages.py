"""The kernels on quantized KV pages (csrc/kv_pages.h, attention_quant.cpp, the quantized
prefill in attention_prefill.cpp, kv_store.cpp) behind torch tensors: KernelLib's calls on
one layer of a KVCache (layers/kv_cache.py), with the same checks before any pointer reaches
C."""

from __future__ import annotations

import ctypes
from ctypes import c_void_p

import torch

# K's format code (TM_KV_INT8, TM_KV_INT4, TM_KV_FP8); int4's V is TM_KV_INT4V
KV_FORMATS = {"int8": 1, "int4": 2, "fp8_e4m3": 3}
INT4V = 4
STAGE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # TM_F32, TM_BF16


class KVPages(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int32), ("codes", c_void_p), ("scale", c_void_p),
                ("params", c_void_p), ("stage", c_void_p), ("stage_dtype", ctypes.c_int32)]


def supports(cache) -> bool:
    """Whether the kernels read and write this cache (its format, head_dim, stage dtype)."""
    d = cache.head_dim
    return (cache.format.name in KV_FORMATS and cache.k[0].device.type == "cpu" and d <= 256
            and d % 32 == 0 and (cache.stage is None or cache.stage.dtype in STAGE_DTYPES))


def pages(cache, layer: int, kind: str) -> KVPages:
    """One layer's K or V pages as the kernels read them."""
    parts = cache.k if kind == "k" else cache.v
    fmt = KV_FORMATS[cache.format.name]
    if kind == "v" and fmt == KV_FORMATS["int4"]:
        fmt = INT4V
    scale = parts[1][layer].data_ptr() if len(parts) > 1 else None
    params = stage = None
    dtype = 0
    if kind == "k" and cache.staged:
        params, stage = cache.k_blocks[0][layer].data_ptr(), cache.stage[layer].data_ptr()
        dtype = STAGE_DTYPES[cache.stage.dtype]
    return KVPages(fmt, parts[0][layer].data_ptr(), scale, params, stage, dtype)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"tokenmill kernel: {what}")


def _index(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.int64).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class KVPageCalls:
    """Mixed into kernels.lib.KernelLib, which provides _lib and _sync_threads."""

    def decode_attention_quant(self, q, cache, layer: int, block_tables, seq_lens, stages,
                               window, scale):
        """decode_attention on one layer of a quantized cache; float32 in and out (int4: the
        output in V's rotated basis). stages: an int4 cache's stage slot of each row's own
        block. A row's output does not depend on the batch (attention_pieces.h)."""
        _check(q.dim() == 3 and q.shape[1] % cache.k[0].shape[3] == 0
               and (stages is not None or not cache.staged), "decode_attention_quant: bad call")
        q = q.float().contiguous()
        tables, lens, stages = _index(block_tables), _index(seq_lens), _index(stages)
        out = torch.empty_like(q)
        b, h, d = q.shape
        k, v = pages(cache, layer, "k"), pages(cache, layer, "v")
        self._sync_threads()
        self._lib.tm_decode_attention_quant(q.data_ptr(), ctypes.byref(k), ctypes.byref(v),
                                            cache.block_size, cache.k[0].shape[3],
                                            tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                            _ptr(stages), b, h, d, window or 0, scale,
                                            out.data_ptr())
        return out

    def prefill_attention_quant(self, q, cache, layer: int, block_table, stage_table,
                                num_computed, window, scale):
        """prefill_attention on one layer of a quantized cache; q float32 or bfloat16 (keys
        rounded to bf16 then), out in q's dtype (int4: in V's rotated basis)."""
        _check(q.dim() == 3 and q.shape[1] % cache.k[0].shape[3] == 0
               and (stage_table is not None or not cache.staged),
               "prefill_attention_quant: bad call")
        q = (q if q.dtype == torch.bfloat16 else q.float()).contiguous()
        table, stages = _index(block_table), _index(stage_table)
        out = torch.empty_like(q)
        k, v = pages(cache, layer, "k"), pages(cache, layer, "v")
        self._sync_threads()
        dtype = int(q.dtype == torch.bfloat16)  # TM_BF16 = 1, TM_F32 = 0
        self._lib.tm_prefill_attention_quant(dtype, q.data_ptr(), *q.shape, ctypes.byref(k),
                                             ctypes.byref(v), cache.block_size,
                                             cache.k[0].shape[3], table.data_ptr(),
                                             _ptr(stages), num_computed, window or 0, scale,
                                             out.data_ptr())
        return out

    def kv_store(self, cache, layer: int, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, stage_rows: torch.Tensor | None = None) -> None:
        """Write k, v (tokens, kv_heads, head_dim) into one layer of a quantized cache at
        slots, as layers/kv_quant.py's and kv_int4.py's encoders do (int4: K into the stage at
        stage_rows, full blocks quantized; V rotated first)."""
        _check(k.dim() == 3 and k.shape == v.shape and k.shape[2] <= 256
               and cache.k[0].shape[3] == k.shape[1]
               and (stage_rows is not None or not cache.staged),
               "kv_store: (tokens, kv_heads, head_dim <= 256) into this layer's parts")
        slots, stage_rows = _index(slots), _index(stage_rows)
        rot = None
        if cache.format.v_rotated:
            rot = cache.format.rotation(k.shape[2], k.device).float().contiguous()
        self._sync_threads()
        for x, kind in ((k, "k"), (v, "v")):
            x = x.float().contiguous()
            target = pages(cache, layer, kind)
            self._lib.tm_kv_store(target.format, x.data_ptr(), x.shape[0], x.shape[1],
                                  x.shape[2], _ptr(rot) if kind == "v" else None,
                                  slots.data_ptr(), _ptr(stage_rows), cache.block_size,
                                  ctypes.byref(target))
