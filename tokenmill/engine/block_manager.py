"""Paged KV blocks: reference counts, prefix caching by chained block hashes, LRU eviction.

Pure Python (no torch), so it can be reasoned about and property-tested on its own. A block is a
fixed number of token slots in the KV cache. A full, computed block is registered under the hash
of (parent block hash, its token ids), so any sequence whose prefix has the same tokens reuses it.
Free blocks wait in one LRU queue: never-cached blocks at the front (used first), cached blocks at
the back in the order they were freed, so the least recently used cached block is evicted first.

A manager owns one pool and manages block table number `group` of each sequence (see
kv_manager.py for models with several pools). The group-0 manager also keeps the sequence's
chained block hashes and its computed-token counter; other groups read them. A compressed pool
(DeepSeek V4) holds one slot per `rate` tokens: its block of block_size slots covers
block_size x rate tokens, a whole number (`stride`) of group 0's blocks, and is cached under
the hash of the last of them.

A pool of a staged KV format (int4) also lends a stage slot with each block until the block's
tokens are computed (stage_slots.py); allocation needs both.
"""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.engine.sequence import Sequence
from tokenmill.engine.stage_slots import StageSlots

# Stands in a block table for a block released because it slid out of the attention window.
NULL_BLOCK = -1


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    """Chained hash of a full block: equal hashes mean equal token prefixes (up to 64-bit hash
    collisions of Python's tuple hash, which is deterministic for ints)."""
    return hash((parent_hash, tuple(token_ids)))


