"""The rows-in-lanes prefill attention on VDPBF16PS (attention_prefill_dot.h: the avx512_bf16
build's path for bf16 caches whose head size is a multiple of 32) against the reference, and the
property the fused step relies on: a query row's output does not depend on the rows it is
computed with, so a prompt gives the same bits however it is chunked, and the last layer's
output rows (one-row calls, decode_stack.cpp) equal the op-by-op path's whole chunk."""

import pytest
import torch

from tests.conftest import paged_history, prefill_reference
from tokenmill.kernels import load_cpu_kernels
from tokenmill.kernels.isa import supported_isas
from tokenmill.layers.attention import PagedAttention

pytestmark = pytest.mark.skipif("avx512_bf16" not in supported_isas(),
                                reason="needs a CPU with AVX512-BF16")


@pytest.fixture(scope="module")
def lib():
    lib = load_cpu_kernels("avx512_bf16")
    if lib is None:
        pytest.skip("no kernel library")
    return lib


def attend(lib, q, cache, table, computed, window, scale):
    return lib.prefill_attention(q, cache.k[0][0], cache.v[0][0], table, computed, window, scale)


# (head_dim, query heads, KV heads): GQA 2, 3 and 4, MHA, MQA; one to four 16-channel steps per
# value block
@pytest.mark.parametrize("d,hq,hk", [(64, 9, 3), (128, 8, 2), (96, 4, 4), (32, 8, 1), (256, 4, 1)])
# (cached, new, window): a first chunk, a chunk reading its history, a window shorter than the
# chunk, one token, chunks ending mid-block, more than one softmax block (256 keys)
@pytest.mark.parametrize("computed,new,window", [(0, 37, None), (20, 50, None), (0, 100, 24),
                                                 (33, 17, 8), (0, 1, None), (5, 75, None),
                                                 (300, 40, 100), (0, 600, None)])
def test_lanes_prefill_attention_matches_the_reference(lib, d, hq, hk, computed, new, window):
    torch.manual_seed(4)
    length = computed + new
    cache, table, _, _, _ = paged_history(length, 16, hk, d, torch.bfloat16)
    q = torch.randn(new, hq, d).to(torch.bfloat16)
    attn = PagedAttention(hq, hk, d, 0, sliding_window=window)
    out = attend(lib, q, cache, table, computed, window, attn.scale)
    ref = prefill_reference(q, cache, table, computed, window, attn)
    # bf16 output and bf16 probabilities (as PyTorch's bf16 attention)
    assert (out.float() - ref).abs().max().item() < 0.02 * ref.abs().max().item()


@pytest.mark.parametrize("window", [None, 40, 300])
def test_a_row_does_not_depend_on_its_chunk(lib, window):
    """Rows alone, and the chunk cut in two, give the whole chunk's bits (a window's first
    block starts elsewhere for each: blocks are cut at fixed positions)."""
    torch.manual_seed(5)
    computed, new, hq, hk, d = 290, 330, 9, 3, 64
    cache, table, _, _, _ = paged_history(computed + new, 16, hk, d, torch.bfloat16)
    q = torch.randn(new, hq, d).to(torch.bfloat16)
    scale = d ** -0.5
    whole = attend(lib, q, cache, table, computed, window, scale)
    for r in (0, 1, 17, 95, 96, 200, new - 1):
        alone = attend(lib, q[r:r + 1], cache, table, computed + r, window, scale)
        assert torch.equal(alone[0], whole[r]), r
    cut = 137
    parts = torch.cat([attend(lib, q[:cut], cache, table, computed, window, scale),
                       attend(lib, q[cut:], cache, table, computed + cut, window, scale)])
    assert torch.equal(parts, whole)


RSS_AFTER_A_LONG_HISTORY = """
import torch
from tokenmill.kernels import load_cpu_kernels

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

lib = load_cpu_kernels("avx512_bf16")
hq, hk, d, history = 32, 8, 128, 30000
blocks = history // 16 + 4
k = torch.randn(blocks, 16, hk, d).to(torch.bfloat16)
v = torch.randn(blocks, 16, hk, d).to(torch.bfloat16)
q = torch.randn(32, hq, d).to(torch.bfloat16)
table = torch.arange(blocks)
lib.prefill_attention(q, k, v, table, 0, None, d ** -0.5)  # the short call's buffers
before = rss_mib()
out = lib.prefill_attention(q, k, v, table, history, None, d ** -0.5)
assert torch.isfinite(out.float()).all()
print(rss_mib() - before)
"""


def test_a_long_historys_key_copy_is_not_kept(lib):
    """The call's keys are copied for the lanes (K rows, V^T pairs); past 64 MiB the copy is
    freed after the call rather than kept resident for the next one (here 118 MiB). In a
    process of its own: the suite's other threads and heaps move this one's RSS."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", RSS_AFTER_A_LONG_HISTORY], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) < 40
