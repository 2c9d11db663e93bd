"""Every C++ kernel against its PyTorch reference (the definition), in float32 and bfloat16, for
every instruction set this CPU runs (the portable scalar build included), and whole models with
kernels on and off."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import build, load_cpu_kernels
from tokenmill.kernels.isa import supported_isas
from tokenmill.layers import ops
from tokenmill.layers.kernel_ops import KernelOps

# Where a compiler exists the kernels must build: a build error would otherwise silently fall
# back to the reference paths and skip these tests.
CAN_BUILD = build.compiler() is not None
pytestmark = [pytest.mark.skipif(not CAN_BUILD, reason="no C++ compiler here"),
              pytest.mark.skipif(os.environ.get("TOKENMILL_KERNELS") == "0",
                                 reason="TOKENMILL_KERNELS=0: reference ops only")]
ISAS = supported_isas()
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def test_kernels_build_here():
    assert load_cpu_kernels() is not None
    assert "scalar" in ISAS


def close(a, b, dtype):
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    scale = b.float().abs().max().item() + 1e-6
    assert (a.float() - b.float()).abs().max().item() / scale < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 9, 16, 40])
# 3: fewer than the 4 k steps of one AVX2 assembly iteration; 3001: odd k tails (and an odd
# pair in the bf16 dot-product layout), row blocks smaller than a tile
@pytest.mark.parametrize("k", [3, 72, 3001])
def test_linear(kops, dtype, rows, k):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, k).to(dtype), torch.randn(37, k).to(dtype), torch.randn(37)
    lib = kops.lib
    close(lib.linear(x, lib.pack(w, b.to(dtype))), F.linear(x, w, b.to(dtype)), dtype)
    close(lib.linear(x, lib.pack(w)), F.linear(x, w), dtype)
    fp32 = lib.linear(x, lib.pack(w), out_fp32=True)
    close(fp32, F.linear(x.float(), w.float()), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("k", [72, 3001])
def test_gated_linear_is_linear_then_silu_mul(kops, dtype, rows, k):
    """A gate|up weight packed gated gives silu_mul of the plain GEMM's output bit for bit
    (with and without a bias), in every build; on AMX 40 rows take the tile path."""
    torch.manual_seed(0)
    lib = kops.lib
    n = 4 * lib.panel_rows  # gate and up of two panels' width each
    assert lib.can_gate(n) and not lib.can_gate(n + lib.panel_rows // 2)
    x, w, b = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    for bias in (None, b):
        plain = lib.silu_mul(lib.linear(x, lib.pack(w, bias)))
        gated = lib.linear(x, lib.pack(w, bias, gated=True))
        assert gated.shape == (rows, n // 2) and torch.equal(gated, plain)
    close(gated, ops.silu_mul_ref(F.linear(x, w, b)), dtype)


@pytest.mark.skipif("amx" not in ISAS, reason="needs AMX")
@pytest.mark.parametrize("gated", [False, True])
def test_amx_bf16_row_does_not_depend_on_the_row_count(gated):
    """On AMX every bf16 row count runs on tiles (under 16 rows, tiles of that many rows), so a
    row's bits are the same in a call of 1 row or of 70 when k is whole tile steps: a bf16
    model's decode, verify and batched rows agree (exact speculation on bf16 weights). So are
    a prompt's 300 rows, which split into one row block per thread (gemm_dot.h)."""
    torch.manual_seed(0)
    lib = load_cpu_kernels("amx")
    n = 4 * lib.panel_rows
    for k in (64, 576):
        w, x = torch.randn(n, k).to(torch.bfloat16), torch.randn(70, k).to(torch.bfloat16)
        packed, plain = lib.pack(w, gated=gated), lib.pack(w)
        full, logits = lib.linear(x, packed), lib.linear(x, plain, out_fp32=True)
        for m in (1, 2, 3, 4, 5, 15, 16, 17, 33):
            assert torch.equal(lib.linear(x[:m], packed), full[:m]), (k, m)
            assert torch.equal(lib.linear(x[m:], packed), full[m:]), (k, m)
            assert torch.equal(lib.linear(x[:m], plain, out_fp32=True), logits[:m]), (k, m)
        prompt = torch.cat([torch.randn(230, k).to(torch.bfloat16), x])
        assert torch.equal(lib.linear(prompt, packed)[230:], full), k


