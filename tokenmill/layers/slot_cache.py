"""A block pool whose layers keep vectors of their own widths per slot: DeepSeek V4's caches.

V4's layers cache different things (models/deepseek_v4.py `cache_pools`): the raw pool holds,
per token, every layer's shared K=V vector and the compressed layers' compressor inputs; a
compressed pool holds one entry per `rate` tokens (CSA: the entry and its indexer key; HCA: the
entry). Each pool has one block table per sequence (engine/kv_manager.py); a slot is
block_id * slots_per_block + offset, as in KVCache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.layers.kv_cache import zeros


class SlotCache:
    def __init__(self, widths: list[int], num_blocks: int, slots_per_block: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.widths = list(widths)
        self.num_blocks = num_blocks
        self.block_size = slots_per_block
        self.dtype = dtype
        self.layers = [zeros((num_blocks * slots_per_block, w), dtype, device) for w in widths]
        self.bytes_per_slot = sum(widths) * dtype.itemsize
        self.quantized = self.latent = False

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.layers)

    def slots(self, table: list[int], first: int, end: int) -> torch.Tensor:
        """Slots of positions [first, end) (token positions in the raw pool, entry indices in a
        compressed one) through a block table."""
        bs = self.block_size
        if end <= first:
            return torch.empty(0, dtype=torch.long, device=self.layers[0].device)
        blocks = torch.tensor(table[first // bs:(end - 1) // bs + 1], dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()
        return slots[first % bs:first % bs + end - first].to(self.layers[0].device)

    def store(self, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.layers[layer].index_copy_(0, slots, values.to(self.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].index_select(0, slots)


@dataclass
class PooledChunk:
    """One scheduled sequence of a step: its tokens [start, end) in the packed batch, the
    tokens it had computed before, and its block table in every pool."""

    start: int
    end: int
    num_computed: int
    tables: list[list[int]]

    @property
    def num_new(self) -> int:
        return self.end - self.start


@dataclass
class PooledContext:
    """What a pooled model's layers read for one step (engine/model_runner.py builds it):
    slot_mapping is every new token's raw-pool slot (pool 0); the slots of a chunk's positions
    in any pool are computed once per step and shared by all layers."""

    caches: list[SlotCache]
    chunks: list[PooledChunk]
    slot_mapping: torch.Tensor
    _memo: dict = field(default_factory=dict)

    def raw_slots(self, chunk: PooledChunk, first: int, end: int) -> torch.Tensor:
        return self.pool_slots(chunk, 0, first, end)

    def pool_slots(self, chunk: PooledChunk, pool: int, first: int, end: int) -> torch.Tensor:
        key = (id(chunk), pool, first, end)
        if key not in self._memo:
            self._memo[key] = self.caches[pool].slots(chunk.tables[pool], first, end)
        return self._memo[key]
