"""Paged KV cache storage: one K and one V tensor per layer, laid out as blocks of token slots.

A token's slot is block_id * block_size + offset. store() scatters a step's new K/V into their
slots; gather() reads whole blocks through a block table, padded to a common length.
"""

from __future__ import annotations

import torch

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return 2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: padded slots are masked out, but 0 * NaN would still poison softmax @ V.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        # k, v: (tokens, kv_heads, head_dim); slots: (tokens,)
        heads, dim = k.shape[1:]
        self.k[layer].view(-1, heads, dim).index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].view(-1, heads, dim).index_copy_(0, slots, v.to(self.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # block_tables: (batch, max_blocks) -> (batch, max_blocks * block_size, kv_heads, head_dim)
        batch, nblocks = block_tables.shape
        k = self.k[layer][block_tables].flatten(1, 2)
        v = self.v[layer][block_tables].flatten(1, 2)
        return k, v
