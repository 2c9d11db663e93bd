"""The kernels on GGUF block-quantized weights (kernels/csrc/quant.cpp), for every instruction
set this CPU runs, against the gguf package's dequantization followed by a float32 matmul."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from tokenmill.kernels import build, load_cpu_kernels
from tokenmill.kernels.isa import supported_isas

pytestmark = pytest.mark.skipif(
    build.compiler() is None or os.environ.get("TOKENMILL_KERNELS") == "0",
    reason="no C++ compiler here, or TOKENMILL_KERNELS=0")
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def blocks(w: np.ndarray, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw blocks as uint8, the gguf package's dequantized float32 weight)."""
    q = quantize(w, getattr(GGMLQuantizationType, fmt))
    ref = dequantize(q, getattr(GGMLQuantizationType, fmt)).astype(np.float32)
    return torch.from_numpy(q).view(torch.uint8).flatten(), torch.from_numpy(ref)


@pytest.fixture(params=supported_isas())
def lib(request):
    return load_cpu_kernels(request.param)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_gguf(lib, fmt):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((37, 96)) * rng.uniform(0.01, 5, (37, 1))).astype(np.float32)
    raw, ref = blocks(w, fmt)
    assert torch.equal(lib.dequantize(lib.quantized(raw, fmt, 37, 96)), ref)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 1-16 rows: the in-register path (one or two passes); 17, 40: dequantized panels + GEMM
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 17, 40])
def test_quantized_linear(lib, fmt, dtype, rows):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((45, 576)).astype(np.float32)
    raw, ref_w = blocks(w, fmt)
    bias = torch.randn(45)
    layer = lib.quantized(raw, fmt, 45, 576, bias)
    x = torch.randn(rows, 576).to(dtype)
    ref = F.linear(x.float(), ref_w, bias)
    for out_fp32 in (False, True):
        out = lib.linear(x, layer, out_fp32=out_fp32)
        want = ref if out_fp32 else ref.to(dtype)
        assert out.dtype == want.dtype
        tol = 2e-5 if out_fp32 or dtype == torch.float32 else 1e-2
        if dtype == torch.bfloat16 and rows > 16:  # panels hold bf16-rounded weights
            tol = 2e-2
        scale = ref.abs().max().item()
        assert (out.float() - want.float()).abs().max().item() < tol * scale


def test_bad_blocks_are_refused(lib):
    raw, _ = blocks(np.zeros((4, 64), np.float32), "Q4_1")
    with pytest.raises(ValueError, match="Q4_1 blocks of a"):
        lib.quantized(raw[:-1], "Q4_1", 4, 64)
