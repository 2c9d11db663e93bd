"""Suffix decoding proposer (after Arctic's suffix decoding): continuation counts of every
context of up to `depth` tokens, over the request's own tokens (prompt + output) and, opt-in,
the outputs of recent requests. A proposal follows the longest context matching the sequence's
end and drafts the most frequent next token while its estimated probability (the product of
the chosen tokens' frequency shares) stays above min_token_prob; the draft is at most
max_spec_factor x the matched length, so short, weak matches draft little."""

from __future__ import annotations

from collections import OrderedDict

from tokenmill.engine.sequence import Sequence
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposal import Proposal, context_keys

MAX_KIND = 16  # matched lengths beyond this are one kind for the planner's statistics


class SuffixIndex:
    """context (1..depth tokens, as its context_keys key) -> {next token: count}."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.counts: dict[int, dict[int, int]] = {}
        self.indexed = 0

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Count the contexts ending before each position from `indexed` on (sign -1 removes
        a sequence counted before)."""
        for e in range(max(self.indexed, 1), len(tokens)):
            nxt = tokens[e]
            for key in context_keys(tokens, e, min(self.depth, e)):
                row = self.counts.setdefault(key, {})
                row[nxt] = row.get(nxt, 0) + sign
                if row[nxt] <= 0:
                    del row[nxt]
                    if not row:
                        del self.counts[key]
        self.indexed = len(tokens) if sign > 0 else 0


def _match(indexes: list[SuffixIndex], ctx: list[int], longest: int) -> tuple[int, dict]:
    """The longest suffix of ctx (at most `longest` tokens) some index knows, and the merged
    next-token counts after it."""
    keys = context_keys(ctx, len(ctx), min(longest, len(ctx)))
    for n in range(len(keys), 0, -1):
        key = keys[n - 1]
        rows = [ix.counts[key] for ix in indexes if key in ix.counts]
        if rows:
            merged: dict[int, int] = {}
            for row in rows:
                for t, c in row.items():
                    merged[t] = merged.get(t, 0) + c
            return n, merged
    return 0, {}


class SuffixProposer:
    cheap = True  # proposing costs no model pass: propose all, let the planner cut

    def __init__(self, config: SpeculativeConfig, **_) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.local: dict[int, SuffixIndex] = {}
        self.last: dict[int, tuple[int, int]] = {}  # seq_id -> (tokens, matched) last time
        self.shared = SuffixIndex(self.depth)  # recent requests' outputs (opt-in)
        self.cached: OrderedDict[int, list[int]] = OrderedDict()

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[Proposal]:
        return [self._propose(seq, k) for seq, k in zip(seqs, lengths)]

    def _propose(self, seq: Sequence, k: int) -> Proposal:
        index = self.local.setdefault(seq.seq_id, SuffixIndex(self.depth))
        index.add(seq.token_ids)
        indexes = [index, self.shared] if self.cached else [index]
        ctx, drafts, prob = list(seq.token_ids), [], 1.0
        # A suffix that matches now matched, Δ tokens shorter, at the last proposal: start the
        # search there, not at the full depth (each length tried costs a look-up).
        last_len, last_match = self.last.get(seq.seq_id, (0, self.depth))
        longest = min(self.depth, last_match + len(ctx) - last_len)
        matched, counts = _match(indexes, ctx, longest)
        self.last[seq.seq_id] = (len(ctx), matched)
        kind, budget = min(matched, MAX_KIND), min(k, int(self.factor * matched + 0.999))
        while counts and len(drafts) < budget:
            token, count = max(counts.items(), key=lambda tc: tc[1])
            prob *= count / sum(counts.values())
            if prob < self.min_prob:
                break
            drafts.append(token)
            ctx.append(token)
            matched, counts = _match(indexes, ctx, min(matched + 1, self.depth))
        return Proposal(drafts, kind=kind)

    def finished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.local.pop(seq.seq_id, None)
            self.last.pop(seq.seq_id, None)
            if self.max_cached and seq.output_token_ids:
                self._cache(seq.seq_id, seq.output_token_ids)

    def _cache(self, key: int, tokens: list[int]) -> None:
        self.cached[key] = tokens
        self.shared.indexed = 0
        self.shared.add(tokens)
        while len(self.cached) > self.max_cached:
            _, old = self.cached.popitem(last=False)
            self.shared.indexed = 0
            self.shared.add(old, sign=-1)