def test_gated_layer_runs_its_act_in_the_gemm(kops):
    """A gated gate|up Linear: linear_act gives the reference's silu_mul of the layer from
    the gated pack's GEMM; the layer called alone still gives gate|up (PyTorch's GEMM)."""
    from tokenmill.layers.linear import Linear

    torch.manual_seed(3)
    n = 2 * kops.lib.panel_rows
    with ops.building(kops):
        layer = Linear(48, [n // 2, n // 2])
    layer.weight.data = torch.randn(n, 48).to(torch.bfloat16)
    layer.gated = True
    ran = []
    real = kops.lib.linear
    kops.lib.linear = lambda x, w, *a: ran.append(w.gated) or real(x, w, *a)
    try:
        x = torch.randn(5, 48).to(torch.bfloat16)
        out = kops.linear_act(x, layer, "silu_mul")
        both = layer(x)
    finally:
        kops.lib.linear = real
    assert layer.prepared().packed.gated and ran == [True]  # layer(x): not the gated GEMM
    close(out, ops.silu_mul_ref(F.linear(x, layer.weight)), torch.bfloat16)
    close(both, F.linear(x, layer.weight), torch.bfloat16)


def expected_pack(w: torch.Tensor, isa: str, nr: int) -> torch.Tensor:
    """The panel layouts gemm.cpp documents, built element by element."""
    n, k = w.shape
    pairs = isa in ("amx", "avx512_bf16") and w.dtype == torch.bfloat16
    depth = (k + 1) // 2 * 2 if pairs else k
    panels = -(-n // nr)
    out = torch.zeros(panels * depth * nr, dtype=w.dtype)
    for p in range(panels):
        for kk in range(depth):
            for j in range(nr):
                if pairs:
                    slot = (kk // 2) * 2 * nr + j * 2 + kk % 2
                elif w.dtype == torch.bfloat16:  # rows j and nr/2 + j share a 32-bit lane
                    slot = kk * nr + (j % (nr // 2)) * 2 + j // (nr // 2)
                else:
                    slot = kk * nr + j
                row = p * nr + j
                if row < n and kk < k:
                    out[p * depth * nr + slot] = w[row, kk]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_weight_layout(kops, dtype):
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3).to(dtype)
    packed = kops.lib.pack(w).packed
    assert torch.equal(packed, expected_pack(w, kops.lib.isa, kops.lib.panel_rows))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 72])  # 72: a tail after whole vectors
def test_rms_norm_and_residual(kops, dtype, hidden):
    torch.manual_seed(1)
    x, res = torch.randn(5, hidden).to(dtype), torch.randn(5, hidden).to(dtype)
    w = torch.rand(hidden).to(dtype)
    close(kops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6), dtype)
    ref_res = res + x
    out, new_res = kops.add_rms_norm(x, res.clone(), w, 1e-6)
    close(new_res, ref_res, dtype)
    close(out, ops.rms_norm_ref(ref_res, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 72])  # whole vectors and scalar tails
def test_rope_and_gated_activations(kops, dtype, head_dim):
    from tokenmill.layers.rotary import RotaryEmbedding

    torch.manual_seed(2)
    table = RotaryEmbedding(head_dim, 128, 10000.0, None).cos_sin
    q, k = torch.randn(6, 4, head_dim).to(dtype), torch.randn(6, 2, head_dim).to(dtype)
    pos = torch.tensor([0, 5, 9, 64, 100, 127])
    fq, fk = kops.rope(q.clone(), k.clone(), table, pos)
    # the same roundings in the same order as the reference: equal, not just close
    assert torch.equal(fq, ops.rope_ref(q, table, pos))
    assert torch.equal(fk, ops.rope_ref(k, table, pos))
    x = torch.randn(3, 2 * (head_dim + 8)).to(dtype)
    close(kops.silu_mul(x), ops.silu_mul_ref(x), dtype)
    x = torch.cat([x, 12 * x, torch.full_like(x[:1], -30.0)])  # tanh saturating both ways
    close(kops.gelu_tanh_mul(x), ops.gelu_tanh_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
# (tokens already cached, new tokens, window): a first chunk, a later chunk reading its history,
# a window shorter than the chunk, one token, a chunk ending mid-block
@pytest.mark.parametrize("computed,new,window", [(0, 37, None), (20, 50, None), (0, 100, 24),
                                                 (33, 17, 8), (0, 1, None), (5, 60, None)])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("d", [40, 64])  # 64: whole AMX tile steps (attention_amx.h)
def test_prefill_attention(kops, dtype, computed, new, window, threads, d):
    from tests.conftest import paged_history
    from tokenmill.layers.attention import PagedAttention, chunk_mask

    torch.manual_seed(4)
    hq, hk, length = 6, 2, computed + new
    cache, table, _, _, _ = paged_history(length, 16, hk, d, dtype)
    q = torch.randn(new, hq, d).to(dtype)
    attn = PagedAttention(hq, hk, d, 0, sliding_window=window)
    fast = kops.lib.prefill_attention(q, cache.k[0][0], cache.v[0][0], table, computed, window,
                                      attn.scale)
    k, v = cache.gather(0, table[None], dtype)
    ref = attn._sdpa(q.transpose(0, 1), k[0, :length].transpose(0, 1),
                     v[0, :length].transpose(0, 1),
                     mask=chunk_mask(computed, new, window, q.device)).transpose(0, 1)
    close(fast, ref, dtype)


def test_prefill_attention_plan(monkeypatch):
    """SDPA from the planned key length on; the kernel below it; float32 stays on SDPA."""
    from tokenmill.kernels import attention_plan

    backend = KernelOps(load_cpu_kernels())
    real = attention_plan.sdpa_from_len
    monkeypatch.setattr(attention_plan, "sdpa_from_len", lambda *a: 64)
    cache = torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16)
    q = torch.randn(20, 4, 32).bfloat16()
    table = torch.arange(8)
    assert backend.prefill_attention(q, cache, cache, table, 40, None, 0.1) is not None
    assert backend.prefill_attention(q, cache, cache, table, 44, None, 0.1) is None  # 64 keys
    assert backend.prefill_attention(q.float(), cache.float(), cache.float(), table, 0, None,
                                     0.1) is None
    monkeypatch.setenv("TOKENMILL_PREFILL_ATTENTION", "sdpa")
    assert real(backend.planner, 4, 2, 32, torch.bfloat16) == 0
    monkeypatch.setenv("TOKENMILL_PREFILL_ATTENTION", "kernel")
    assert real(backend.planner, 4, 2, 32, torch.bfloat16) > 1 << 40


@pytest.mark.parametrize("n", [1, 7, 8, 21, 49152])
def test_argmax(kops, n):
    torch.manual_seed(5)
    x = torch.randn(6, n)
    x[1] = x[1].round()  # ties: the first maximum wins
    x[2, -1] = x[2].max() + 1  # the maximum in the tail (or the last vector)
    x[3] = -float("inf")
    x[4, n // 2] = float("nan")  # NaN counts as the largest
    x[5, ::2] = float("nan")
    assert torch.equal(kops.argmax(x), x.argmax(-1))


def greedy(path, dtype, use_kernels, prompts, kv_cache_dtype="auto"):
    llm = LLM(str(path), dtype=dtype, use_kernels=use_kernels, max_num_batched_tokens=32,
              kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("isa", ISAS)
def test_model_float32_kernels_equal_reference(tiny_llama, isa, monkeypatch):
    monkeypatch.setenv("TOKENMILL_ISA", isa)
    prompts = random_prompts(6, 3, 70, seed=8)  # 70 > 32: chunked prefill + big-batch linear
    fast, fast_llm = greedy(tiny_llama[0], "float32", True, prompts)
    ref, ref_llm = greedy(tiny_llama[0], "float32", False, prompts)
    assert fast_llm.engine.runner.ops.lib.isa == isa and not ref_llm.engine.runner.kernels
    assert fast == ref
    # two engines in one process keep their own choice
    again, _ = greedy(tiny_llama[0], "float32", True, prompts)
    assert again == fast


def test_model_bfloat16_kernels_close_to_reference(tiny_llama):
    prompts = random_prompts(6, 3, 70, seed=9)
    fast, _ = greedy(tiny_llama[0], "bfloat16", True, prompts)
    ref, _ = greedy(tiny_llama[0], "bfloat16", False, prompts)
    same = sum(a == b for x, y in zip(fast, ref) for a, b in zip(x, y))
    assert same / sum(len(r) for r in ref) >= 0.9  # bf16 rounding differs in summation order


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_step_equals_layer_by_layer(tmp_path, monkeypatch, dtype):
    """The fused C++ step against the same kernels called layer by layer from Python, on a
    Qwen3 (q/k norm), a sliding-window Mistral, a QKV-bias Qwen2, a Qwen3 with a global and a
    sliding layer (two KV pools) and a Gemma 3 (four norms, GeGLU, two RoPE tables, two pools):
    the same tokens and logprobs. In float32 it runs the decode-only steps (prefill attention
    is SDPA there); in bf16 also every step with prefill chunks (32-token chunks beside decode
    rows, histories read through the block tables). Both run the same kernels in the same
    order: the numbers are identical."""
    from tests.conftest import save_tiny_model
    from tests.test_gemma3 import tiny_gemma3
    from tokenmill.layers.fused_decode import FusedDecoder
    from tokenmill.models import gemma3, llama

    prompts = random_prompts(4, 3, 70, seed=10)

    def run(path):
        llm = LLM(str(path), dtype=dtype, max_num_batched_tokens=32)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=16, logprobs=3),
                            use_tqdm=False)
        return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()}
                                          for d in o.outputs[0].logprobs]) for o in outs]

    for arch, extra in (("qwen3", {"head_dim": 32}), ("mistral", {"sliding_window": 8}),
                        ("qwen2", {}), ("qwen3", {"use_sliding_window": True, "sliding_window": 8,
                                                  "max_window_layers": 1}), ("gemma3", {})):
        path = tmp_path / f"{arch}-{len(extra)}"
        if arch == "gemma3":
            tiny_gemma3(query_pre_attn_scalar=24).save_pretrained(path)
        else:
            save_tiny_model(path, arch, **extra)
        steps = []  # whether each fused step had prefill chunks
        real = FusedDecoder.__call__
        with monkeypatch.context() as m:
            m.setattr(FusedDecoder, "__call__", lambda self, x, pos, ctx, real=real, steps=steps:
                      steps.append(bool(ctx.prefills)) or real(self, x, pos, ctx))
            fused = run(path)
        assert steps.count(False) >= 15  # every all-decode step went through the fused step
        # bf16: every step with prompt tokens too (129 of them: at least 5 steps of 32), float32
        # prefill attends by SDPA: op by op
        assert steps.count(True) >= 5 if dtype == "bfloat16" else steps.count(True) == 0, arch
        with monkeypatch.context() as m:
            m.setattr(llama.LlamaModel, "_fused_decoder", lambda *a: None)
            m.setattr(gemma3.Gemma3Model, "_fused_decoder", lambda *a: None)
            layered = run(path)
        assert fused == layered, arch


