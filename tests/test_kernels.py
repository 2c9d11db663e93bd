"""Every C++ kernel against its PyTorch reference (the definition), in float32 and bfloat16,
and whole models with kernels on and off."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import _cpu_has_avx2, load_cpu_kernels
from tokenmill.layers import ops

# Where the kernels can build (x86-64 with AVX2 and a C++ compiler) they must: a build error
# would otherwise silently fall back to the reference paths and skip these tests.
CAN_BUILD = _cpu_has_avx2() and shutil.which("c++") is not None
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="no AVX2 CPU or no C++ compiler here")


def test_kernels_build_here():
    assert load_cpu_kernels() is not None
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture
def kernels():
    with ops.kernels(True) as on:
        yield on


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def close(a, b, dtype):
    assert a.dtype == b.dtype == dtype and a.shape == b.shape
    scale = b.float().abs().max().item() + 1e-6
    assert (a.float() - b.float()).abs().max().item() / scale < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 16, 40])
# 3: fewer than the 4 k steps of one assembly iteration; 3001: an odd k tail, row blocks of 18
@pytest.mark.parametrize("k", [3, 72, 3001])
def test_linear(kernels, dtype, rows, k):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, k).to(dtype), torch.randn(37, k).to(dtype), torch.randn(37)
    close(ops.linear(x, w, b.to(dtype)), torch.nn.functional.linear(x, w, b.to(dtype)), dtype)
    close(ops.linear(x, w), torch.nn.functional.linear(x, w), dtype)
    fp32 = ops.linear(x, w, out_fp32=True)
    close(fp32, torch.nn.functional.linear(x.float(), w.float()), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_weight_layout(dtype):
    """Panel p, position k holds rows 16p..16p+15 at k; bf16 lanes pair row i with row 8 + i."""
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3).to(dtype)
    packed = ops.pack_weight(w)
    assert packed.shape == (3, 3, 16) and packed.dtype == dtype
    order = [r for i in range(8) for r in (i, 8 + i)] if dtype == torch.bfloat16 else range(16)
    for p in range(3):
        for k in range(3):
            rows = [16 * p + r for r in order]
            want = [w[r, k].item() if r < 40 else 0.0 for r in rows]
            assert packed[p, k].tolist() == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual(kernels, dtype):
    torch.manual_seed(1)
    x, res, w = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype), torch.rand(64).to(dtype)
    close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6), dtype)
    ref_res = res + x
    out, new_res = ops.add_rms_norm(x, res.clone(), w, 1e-6)
    close(new_res, ref_res, dtype)
    close(out, ops.rms_norm_ref(ref_res, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40])  # 40: eight-lane steps and a scalar tail
def test_rope_and_silu_mul(kernels, dtype, head_dim):
    from tokenmill.layers.rotary import RotaryEmbedding

    torch.manual_seed(2)
    table = RotaryEmbedding(head_dim, 128, 10000.0, None).cos_sin
    q, k = torch.randn(6, 4, head_dim).to(dtype), torch.randn(6, 2, head_dim).to(dtype)
    pos = torch.tensor([0, 5, 9, 64, 100, 127])
    fq, fk = ops.rope(q.clone(), k.clone(), table, pos)
    # the same roundings in the same order as the reference: equal, not just close
    assert torch.equal(fq, ops.rope_ref(q, table, pos))
    assert torch.equal(fk, ops.rope_ref(k, table, pos))
    x = torch.randn(3, 2 * 48).to(dtype)
    close(ops.silu_mul(x), ops.silu_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("block_size", [8, 32])
# tasks: 2 seqs x 2 KV heads >= 4 x 1 thread: per GQA group, < 4 x 2 threads: per query head;
# 9 seqs >= 4 x threads: per sequence (both KV heads side by side)
@pytest.mark.parametrize("seqs", [2, 9])
def test_decode_attention(kernels, dtype, window, threads, block_size, seqs):
    from tokenmill.layers.attention import AttentionContext, PagedAttention
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(3)
    cache = KVCache(1, 10, block_size, 2, 32, dtype, torch.device("cpu"))
    slots = 10 * block_size
    cache.store(0, torch.randn(slots, 2, 32), torch.randn(slots, 2, 32), torch.arange(slots))
    tables = torch.tensor([[3, 1, 4, 0, 5, 9, 2, 6], [7, 8, 0, 0, 0, 0, 0, 0]])
    lens = torch.tensor([61, 13])
    if seqs > 2:  # more sequences reading (sharing) the same blocks in other orders
        more = [torch.randperm(10)[:8] for _ in range(seqs - 2)]
        tables = torch.stack([tables[0], tables[1], *more])
        lens = torch.cat([lens, torch.randint(1, 8 * block_size + 1, (seqs - 2,))])
    q = torch.randn(seqs, 6, 32).to(dtype)
    attn = PagedAttention(6, 2, 32, 0, sliding_window=window)
    fast = ops.decode_attention(q, cache.k[0][0], cache.v[0][0], tables, lens, window,
                                attn.scale)
    ctx = AttentionContext(cache, torch.tensor([]), seqs, decode_block_tables=tables,
                           decode_seq_lens=lens)
    with ops.kernels(False):
        k, v = cache.gather(0, tables, dtype)
        ref = attn._sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                         mask=ctx.decode_mask(window))[:, :, 0]
    close(fast, ref, dtype)


def greedy(path, dtype, use_kernels, prompts):
    llm = LLM(str(path), dtype=dtype, use_kernels=use_kernels, max_num_batched_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_model_float32_kernels_equal_reference(tiny_llama):
    prompts = random_prompts(6, 3, 70, seed=8)  # 70 > 32: chunked prefill + big-batch linear
    fast, fast_llm = greedy(tiny_llama[0], "float32", True, prompts)
    ref, ref_llm = greedy(tiny_llama[0], "float32", False, prompts)
    assert fast_llm.engine.runner.kernels and not ref_llm.engine.runner.kernels
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


def test_decode_stack_equals_layer_by_layer(tiny_llama, tmp_path):
    """The C++ decode stack against the same kernels called layer by layer from Python, on a
    Qwen3 (q/k norm), a sliding-window Mistral and a QKV-bias Qwen2."""
    from tests.conftest import save_tiny_model
    from tokenmill.models import llama

    prompts = random_prompts(4, 3, 40, seed=10)
    for arch, extra in (("qwen3", {"head_dim": 32}), ("mistral", {"sliding_window": 8}),
                        ("qwen2", {})):
        path = tmp_path / arch
        save_tiny_model(path, arch, **extra)
        calls = []
        real = ops.decode_stack
        ops.decode_stack = lambda *a, calls=calls, real=real: calls.append(1) or real(*a)
        try:
            fused, _ = greedy(path, "float32", True, prompts)
        finally:
            ops.decode_stack = real
        assert len(calls) >= 15  # every all-decode step went through the C++ stack
        original = llama.LlamaModel._decode_stack_applies
        llama.LlamaModel._decode_stack_applies = lambda *a: False
        try:
            layered, _ = greedy(path, "float32", True, prompts)
        finally:
            llama.LlamaModel._decode_stack_applies = original
        assert fused == layered, arch


@pytest.mark.parametrize("n", [1, 7, 8, 21, 49152])
def test_argmax(kernels, n):
    torch.manual_seed(5)
    x = torch.randn(6, n)
    x[1] = x[1].round()  # ties: the first maximum wins
    x[2, -1] = x[2].max() + 1  # the maximum in the tail (or the last vector)
    x[3] = -float("inf")
    x[4, n // 2] = float("nan")  # NaN counts as the largest
    x[5, ::2] = float("nan")
    assert torch.equal(ops.argmax(x), x.argmax(-1))
