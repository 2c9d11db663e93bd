"""N-gram (prompt lookup) proposer: find the latest earlier place where the sequence's last n
tokens occurred (n from prompt_lookup_max down to prompt_lookup_min) and draft what followed.
Each sequence keeps an index n-gram -> where its latest occurrence ended, extended with the
tokens added since the last step, so a proposal costs a few dict look-ups, not a scan."""

from __future__ import annotations

from tokenmill.engine.sequence import Sequence
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.proposal import KEY_BITS, Proposal, context_keys


class NgramIndex:
    """For every n in [lo, hi]: n-gram (its context_keys key) -> end position (exclusive) of
    its latest occurrence that has a next token."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[int, int] = {}
        self.indexed = 0  # positions e < indexed are in the index

    def extend(self, tokens: list[int]) -> None:
        """Index every end e < len(tokens): each has its next token, tokens[e]. (context_keys'
        packing, inlined: this runs for every token of every sequence.)"""
        ends, lo, hi = self.ends, self.lo, self.hi
        for e in range(max(self.indexed, lo), len(tokens)):
            packed = shift = 0
            for n, t in enumerate(reversed(tokens[max(e - hi, 0): e]), 1):
                packed |= t << shift
                shift += KEY_BITS
                if n >= lo:
                    ends[packed | 1 << shift] = e
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """What followed the latest earlier occurrence of the longest suffix of tokens, and
        that suffix's length (0: no match)."""
        self.extend(tokens)
        keys = context_keys(tokens, len(tokens), min(self.hi, len(tokens) - 1))
        for n in range(len(keys), self.lo - 1, -1):
            end = self.ends.get(keys[n - 1])
            if end is not None:
                return tokens[end: end + k], n
        return [], 0


class NgramProposer:
    cheap = True  # proposing costs no model pass: propose all, let the planner cut

    def __init__(self, config: SpeculativeConfig, **_) -> None:
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, lengths):
            index = self.indexes.get(seq.seq_id)
            if index is None:
                index = self.indexes[seq.seq_id] = NgramIndex(self.lo, self.hi)
            tokens, matched = index.propose(seq.token_ids, k)
            out.append(Proposal(tokens, kind=matched))  # longer matches: likelier drafts
        return out

    def finished(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.indexes.pop(seq.seq_id, None)
