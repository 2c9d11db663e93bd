"""The kernels of quantized KV pages (kernels/csrc/kv_store.cpp, attention_quant.cpp, and the
fused decode step on them), for every instruction set this CPU runs, against the plain path:
layers/kv_quant.py's encoder, gather + dequantize + SDPA, and the layer-by-layer model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts
from tests.test_kernels import close, greedy, pytestmark  # noqa: F401 (the same skips)
from tokenmill.layers import ops


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_kv_store_matches_the_encoder(kops, fmt):
    """The kernel writing quantized pages against layers/kv_quant.py's encoder: int8 exactly;
    int4 (rotation and error sums in another order) with the same codes nearly everywhere."""
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(6)
    x = torch.randn(40, 3, 64) * 2
    x[:, 0, 5] *= 20  # an outlier channel
    slots = torch.randperm(64)[:40]
    ref = KVCache(1, 4, 16, 3, 64, fmt, torch.device("cpu"))
    ref.store(0, x, x, slots)
    got = KVCache(1, 4, 16, 3, 64, fmt, torch.device("cpu"))
    kops.kv_store(got, 0, x, x, slots)
    if fmt == "int8":
        assert all(torch.equal(a, b) for a, b in zip(ref.k + ref.v, got.k + got.v))
        return
    same = (ref.k[0] == got.k[0]).float().mean().item()
    assert same > 0.99
    table = torch.arange(4)[None]
    a, b = got.gather(0, table, torch.float32)[0], ref.gather(0, table, torch.float32)[0]
    assert ((a - b).norm() / b.norm()).item() < 0.01


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("seqs", [2, 9])
def test_decode_attention_on_quantized_pages(kops, fmt, window, threads, seqs):
    """The kernel reading int8 / int4 pages in place (rotated q and output for int4) against
    the plain path: gather, dequantize, SDPA."""
    from tokenmill.layers.attention import AttentionContext, PagedAttention
    from tokenmill.layers.kv_cache import KVCache

    torch.manual_seed(5)
    d, block_size = 64, 16
    cache = KVCache(1, 10, block_size, 3, d, fmt, torch.device("cpu"))
    slots = 10 * block_size
    cache.store(0, torch.randn(slots, 3, d) * 2, torch.randn(slots, 3, d), torch.arange(slots))
    tables = torch.stack([torch.randperm(10)[:8] for _ in range(seqs)])
    lens = torch.randint(1, 8 * block_size + 1, (seqs,))
    q = torch.randn(seqs, 9, d)
    ctx = AttentionContext(cache, torch.tensor([]), seqs, decode_block_tables=tables,
                           decode_seq_lens=lens)
    attn = PagedAttention(9, 3, d, 0, sliding_window=window)
    attn.ops = kops
    fast = attn._decode(q, ctx)
    attn.ops = ops.TorchOps()
    close(fast, attn._decode(q, ctx), torch.float32)


@pytest.mark.parametrize("kv", ["int8", "int4"])
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
