"""GGUF block formats converted to the kernels' block form (quantization/gguf_blocks.py),
against the gguf package's dequantization: exact for the 32-weight formats, within the float16
rounding of the sub-block scales for the K formats, Q6_K exactly as the kernels pack it (q6) and
its 8-bit conversion within its stated requantization error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tests.gguf_util import random_blocks
from tokenmill.quantization import BlockQuant
from tokenmill.quantization.gguf_blocks import NATIVE_TYPES, to_block_quant


def weights(rows: int = 8, cols: int = 512) -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_simple_formats_are_exact(qtype):
    q = quantize(weights(), qtype)
    bq = to_block_quant(q, qtype, 8, 512)
    assert bq.bits == {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8}[qtype]
    assert np.array_equal(bq.dequantize().numpy(), dequantize(q, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K])
def test_k_formats_are_exact(qtype):
    """With their integer scales (ks: what the kernels pack) to float32 rounding; their scales
    rounded to float16 (d, m: every other use) within that rounding."""
    q = random_blocks(qtype, 8, 512, np.random.default_rng(1))
    ref = dequantize(q, qtype).astype(np.float32)
    bq = to_block_quant(q, qtype, 8, 512)
    assert bq.ks is not None and bq.ks[0].shape == (8, 16) and bq.ks[2].shape == (8, 2)
    assert np.abs(bq.dequantize().numpy() - ref).max() < 1e-6 * np.abs(ref).max()
    rounded = BlockQuant(bq.codes, bq.d, bq.m, bq.bits).dequantize().numpy()
    assert np.abs(rounded - ref).max() < 1e-3 * np.abs(ref).max()


def converted(bq: BlockQuant) -> BlockQuant:
    """A Q6_K weight's 8-bit conversion alone (what every use but the packed kernels reads)."""
    return BlockQuant(bq.codes, bq.d, bq.m, bq.bits)


def test_q6_k_is_exact_as_the_kernels_take_it():
    """q6: the file's codes, int8 scales per 16 and float16 d per 256, dequantized to float32
    rounding (d * sc * (q - 32), the gguf package's product)."""
    q = random_blocks(Q.Q6_K, 24, 768, np.random.default_rng(4))
    bq = to_block_quant(q, Q.Q6_K, 24, 768)
    codes, sc, dd = bq.q6
    assert codes.shape == (24, 768) and sc.shape == (24, 48) and dd.shape == (24, 3)
    assert int(codes.max()) < 64
    ref = dequantize(q, Q.Q6_K).astype(np.float32)
    assert np.abs(bq.dequantize().numpy() - ref).max() <= 1e-6 * np.abs(ref).max()
    assert bq.rows(slice(8, 16)).q6[1].shape == (8, 48)
    assert torch.equal(BlockQuant.cat([bq.rows(slice(0, 16)), bq.rows(slice(16, 24))]).q6[0],
                       codes)


@pytest.mark.parametrize("rows,cols", [(8, 512), (40, 16384)])  # more than one of _q6_k's chunks
def test_q6_k_within_its_stated_error(rows, cols):
    """Per block of 32, the half with the larger |sc| exact (up to the float16 scale), the
    other within 1/8 of the block's step D = d * sc, a quarter step where a code was clamped
    (file code 0 under a negative ratio)."""
    from tokenmill.quantization.gguf_blocks import _q6_k_codes

    q = random_blocks(Q.Q6_K, rows, cols, np.random.default_rng(1))
    b = q.reshape(-1, 210)
    bq = to_block_quant(q, Q.Q6_K, rows, cols)
    ours = converted(bq).dequantize().numpy().reshape(-1, 2, 16)
    ref = dequantize(q, Q.Q6_K).astype(np.float32).reshape(-1, 2, 16)
    sc = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2)
    big = np.abs(sc[:, 0]) >= np.abs(sc[:, 1])
    step = 4 * np.abs(bq.d.float().numpy().reshape(-1))  # |D|: the codes step D / 4
    err = np.abs(ours - ref)
    exact = np.where(big, err[:, 0].max(1), err[:, 1].max(1))
    assert (exact <= 1e-3 * step + 2 ** -10 * np.abs(ref).max((1, 2))).all()
    clamped = (_q6_k_codes(b).reshape(-1, 2, 16) == 0) & (
        np.sign(sc) != np.sign(sc[:, ::-1]))[..., None]
    allowed = np.where(clamped, 0.25, 0.125) * step[:, None, None]
    assert (err <= allowed * (1 + 1e-3) + 2 ** -10 * np.abs(ref)).all()


def test_q6_k_with_equal_half_scales_is_exact_up_to_the_scale():
    q = random_blocks(Q.Q6_K, 8, 512, np.random.default_rng(2)).reshape(-1, 210)
    q[:, 192:208] = 5  # every sub-block scale equal: no requantization
    q = q.reshape(8, -1)
    ref = dequantize(q, Q.Q6_K).astype(np.float32)
    ours = converted(to_block_quant(q, Q.Q6_K, 8, 512)).dequantize().numpy()
    assert np.abs(ours - ref).max() < 2 ** -11 * np.abs(ref).max()


def test_q6_k_codes_are_the_file_codes():
    """The 6-bit codes unpacked as the gguf package reads them: every scale 1 and d = 1."""
    from tokenmill.quantization.gguf_blocks import _q6_k_codes

    q = random_blocks(Q.Q6_K, 16, 1024, np.random.default_rng(3)).reshape(-1, 210)
    unit = q.copy()
    unit[:, 192:208] = 1
    unit[:, 208:210] = np.array([1.0], np.float16).view(np.uint8)
    assert np.array_equal(_q6_k_codes(q), dequantize(unit, Q.Q6_K).reshape(-1, 256) + 32)


def test_other_types_are_left_to_the_loader():
    assert Q.Q2_K not in NATIVE_TYPES and to_block_quant(np.zeros((1, 84), np.uint8), Q.Q2_K, 1,
                                                         256) is None
