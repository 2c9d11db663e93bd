"""The AArch64 builds (NEON and the portable scalar one), which this x86 machine cannot load:
cross-compiled with the kernel harness (tests/kernel_harness.cpp), run under qemu-user, and
compared with the same PyTorch references as tests/test_kernels.py. Needs
g++-aarch64-linux-gnu and qemu-user (Debian packages); skipped where they are missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import build
from tokenmill.layers import ops

CXX, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
pytestmark = pytest.mark.skipif(not (shutil.which(CXX) and shutil.which(QEMU)),
                                reason=f"needs {CXX} and {QEMU}")
ROOT = Path(__file__).resolve().parents[1]
DT = {torch.float32: 0, torch.bfloat16: 1}
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", params=["neon", "scalar"])
def harness(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("arm") / f"harness_{request.param}"
    subprocess.run([CXX, "-O2", "-std=c++17", "-static", "-fno-math-errno", "-ffp-contract=off",
                    f"-DTM_ISA_{request.param.upper()}", str(ROOT / "tests/kernel_harness.cpp"),
                    *map(str, build.sources()), "-o", str(out)], check=True)
    return out


def call(harness: Path, tmp_path: Path, kernel: str, params: list, inputs: list[torch.Tensor],
         out_dtype: torch.dtype, out_shape, extra: str | None = None):
    for i, t in enumerate(inputs):
        t = t.contiguous()
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        (tmp_path / f"in{i}.bin").write_bytes(raw.numpy().tobytes())
    (tmp_path / "params.txt").write_text(" ".join(map(str, params)))
    run = subprocess.run([QEMU, str(harness), kernel, str(tmp_path)], capture_output=True,
                         text=True, check=True)
    assert run.stdout.split()[0] == harness.name.split("_")[1]  # the library says its ISA

    def read(name):
        data = bytearray((tmp_path / name).read_bytes())
        raw = torch.int16 if out_dtype == torch.bfloat16 else out_dtype
        return torch.frombuffer(data, dtype=raw).view(out_dtype).view(out_shape)

    return (read("out.bin"), read(extra)) if extra else read("out.bin")


def close(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    scale = b.float().abs().max().item() + 1e-6
    assert (a.float() - b.float()).abs().max().item() / scale < TOL[b.dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k", [(1, 72), (5, 3001), (16, 72)])
def test_linear(harness, tmp_path, dtype, rows, k):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, k).to(dtype), torch.randn(37, k).to(dtype), torch.randn(37)
    got = call(harness, tmp_path, "linear", [DT[dtype], rows, 37, k, 1, DT[dtype]],
               [x, w, b.to(dtype).float()], dtype, (rows, 37))
    close(got, F.linear(x, w, b.to(dtype)))
    got = call(harness, tmp_path, "linear", [DT[dtype], rows, 37, k, 0, 0], [x, w], torch.float32,
               (rows, 37))
    close(got, F.linear(x.float(), w.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rope_silu(harness, tmp_path, dtype):
    from tokenmill.layers.rotary import RotaryEmbedding

    torch.manual_seed(1)
    x, res, w = torch.randn(5, 72).to(dtype), torch.randn(5, 72).to(dtype), torch.rand(72).to(dtype)
    out, new_res = call(harness, tmp_path, "rms_norm", [DT[dtype], 5, 72, 1e-6, 1], [res, w, x],
                        dtype, (5, 72), extra="residual.bin")
    close(new_res, res + x)
    close(out, ops.rms_norm_ref(res + x, w, 1e-6))
    table = RotaryEmbedding(40, 128, 10000.0, None).cos_sin
    q, pos = torch.randn(6, 4, 40).to(dtype), torch.tensor([0, 5, 9, 64, 100, 127])
    got = call(harness, tmp_path, "rope", [DT[dtype], 6, 4, 40, 128], [q, table, pos], dtype,
               (6, 4, 40))
    assert torch.equal(got, ops.rope_ref(q, table, pos))  # the same roundings: equal
    g = torch.randn(3, 2 * 52).to(dtype)
    close(call(harness, tmp_path, "silu_mul", [DT[dtype], 3, 52], [g], dtype, (3, 52)),
          ops.silu_mul_ref(g))
    close(call(harness, tmp_path, "gelu_tanh_mul", [DT[dtype], 3, 52], [g], dtype, (3, 52)),
          ops.gelu_tanh_mul_ref(g))


def test_argmax(harness, tmp_path):
    torch.manual_seed(5)
    x = torch.randn(4, 21)
    x[1] = x[1].round()
    x[2, 5] = float("nan")
    x[3] = -float("inf")
    got = call(harness, tmp_path, "argmax", [4, 21], [x], torch.int64, (4,))
    assert torch.equal(got, x.argmax(-1))


def test_sample(harness, tmp_path):
    from tokenmill.layers.sampler import Sampler, SamplingMetadata, inverse_cdf

    torch.manual_seed(6)
    rows, vocab = 24, 1003
    logits = torch.randn(rows, vocab) * 3
    logits[:, 1::5] = -float("inf")
    temps = [0.7, 1.0, 1.3] * 8
    top_k, top_p, min_p = [0, 0, 40] * 8, [1.0, 0.9, 0.8] * 8, [0.0] * 12 + [0.05] * 12
    u = torch.rand(rows)
    got = call(harness, tmp_path, "sample", [rows, vocab],
               [logits, torch.tensor(temps), torch.tensor(top_k), torch.tensor(top_p),
                torch.tensor(min_p), u], torch.int64, (rows,))
    meta = SamplingMetadata(temps, top_k, top_p, min_p, [None] * rows, [[]] * rows,
                            [None] * rows, [None] * rows)
    want = inverse_cdf(Sampler(torch.device("cpu"), backend=ops.TorchOps()).probs(logits, meta), u)
    assert (got != want).sum().item() <= 1  # a uniform at a boundary may round either way


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention(harness, tmp_path, dtype):
    from tokenmill.layers.attention import AttentionContext, PagedAttention
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(3)
    cache = KVCache(1, 10, 8, 2, 32, dtype, torch.device("cpu"))
    cache.store(0, torch.randn(80, 2, 32), torch.randn(80, 2, 32), torch.arange(80))
    tables = torch.tensor([[3, 1, 4, 0, 5, 9, 2, 6], [7, 8, 0, 0, 0, 0, 0, 0]])
    lens = torch.tensor([61, 13])
    q = torch.randn(2, 6, 32).to(dtype)
    attn = PagedAttention(6, 2, 32, 0, sliding_window=20)
    got = call(harness, tmp_path, "attention", [DT[dtype], 2, 6, 2, 32, 8, 8, 20, attn.scale],
               [q, cache.k[0][0], cache.v[0][0], tables, lens], dtype, (2, 6, 32))
    ctx = AttentionContext(cache, torch.tensor([]), 2, decode_block_tables=tables,
                           decode_seq_lens=lens)
    k, v = cache.gather(0, tables, dtype)
    ref = attn._sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                     mask=ctx.decode_mask(20))[:, :, 0]
    close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention(harness, tmp_path, dtype):
    from tokenmill.layers.attention import PagedAttention, chunk_mask
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(4)
    computed, new, window, length = 20, 30, 24, 50
    cache = KVCache(1, 6, 16, 2, 40, dtype, torch.device("cpu"))
    table = torch.tensor([4, 0, 5, 2])
    slots = torch.tensor([int(table[p // 16]) * 16 + p % 16 for p in range(length)])
    cache.store(0, torch.randn(length, 2, 40), torch.randn(length, 2, 40), slots)
    q = torch.randn(new, 6, 40).to(dtype)
    attn = PagedAttention(6, 2, 40, 0, sliding_window=window)
    got = call(harness, tmp_path, "prefill", [DT[dtype], new, 6, 2, 40, 16, computed, window,
                                              attn.scale],
               [q, cache.k[0][0], cache.v[0][0], table], dtype, (new, 6, 40))
    k, v = cache.gather(0, table[None], dtype)
    ref = attn._sdpa(q.transpose(0, 1), k[0, :length].transpose(0, 1),
                     v[0, :length].transpose(0, 1),
                     mask=chunk_mask(computed, new, window, q.device)).transpose(0, 1)
    close(got, ref)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
def test_quantized_kv_decode_attention(harness, tmp_path, fmt):
    """tm_kv_store then tm_decode_attention_quant (the integer key and value paths on NEON and
    scalar) against the PyTorch encoders and gather + SDPA, within the kernels' integer
    rounding (tests/test_kv_kernels.py INTEGER_TOL)."""
    from tests.test_kv_kernels import INTEGER_TOL
    from tokenmill.kernels.kv_pages import KV_FORMATS
    from tokenmill.layers.attention import AttentionContext, PagedAttention
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(5)
    blocks, bs, hk, d = 12, 16, 2, 64
    k, v = torch.randn(blocks * bs, hk, d) * 2, torch.randn(blocks * bs, hk, d)
    cache = KVCache(1, blocks, bs, hk, d, fmt, torch.device("cpu"), stage_slots=blocks)
    slots = torch.arange(blocks * bs)
    cache.store(0, k, v, slots, slots)
    tables = torch.tensor([[3, 1, 4, 0, 5, 9, 2, 6, 11, 7], [7, 8, 10, 0, 0, 0, 0, 0, 0, 0]])
    lens = torch.tensor([150, 40])
    stages = tables[torch.arange(2), (lens - 1) // bs]  # stage slot i is block i's
    q = torch.randn(2, 6, d)
    attn = PagedAttention(6, hk, d, 0, sliding_window=None)
    rot = cache.format.rotation(d, q.device) if fmt == "int4" else torch.zeros(1)
    got = call(harness, tmp_path, "kv_attention",
               [KV_FORMATS[fmt], 2, 6, hk, d, bs, blocks, tables.shape[1], 0, attn.scale],
               [k, v, rot, tables, lens, stages, q], torch.float32, (2, 6, d))
    if fmt == "int4":
        got = got @ rot.T
    ctx = AttentionContext(cache, torch.tensor([]), 2, decode_block_tables=tables,
                           decode_seq_lens=lens, decode_stages=stages)
    attn.ops = ops.TorchOps()
    ref = attn._decode(q, ctx)
    assert (got - ref).abs().max().item() / ref.abs().max().item() < INTEGER_TOL


@pytest.mark.parametrize("fmt", [4, 5, 8, "4s", "5s", "8s"])  # "s": symmetric, d alone packed
@pytest.mark.parametrize("rows", [1, 9])  # one tile, two
def test_quantized_linear(harness, tmp_path, fmt, rows):
    from tests.test_quant_kernels import random_bq
    from tokenmill.kernels.lib import QSYM
    from tokenmill.quantization import linear_ref

    bq = random_bq(24, 96, fmt, seed=2)
    quant = bq.bits | (QSYM if str(fmt).endswith("s") else 0)
    x = torch.randn(rows, 96)
    got = call(harness, tmp_path, "qlinear", [quant, 24, 96, rows, 0, 0],
               [bq.codes, bq.d.view(torch.int16), bq.m.view(torch.int16), x], torch.float32,
               (rows, 24))
    close(got, linear_ref(x, bq))
