"""Hot-path operators behind one interface, with two implementations:

- TorchOps: plain PyTorch, the reference (the definition of each op), on any device and dtype;
- KernelOps (layers/kernel_ops.py): tokenmill's C++ CPU kernels (kernels/), the same results
  with one call instead of many small ops, for float32/bfloat16 tensors on the CPU; anything
  else goes to TorchOps.

Implementations are chosen when modules are built, not per call (vLLM's CustomOp): a module
keeps `ops.current()` from its constructor, and the engine builds its model inside
`with ops.building(backend):`. Two engines in one process keep their own choice.
tests/test_kernels.py checks every kernel against its reference.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from tokenmill.quantization import BlockQuant

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# ---- references ---------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # x: (tokens, heads, head_dim); cos_sin: (2, max_positions, head_dim / 2) float32, each
    # column for both halves, as Hugging Face's cos/sin of cat((freqs, freqs)) hold it twice
    cos = cos_sin[0, positions].to(x.dtype).repeat(1, 2)[:, None, :]  # (tokens, 1, head_dim)
    sin = cos_sin[1, positions].to(x.dtype).repeat(1, 2)[:, None, :]
    return x * cos + rotate_half(x) * sin


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation of GELU (Gemma's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class TorchOps:
    """The reference implementation of every op."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + x becomes the new residual stream; returns (its norm, new residual)."""
        residual = residual + x
        return rms_norm_ref(residual, weight, eps), residual

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_ref(q, cos_sin, positions), rope_ref(k, cos_sin, positions)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul_ref(x)

    def gelu_tanh_mul(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_mul_ref(x)

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None,
                       gated: bool = False):
        """What this implementation precomputes for a weight (packed panels; gated: a gate|up
        weight whose GEMM may also apply silu_mul, see linear_act); None here."""
        return None

    def linear_act(self, x: torch.Tensor, layer, act: str) -> torch.Tensor:
        """act (an op name: silu_mul, gelu_tanh_mul) of a gate|up layer's output."""
        return getattr(self, act)(layer(x))

    # quantized weights (tokenmill/quantization): the reference keeps the BlockQuant and
    # dequantizes it for every use
    quantized_kernels = False  # whether quantized weights run faster than dequantized ones

    def pack_quantized(self, parts: list):
        """The executable form of quantized parts stacked along the output rows."""
        return parts[0].block_quant() if len(parts) == 1 else BlockQuant.cat(parts)

    def dequantize(self, q, rows: torch.Tensor | None = None) -> torch.Tensor:
        """A packed quantized weight (or some of its rows) in float32, columns as stored."""
        return (q if rows is None else q.rows(rows)).dequantize(stored_order=True)

    def quantized_rows(self, q, ids: torch.Tensor) -> torch.Tensor:
        return self.dequantize(q, ids)

    @contextlib.contextmanager
    def prompt_rows(self, ranges: list[tuple[int, int]], rows: int, keep=None):
        """While it lasts, a linear call over a step's `rows` rows knows which of them are
        prompt tokens (ranges [begin, end)), as does one over the rows `keep` its last layer
        runs on (AttentionContext.rows_to_keep): the kernels may multiply those by a quantized
        weight dequantized to bf16 (tm.h, tm_linear_fwd). The reference computes all alike."""
        yield

    def runs_prepared_only(self, prepared) -> bool:
        """Whether every linear call of a layer prepared as `prepared` reads only that, never
        the weight's rows (which the layer may then drop)."""
        return False

    def dropped_rows(self, prepared, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of a weight dropped under runs_prepared_only (all, or those indexed by
        `rows`: a tied embedding's lookups), rebuilt from `prepared`."""
        raise RuntimeError(f"{self.name} drops no weight rows")

    def linear(self, x: torch.Tensor, layer, out_fp32: bool = False) -> torch.Tensor:
        """x @ layer.weight.T + layer.bias, in x's dtype, or in float32 with out_fp32."""
        weight = layer.weight
        q = getattr(weight, "quant", None)
        if q is not None:
            weight = self.dequantize(q).to(x.device, x.dtype)
        elif getattr(weight, "rows_dropped", False):  # rebuilt from the prepared form
            weight = layer.rows()
        if out_fp32 and x.dtype != torch.float32:
            bias = None if layer.bias is None else layer.bias.float()
            return F.linear(x.float(), weight.float(), bias)
        return F.linear(x, weight, layer.bias)

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, window, scale):
        """Paged attention read in place; None when this implementation has none (the caller
        gathers the cache and uses SDPA)."""
        return None

    def prefill_attention(self, q, k_cache, v_cache, block_table, num_computed, window, scale):
        """Causal attention of one sequence's prefill chunk read in place from its paged cache;
        None when this implementation has none for it (the caller uses SDPA)."""
        return None

    def latent_decode_attention(self, q, pages, block_tables, seq_lens, scale):
        """MLA's absorbed decode: q (rows, heads, latent) against one layer's latent pages
        (blocks, block_size, 1, latent), each row both key and value, read in place; the
        output is (rows, heads, latent). None when this implementation has none."""
        return None

    def kv_store(self, cache, layer: int, k: torch.Tensor, v: torch.Tensor,
                 slots: torch.Tensor, stage_rows: torch.Tensor | None = None) -> None:
        """Write a step's new K/V (tokens, kv_heads, head_dim) into `layer` of the cache
        (stage_rows: a staged cache's K rows, layers/kv_cache.py)."""
        cache.store(layer, k, v, slots, stage_rows)

    def rope_store(self, q, k, v, rotary, positions, cache, layer: int, slots,
                   stage_rows=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """rotary(positions, q, k) and kv_store of the rotated k and v in one pass, returning
        the rotated (q, k); None where this implementation does not fuse them (the caller
        then runs the two)."""
        return None

    def decode_attention_quant(self, q, cache, layer: int, block_tables, seq_lens, stages,
                               window, scale):
        """Paged attention on one layer of a quantized cache, float32 q (stages: a staged
        cache's stage slot of each row's own block); the output as V is stored (rotated where
        V is). None when this implementation has none (the caller gathers, dequantizes and uses
        SDPA)."""
        return None

    def prefill_attention_quant(self, q, cache, layer: int, block_table, stage_table,
                                num_computed, window, scale):
        """prefill_attention on a quantized cache, q float32 or bfloat16; None when this
        implementation has none (the caller gathers, dequantizes and uses SDPA)."""
        return None

    def prepare_attention(self, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        """Plan the prefill attention of this shape now (measured once per machine)."""
        return None

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x: (rows, n) -> (rows,) int64: first maximum, NaN counting as the largest."""
        return x.argmax(-1)

    def sample(self, logits: torch.Tensor, temperatures: list[float], top_k: list[int],
               top_p: list[float], min_p: list[float], u: torch.Tensor) -> torch.Tensor | None:
        """One token per row of float32 logits drawn as layers/sampler.py's reference draws
        it (Sampler.probs, then inverse_cdf with the uniforms u); -1 in a row this leaves to
        the reference (temperature 0, a NaN, every logit -inf). None when this implementation
        has no sampler of its own (the reference is the sampler's own tensor code)."""
        return None

    def fused_decoder(self, weights):
        """A callable running all decoder layers of a decode step at once, from a model's
        named weights (layers/fused_decode.py); None when this implementation has none."""
        return None


_REFERENCE = TorchOps()
_building: TorchOps = _REFERENCE


def current() -> TorchOps:
    """The implementation for modules being built now (the reference outside `building`)."""
    return _building


@contextlib.contextmanager
def building(backend: TorchOps):
    """Modules constructed inside use `backend`."""
    global _building
    previous, _building = _building, backend
    try:
        yield backend
    finally:
        _building = previous


def available() -> bool:
    """Whether the C++ kernels load on this machine."""
    from tokenmill.kernels import load_cpu_kernels

    return load_cpu_kernels() is not None


def select(use_kernels: bool, device: torch.device, deterministic: bool = False) -> TorchOps:
    """The kernels for a CPU engine when they load (and are wanted), else the reference;
    deterministic: their batch-invariant form (layers/batch_invariant.py), which needs them."""
    if use_kernels and device.type == "cpu":
        from tokenmill.kernels import load_cpu_kernels

        lib = load_cpu_kernels()
        if lib is not None:
            if deterministic:
                from tokenmill.layers.batch_invariant import BatchInvariantOps

                return BatchInvariantOps(lib)
            from tokenmill.layers.kernel_ops import KernelOps

            return KernelOps(lib)
    if deterministic:
        raise ValueError("deterministic (batch-invariant) mode needs tokenmill's C++ kernels "
                         "on the CPU: they did not load here, or use_kernels/device exclude them")
    return _REFERENCE
