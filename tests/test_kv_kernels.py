"""The kernels of quantized KV pages (kernels/csrc/kv_store.cpp, attention_quant.cpp, and the
fused decode step on them), for every instruction set this CPU runs, against the plain path:
layers/kv_quant.py's encoder, gather + dequantize + SDPA, and the layer-by-layer model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import paged_history, random_prompts
from tests.test_kernels import close, greedy, pytestmark  # noqa: F401 (the same skips)
from tokenmill.layers import ops


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
def test_kv_store_matches_the_encoder(kops, fmt):
    """The kernel writing quantized pages against layers/kv_quant.py's encoder: int8 and fp8
    (rounded to nearest even, subnormals too) exactly; int4 (rotation and error sums in another
    order) with the same codes nearly everywhere."""
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(6)
    x = torch.randn(40, 3, 64) * 2
    x[:, 0, 5] *= 20  # an outlier channel
    x[:, 1, 7] *= 1e-4  # values fp8 stores as subnormals
    slots = torch.randperm(64)[:40]
    ref = KVCache(1, 4, 16, 3, 64, fmt, torch.device("cpu"))
    ref.store(0, x, x, slots)
    got = KVCache(1, 4, 16, 3, 64, fmt, torch.device("cpu"))
    kops.kv_store(got, 0, x, x, slots)
    if fmt != "int4":
        raw = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
        assert all(torch.equal(raw(a), raw(b)) for a, b in zip(ref.k + ref.v, got.k + got.v))
        return
    same = (ref.k[0] == got.k[0]).float().mean().item()
    assert same > 0.99
    table = torch.arange(4)[None]
    a, b = got.gather(0, table, torch.float32)[0], ref.gather(0, table, torch.float32)[0]
    assert ((a - b).norm() / b.norm()).item() < 0.01


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("seqs", [1, 2, 9])
def test_decode_attention_on_quantized_pages(kops, fmt, window, threads, seqs):
    """The kernel reading int8 / fp8 / int4 pages in place (rotated q and output for int4)
    against the plain path: gather, dequantize, SDPA. One sequence of 1,000 positions is split
    between tasks (partial softmax sums combined); nine take every KV head per task."""
    from tokenmill.layers.attention import AttentionContext, PagedAttention
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(5)
    d, block_size, blocks = 64, 16, 64
    cache = KVCache(1, blocks, block_size, 3, d, fmt, torch.device("cpu"))
    slots = blocks * block_size
    cache.store(0, torch.randn(slots, 3, d) * 2, torch.randn(slots, 3, d), torch.arange(slots))
    tables = torch.stack([torch.randperm(blocks)[:63] for _ in range(seqs)])
    lens = torch.randint(1, 63 * block_size + 1, (seqs,)) if seqs > 1 else torch.tensor([1000])
    q = torch.randn(seqs, 9, d)
    ctx = AttentionContext(cache, torch.tensor([]), seqs, decode_block_tables=tables,
                           decode_seq_lens=lens)
    attn = PagedAttention(9, 3, d, 0, sliding_window=window)
    attn.ops = kops
    fast = attn._decode(q, ctx)
    attn.ops = ops.TorchOps()
    close(fast, attn._decode(q, ctx), torch.float32)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize(("computed", "new", "window"), [(0, 37, None), (150, 21, None),
                                                           (300, 64, 100), (5, 1, None)])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_on_quantized_pages(kops, fmt, computed, new, window, threads, dtype):
    """A prefill chunk against its quantized history (prefix-cache hits, chunked prefill), read
    a key tile at a time, against the plain path: gather, dequantize, SDPA (through the layer,
    so int4's rotation of q and the output is included); a bf16 model's keys in bf16."""
    from tokenmill.layers.attention import AttentionContext, PagedAttention, PrefillChunk

    torch.manual_seed(8)
    hq, hk, d = 6, 2, 64
    cache, table, slots, k, v = paged_history(computed + new, 16, hk, d, fmt, k_scale=2.0)
    q = torch.randn(new, hq, d).to(dtype)
    ctx = AttentionContext(cache, slots[computed:], 0,
                           prefills=[PrefillChunk(0, new, computed, table)])
    attn = PagedAttention(hq, hk, d, 0, sliding_window=window)
    attn.ops = kops
    fast = attn._prefill(q, k[computed:], v[computed:], ctx.prefills[0], ctx)
    attn.ops = ops.TorchOps()
    close(fast, attn._prefill(q, k[computed:], v[computed:], ctx.prefills[0], ctx), dtype)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3", "int4"])
def test_fused_decode_on_quantized_pages_equals_layer_by_layer(tmp_path, monkeypatch, kv):
    """The fused decode step writing and reading int8 / int4 pages (int4: q and the output
    rotated in C++) against the layer-by-layer path on the same cache format."""
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
