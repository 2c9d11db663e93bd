"""The AMX tile code on a CPU without AMX: the AVX2 build of the kernels compiled with the tile
intrinsics emulated in plain C++ (tests/csrc/amx_emulation.h) and the AMX prefill attention
(attention_amx.h) switched on. Its layouts, strides, padding and masking are checked against
the reference on every x86 machine CI runs; the real AMX build runs the same cases in
test_kernels.py where the CPU has AMX."""

from pathlib import Path

import pytest
import torch

from tests.conftest import paged_history, prefill_reference
from tests.test_quant_kernels import FORMATS
from tokenmill.kernels import build
from tokenmill.kernels.isa import supported_isas
from tokenmill.kernels.lib import KernelLib
from tokenmill.layers.attention import PagedAttention

EMULATION = Path(__file__).parent / "csrc" / "amx_emulation.h"

pytestmark = pytest.mark.skipif(
    build.machine_arch() != "x86_64" or "avx2" not in supported_isas() or not build.compiler(),
    reason="needs an x86-64 CPU with AVX2 and a C++ compiler")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("amx") / build.library_name("avx2")
    # -O1: the emulated tiles are slow either way; the build is ~2x faster to compile
    flags = ["-fopenmp", "-DTM_AMX_EMULATED", "-include", str(EMULATION), "-O1"]
    return KernelLib(build._compile("avx2", out, build.compiler(), flags))


def tile_ops(lib: KernelLib) -> int:
    import ctypes

    return ctypes.c_int64.in_dll(lib._lib, "tm_emulated_tile_ops").value


# (head_dim, query heads, KV heads): GQA 2, 3 and 4, MHA, MQA; head sizes of 1, 2, 3, 4 and 8 tile
# steps (the value tiles: part of one pass of four, one pass, two passes, four)
@pytest.mark.parametrize("d,hq,hk", [(64, 9, 3), (128, 8, 2), (96, 4, 4), (32, 8, 1), (256, 4, 2)])
# (cached, new, window): a first chunk, a chunk reading its history, a window shorter than the
# chunk, one token, chunks ending mid-block and mid key tile, more than one query tile
@pytest.mark.parametrize("computed,new,window", [(0, 37, None), (20, 50, None), (0, 100, 24),
                                                 (33, 17, 8), (0, 1, None), (5, 75, None),
                                                 (40, 31, 100)])
def test_amx_prefill_attention_matches_the_reference(emulated, d, hq, hk, computed, new, window):
    torch.manual_seed(4)
    length = computed + new
    cache, table, _, _, _ = paged_history(length, 16, hk, d, torch.bfloat16)
    q = torch.randn(new, hq, d).to(torch.bfloat16)
    attn = PagedAttention(hq, hk, d, 0, sliding_window=window)
    before = tile_ops(emulated)
    out = emulated.prefill_attention(q, cache.k[0][0], cache.v[0][0], table, computed, window,
                                     attn.scale)
    assert tile_ops(emulated) > before  # the tile path ran
    ref = prefill_reference(q, cache, table, computed, window, attn)
    # bf16 output and bf16 probabilities (as the VDPBF16PS path and PyTorch's bf16 attention)
    assert (out.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


@pytest.mark.parametrize("window", [None, 30])
def test_amx_row_does_not_depend_on_its_chunk(emulated, window):
    """As on the VDPBF16PS engine (test_prefill_lanes.py): a row alone gives its bits in the
    whole chunk."""
    torch.manual_seed(5)
    computed, new, d = 530, 40, 64
    cache, table, _, _, _ = paged_history(computed + new, 16, 1, d, torch.bfloat16)
    q = torch.randn(new, 4, d).to(torch.bfloat16)
    whole = emulated.prefill_attention(q, cache.k[0][0], cache.v[0][0], table, computed, window,
                                       0.125)
    for r in (0, 5, new - 1):
        alone = emulated.prefill_attention(q[r:r + 1], cache.k[0][0], cache.v[0][0], table,
                                           computed + r, window, 0.125)
        assert torch.equal(alone[0], whole[r]), r


def test_amx_path_is_bf16_whole_tiles_only(emulated):
    """float32 and a head size that is no multiple of 32 keep the vector path."""
    torch.manual_seed(0)
    for dtype, d in ((torch.float32, 64), (torch.bfloat16, 40)):
        cache, table, _, _, _ = paged_history(40, 16, 2, d, dtype)
        q = torch.randn(40, 4, d).to(dtype)
        before = tile_ops(emulated)
        emulated.prefill_attention(q, cache.k[0][0], cache.v[0][0], table, 0, None, 0.1)
        assert tile_ops(emulated) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_amx_quantized_gemm_matches_the_vector_tiles(emulated, fmt):
    """64 or more rows of a block-quantized GEMM (16 or more with 8-bit codes) run on int8
    tiles (quant_amx.h): per block the exact integer sums, scaled as the vector tiles scale
    theirs, so a row's output equals the one-row call's (4 and 5 bits; AVX2 treats 8-bit codes
    as signed, another rounding). Q6_K (a scale per half block) stays on the vector tiles."""
    from tests.test_quant_kernels import check_packed_form, pack, random_bq
    from tokenmill.quantization import linear_ref

    bq = random_bq(45, 256, fmt, seed=3)  # 3 groups, the last partial; 8 blocks
    bias = torch.randn(45, generator=torch.Generator().manual_seed(3))
    layer = pack(emulated, bq, bias)
    check_packed_form(layer, fmt)
    bits = layer.bits
    x = torch.randn(70, 256).to(torch.bfloat16)  # 5 row tiles, the last partial
    before = tile_ops(emulated)
    many = emulated.linear(x, layer, out_fp32=True)
    assert (tile_ops(emulated) > before) == (bits != 6)  # the tile path ran
    alone = torch.cat([emulated.linear(x[i:i + 1], layer, out_fp32=True) for i in range(70)])
    if bits != 8:
        assert torch.equal(many, alone)
    want = linear_ref(x, bq, bias)
    assert (many - want).abs().max().item() < 2e-5 * want.abs().max().item()
    before = tile_ops(emulated)
    emulated.linear(x[:15 if bits == 8 else 63], layer)  # fewer rows: the vector tiles
    assert tile_ops(emulated) == before
    if bits == 8:
        emulated.linear(x[:16], layer)
        assert tile_ops(emulated) > before


def test_amx_quantized_runs_take_each_their_path(emulated):
    """A weight in runs of its own code widths (a Q4_K_M file's q|k|v): at 40 rows the 8-bit
    run runs on int8 tiles (its codes tiled), the 4-bit run on the vector tiles (row by row),
    in one call; each run's outputs are its part's own alone."""
    from tests.test_quant_kernels import random_bq
    from tokenmill.layers.kernel_ops import KernelOps

    parts = [random_bq(32, 128, 4, seed=1), random_bq(29, 128, 8, seed=2)]
    layer = KernelOps(emulated).pack_quantized(parts)
    assert layer.runs == [(4, 32), (8, 61)]
    x = torch.randn(40, 128).to(torch.bfloat16)
    before = tile_ops(emulated)
    got = emulated.linear(x, layer, out_fp32=True)
    assert tile_ops(emulated) > before
    own = [emulated.linear(x, emulated.qpack(p.codes, p.d, p.m, p.bits), out_fp32=True)
           for p in parts]
    assert torch.equal(got, torch.cat(own, dim=1))
