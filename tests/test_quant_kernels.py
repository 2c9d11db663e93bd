"""The kernels on block-quantized weights (kernels/csrc/quant.cpp), for every instruction set
this CPU runs: the same arithmetic as quantization.linear_ref (int8 activations per block of
32), and within the stated accuracy of plain dequantize-then-matmul."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import build, load_cpu_kernels
from tokenmill.kernels.isa import supported_isas
from tokenmill.quantization import BlockQuant, linear_ref, quantize_activations
from tokenmill.quantization.rtn import quantize

pytestmark = pytest.mark.skipif(
    build.compiler() is None or os.environ.get("TOKENMILL_KERNELS") == "0",
    reason="no C++ compiler here, or TOKENMILL_KERNELS=0")


@pytest.fixture(params=supported_isas())
def lib(request):
    return load_cpu_kernels(request.param)


# code widths, the symmetric forms ("4s": m = -8 d in every block, as GGUF's Q4_0; packed with d
# alone, QSYM), the K formats' integer scales ("4k": d = sc D, m = -mn M, as Q4_K; packed
# as they are, QSUPER, where k is a multiple of 256) and Q6_K ("6k": 6-bit codes, a scale per
# 16; packed as it is where k is a multiple of 256, else its 8-bit conversion)
FORMATS = [4, 5, 8, "4s", "5s", "8s", "4k", "5k", "6k"]


def quant_of(fmt, k: int) -> int:
    """The quant code the packer gives fmt (tm.h)."""
    from tokenmill.kernels.lib import Q6_K, QSUPER, QSYM

    bits, kind = int(str(fmt)[0]), str(fmt)[1:]
    if kind == "k" and k % 256 == 0:
        return Q6_K if bits == 6 else bits | QSUPER
    return (8 if bits == 6 else bits) | (QSYM if kind == "s" or bits == 6 else 0)


def random_q6_k(n: int, k: int, seed: int) -> BlockQuant:
    """A Q6_K weight from random file blocks (its exact q6 and its 8-bit conversion)."""
    from gguf.constants import GGMLQuantizationType

    from tests.gguf_util import random_blocks
    from tokenmill.quantization.gguf_blocks import to_block_quant

    kk = (k + 255) // 256 * 256  # whole 256-blocks, then the columns asked for
    blocks = random_blocks(GGMLQuantizationType.Q6_K, n, kk, np.random.default_rng(seed))
    bq = to_block_quant(blocks, GGMLQuantizationType.Q6_K, n, kk)
    if kk == k:
        return bq
    return BlockQuant(bq.codes[:, :k].contiguous(), bq.d[:, :k // 32].contiguous(),
                      bq.m[:, :k // 32].contiguous(), 8)


def random_bq(n: int, k: int, fmt: int | str, seed: int = 0) -> BlockQuant:
    bits, kind = int(str(fmt)[0]), str(fmt)[1:]
    if bits == 6:
        return random_q6_k(n, k, seed)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.1).half()
    m = (torch.randn(n, k // 32, generator=g) * 0.3).half()
    if kind == "s":
        m = d * -(1 << (bits - 1))
    if kind != "k" or k % 256:
        return BlockQuant(codes, d, m, bits)
    sc, mn = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in "ab")
    dd, mm = ((torch.rand(n, k // 256, generator=g) * 4e-3).half() for _ in "ab")
    d = (sc.float() * dd.float().repeat_interleave(8, 1)).half()
    m = (-(mn.float() * mm.float().repeat_interleave(8, 1))).half()
    return BlockQuant(codes, d, m, bits, ks=(sc, mn, dd, mm))


def pack(lib, bq: BlockQuant, bias=None):
    """bq packed as the engine packs a weight (KernelOps.pack_quantized: the K scales too)."""
    return lib.qpack_parts([(bq.codes, bq.d, bq.m, bq.ks, bq.q6)], bq.bits, bias)


def check_packed_form(layer, fmt) -> None:
    """The layer packed as fmt says: per group of 16 rows and block of 32 columns, 16 float16 d
    (symmetric), 16 sc and 16 mn (K scales, and per 8 blocks 16 D and 16 M; Q6_K: 16 sc per
    half block, and per 8 blocks 16 D), or 16 d and 16 m, then the codes."""
    from tokenmill.kernels.lib import QSUPER, QSYM

    q = quant_of(fmt, layer.k)
    assert layer.quant == q and layer.bits == q & 15
    block = (32 if q & (QSYM | QSUPER) else 64) + {4: 256, 5: 320, 6: 384, 8: 512}[layer.bits]
    header = 32 if layer.bits == 6 else 64 if q & QSUPER else 0  # per 8 blocks
    groups, blocks = (layer.n + 15) // 16, layer.k // 32
    assert layer.packed.numel() == groups * (blocks * block + blocks // 8 * header)


@pytest.mark.parametrize("sizes,fmts", [([32, 16, 16], (4, 4, 4)), ([48, 16, 37], (4, 5, 8)),
                                         ([64, 64], (5, 4)), ([32, 32, 16], (4, 4, 8)),
                                         ([32, 16, 16], ("8s", "8s", 8)),
                                         ([32, 16, 16], ("4k", "4k", 8)),
                                         ([32, 16, 16], ("4k", "4k", "6k")),
                                         ([32, 32], ("6k", "6k"))])
def test_fused_parts_pack_in_place(lib, sizes, fmts):
    """Parts packed where they land (a fused q|k|v, gate|up), each in its own form: one form
    packs byte for byte as the stack; mixed widths (or symmetric beside not) make runs of rows
    (tm_linear.runs) whose outputs are each part's own, bit for bit; a part ending inside a
    group of 16 rows is refused (the loader stacks those)."""
    from tokenmill.kernels.lib import PackedLinear
    from tokenmill.layers.kernel_ops import KernelOps

    k = 256 if any(str(f).endswith("k") for f in fmts) else 96
    parts = [random_bq(n, k, f, seed=i) for i, (n, f) in enumerate(zip(sizes, fmts))]
    stacked = BlockQuant.cat(parts)
    got = KernelOps(lib).pack_quantized(parts)
    quants = [quant_of(f, k) for f in fmts]
    assert (got.n, got.k, got.bits) == (sum(sizes), k, max(q & 15 for q in quants))
    if len(set(quants)) == 1:
        want = pack(lib, stacked)
        assert got.runs is None and torch.equal(got.packed, want.packed)
    else:
        ends = torch.tensor(sizes).cumsum(0).tolist()
        runs = [(q, e) for i, (q, e) in enumerate(zip(quants, ends))
                if i == len(quants) - 1 or quants[i + 1] != q]
        assert got.runs == runs
    whole = torch.cat([p.dequantize() for p in parts])  # each part exactly (the K scales too)
    assert torch.equal(lib.qdequantize(got), whole)
    idx = torch.tensor([sum(sizes) - 1, 0, 40])
    assert torch.equal(lib.qdequantize(got, idx), whole[idx])
    bias = torch.randn(sum(sizes))
    layer = PackedLinear(got.packed, bias, got.n, got.k, got.quant, runs=got.runs)
    ends = torch.tensor([0] + sizes).cumsum(0).tolist()
    for rows in (1, 5, 70):
        x = torch.randn(rows, k).bfloat16()
        own = torch.cat([lib.linear(x, pack(lib, p, bias[a:b]))
                         for p, a, b in zip(parts, ends, ends[1:])], dim=1)
        assert torch.equal(lib.linear(x, layer), own)
    odd = [random_bq(20, 96, 4), random_bq(16, 96, 4)]
    with pytest.raises(ValueError, match="whole groups of 16"):
        lib.qpack_parts([(p.codes, p.d, p.m) for p in odd], 4)
    fused = KernelOps(lib).pack_quantized(odd)  # stacked first
    assert torch.equal(lib.qdequantize(fused), BlockQuant.cat(odd).dequantize())


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_round_trip(lib, fmt):
    bq = random_bq(37, 512 if str(fmt).endswith("k") else 96, fmt)  # 37 rows: a partial group
    packed = pack(lib, bq)
    check_packed_form(packed, fmt)
    assert torch.equal(lib.qdequantize(packed), bq.dequantize())
    rows = torch.tensor([36, 0, 17, 17])
    assert torch.equal(lib.qdequantize(packed, rows), bq.dequantize()[rows])
    for bad in (37, 40, -1):  # past n (37 is inside the padded group of 48), negative
        with pytest.raises(ValueError, match=r"row indices in \[0, 37\)"):
            lib.qdequantize(packed, torch.tensor([0, bad]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 1-8 rows: one tile; 9, 17: several; 70: two row chunks of 64
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 70])
def test_quantized_linear(lib, fmt, dtype, rows):
    k = 768 if str(fmt).endswith("k") else 576
    bq = random_bq(45, k, fmt, seed=rows)
    g = torch.Generator().manual_seed(rows)  # not the global RNG: its state depends on the order
    bias = torch.randn(45, generator=g)
    layer = pack(lib, bq, bias)
    check_packed_form(layer, fmt)
    x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(dtype)
    x[0, :32] = 0  # an all-zero block
    want = linear_ref(x, bq, bias)
    scale = want.abs().max().item()
    got = lib.linear(x, layer, out_fp32=True)
    assert (got - want).abs().max().item() < 2e-5 * scale  # float32 summation order only
    got = lib.linear(x, layer)
    assert got.dtype == dtype
    assert (got.float() - want.to(dtype).float()).abs().max().item() < 1e-2 * scale
    # against plain dequantize-then-matmul: the activations' int8 rounding, ~0.5 % rms
    exact = F.linear(x.float(), bq.dequantize(), bias)
    assert ((got.float() - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_integer_sums_at_their_bound(lib, fmt, sign):
    """The largest codes against activations all at +-127 (a constant block): where a kernel's
    narrow integer partial sums (AVX2 adds pair sums in int16) would overflow first."""
    n, k = 32, 256
    bits, kind = int(str(fmt)[0]), str(fmt)[1:]
    codes = torch.full((n, k), (1 << bits) - 1, dtype=torch.uint8)
    codes[1::2, ::3] = 0  # and a few rows mixing both ends
    d = torch.full((n, k // 32), 1e-3).half()
    m = d * -(1 << (bits - 1)) if kind == "s" else torch.full((n, k // 32), -1e-2).half()
    ks = q6 = None
    if kind == "k" and bits == 6:  # Q6_K: the int8 scales at both ends, beside its conversion
        sc = torch.full((n, k // 16), 127, dtype=torch.int8)
        sc[::3] = -128
        q6 = (codes, sc, torch.full((n, k // 256), 1e-4).half())
        codes, bits = torch.full((n, k), 255, dtype=torch.uint8), 8
        m = d * -128
    elif kind == "k":  # the largest integer scales
        sc = mn = torch.full((n, k // 32), 63, dtype=torch.uint8)
        ks = (sc, mn, (d[:, ::8].float() / 63).half(), (-m[:, ::8].float() / 63).half())
    bq = BlockQuant(codes, d, m, bits, ks=ks, q6=q6)
    layer = pack(lib, bq)
    check_packed_form(layer, fmt)
    x = torch.full((5, k), sign * 3.0)  # quantizes to +-127 in every position
    x[3] = -x[3]
    want = linear_ref(x, bq, None)
    got = lib.linear(x, layer, out_fp32=True)
    assert (got - want).abs().max().item() < 2e-5 * want.abs().max().item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_does_not_depend_on_the_other_rows(lib, fmt):
    """Each output is computed the same whatever tile its row lands in (row tiles of 1-8 rows,
    one group or two; on AMX, 16-row int8 tiles from 64 rows on, 8-bit codes from 16, the last
    tile partial): what
    keeps speculative decoding's verify rows, which share a step, exactly equal to decoding
    alone on quantized weights."""
    bq = random_bq(77, 256, fmt, seed=5)  # 5 groups, the last partial
    bias = torch.randn(77, generator=torch.Generator().manual_seed(5))
    layer = pack(lib, bq, bias)
    check_packed_form(layer, fmt)
    x = torch.randn(130, 256).to(torch.bfloat16)
    for out_fp32 in (True, False):
        alone = torch.cat([lib.linear(x[i:i + 1], layer, out_fp32=out_fp32) for i in range(130)])
        for m in [*range(2, 18), 24, 40, 63, 64, 70, 130]:
            assert torch.equal(lib.linear(x[:m], layer, out_fp32=out_fp32), alone[:m]), m


def test_activation_rounding_matches_the_kernel(lib):
    """linear_ref's quantization is the kernel's: a one-hot weight row reads q * dx back."""
    k = 64
    codes = torch.zeros(16, k, dtype=torch.uint8)
    codes[torch.arange(16), torch.arange(16) * 3] = 1
    # 4-bit codes: every build's arithmetic is exact here (the AVX2 build's 8-bit path adds
    # and cancels 128 * sum(q), test_quantized_linear's tolerance covers it)
    bq = BlockQuant(codes, torch.ones(16, k // 32).half(), torch.zeros(16, k // 32).half(), 4)
    x = torch.randn(2, k) * 3
    got = lib.linear(x, lib.qpack(bq.codes, bq.d, bq.m, 4), out_fp32=True)
    q, dx = quantize_activations(x)
    cols = torch.arange(16) * 3
    assert torch.equal(got, q[:, cols] * dx[:, cols // 32])


def test_rtn_methods_dequantize_exactly():
    w = torch.randn(32, 256)
    for method, bits, tol in (("int8", 8, 0.01), ("int4", 4, 0.1), ("int4-g128", 4, 0.2)):
        bq = quantize(w, method)
        assert bq.bits == bits
        assert torch.equal(bq.dequantize(), bq.d.float().repeat_interleave(32, 1) * bq.codes
                           + bq.m.float().repeat_interleave(32, 1))
        assert ((bq.dequantize() - w).norm() / w.norm()).item() < tol


def test_bad_quantized_weights_are_refused(lib):
    bq = random_bq(4, 64, 4)
    with pytest.raises(ValueError, match="scales"):
        BlockQuant(bq.codes, bq.d[:, :1], bq.m[:, :1], 4)
    with pytest.raises(ValueError, match="4-bit quantized weight has codes above 15"):
        BlockQuant(bq.codes + 16, bq.d, bq.m, 4)
    for bad in (float("inf"), float("-inf"), float("nan")):  # any non-finite d or m
        for which in ("d", "m"):
            scales = {"d": bq.d.clone(), "m": bq.m.clone()}
            scales[which][3, 1] = bad
            with pytest.raises(ValueError, match="overflow float16"):
                BlockQuant(bq.codes, scales["d"], scales["m"], 4)
    edge = bq.d.clone()
    edge[0, 0], edge[1, 1] = 65504.0, -65504.0  # the largest finite float16 values pass
    BlockQuant(bq.codes, edge, bq.m, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 48), "int4")
    with pytest.raises(ValueError, match="not supported"):
        quantize(torch.randn(4, 64), "int3")
    with pytest.raises(ValueError, match="qpack"):
        lib.qpack(bq.codes, bq.d.float(), bq.m, 4)
    kq = random_bq(16, 256, "4k")
    with pytest.raises(ValueError, match="K scales"):  # D per 32 instead of per 256
        lib.qpack_parts([(kq.codes, kq.d, kq.m, (*kq.ks[:2], kq.d, kq.d))], 4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_prompt_rows_on_the_dequantized_weights(lib, fmt):
    """Rows named as prompt tokens: on the AMX build bf16 rows times the weights dequantized to
    bf16, float32 sums (no int8 activations); every other row, and every row elsewhere, the
    int8 path's bits. Either way a row's bits do not depend on the rows beside it, nor on how
    the ranges split (chunked prompts)."""
    bq = random_bq(77, 256, fmt, seed=7)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(77, generator=g)
    layer = pack(lib, bq, bias)
    check_packed_form(layer, fmt)
    x = torch.randn(130, 256, generator=g).to(torch.bfloat16)
    ranges = [(3, 41), (41, 45), (70, 130)]
    prompt = torch.zeros(130, dtype=torch.bool)
    for a, b in ranges:
        prompt[a:b] = True
    dense = lib.isa == "amx"
    ref = F.linear(x.float(), bq.dequantize().bfloat16().float(), bias)
    for out_fp32 in (True, False):
        got = lib.linear(x, layer, out_fp32, prompt_rows=ranges)
        plain = lib.linear(x, layer, out_fp32)
        assert torch.equal(got[~prompt], plain[~prompt])
        alone = torch.cat([lib.linear(x[i:i + 1], layer, out_fp32, prompt_rows=[(0, 1)])
                           for i in range(130)])
        assert torch.equal(got[prompt], alone[prompt])
        assert torch.equal(lib.linear(x, layer, out_fp32, prompt_rows=[(3, 45), (70, 130)]), got)
        err = ((got[prompt].float() - ref[prompt]).norm() / ref[prompt].norm()).item()
        if not dense:
            assert torch.equal(got, plain)
        elif out_fp32:
            assert err < 1e-6  # the dequantized product up to float32 summation order
        else:
            assert err < 4e-3  # and the output's bf16 rounding
    for bad in ([(5, 5)], [(0, 10), (8, 20)], [(120, 131)], [(9, 3)]):
        with pytest.raises(ValueError, match="prompt_rows"):
            lib.linear(x, layer, prompt_rows=bad)
