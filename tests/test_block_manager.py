"""Block manager on its own: property tests (random allocate / append / commit / fork / free
never leak or double-free), and prefix-cache reuse and LRU eviction."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tokenmill.engine.block_manager import NULL_BLOCK, BlockManager
from tokenmill.engine.sequence import Sequence
from tokenmill.sampling_params import SamplingParams

BS = 4


def new_seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What a step does to one sequence: blocks for n tokens, compute them, register."""
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.commit(seq)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=BS, enable_prefix_caching=True)
        self.live: list[Sequence] = []

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, tokens):
        """Tiny alphabet, so prompts often share prefixes and hit the cache."""
        seq = new_seq(tokens)
        hits = self.bm.lookup_prefix(seq)
        n = seq.num_tokens - len(hits) * BS
        if self.bm.can_allocate(seq, n, hits):
            self.bm.allocate(seq, n, hits)
            seq.num_computed_tokens += n
            self.bm.commit(seq)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, index, token):
        seq = self.live[index % len(self.live)]
        seq.append_token(token)
        if self.bm.can_allocate(seq, 1):
            compute(self.bm, seq, 1)
        else:  # what preemption does
            self.bm.free(seq)
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def fork(self, index):
        parent = self.live[index % len(self.live)]
        child = new_seq(parent.token_ids[: parent.num_prompt_tokens])
        self.bm.fork(parent, child)
        n = child.num_uncomputed_tokens
        if n == 0 or self.bm.can_allocate(child, n):
            if n:
                compute(self.bm, child, n)
            self.live.append(child)
        else:
            self.bm.free(child)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), window=st.integers(1, 9))
    def slide(self, index, window):
        """Sliding-window release of blocks no later query can see."""
        seq = self.live[index % len(self.live)]
        before = self.bm.num_held_blocks(seq)
        self.bm.release_outside_window(seq, window)
        visible = -(-window // BS) + 1
        assert self.bm.num_held_blocks(seq) <= max(before, 0)
        assert self.bm.num_held_blocks(seq) <= visible + 1

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        seq = self.live.pop(index % len(self.live))
        self.bm.free(seq)

    @invariant()
    def ref_counts_match_block_tables(self):
        counts = [0] * self.bm.num_blocks
        for seq in self.live:
            assert len(seq.block_table) == self.bm.blocks_for_tokens(seq.num_computed_tokens)
            for b in seq.block_table:
                if b != NULL_BLOCK:
                    counts[b] += 1
        assert counts == [b.ref_count for b in self.bm.blocks]
        free = {b.block_id for b in self.bm.blocks if b.ref_count == 0}
        assert set(self.bm._free) == free and len(self.bm._free) == len(free)

    @invariant()
    def cache_points_at_blocks_with_that_hash(self):
        for h, block_id in self.bm._cached.items():
            assert self.bm.blocks[block_id].block_hash == h

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks  # nothing leaked


TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = settings(max_examples=150, stateful_step_count=40,
                                               deadline=None)


def test_cached_blocks_are_reused():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = new_seq(range(10))  # two full blocks + 2 tokens
    compute(bm, a, 10)
    a_blocks = list(a.block_table)
    bm.free(a)
    b = new_seq([*range(8), 99, 98, 97])
    hits = bm.lookup_prefix(b)
    assert hits == a_blocks[:2]  # the same physical blocks, no recompute
    bm.allocate(b, b.num_tokens - 8, hits)
    assert b.block_table[:2] == hits and b.num_computed_tokens == 8


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = new_seq(range(5))
    compute(bm, a, 5)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    try:
        bm.free(a)
    except RuntimeError as e:
        assert "double free" in str(e)
    else:
        raise AssertionError("double free went unnoticed")


def test_lru_evicts_least_recently_freed_cached_block():
    bm = BlockManager(num_blocks=4, block_size=BS)
    x, y = new_seq([1] * 5), new_seq([2] * 5)  # each: one full (cached) block + one partial
    compute(bm, x, 5)
    compute(bm, y, 5)
    bm.free(x)
    bm.free(y)
    assert bm.num_free_blocks == 4
    z = new_seq([3] * 9)
    bm.allocate(z, 9)  # three blocks: both never-cached ones first, then the LRU cached one
    assert bm.lookup_prefix(new_seq([1] * 5)) == []  # x's block, freed first, was evicted
    assert len(bm.lookup_prefix(new_seq([2] * 5))) == 1  # y's survives


class TwoPoolMachine(RuleBasedStateMachine):
    """KVCacheManager with a full-history pool and a sliding-window pool (window 6): random
    admissions with prefix hits, decodes, forks and frees keep both pools' ref counts equal
    to their block tables, and the window pool never holds more than the window needs."""

    WINDOW = 6

    def __init__(self):
        from tokenmill.engine.kv_manager import CacheGroup, KVCacheManager

        super().__init__()
        self.kv = KVCacheManager([CacheGroup([0], None, 14, 8),
                                  CacheGroup([1], self.WINDOW, 10, 8)], BS)
        self.live: list[Sequence] = []

    def _step(self, seq: Sequence, n: int, hits=None) -> bool:
        if not self.kv.can_allocate(seq, n, hits):
            return False
        self.kv.allocate(seq, n, hits)
        seq.num_computed_tokens += n
        self.kv.commit(seq)
        return True

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def admit(self, tokens):
        seq = new_seq(tokens)
        hits = self.kv.lookup_prefix(seq)
        if self._step(seq, seq.num_tokens - self.kv.hit_tokens(hits), hits):
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, index, token):
        seq = self.live[index % len(self.live)]
        seq.append_token(token)
        if not self._step(seq, 1):
            self.kv.free(seq)
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def fork(self, index):
        parent = self.live[index % len(self.live)]
        child = new_seq(parent.token_ids[: parent.num_prompt_tokens])
        self.kv.fork(parent, child)
        if child.num_uncomputed_tokens == 0 or self._step(child, child.num_uncomputed_tokens):
            self.live.append(child)
        else:
            self.kv.free(child)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def finish(self, index):
        self.kv.free(self.live.pop(index % len(self.live)))

    @invariant()
    def pools_consistent(self):
        for g, m in enumerate(self.kv.managers):
            counts = [0] * m.num_blocks
            for seq in self.live:
                table = m.table(seq)
                assert len(table) == m.blocks_for_tokens(seq.num_computed_tokens)
                for b in table:
                    if b != NULL_BLOCK:
                        counts[b] += 1
                if g == 1:
                    assert m.num_held_blocks(seq) <= -(-self.WINDOW // BS) + 2
            assert counts == [b.ref_count for b in m.blocks]

    def teardown(self):
        for seq in self.live:
            self.kv.free(seq)
        assert self.kv.num_free_blocks == self.kv.num_blocks


TestTwoPools = TwoPoolMachine.TestCase
TestTwoPools.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
