"""KernelOps: the ops of layers/ops.py on tokenmill's C++ CPU kernels (kernels/) for float32 /
bfloat16 tensors on the CPU, the reference's results with one call instead of many small ops;
anything else goes to the reference (TorchOps). tests/test_kernels.py checks every kernel
against its reference."""

from __future__ import annotations

import contextlib

import torch

from tokenmill.layers.ops import KERNEL_DTYPES, TorchOps
from tokenmill.quantization import BlockQuant


class KernelOps(TorchOps):
    """The C++ kernels of one instruction set (a kernels.lib.KernelLib)."""

    def __init__(self, lib, planner=None) -> None:
        from tokenmill.kernels.gemm_plan import GemmPlanner

        self.lib = lib
        self.name = f"kernels ({lib.isa})"
        self.planner = planner or GemmPlanner.for_lib(lib)
        self._sdpa_from: dict = {}  # (heads, kv heads, head_dim, dtype) -> key length
        self._prompt: tuple | None = None  # the step's (prompt row ranges, rows): prompt_rows

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in KERNEL_DTYPES

    def rms_norm(self, x, weight, eps):
        if self.fits(x) and weight.dtype == x.dtype:
            return self.lib.rms_norm(x.contiguous(), weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if self.fits(x) and weight.dtype == x.dtype == residual.dtype and residual.is_contiguous():
            return self.lib.rms_norm(residual, weight, eps, add=x), residual
        return super().add_rms_norm(x, residual, weight, eps)

    def rope(self, q, k, cos_sin, positions):
        if self.fits(q) and q.dtype == k.dtype:
            q, k = q.contiguous(), k.contiguous()
            self.lib.rope(q, cos_sin, positions)
            self.lib.rope(k, cos_sin, positions)
            return q, k
        return super().rope(q, k, cos_sin, positions)

    def silu_mul(self, x):
        return self.lib.silu_mul(x) if self.fits(x) else super().silu_mul(x)

    def gelu_tanh_mul(self, x):
        return self.lib.gelu_tanh_mul(x) if self.fits(x) else super().gelu_tanh_mul(x)

    def prepare_linear(self, weight, bias, gated=False):
        from tokenmill.kernels.gemm_plan import NEVER, PreparedLinear
        from tokenmill.kernels.lib import PackedLinear

        q = getattr(weight, "quant", None)
        if q is not None:  # the codes as packed at load, with this bias
            b = None if bias is None else bias.detach().float().contiguous()
            return PreparedLinear(PackedLinear(q.packed, b, q.n, q.k, q.quant, runs=q.runs),
                                  NEVER, None)
        if weight.device.type != "cpu" or weight.dtype not in KERNEL_DTYPES or weight.dim() != 2:
            return None
        return self.planner.prepare(weight, bias, gated and self.lib.can_gate(weight.shape[0]))

    def runs_prepared_only(self, prepared) -> bool:
        """A float weight whose every row count runs on the packed GEMM (PyTorch's never won
        the planner's measurement): its rows are needed only to rebuild them (dropped_rows)."""
        from tokenmill.kernels.gemm_plan import NEVER

        return prepared is not None and not prepared.packed.bits and (
            prepared.torch_from_rows == NEVER)

    def dropped_rows(self, prepared, rows=None):
        return self.lib.unpack(prepared.packed, rows)

    @property
    def quantized_kernels(self) -> bool:
        return self.lib.quant_fast

    def pack_quantized(self, parts: list):
        """Each part packed where it lands (no stacked copy of the codes), in its own code
        width (a Q4_K_M file's q|k|v: q and k 4-bit, v 8-bit), when every part but the last
        ends on a group of rows; else the stacked parts in the widest. GGUF matrices pack
        straight from their file's blocks."""
        from tokenmill.kernels.lib import MAX_RUNS, QUANT_GROUP
        from tokenmill.quantization.gguf_blocks import GGUFMatrix

        if any(p.shape[0] % QUANT_GROUP for p in parts[:-1]) or len(parts) > MAX_RUNS:
            parts = [BlockQuant.cat(parts)]
        if all(isinstance(p, GGUFMatrix) for p in parts):  # from the file's blocks
            packed = self.lib.qpack_gguf_parts(parts, parts[0].shape[1])
        else:
            parts = [p.block_quant() for p in parts]
            packed = self.lib.qpack_parts([(p.codes, p.d, p.m, p.ks, p.q6) for p in parts],
                                          [p.bits for p in parts])
        if packed.has_q6:
            self.planner.choose_q6_widen()
        return packed

    def dequantize(self, q, rows=None):
        return self.lib.qdequantize(q, rows)

    @contextlib.contextmanager
    def prompt_rows(self, ranges, rows, keep=None):
        previous, self._prompt = self._prompt, ((ranges, rows) if ranges else None)
        if ranges and keep is not None:  # the last layer's calls over the kept rows
            self._prompt += (kept_ranges(ranges, keep), len(keep))
        try:
            yield
        finally:
            self._prompt = previous

    def _prompt_of(self, x) -> list | None:
        """The step's prompt row ranges for a call over all its rows, or over the rows its
        last layer keeps (renumbered); not for one over other subsets (MoE experts' routed
        rows, the LM head's sampled ones)."""
        p = self._prompt
        if p and x.shape[0] == p[1]:
            return p[0]
        return p[2] if p and len(p) > 2 and x.shape[0] == p[3] else None

    def linear(self, x, layer, out_fp32=False):
        """The packed-weight GEMM, or PyTorch's (oneDNN / MKL) from the row count where the
        GEMM planner measured it faster; logits (out_fp32) always come from the packed GEMM's
        float32 accumulators. Quantized weights: the kernels' integer GEMM."""
        prepared = layer.prepared() if self.fits(x) and x.dim() == 2 else None
        quantized = prepared is not None and prepared.packed.bits
        if prepared is None or (x.dtype != layer.weight.dtype and not quantized) or (
                not out_fp32 and x.shape[0] >= prepared.torch_from_rows) or prepared.packed.gated:
            return super().linear(x, layer, out_fp32)
        return self.lib.linear(x, prepared.packed, out_fp32,
                               self._prompt_of(x) if quantized else None)

    def linear_act(self, x, layer, act):
        """silu_mul of a gate|up layer straight from the packed GEMM (a gated pack: one pass,
        the product never stored) where the planner picked the packed kernel; otherwise the
        layer and then act."""
        prepared = layer.prepared() if self.fits(x) and x.dim() == 2 else None
        if (prepared is not None and prepared.packed.gated and act == "silu_mul"
                and x.dtype == layer.weight.dtype and x.shape[0] < prepared.torch_from_rows):
            return self.lib.linear(x, prepared.packed)
        return super().linear_act(x, layer, act)

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, window, scale):
        d = q.shape[-1]
        if self.fits(q) and k_cache.dtype == q.dtype and d % 8 == 0 and d <= 256:
            return self.lib.decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                             window, scale)
        return None

    def latent_decode_attention(self, q, pages, block_tables, seq_lens, scale):
        if self.fits(q) and pages.dtype == q.dtype and q.shape[-1] % 8 == 0:
            return self.lib.decode_attention(q, pages, pages, block_tables, seq_lens, None,
                                             scale)
        return None

    def kv_store(self, cache, layer, k, v, slots, stage_rows=None):
        from tokenmill.kernels.kv_pages import supports

        if not supports(cache):
            return super().kv_store(cache, layer, k, v, slots, stage_rows)
        self.lib.kv_store(cache, layer, k, v, slots, stage_rows)

    def rope_store(self, q, k, v, rotary, positions, cache, layer, slots, stage_rows=None):
        # q, k, v: views of one projection's rows (q | k | v side by side), whole-head RoPE,
        # into an unquantized cache of their dtype
        D, hq, hk = q.shape[-1], q.shape[1], k.shape[1]
        rows = (q.stride(0), D, 1)
        step = D * q.element_size()
        if (rotary.rotary_dim != D or not cache.lossless(q.dtype) or not self.fits(q)
                or not q.stride() == k.stride() == v.stride() == rows
                or k.data_ptr() != q.data_ptr() + hq * step
                or v.data_ptr() != k.data_ptr() + hk * step):
            return None
        qkv = q.as_strided((q.shape[0], (hq + 2 * hk) * D), (q.stride(0), 1))
        flat = lambda part: part[layer].view(-1, hk, D)  # noqa: E731
        return self.lib.rope_store(qkv, hq, hk, rotary.cos_sin, positions, flat(cache.k[0]),
                                   flat(cache.v[0]), slots)

    def decode_attention_quant(self, q, cache, layer, block_tables, seq_lens, stages, window,
                               scale):
        from tokenmill.kernels.kv_pages import supports

        if not supports(cache):
            return None
        return self.lib.decode_attention_quant(q, cache, layer, block_tables, seq_lens, stages,
                                               window, scale)

    def prefill_attention_quant(self, q, cache, layer, block_table, stage_table, num_computed,
                                window, scale):
        from tokenmill.kernels.kv_pages import supports

        if not supports(cache):
            return None
        return self.lib.prefill_attention_quant(q, cache, layer, block_table, stage_table,
                                                num_computed, window, scale)

    def prefill_attention(self, q, k_cache, v_cache, block_table, num_computed, window, scale):
        """bf16 only: float32 is the mode checked against transformers (logits within 1e-4),
        where PyTorch's SDPA measured closer to it than the kernel's summation order."""
        n, heads, d = q.shape
        if not (self.fits(q) and k_cache.dtype == q.dtype) or num_computed + n >= \
                self.prefill_kernel_len(heads, k_cache.shape[2], d, q.dtype):
            return None
        return self.lib.prefill_attention(q, k_cache, v_cache, block_table, num_computed, window,
                                          scale)

    def prefill_kernel_len(self, heads, kv_heads, head_dim, dtype) -> int:
        """The key length from which a prefill chunk does not run the paged kernel (0: never
        runs it): bf16, head_dim a multiple of 8 up to 256, below the plan's SDPA length."""
        if dtype != torch.bfloat16 or head_dim % 8 or head_dim > 256:
            return 0
        return self.prepare_attention(heads, kv_heads, head_dim, dtype)

    def prepare_attention(self, heads, kv_heads, head_dim, dtype) -> int:
        """The key length from which SDPA runs a prefill chunk (kernels/attention_plan.py)."""
        from tokenmill.kernels.attention_plan import sdpa_from_len

        key = (heads, kv_heads, head_dim, dtype)
        if key not in self._sdpa_from:
            self._sdpa_from[key] = sdpa_from_len(self.planner, *key)
        return self._sdpa_from[key]

    def argmax(self, x):
        if self.fits(x) and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0:
            return self.lib.argmax_rows(x)
        return super().argmax(x)

    def sample(self, logits, temperatures, top_k, top_p, min_p, u):
        if not (self.fits(logits) and logits.dtype == torch.float32 and logits.dim() == 2
                and logits.shape[1] > 0):
            return super().sample(logits, temperatures, top_k, top_p, min_p, u)
        dev = logits.device
        floats = torch.tensor([temperatures, top_p, min_p], dtype=torch.float32, device=dev)
        return self.lib.sample_rows(logits, floats[0],
                                    torch.tensor(top_k, dtype=torch.int64, device=dev),
                                    floats[1], floats[2], u.float().contiguous())

    def fused_decoder(self, weights):
        from tokenmill.layers.fused_decode import FusedDecoder

        if weights is None or not self.fits(weights.final_norm) or any(
                lin.prepared() is None or lin.input_perm is not None for layer in weights.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)):
            return None  # e.g. a float16 model, or act-order GPTQ: layers run op by op
        return FusedDecoder(self.lib, weights, self.prefill_kernel_len)


# ---- choosing -----------------------------------------------------------------------------


def kept_ranges(ranges, keep) -> list[tuple[int, int]]:
    """The prompt rows among `keep` (ascending rows of a step) as ranges of their places in
    keep: the prompt rows of the last layer's compacted rows, as tm_decode_stack numbers them."""
    out = []
    for i, r in enumerate(keep):
        if any(a <= r < b for a, b in ranges):
            if out and out[-1][1] == i:
                out[-1] = (out[-1][0], i + 1)
            else:
                out.append((i, i + 1))
    return out
