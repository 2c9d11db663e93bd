"""The paged decode attention kernel (kernels/csrc/attention.cpp) against the reference, for
every instruction set this CPU runs: sequences sharing blocks, verify runs of one sequence read
once for all their rows, and long histories; a row batched gives bit for bit what it gives
alone."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels import DTYPES, close, pytestmark  # noqa: F401 (pytestmark applies here)


def random_cache(blocks: int, block_size: int, d: int, dtype):
    """One layer of 2 KV heads, every slot filled."""
    from tokenmill.layers.kv_cache import KVCache

    cache = KVCache(1, blocks, block_size, 2, d, dtype, torch.device("cpu"))
    slots = blocks * block_size
    cache.store(0, torch.randn(slots, 2, d), torch.randn(slots, 2, d), torch.arange(slots))
    return cache


def reference(attn, cache, q, tables, lens, window, dtype):
    from tokenmill.layers.attention import AttentionContext

    ctx = AttentionContext(cache, torch.tensor([]), len(lens), decode_block_tables=tables,
                           decode_seq_lens=lens)
    k, v = cache.gather(0, tables, dtype)
    return attn._sdpa(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                      mask=ctx.decode_mask(window))[:, :, 0]


def check_rows(kops, cache, tables, lens, window, d, dtype):
    """6 query heads: every row batched equals itself alone, and the batch the reference."""
    from tokenmill.layers.attention import PagedAttention

    tables, lens = torch.stack(tables), torch.tensor(lens)
    q = torch.randn(len(lens), 6, d).to(dtype)
    attn = PagedAttention(6, 2, d, 0, sliding_window=window)
    kc, vc = cache.k[0][0], cache.v[0][0]
    fast = kops.decode_attention(q, kc, vc, tables, lens, window, attn.scale)
    for b in range(len(lens)):
        alone = kops.decode_attention(q[b:b + 1], kc, vc, tables[b:b + 1], lens[b:b + 1],
                                      window, attn.scale)
        assert torch.equal(fast[b:b + 1], alone), b
    close(fast, reference(attn, cache, q, tables, lens, window, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("block_size", [8, 32])
# tasks: 2 seqs x 2 KV heads >= 4 x 1 thread: per GQA group, < 4 x 2 threads: per query head;
# 9 seqs >= 4 x threads: per sequence (both KV heads side by side)
@pytest.mark.parametrize("seqs", [2, 9])
@pytest.mark.parametrize("head_dim", [32, 40])  # 40: a partial vector on AVX-512
def test_decode_attention(kops, dtype, window, threads, block_size, seqs, head_dim):
    from tokenmill.layers.attention import PagedAttention

    torch.manual_seed(3)
    d = head_dim
    cache = random_cache(10, block_size, d, dtype)
    tables = torch.tensor([[3, 1, 4, 0, 5, 9, 2, 6], [7, 8, 0, 0, 0, 0, 0, 0]])
    lens = torch.tensor([61, 13])
    if seqs > 2:  # more sequences reading (sharing) the same blocks in other orders
        more = [torch.randperm(10)[:8] for _ in range(seqs - 2)]
        tables = torch.stack([tables[0], tables[1], *more])
        lens = torch.cat([lens, torch.randint(1, 8 * block_size + 1, (seqs - 2,))])
    q = torch.randn(seqs, 6, d).to(dtype)
    attn = PagedAttention(6, 2, d, 0, sliding_window=window)
    fast = kops.decode_attention(q, cache.k[0][0], cache.v[0][0], tables, lens, window,
                                 attn.scale)
    close(fast, reference(attn, cache, q, tables, lens, window, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20, 300, 1100])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("head_dim", [32, 64])
def test_decode_attention_long_histories(kops, dtype, window, threads, head_dim):
    """Histories of 100-2,300 positions over 150 blocks of 16, rows and verify runs on both sides
    of the pieces' edges (1,024 and 2,048, attention_pieces.h): batched, each sequence attends
    its pieces in turn in one task; alone (a row, or a verify run kept whole), a piece a task,
    combined afterwards. Every row is bit for bit what it gives alone, and the reference's."""
    torch.manual_seed(5)
    cache = random_cache(150, 16, head_dim, dtype)
    tables, lens = [], []
    runs = [(253, 6), (511, 3), (100, 1), (1020, 8), (1024, 1), (1025, 1), (2046, 5),
            (2300, 1), (700, 12)]
    for start, n in runs:
        tables += [torch.randperm(150)[:146]] * n
        lens += range(start, start + n)
    check_rows(kops, cache, tables, lens, window, head_dim, dtype)
    at = 0
    for start, n in runs:  # a verify run alone: one unit (not cut for the threads), its pieces
        if n > 1 and start + n - 1 > 1024:
            check_rows(kops, cache, tables[at:at + n], lens[at:at + n], window, head_dim, dtype)
        at += n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
# 64: two 32-column groups summed per key (keys in lanes on AVX512-BF16, attention_lanes.h)
@pytest.mark.parametrize("head_dim", [32, 40, 64])
# rows per sequence: one verifying 5 drafts (6 rows), one 2, a lone row, 12 rows (cut in runs of
# at most 32 / group); [1, 9]: one long run and nothing else (split for the threads)
@pytest.mark.parametrize("runs", [[6, 2, 1, 12], [9]])
def test_decode_attention_runs(kops, dtype, window, threads, head_dim, runs):
    """Rows of one sequence at consecutive positions (speculative decoding's verify rows, a
    batch-invariant prefill chunk) read the history once for all of them: each row's output is
    bit for bit what it gets alone, and matches the reference."""
    torch.manual_seed(4)
    bs = 8
    cache = random_cache(12, bs, head_dim, dtype)
    tables, lens = [], []
    for n in runs:
        table = torch.randperm(12)[:11]
        start = int(torch.randint(1, 11 * bs - n, ()))
        tables += [table] * n
        lens += range(start, start + n)
    if len(runs) > 1:  # a row whose length follows the previous row's but whose blocks differ
        tables.append(torch.randperm(12)[:11])
        lens.append(lens[-1] + 1)
    check_rows(kops, cache, tables, lens, window, head_dim, dtype)
