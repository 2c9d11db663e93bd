"""The fused RoPE + cache write of a prefill layer (KernelOps.rope_store, kernels/csrc
elementwise.cpp tm_rope_store), for every instruction set this CPU runs, against the
reference's rotary + KVCache.store."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels import DTYPES, pytestmark  # noqa: F401 (the same skips)
from tokenmill.layers import ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40])  # 40: scalar tails
def test_rope_store_is_rope_then_the_cache_write(kops, dtype, head_dim):
    """The fused prefill step (q, k rotated; k, v into their slots) against the reference's
    rotary + cache write: equal, on the views of one QKV projection; and not taken (None)
    where it does not apply."""
    from tokenmill.layers.kv_cache import KVCache
    from tokenmill.layers.rotary import RotaryEmbedding

    torch.manual_seed(4)
    d, hq, hk, tokens = head_dim, 6, 2, 37
    rotary = RotaryEmbedding(d, 256, 10000.0, None)
    qkv = torch.randn(tokens, (hq + 2 * hk) * d).to(dtype)
    q, k, v = (t.reshape(tokens, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    pos, slots = torch.randint(0, 256, (tokens,)), torch.randperm(5 * 8)[:tokens]
    caches = [KVCache(3, 5, 8, hk, d, dtype, torch.device("cpu")) for _ in range(2)]
    fq, fk = kops.rope_store(q, k, v, rotary, pos, caches[0], 1, slots)
    rq, rk = ops.rope_ref(q, rotary.cos_sin, pos), ops.rope_ref(k, rotary.cos_sin, pos)
    caches[1].store(1, rk, v, slots)
    assert torch.equal(fq, rq) and torch.equal(fk, rk)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a, b)  # the other layers untouched, the other slots zero
    assert kops.rope_store(q.contiguous(), k, v, rotary, pos, caches[0], 1, slots) is None
    int8 = KVCache(3, 5, 8, hk, d, "int8", torch.device("cpu"))
    assert kops.rope_store(q, k, v, rotary, pos, int8, 1, slots) is None
    partial = RotaryEmbedding(d, 256, 10000.0, None, rotary_dim=d // 2)
    assert kops.rope_store(q, k, v, partial, pos, caches[0], 1, slots) is None