class BlockManager(StageSlots):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 group: int = 0, rate: int = 1, token_block_size: int | None = None,
                 stage_slots: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size  # slots per block
        self.rate = rate  # tokens per slot
        self.token_block_size = token_block_size or block_size  # group 0's, the hash chain's
        self.stride = block_size * rate // self.token_block_size
        if self.stride * self.token_block_size != block_size * rate:
            raise ValueError(f"a block of {block_size} x {rate} tokens is not a whole number "
                             f"of {self.token_block_size}-token blocks")
        self.enable_prefix_caching = enable_prefix_caching
        self.group = group
        self.primary = group == 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_queried_tokens = 0  # prefix-cache statistics, in tokens
        self.num_hit_tokens = 0
        self._init_stages(stage_slots)

    # ---- this manager's table of a sequence --------------------------------------------------
    def table(self, seq: Sequence) -> list[int]:
        while len(seq.block_tables) <= self.group:
            seq.block_tables.append([])
        return seq.block_tables[self.group]

    def _set_table(self, seq: Sequence, table: list[int]) -> None:
        self.table(seq)
        seq.block_tables[self.group] = table
        self._reset_stages(seq, len(table))

    # ---- accounting -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks holding the slots of num_tokens tokens (a compressed pool: of its complete
        windows)."""
        return -(-(num_tokens // self.rate) // self.block_size)

    # ---- prefix cache -----------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq. The last token is never served from
        the cache: its logits are needed to sample. Requests asking for prompt logprobs compute
        every prompt position, so they skip the cache."""
        hits: list[int] = []
        for block_id in self.cached_prefix_blocks(seq):
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cached_prefix_blocks(self, seq: Sequence) -> list[int | None]:
        """For each full block of seq's tokens but the last token: its cached block id, or
        None. A sliding-window pool needs only the blocks its next query can see
        (kv_manager.py), so the list goes on past the first block that is not cached."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        bs = self.token_block_size
        found: list[int | None] = []
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            parent = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
            if (i + 1) % self.stride == 0:
                found.append(self._cached.get(parent))
        return found

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    # ---- allocation -------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (),
                          hit_tokens: int = 0) -> int:
        """Free blocks that allocate(seq, num_new_tokens, hits) would consume. hit_tokens:
        the prefix the hits serve (a compressed pool's hits cover up to it)."""
        revived = sum(1 for b in hits if b != NULL_BLOCK and self.blocks[b].ref_count == 0)
        return self._fresh(seq, num_new_tokens, hits, hit_tokens) + revived

    def _fresh(self, seq: Sequence, num_new_tokens: int, hits=(), hit_tokens: int = 0) -> int:
        """New blocks (each with a stage slot, in a staged pool) that the allocation appends."""
        total = self._base(seq, hits, hit_tokens) + num_new_tokens
        return max(self.blocks_for_tokens(total) - len(self.table(seq)) - len(hits), 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (),
                     hit_tokens: int = 0, reserve: int = 0) -> bool:
        """Whether the tokens fit, with `reserve` blocks (and stage slots) left free after."""
        if self.staged and self._fresh(seq, num_new_tokens, hits, hit_tokens) + reserve > (
                self.num_free_stages):
            return False
        return self.num_blocks_needed(seq, num_new_tokens, hits, hit_tokens) + reserve <= (
            self.num_free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] = (),
                 hit_tokens: int = 0) -> None:
        """Grow seq's block table to hold num_new_tokens more tokens. Cache hits (only for a
        sequence with no blocks yet) become its first blocks and count as computed; a
        sliding-window pool's hits may start with NULL_BLOCKs (blocks outside the window)."""
        if not self.can_allocate(seq, num_new_tokens, hits, hit_tokens):
            raise RuntimeError("allocate() called without enough free blocks")
        total = self._base(seq, hits, hit_tokens) + num_new_tokens
        if hits:
            assert not self.table(seq)
            for block_id in hits:
                if block_id != NULL_BLOCK:
                    self._take(block_id)
            self._set_table(seq, list(hits))
            if self.primary:
                seq.block_hashes = self._chain(seq, len(hits))
                seq.num_computed_tokens = len(hits) * self.block_size
        table = self.table(seq)
        while len(table) < self.blocks_for_tokens(total):
            table.append(self._pop_free())
            self._lend_stage(seq)

    def _chain(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of seq's first num_blocks blocks."""
        bs, hashes, parent = self.block_size, [], None
        for i in range(num_blocks):
            parent = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def _base(self, seq: Sequence, hits, hit_tokens: int = 0) -> int:
        """Tokens already held before an allocation: cache hits, or what is computed."""
        if hit_tokens:
            return hit_tokens
        return len(hits) * self.block_size * self.rate if hits else seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks seq has computed so far, so later sequences can reuse them
        (group 0: extends seq.block_hashes first)."""
        bs = self.block_size
        start = len(seq.block_hashes)
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        self.register(seq, start, len(seq.block_hashes))
        self.release_stages(seq)

    def register(self, seq: Sequence, start: int, end: int) -> None:
        """Put blocks start..end-1 of seq's table under their hashes in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.table(seq)
        for c in range(start, end):  # c: a block of the hash chain; i: this pool's block
            if (c + 1) % self.stride:
                continue
            i = (c + 1) // self.stride - 1
            if table[i] == NULL_BLOCK:
                continue
            block, block_hash = self.blocks[table[i]], seq.block_hashes[c]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block.block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give child the parent's full prompt blocks (shared, ref-counted). The child recomputes
        the partial last block itself, so no block is ever written by two sequences."""
        assert not self.table(child)
        num_full = min(parent.num_computed_tokens, parent.num_prompt_tokens) // (
            self.token_block_size)
        shared = self.table(parent)[:num_full // self.stride]
        for block_id in shared:
            if block_id != NULL_BLOCK:
                self._take(block_id)
        self._set_table(child, shared)
        if self.primary:
            child.block_hashes = parent.block_hashes[:num_full]
            child.num_computed_tokens = num_full * self.block_size

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks (finish, abort or preemption). Tail blocks are released
        first so that, among equally old cached blocks, a prompt's head outlives its tail."""
        for block_id in reversed(self.table(seq)):
            if block_id != NULL_BLOCK:
                self._release(block_id)
        self._return_stages(seq)
        self._set_table(seq, [])
        if self.primary:
            seq.block_hashes = []

    def truncate(self, seq: Sequence) -> None:
        """Release blocks beyond what seq's tokens need: a verify step allocated slots for its
        drafts, and rejected drafts' K/V are garbage past num_computed_tokens (never hashed:
        commit() only registers blocks of computed, verified tokens)."""
        table = self.table(seq)
        keep = self.blocks_for_tokens(seq.num_tokens)
        while len(table) > keep:
            block_id = table.pop()
            if block_id != NULL_BLOCK:
                self._release(block_id)
            self._return_stages(seq, last=True)

    def release_outside_window(self, seq: Sequence, window: int) -> None:
        """Free blocks no future query can see: every later query sits at a position
        >= num_computed_tokens and attends only the last `window` positions. Call after
        commit(), so released full blocks stay in the prefix cache until evicted."""
        first_visible = seq.num_computed_tokens - window + 1
        table = self.table(seq)
        for i in range(max(first_visible, 0) // self.block_size):
            if table[i] == NULL_BLOCK:
                continue
            self._release(table[i])
            table[i] = NULL_BLOCK

    def num_held_blocks(self, seq: Sequence) -> int:
        return sum(1 for b in self.table(seq) if b != NULL_BLOCK)

    # ---- internals --------------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)
