"""The KV cache's block pools. Most models keep one pool for all layers. A model mixing
sliding-window and full-attention layers keeps two: the full layers' blocks hold the whole
history, the sliding layers' blocks are freed once they slide out of the window. DeepSeek V4
keeps a windowed pool of raw tokens and one compressed pool per compressed layer type (one
slot per `rate` tokens). Each pool is a BlockManager with its own block table per sequence;
this class gives the scheduler one interface over all of them."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.block_manager import NULL_BLOCK, BlockManager
from tokenmill.engine.sequence import Sequence


@dataclass(frozen=True)
class CacheGroup:
    layers: list[int]  # model layers whose K/V live in this pool
    window: int | None  # blocks entirely older than this many tokens are freed
    num_blocks: int
    bytes_per_token: int  # K and V of this group's layers for one token (per slot, if rate > 1)
    rate: int = 1  # tokens per slot: a compressed pool keeps one entry per `rate` tokens
    slots_per_block: int | None = None  # None: the engine's block size
    widths: tuple[int, ...] | None = None  # per layer, values per slot (a SlotCache pool)
    stage_slots: int = 0  # a staged format's (int4) open blocks at once (block_manager.py)
    stage_bytes: int = 0  # bytes of one stage slot
    stage_dtype: str = "float32"  # the stage's dtype: the model's

    def block_bytes(self, block_size: int) -> int:
        return round(self.bytes_per_token * (self.slots_per_block or block_size))

    def tokens_per_block(self, block_size: int) -> int:
        return (self.slots_per_block or block_size) * self.rate


class KVCacheManager:
    def __init__(self, groups: list[CacheGroup], block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.groups = groups
        self.block_size = block_size
        self.managers = [BlockManager(g.num_blocks, g.slots_per_block or block_size,
                                      enable_prefix_caching, group=i, rate=g.rate,
                                      token_block_size=block_size, stage_slots=g.stage_slots)
                         for i, g in enumerate(groups)]

    @property
    def primary(self) -> BlockManager:
        """Group 0's pool: it also tracks the sequence's block hashes and computed tokens."""
        return self.managers[0]

    # ---- the scheduler's interface ------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[list[int]]:
        """Per pool, the blocks of seq's longest prefix that every pool can serve. A full
        pool must hold every block of it; a sliding-window pool only the blocks the next query
        sees (the others, long released, stand as NULL_BLOCK), as vLLM's sliding-window
        manager does: a shared system prompt longer than the window is still a hit. Linear in
        the prompt's blocks (this runs for the head of the waiting queue every step)."""
        found = [m.cached_prefix_blocks(seq) for m in self.managers]
        longest = len(found[0])  # in group 0's blocks; a compressed pool's cover `stride` each
        for f, g, m in zip(found, self.groups, self.managers):  # a full pool: its leading hits
            if g.window is None:
                run = next((i for i, b in enumerate(f) if b is None), len(f))
                longest = min(longest, (run + 1) * m.stride - 1)
        # per sliding pool, the last missing block before each position
        last_missing = {}
        for i, (f, g) in enumerate(zip(found, self.groups)):
            if g.window is not None:
                last, before = -1, []
                for j, b in enumerate(f[:longest]):
                    before.append(last)
                    last = j if b is None else last
                last_missing[i] = before + [last]
        for n in range(longest, 0, -1):
            firsts = [self._first_visible(n, g.window) for g in self.groups]
            if all(last_missing[i][n] < firsts[i] for i in last_missing):
                return [[NULL_BLOCK] * first + f[first:n] if m.stride == 1 else f[:n // m.stride]
                        for f, first, m in zip(found, firsts, self.managers)]
        return [[] for _ in self.managers]

    def _first_visible(self, n: int, window: int | None) -> int:
        """The first block the query at position n * block_size sees in a pool."""
        return 0 if window is None else max(n * self.block_size - window + 1, 0) // self.block_size

    def hit_tokens(self, hits: list[list[int]] | None) -> int:
        return len(hits[0]) * self.block_size if hits else 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits=None,
                     reserve: int = 0) -> bool:
        """Whether the tokens fit, with `reserve` blocks (and stage slots) of every pool left
        free after."""
        tokens = self.hit_tokens(hits)
        hits = hits or [()] * len(self.managers)
        return all(m.can_allocate(seq, num_new_tokens, h, tokens, reserve)
                   for m, h in zip(self.managers, hits))

    def allocate(self, seq: Sequence, num_new_tokens: int, hits=None) -> None:
        if not self.can_allocate(seq, num_new_tokens, hits):
            raise RuntimeError("allocate() called without enough free blocks")
        tokens = self.hit_tokens(hits)
        hits = hits or [()] * len(self.managers)
        for m, h in reversed(list(zip(self.managers, hits))):  # group 0 (moves counters) last
            m.allocate(seq, num_new_tokens, h, tokens)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.primary.record_prefix_query(num_tokens, num_hit_tokens)

    def commit(self, seq: Sequence) -> None:
        """Register newly full blocks in every pool, then free what slid out of a window."""
        start = len(seq.block_hashes)
        self.primary.commit(seq)
        for m in self.managers[1:]:
            m.register(seq, start, len(seq.block_hashes))
            m.release_stages(seq)
        for m, g in zip(self.managers, self.groups):
            if g.window is not None:
                m.release_outside_window(seq, g.window)

    def truncate(self, seq: Sequence) -> None:
        """Release the tail blocks past seq's tokens (drafted tokens that were rejected)."""
        for m in self.managers:
            m.truncate(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for m in reversed(self.managers):
            m.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        for m in self.managers:
            m.free(seq)

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks sequences hold (cached-but-free prefix blocks not counted)."""
        return sum((m.num_blocks - m.num_free_blocks) * g.block_bytes(self.block_size)
                   for m, g in zip(self.managers, self.groups))

    @property
    def usage(self) -> float:
        """Share of the cache's bytes held by sequences."""
        total = sum(m.num_blocks * g.block_bytes(self.block_size)
                    for m, g in zip(self.managers, self.groups))
        return self.used_bytes / total

    def num_held_blocks(self, seq: Sequence) -> list[int]:
        return [m.num_held_blocks(seq) for m in self.managers]
