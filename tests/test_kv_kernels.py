"""The kernels of quantized KV pages (kernels/csrc/kv_store.cpp, attention_quant.cpp, and the
fused decode step on them), for every instruction set this CPU runs, against the plain path:
layers/kv_quant.py's encoder, gather + dequantize + SDPA, and the layer-by-layer model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import paged_history, random_prompts
from tests.test_kernels import close, greedy, pytestmark  # noqa: F401 (the same skips)
from tokenmill.layers import ops

# Decode attention scores int8 / int4 keys with the query rounded to int16 (2**14 levels: a score
# moves by ~4e-4 for these unit-scale keys, against int4's own ~0.1) and sums int4 values with
# weights rounded to int16 per chunk (2**15 levels): outputs within 1e-3 of the float reference
# (measured up to 4.6e-4), not float32's 2e-5.
INTEGER_TOL = 1e-3


def close_integer(a, b):
    scale = b.abs().max().item() + 1e-6
    assert (a - b).abs().max().item() / scale < INTEGER_TOL


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("stage_dtype", [torch.float32, torch.bfloat16])
def test_kv_store_matches_the_encoder(kops, fmt, stage_dtype):
    """The kernel writing quantized pages against layers/kv_quant.py's and kv_int4.py's
    encoders: int8 and fp8 (rounded to nearest even, subnormals too) exactly; int4 (V's
    rotation and the error sums in another order) with the same codes nearly everywhere: V per
    token, K into the stage (exactly), each block whose last row came quantized per channel."""
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(6)
    x = torch.randn(40, 3, 64) * 2
    x[:, 0, 5] *= 20  # an outlier channel
    x[:, 0, 9] += 30  # an offset channel
    x[:, 1, 7] *= 1e-4  # values fp8 stores as subnormals
    x = x.to(stage_dtype).float()
    slots = torch.randperm(64)[:40]
    caches = [KVCache(1, 4, 16, 3, 64, fmt, torch.device("cpu"), stage_slots=4,
                      stage_dtype=stage_dtype) for _ in range(2)]
    ref, got = caches
    ref.store(0, x, x, slots, slots)
    kops.kv_store(got, 0, x, x, slots, slots)
    raw = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    if fmt != "int4":
        assert all(torch.equal(raw(a), raw(b)) for a, b in zip(ref.k + ref.v, got.k + got.v))
        return
    assert torch.equal(ref.stage, got.stage)
    full = slots[slots % 16 == 15] // 16  # the blocks whose last row came: quantized
    assert len(full) > 0
    for a, b in ((ref.k[0][0, full], got.k[0][0, full]), (ref.v[0], got.v[0])):
        assert (a == b).float().mean().item() > 0.99
    assert (ref.k_blocks[0][0, full] == got.k_blocks[0][0, full]).float().mean().item() > 0.99
    table = full[None]
    a, b = got.gather(0, table, torch.float32), ref.gather(0, table, torch.float32)
    for ours, theirs in zip(a, b):
        assert ((ours - theirs).norm() / theirs.norm()).item() < 0.01


def filled_cache(fmt: str, blocks: int, block_size: int, d: int):
    """One layer of 3 KV heads in `fmt`, every slot stored (keys twice the values' scale),
    each block its own stage slot."""
    from tokenmill.layers.kv_cache import KVCache

    cache = KVCache(1, blocks, block_size, 3, d, fmt, torch.device("cpu"), stage_slots=blocks)
    slots = torch.arange(blocks * block_size)
    cache.store(0, torch.randn(len(slots), 3, d) * 2, torch.randn(len(slots), 3, d), slots,
                slots)
    return cache


def decode_context(cache, tables, lens):
    """A decode step's context over a paged_history-style cache (stage slot i = block i)."""
    from tokenmill.layers.attention import AttentionContext

    ctx = AttentionContext(cache, torch.tensor([]), len(lens), decode_block_tables=tables,
                           decode_seq_lens=lens)
    if cache.staged:
        ctx.decode_stages = tables[torch.arange(len(lens)), (lens - 1) // cache.block_size]
    return ctx


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("seqs", [1, 2, 9])
def test_decode_attention_on_quantized_pages(kops, fmt, window, threads, seqs):
    """The kernel reading int8 / fp8 / int4 pages in place (int4: each row's own block from
    the stage, the output rotated back; integer dot products, INTEGER_TOL) against the plain
    path: gather, dequantize, SDPA. One sequence of 1,000 positions: a task per KV head;
    nine take every KV head per task. (Histories of several pieces: the test below.)"""
    from tokenmill.layers.attention import PagedAttention

    torch.manual_seed(5)
    d, block_size, blocks = 64, 16, 64
    cache = filled_cache(fmt, blocks, block_size, d)
    tables = torch.stack([torch.randperm(blocks)[:63] for _ in range(seqs)])
    lens = torch.randint(1, 63 * block_size + 1, (seqs,)) if seqs > 1 else torch.tensor([1000])
    q = torch.randn(seqs, 9, d)
    ctx = decode_context(cache, tables, lens)
    attn = PagedAttention(9, 3, d, 0, sliding_window=window)
    attn.ops = kops
    fast = attn._decode(q, ctx)
    attn.ops = ops.TorchOps()
    close_integer(fast, attn._decode(q, ctx))


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("window", [None, 1100])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_quantized_decode_rows_do_not_depend_on_the_batch(kops, fmt, window, threads):
    """A row of 300-2,300 positions gives bit for bit the same output alone (its history's
    pieces a task each) as batched with eight others (each sequence's KV heads a task), so
    drafts verified on a quantized cache match decode exactly at any length
    (attention_pieces.h: pieces at fixed positions, combined in order)."""
    torch.manual_seed(6)
    d, block_size, blocks = 64, 16, 150
    cache = filled_cache(fmt, blocks, block_size, d)
    tables = torch.stack([torch.randperm(blocks)[:146] for _ in range(9)])
    lens = torch.tensor([300, 1023, 1024, 1025, 2048, 2049, 2300, 700, 1500])
    stages = tables[torch.arange(9), (lens - 1) // block_size] if cache.staged else None
    q = torch.randn(9, 9, d)
    lib = kops.lib
    batched = lib.decode_attention_quant(q, cache, 0, tables, lens, stages, window, d ** -0.5)
    for b in range(9):
        alone = lib.decode_attention_quant(q[b:b + 1], cache, 0, tables[b:b + 1], lens[b:b + 1],
                                           None if stages is None else stages[b:b + 1], window,
                                           d ** -0.5)
        assert torch.equal(batched[b:b + 1], alone), b


def test_every_fp8_code_is_read_exactly(kops):
    """Every e4m3 code but NaN (zeros, subnormals, both signs) as the decode kernel reads it:
    one cached token, so each head's output is that token's value row, bit for bit torch's
    float8 times the row's scale."""
    from tokenmill.layers.kv_cache import KVCache

    cache = KVCache(1, 1, 16, 4, 64, "fp8_e4m3", torch.device("cpu"))
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's two NaNs
    cache.v[0][0, 0, 0] = codes.view(4, 64).view(torch.float8_e4m3fn)
    cache.v[1][0, 0, 0] = torch.tensor([[1.0], [0.5], [3.0], [1 / 7]]).half()
    q = torch.randn(1, 8, 64)
    out = kops.lib.decode_attention_quant(q, cache, 0, torch.zeros(1, 1, dtype=torch.long),
                                          torch.tensor([1]), None, None, 0.125)
    rows = cache.v[0][0, 0, 0].float() * cache.v[1][0, 0, 0].float()
    assert torch.equal(out[0], rows.repeat_interleave(2, 0))


def avx2_variant(tmp_path_factory, name, define):
    """The AVX2 library built with one extra -D (at -O1: compiles ~2x faster); skips off AVX2."""
    from tokenmill.kernels import build
    from tokenmill.kernels.isa import supported_isas
    from tokenmill.kernels.lib import KernelLib

    if build.machine_arch() != "x86_64" or "avx2" not in supported_isas():
        pytest.skip("needs an x86-64 CPU with AVX2")
    out = tmp_path_factory.mktemp(name) / build.library_name("avx2")
    return KernelLib(build._compile("avx2", out, build.compiler(), ["-fopenmp", define, "-O1"]))


@pytest.fixture(scope="module")
def wide_value_passes(tmp_path_factory):
    """The AVX2 build with the value passes AVX-512 takes (four accumulators a head: values_int.h),
    which AVX2 itself never runs."""
    return avx2_variant(tmp_path_factory, "passes", "-DTM_VALUES_PASS=4")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(("d", "hq", "hk"), [(64, 9, 3), (128, 8, 2), (192, 10, 2), (256, 4, 4),
                                             (64, 8, 1)])
def test_value_passes_give_the_same_bits(wide_value_passes, fmt, d, hq, hk):
    """The integer value sums over a pass's accumulators (two a head on AVX2, four on AVX-512)
    and heads (groups of 1-4 of GQA 1-5 and MQA): integers, so the pass widths give the same
    bits; both against the plain path at each head size."""
    from tokenmill.kernels import load_cpu_kernels
    from tokenmill.layers.attention import PagedAttention
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(7)
    blocks, block_size, seqs = 48, 16, 5
    cache = KVCache(1, blocks, block_size, hk, d, fmt, torch.device("cpu"), stage_slots=blocks)
    slots = torch.arange(blocks * block_size)
    cache.store(0, torch.randn(len(slots), hk, d) * 2, torch.randn(len(slots), hk, d), slots,
                slots)
    tables = torch.stack([torch.randperm(blocks)[:40] for _ in range(seqs)])
    lens = torch.tensor([1, 17, 300, 501, 640])
    q = torch.randn(seqs, hq, d)
    ctx = decode_context(cache, tables, lens)
    attn = PagedAttention(hq, hk, d, 0)
    narrow = load_cpu_kernels("avx2")
    args = (q, cache, 0, tables, lens, ctx.decode_stages if cache.staged else None, None,
            attn.scale)
    out = narrow.decode_attention_quant(*args)
    assert torch.equal(out, wide_value_passes.decode_attention_quant(*args))
    attn.ops = ops.TorchOps()
    out = attn._unrotate(out, cache)  # int4: the kernel's output is in V's rotated basis
    close_integer(out, attn._decode(q, ctx))


def integer_prefill(kops, fmt, d):
    """Whether the prefill tile on these pages takes integer dot products
    (attention_prefill_int.h: AVX2, int8 / int4, head sizes that are multiples of 64)."""
    return kops.lib.isa == "avx2" and fmt in ("int8", "int4") and d % 64 == 0 and d <= 256


def check_prefill(kops, fmt, computed, new, window, dtype, hq=6, hk=2, d=64, k_scale=2.0,
                  history=None, block_size=16):
    from tokenmill.layers.attention import AttentionContext, PagedAttention, PrefillChunk

    cache, table, slots, k, v = history or paged_history(computed + new, block_size, hk, d,
                                                         fmt, k_scale=k_scale)
    q = torch.randn(new, hq, d).to(dtype)
    stages = table if cache.staged else None  # paged_history: stage slot i is block i's
    ctx = AttentionContext(cache, slots[computed:], 0,
                           prefills=[PrefillChunk(0, new, computed, table, stages)])
    attn = PagedAttention(hq, hk, d, 0, sliding_window=window)
    attn.ops = kops
    fast = attn._prefill(q, k[computed:], v[computed:], ctx.prefills[0], ctx)
    attn.ops = ops.TorchOps()
    ref = attn._prefill(q, k[computed:], v[computed:], ctx.prefills[0], ctx)
    if integer_prefill(kops, fmt, d) and dtype == torch.float32:
        close_integer(fast, ref)
    else:
        close(fast, ref, dtype)
    return fast


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize(("computed", "new", "window"), [(0, 37, None), (150, 21, None),
                                                           (300, 64, 100), (5, 1, None)])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_on_quantized_pages(kops, fmt, computed, new, window, threads, dtype):
    """A prefill chunk against its quantized history (prefix-cache hits, chunked prefill), read
    a key tile at a time, against the plain path: gather, dequantize, SDPA (through the layer,
    so int4's stage reads and the output's rotation are included); a bf16 model's keys in
    bf16. int8 / int4 on AVX2 take integer dot products: INTEGER_TOL in float32."""
    torch.manual_seed(8)
    check_prefill(kops, fmt, computed, new, window, dtype)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(("hq", "hk", "d", "block_size"),
                         [(4, 1, 128, 16), (2, 2, 256, 16), (10, 2, 192, 16), (6, 2, 64, 32)])
def test_prefill_integer_tile_head_sizes(kops, fmt, hq, hk, d, block_size):
    """Head sizes past 64 (two, four and three vectors of value pairs a pass; MQA, MHA, GQA 5),
    and 32-token blocks (int4's default: two key tiles a block), against the plain path."""
    torch.manual_seed(9)
    check_prefill(kops, fmt, 100, 40, None, torch.float32, hq, hk, d, block_size=block_size)


def test_int4_prefill_scores_do_not_overflow(kops):
    """The int4 keys at their extremes (every channel of a block spanning the same wide range,
    so step codes of 255, codes of 15) against a query aligned with them, at head size 256: the
    pair sums reach ~1.6e10, past int32, unless the tile moves them to float often enough."""
    from tokenmill.layers.attention import AttentionContext, PagedAttention, PrefillChunk

    torch.manual_seed(10)
    d, n = 256, 64
    cache, table, slots, k, v = paged_history(n, 16, 1, d, "int4")
    keys = torch.zeros(n, 1, d)
    keys[1::2] = 3.0  # every other row at the maximum (codes 15), the rest mid-range
    keys[::16] = -3.0  # each block's first row at the minimum
    cache.store(0, keys, v, slots, slots)
    q = torch.ones(8, 2, d) * 4  # scores 3 x 4 x 256 / 16 at the maximum rows, 0 mid-range
    chunk = PrefillChunk(0, 8, n - 8, table, table)
    ctx = AttentionContext(cache, slots[n - 8:], 0, prefills=[chunk])
    attn = PagedAttention(2, 1, d, 0)
    attn.ops = kops
    fast = attn._prefill(q, keys[n - 8:], v[n - 8:], chunk, ctx)
    attn.ops = ops.TorchOps()
    close_integer(fast, attn._prefill(q, keys[n - 8:], v[n - 8:], chunk, ctx))


@pytest.fixture(scope="module")
def intrinsics_tile(tmp_path_factory):
    """The AVX2 build without the assembly pair loops (attention_int_asm.h): the intrinsics
    the loops replace."""
    return avx2_variant(tmp_path_factory, "intrinsics", "-DTM_NO_INT_ASM")


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(("computed", "new", "hq", "hk", "d"),
                         [(300, 45, 9, 3, 64), (70, 33, 4, 1, 128), (20, 7, 2, 2, 256)])
def test_prefill_assembly_loops_give_the_same_bits(intrinsics_tile, fmt, computed, new, hq, hk,
                                                   d):
    """The AVX2 assembly pair loops of the integer prefill tile against the intrinsics (integer
    sums: the same bits), and both against the plain path."""
    from tokenmill.kernels import load_cpu_kernels
    from tokenmill.layers.kernel_ops import KernelOps

    torch.manual_seed(11)
    history = paged_history(computed + new, 16, hk, d, fmt, k_scale=2.0)
    asm = KernelOps(load_cpu_kernels("avx2"))
    state = torch.get_rng_state()
    a = check_prefill(asm, fmt, computed, new, None, torch.float32, hq, hk, d, history=history)
    torch.set_rng_state(state)
    b = check_prefill(KernelOps(intrinsics_tile), fmt, computed, new, None, torch.float32, hq,
                      hk, d, history=history)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "int4"])
def test_fused_decode_on_quantized_pages_equals_layer_by_layer(tmp_path, monkeypatch, kv):
    """The fused decode step writing and reading int8 / fp8 / int4 pages (int4: the stage,
    blocks quantized as they fill, the output rotated back in C++) against the layer-by-layer
    path on the same cache format."""
    from tests.conftest import save_tiny_model
    from tokenmill.layers.fused_decode import FusedDecoder
    from tokenmill.models import llama

    prompts = random_prompts(4, 3, 40, seed=11)
    save_tiny_model(tmp_path, "qwen3", head_dim=32)
    calls = []
    real = FusedDecoder.__call__
    with monkeypatch.context() as m:
        m.setattr(FusedDecoder, "__call__", lambda *a: calls.append(1) or real(*a))
        fused, _ = greedy(tmp_path, "float32", True, prompts, kv)
    assert len(calls) >= 15
    with monkeypatch.context() as m:
        m.setattr(llama.LlamaModel, "_fused_decoder", lambda *a: None)
        layered, _ = greedy(tmp_path, "float32", True, prompts, kv)
    assert fused == layered