def test_float16_model_runs_op_by_op(tiny_llama):
    """The kernels take float32 and bf16; a float16 model on the CPU runs the reference ops
    (and no fused decode step) with the kernels on, as it does with them off."""
    prompts = random_prompts(2, 3, 20, seed=11)
    fast, llm = greedy(tiny_llama[0], "float16", True, prompts)
    ref, _ = greedy(tiny_llama[0], "float16", False, prompts)
    assert llm.engine.runner.kernels and llm.engine.runner.model.model._fused is False
    assert fast == ref


@pytest.mark.parametrize("arch,extra", [
    ("mistral", {"sliding_window": 8}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
])
@pytest.mark.parametrize("chunk", [2048, 16])  # one prefill chunk, or 16-token chunks
def test_bf16_prefill_attention_in_models(tmp_path, arch, extra, chunk):
    """bf16 prefill runs the paged prefill kernel (windows, two block pools, chunks reading
    their history through block tables with released blocks): logits close to the reference
    ops' (bf16 rounding apart)."""
    from tests.conftest import save_tiny_model

    save_tiny_model(tmp_path, arch, **extra)
    ids = random_prompts(1, 45, 45, seed=12)[0]
    logits = [LLM(str(tmp_path), dtype="bfloat16", use_kernels=kernels, max_model_len=128,
                  max_num_batched_tokens=chunk).engine.compute_logits(ids)
              for kernels in (True, False)]
    scale = logits[1].abs().max().item()
    assert (logits[0] - logits[1]).abs().max().item() < 0.05 * scale
