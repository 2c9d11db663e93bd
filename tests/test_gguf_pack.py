"""GGUF matrices packed straight from their file blocks (quantization/gguf_blocks.GGUFMatrix,
kernels/csrc/quant_gguf.cpp), for every instruction set this CPU runs: byte for byte the packed
form of their BlockQuant conversion (qpack_parts), every native type, partial groups, rows
reordered as the loader reorders Q and K, fused parts of mixed types; bad blocks are refused."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import quantize

from tests.gguf_util import random_blocks
from tokenmill.kernels import build, load_cpu_kernels
from tokenmill.kernels.isa import supported_isas
from tokenmill.kernels.lib import Q6_K, QSUPER, QSYM
from tokenmill.loaders.permute import unpermute_rope_rows
from tokenmill.quantization import BlockQuant
from tokenmill.quantization.gguf_blocks import NATIVE_TYPES, GGUFMatrix, to_block_quant

pytestmark = pytest.mark.skipif(
    build.compiler() is None or os.environ.get("TOKENMILL_KERNELS") == "0",
    reason="no C++ compiler here, or TOKENMILL_KERNELS=0")

SIMPLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
QUANT = {Q.Q4_0: 4 | QSYM, Q.Q4_1: 4, Q.Q5_0: 5 | QSYM, Q.Q5_1: 5, Q.Q8_0: 8 | QSYM,
         Q.Q4_K: 4 | QSUPER, Q.Q5_K: 5 | QSUPER, Q.Q6_K: Q6_K}


@pytest.fixture(params=supported_isas())
def lib(request):
    return load_cpu_kernels(request.param)


def file_matrix(qtype, rows: int, cols: int, seed: int = 0) -> GGUFMatrix:
    """Blocks as a file holds them: the gguf package's quantization of random weights for the
    32-weight formats (it has none for the K formats: random finite blocks there)."""
    rng = np.random.default_rng(seed)
    if qtype in SIMPLE:
        w = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3, (rows, 1))
        data = quantize(w.astype(np.float32), qtype)
    else:
        data = random_blocks(qtype, rows, cols, rng)
    return GGUFMatrix.from_file(data, qtype, cols)


def converted(lib, parts: list[GGUFMatrix]):
    bqs = [p.block_quant() for p in parts]
    return lib.qpack_parts([(b.codes, b.d, b.m, b.ks, b.q6) for b in bqs], [b.bits for b in bqs])


@pytest.mark.parametrize("qtype", NATIVE_TYPES)
@pytest.mark.parametrize("rows,cols", [(48, 512), (7, 768), (21, 256)])
def test_packed_from_the_blocks_as_from_the_conversion(lib, qtype, rows, cols):
    m = file_matrix(qtype, rows, cols)
    direct, ref = lib.qpack_gguf_parts([m], cols), converted(lib, [m])
    assert direct.quant == ref.quant == QUANT[qtype] and direct.runs is None
    assert (direct.n, direct.k) == (rows, cols)
    assert torch.equal(direct.packed, ref.packed)
    assert torch.equal(lib.qdequantize(direct), m.dequantize())  # the file's weights


def test_rows_reordered_as_the_loader_reorders_q_and_k(lib):
    m = file_matrix(Q.Q4_K, 64, 512, seed=1)
    rows = m.map_rows(lambda t: unpermute_rope_rows(t, 4))
    assert torch.equal(rows.dequantize(), unpermute_rope_rows(m.dequantize(), 4))
    assert torch.equal(lib.qpack_gguf_parts([rows], 512).packed,
                       converted(lib, [rows]).packed)
    assert rows.rows(slice(16, 32)).shape == (16, 512)


def test_fused_parts_of_mixed_types_in_runs(lib):
    """A Q4_K_M file's q|k|v: q and k Q4_K, v Q6_K (two runs); and Q8_0 | Q4_0 | Q4_0."""
    for types in ((Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q4_0, Q.Q4_0)):
        parts = [file_matrix(t, n, 512, seed=i) for i, (t, n) in enumerate(zip(types, (32, 16, 9)))]
        direct = lib.qpack_gguf_parts(parts, 512)
        ref = converted(lib, parts)
        assert direct.runs == ref.runs and len(direct.runs) == 2
        assert torch.equal(direct.packed, ref.packed)


def test_block_quant_is_the_conversion():
    m = file_matrix(Q.Q6_K, 16, 512, seed=2)
    bq, ref = m.block_quant(), to_block_quant(m.blocks.numpy(), Q.Q6_K, 16, 512)
    assert isinstance(bq, BlockQuant) and bq.bits == m.bits == 8
    assert all(torch.equal(a, b) for a, b in zip(bq.q6, ref.q6))
    assert torch.equal(bq.codes, ref.codes)


def raw(qtype, blocks: torch.Tensor, cols: int) -> SimpleNamespace:
    """Blocks as the packer takes them, unchecked (GGUFMatrix refuses bad shapes itself)."""
    return SimpleNamespace(qtype=qtype, file_blocks=blocks, blocks=blocks,
                           shape=(blocks.shape[0], cols), identity=lambda: ())


def test_bad_blocks_are_refused(lib):
    m = file_matrix(Q.Q4_0, 16, 256)
    with pytest.raises(ValueError, match="columns"):  # bytes a row that are not the blocks'
        lib.qpack_gguf_parts([raw(Q.Q4_0, m.blocks[:, :-18], 256)], 256)
    with pytest.raises(ValueError, match="columns"):  # a type the packer does not take
        lib.qpack_gguf_parts([raw(Q.Q2_K, m.blocks, 256)], 256)
    with pytest.raises(ValueError, match="whole groups"):
        lib.qpack_gguf_parts([m.rows(slice(0, 9)), m], 256)
    with pytest.raises(ValueError, match="bytes"):
        GGUFMatrix(Q.Q4_0, m.blocks, 512)
    for qtype, at in ((Q.Q4_1, 2), (Q.Q6_K, 208), (Q.Q5_K, 0)):
        bad = file_matrix(qtype, 16, 256).blocks.clone()
        bad[3, at:at + 2] = torch.tensor([0, 0x7C], dtype=torch.uint8)  # float16 inf
        with pytest.raises(ValueError, match="inf or NaN"):
            lib.qpack_gguf_parts([GGUFMatrix(qtype, bad, 256)], 256)
