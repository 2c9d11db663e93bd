"""Proposers and the length controller on their own: the n-gram index drafts what followed the
latest longest match, the suffix index the most frequent continuation (from recent requests
too when asked), and drafts shrink and pause for sequences whose drafts keep failing."""

from __future__ import annotations

import random

from tokenmill import SamplingParams
from tokenmill.engine.sequence import Sequence
from tokenmill.spec_decode import SpeculativeConfig
from tokenmill.spec_decode.adaptive import MAX_PAUSE, LengthController
from tokenmill.spec_decode.ngram import NgramIndex, NgramProposer
from tokenmill.spec_decode.suffix import SuffixProposer


def naive_ngram(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The definition: longest n first, latest earlier occurrence of the last n tokens."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_ngram_index_equals_the_naive_search_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(20):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        index, tokens = NgramIndex(lo, hi), []
        for _ in range(120):
            tokens.append(rng.randrange(4 + trial % 3))  # small alphabets: many matches
            k = rng.randint(1, 6)
            assert index.propose(tokens, k) == naive_ngram(tokens, lo, hi, k)


def test_ngram_proposer_drafts_from_the_prompt():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)  # vLLM's rule
    seq = Sequence([5, 6, 7, 8, 9, 1, 2, 6, 7], SamplingParams())
    proposer = NgramProposer(config)
    assert proposer.propose([seq], [3]) == [([8, 9, 1], None)]
    proposer.finished([seq])
    assert not proposer.indexes
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=1).prompt_lookup_max == 5


def suffix_proposer(**overrides) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig(method="suffix", num_speculative_tokens=8,
                                            **overrides))


def test_suffix_drafts_the_most_frequent_continuation():
    proposer = suffix_proposer(suffix_decoding_min_token_prob=0.0)
    # after "1 2" came "3 4" twice and "9" once: the draft follows the majority
    seq = Sequence([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 9, 0, 1, 2], SamplingParams())
    drafts, _ = proposer.propose([seq], [3])[0]
    assert drafts == [3, 4, 0]


def test_suffix_stops_when_the_continuation_is_uncertain():
    proposer = suffix_proposer(suffix_decoding_min_token_prob=0.5)
    seq = Sequence([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], SamplingParams())  # 3, 4, 5: 1/3 each
    assert proposer.propose([seq], [4]) == [([], None)]


def test_suffix_length_follows_the_match_length():
    proposer = suffix_proposer(suffix_decoding_max_spec_factor=1.0,
                               suffix_decoding_min_token_prob=0.0)
    seq = Sequence([7, 1, 2, 3, 4, 5, 6, 8, 7], SamplingParams())  # "7" matched: 1 token
    drafts, _ = proposer.propose([seq], [8])[0]
    assert drafts == [1]


def test_suffix_uses_recent_requests_only_when_asked():
    output = [10, 11, 12, 13, 14, 15]
    for cached, expected in ((0, []), (4, [12, 13, 14, 15])):
        proposer = suffix_proposer(suffix_decoding_max_cached_requests=cached,
                                   suffix_decoding_min_token_prob=0.0,
                                   suffix_decoding_max_spec_factor=2.0)  # 2 matched: 4 drafts
        old = Sequence([1, 2], SamplingParams())
        old.token_ids += output
        proposer.propose([old], [1])
        proposer.finished([old])
        new = Sequence([3, 4, 10, 11], SamplingParams())
        assert proposer.propose([new], [4])[0][0] == expected


def test_suffix_cache_forgets_the_oldest_requests():
    proposer = suffix_proposer(suffix_decoding_max_cached_requests=2,
                               suffix_decoding_min_token_prob=0.0,
                               suffix_decoding_max_spec_factor=2.0)
    for i in range(3):
        seq = Sequence([0], SamplingParams())
        seq.token_ids += [100 + i, 200 + i, 300 + i]
        proposer.finished([seq])
    probe = Sequence([5, 100], SamplingParams())  # the first request was evicted
    assert proposer.propose([probe], [2])[0][0] == []
    probe = Sequence([5, 102], SamplingParams())
    assert proposer.propose([probe], [2])[0][0] == [202, 302]
    assert all(count > 0 for row in proposer.shared.counts.values() for count in row.values())


def test_length_grows_shrinks_and_pauses():
    c = LengthController(max_length=4)
    assert c.next_length(1) == 4
    c.record(1, 4, 1)
    assert c.next_length(1) == 2  # accepted + 1
    c.record(1, 2, 2)
    assert c.next_length(1) == 3  # all accepted: one more
    c.record(1, 3, 0)
    assert c.next_length(1) == 1
    c.record(1, 1, 0)  # two steps in a row with nothing accepted: pause
    pauses = [c.next_length(1) for _ in range(3)]
    assert pauses == [0, 0, 1]
    for _ in range(12):  # failing forever: pauses grow to MAX_PAUSE, never forever
        c.record(1, 1, 0)
    assert c.states[1].paused == MAX_PAUSE
    c.forget(1)
    assert not c.states
    fixed = LengthController(max_length=4, adaptive=False)
    fixed.next_length(2)
    fixed.record(2, 4, 0)
    fixed.record(2, 4, 0)
    assert fixed.next_length(2) == 4
