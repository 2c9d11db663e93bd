"""The kernels on quantized KV pages (csrc/kv_pages.h, attention_quant.cpp, the quantized
prefill in attention_prefill.cpp, kv_store.cpp) behind torch tensors: KernelLib's calls on
them, with the same checks before any pointer reaches C."""

from __future__ import annotations

import ctypes
from ctypes import c_void_p

import torch


class KVPages(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int32), ("codes", c_void_p), ("scale", c_void_p),
                ("zero", c_void_p)]


KV_FORMATS = {"int8": 1, "int4": 2, "fp8_e4m3": 3}  # TM_KV_INT8, TM_KV_INT4, TM_KV_FP8


def pages(fmt: str, parts) -> KVPages:
    """One layer's quantized cache parts (codes, scale[, minimum]) as the kernels read them."""
    zero = parts[2].data_ptr() if len(parts) > 2 else None
    return KVPages(KV_FORMATS[fmt], parts[0].data_ptr(), parts[1].data_ptr(), zero)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"tokenmill kernel: {what}")


class KVPageCalls:
    """Mixed into kernels.lib.KernelLib, which provides _lib and _sync_threads."""

    def decode_attention_quant(self, q, fmt: str, k_parts, v_parts, block_tables, seq_lens,
                               window, scale):
        """decode_attention on one layer's quantized cache: k_parts / v_parts are its stored
        parts (codes, scale[, minimum]), each (blocks, block_size, kv_heads, width); float32 in
        and out."""
        codes = k_parts[0]
        _check(q.dim() == 3 and codes.dim() == 4 and fmt in KV_FORMATS
               and all(p.is_contiguous() for p in (*k_parts, *v_parts))
               and q.shape[1] % codes.shape[2] == 0, "decode_attention_quant: bad cache parts")
        q = q.float().contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        lens = seq_lens.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        b, h, d = q.shape
        k, v = pages(fmt, k_parts), pages(fmt, v_parts)
        self._sync_threads()
        self._lib.tm_decode_attention_quant(q.data_ptr(), ctypes.byref(k), ctypes.byref(v),
                                            codes.shape[1], codes.shape[2], tables.data_ptr(),
                                            tables.shape[1], lens.data_ptr(), b, h, d,
                                            window or 0, scale, out.data_ptr())
        return out

    def prefill_attention_quant(self, q, fmt: str, k_parts, v_parts, block_table, num_computed,
                                window, scale):
        """prefill_attention on one layer's quantized cache (parts as decode_attention_quant);
        q float32 or bfloat16 (keys rounded to bf16 then), out in q's dtype."""
        _check(q.dim() == 3 and fmt in KV_FORMATS and k_parts[0].shape[2] == v_parts[0].shape[2]
               and all(p.is_contiguous() for p in (*k_parts, *v_parts))
               and q.shape[1] % k_parts[0].shape[2] == 0, "prefill_attention_quant: bad parts")
        q = (q if q.dtype == torch.bfloat16 else q.float()).contiguous()
        table = block_table.to(torch.int64).contiguous()
        out = torch.empty_like(q)
        k, v = pages(fmt, k_parts), pages(fmt, v_parts)
        self._sync_threads()
        dtype = int(q.dtype == torch.bfloat16)  # TM_BF16 = 1, TM_F32 = 0
        self._lib.tm_prefill_attention_quant(dtype, q.data_ptr(), *q.shape, ctypes.byref(k),
                                             ctypes.byref(v), k_parts[0].shape[1],
                                             k_parts[0].shape[2], table.data_ptr(), num_computed,
                                             window or 0, scale, out.data_ptr())
        return out

    def kv_store(self, fmt: str, x: torch.Tensor, parts, slots: torch.Tensor,
                 rotation: torch.Tensor | None = None) -> None:
        """Quantize x (tokens, kv_heads, head_dim) into one layer's cache parts at slots, as
        layers/kv_quant.py's encoder does (int4: after x @ rotation)."""
        _check(x.dim() == 3 and fmt in KV_FORMATS and x.shape[2] <= 256
               and all(p.is_contiguous() for p in parts) and parts[0].shape[2] == x.shape[1],
               "kv_store: (tokens, kv_heads, head_dim <= 256) into this layer's parts")
        x = x.float().contiguous()
        slots = slots.to(torch.int64).contiguous()
        rot = None if rotation is None else rotation.float().contiguous()
        target = pages(fmt, parts)
        self._sync_threads()
        self._lib.tm_kv_store(KV_FORMATS[fmt], x.data_ptr(), x.shape[0], x.shape[1], x.shape[2],
                              None if rot is None else rot.data_ptr(), slots.data_ptr(),
                              ctypes.byref(target))
