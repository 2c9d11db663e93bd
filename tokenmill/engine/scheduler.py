"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget. Running sequences go first (a decode costs one token, an
unfinished prompt takes what the budget allows), then waiting sequences are admitted in arrival
order while budget, max_num_seqs and free KV blocks allow. When a running sequence needs a block
and none is free, the newest running sequence is preempted: its blocks are freed and it goes
back to the front of the queue to recompute its tokens later (prefix-cache hits make that cheap).
A decoding sequence with drafted tokens (speculative decoding) asks for 1 + drafts tokens; its
drafts are cut to what the budget and free blocks allow rather than preempting anyone for them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tokenmill.engine.kv_manager import KVCacheManager
from tokenmill.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence (n > 1) joins the running batch directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if seq.spec_token_ids:
                self._trim_drafts(seq, budget)
            want = seq.num_uncomputed_tokens + len(seq.spec_token_ids)
            n = self._reserve(seq, min(want, budget), out.preempted)
            drop_drafts(seq, max(n - 1, 0))
            if n:
                out.scheduled.append((seq, n))
                budget -= n
        if not out.preempted:
            budget = self._admit(out, budget)
        return out

    def _reserve(self, seq: Sequence, n: int, preempted: list[Sequence]) -> int:
        """Blocks for up to n more tokens of seq (a smaller chunk if that is what fits),
        preempting the newest running sequences when not even one token fits. Returns the
        tokens reserved; 0 when seq itself had to be preempted."""
        while not (fit := self._fit(seq, n)):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return 0
        self.block_manager.allocate(seq, fit)
        return fit

    def _trim_drafts(self, seq: Sequence, budget: int) -> None:
        """Keep the drafts that fit the step's budget and the free blocks, leaving a block for
        every other running sequence, so drafts never make the scheduler preempt anyone."""
        keep = min(len(seq.spec_token_ids), budget - 1)
        reserve = len(self.running)
        while keep and not self.block_manager.can_allocate(seq, 1 + keep, reserve=reserve):
            keep //= 2
        drop_drafts(seq, keep)

    def _fit(self, seq: Sequence, n: int, hits=None) -> int:
        """The most of n tokens that free blocks allow, halving the chunk (chunked prefill
        only); 0 when nothing fits."""
        while not self.block_manager.can_allocate(seq, n, hits):
            if not self.enable_chunked_prefill or n == 1:
                return 0
            n //= 2
        return n

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + seq.group_size > self.max_num_seqs:
                break
            hits = bm.lookup_prefix(seq)
            cached = bm.hit_tokens(hits)
            n = seq.num_tokens - cached
            if n > budget and not self.enable_chunked_prefill:
                break
            n = self._fit(seq, min(n, budget), hits)
            if not n:
                break
            bm.allocate(seq, n, hits)
            bm.record_prefix_query(seq.num_tokens, cached)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        drop_drafts(seq, 0)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def drop_drafts(seq: Sequence, keep: int) -> None:
    """Keep only seq's first `keep` drafted tokens (and their draft probabilities)."""
    if keep < len(seq.spec_token_ids):
        seq.spec_token_ids = seq.spec_token_ids[:keep]
        if seq.spec_draft_probs is not None:
            seq.spec_draft_probs = seq.spec_draft_probs[:keep] if keep else None
