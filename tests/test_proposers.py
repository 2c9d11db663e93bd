"""Proposers and the length controller on their own: the n-gram index drafts what followed the
latest longest match, the suffix index the most frequent continuation (from recent requests
too when asked), and the planner keeps only drafts that pay for the step rows they add."""

from __future__ import annotations

import random

import pytest

from tokenmill import SamplingParams
from tokenmill.engine.sequence import Sequence
from tokenmill.spec_decode import SpeculativeConfig, adaptive
from tokenmill.spec_decode.adaptive import EXPLORE, DraftPlanner, StepCost
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
            drafts, matched = index.propose(tokens, k)
            assert drafts == naive_ngram(tokens, lo, hi, k)
            assert (matched > 0) == bool(drafts) and matched <= hi


def test_ngram_proposer_drafts_from_the_prompt():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 2)  # vLLM's rule
    seq = Sequence([5, 6, 7, 8, 9, 1, 2, 6, 7], SamplingParams())
    proposer = NgramProposer(config)
    [p] = proposer.propose([seq], [3])
    assert (p.tokens, p.probs, p.kind) == ([8, 9, 1], None, 2)
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
    assert proposer.propose([seq], [3])[0].tokens == [3, 4, 0]


def test_suffix_stops_when_the_continuation_is_uncertain():
    proposer = suffix_proposer(suffix_decoding_min_token_prob=0.5)
    seq = Sequence([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], SamplingParams())  # 3, 4, 5: 1/3 each
    assert proposer.propose([seq], [4])[0].tokens == []


def test_suffix_length_follows_the_match_length():
    proposer = suffix_proposer(suffix_decoding_max_spec_factor=1.0,
                               suffix_decoding_min_token_prob=0.0)
    seq = Sequence([7, 1, 2, 3, 4, 5, 6, 8, 7], SamplingParams())  # "7" matched: 1 token
    [p] = proposer.propose([seq], [8])
    assert p.tokens == [1] and p.kind == 1


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
        assert proposer.propose([new], [4])[0].tokens == expected


def test_suffix_cache_forgets_the_oldest_requests():
    proposer = suffix_proposer(suffix_decoding_max_cached_requests=2,
                               suffix_decoding_min_token_prob=0.0,
                               suffix_decoding_max_spec_factor=2.0)
    for i in range(3):
        seq = Sequence([0], SamplingParams())
        seq.token_ids += [100 + i, 200 + i, 300 + i]
        proposer.finished([seq])
    probe = Sequence([5, 100], SamplingParams())  # the first request was evicted
    assert proposer.propose([probe], [2])[0].tokens == []
    probe = Sequence([5, 102], SamplingParams())
    assert proposer.propose([probe], [2])[0].tokens == [202, 302]
    assert all(count > 0 for row in proposer.shared.counts.values() for count in row.values())


def test_context_keys_are_distinct_untracked_ints():
    import gc

    from tokenmill.spec_decode.ngram import NgramIndex
    from tokenmill.spec_decode.proposal import KEY_BITS, context_keys

    keys = [context_keys(t, len(t), len(t))[-1] for t in ([5], [0, 5], [0, 0, 5], [5, 0],
                                                          [2**KEY_BITS - 1, 1])]
    assert len(set(keys)) == len(keys)  # a leading 0 token still makes another context
    index = NgramIndex(1, 4)
    index.extend(list(range(100)) * 3)
    # no key the garbage collector tracks: an index of tuples made full collections frequent
    assert index.ends and not any(gc.is_tracked(k) for k in index.ends)


def test_step_cost_interpolates_and_never_decreases(monkeypatch):
    monkeypatch.setattr(adaptive, "RIDGE", 0.0)  # the plain least squares: exact on exact data
    cost = StepCost([1, 4, 8, 16], [1.0, 1.6, 1.2, 2.0])  # a slow outlier at 4 rows
    assert cost.seconds == [1.0, 1.2, 1.2, 2.0]
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.0 + 0.2 / 3)
    assert cost(12) == pytest.approx(1.6) and cost(32) == pytest.approx(3.6)  # last slope
    for _ in range(80):  # one row count only: what it takes beyond the forward
        cost.observe(1, 1, cost.forward(1) + 0.3)
    assert cost.per_seq == cost.per_draft == 0 and cost.overhead == pytest.approx(0.3)
    # real steps: the forward, + 0.5, + 0.3 a sequence beyond the first, + 0.1 a draft
    for seqs, drafts in [(1, 0), (1, 3), (4, 0), (4, 8), (16, 0), (16, 4), (8, 8)] * 40:
        rows = seqs + drafts
        cost.observe(rows, seqs, cost.forward(rows) + 0.5 + 0.3 * (seqs - 1) + 0.1 * drafts)
    assert cost.per_seq == pytest.approx(0.3) and cost.per_draft == pytest.approx(0.1)
    assert cost.overhead == pytest.approx(0.5)
    assert cost(8, 4) == pytest.approx(1.2 + 0.5 + 0.9 + 0.4)
    cost.observe(1, 1, 50.0)  # one slow step (a long prompt indexed) is clipped
    assert cost(1) < 1.6
    assert StepCost([2], [2.0])(4) == 4.0
    calls = []
    slow_first = StepCost.measure(lambda r: calls.append(r) or (9.0 if len(calls) == 1 else r),
                                  10)
    assert slow_first.rows == [1, 2, 3, 4, 6, 8, 10] and slow_first.seconds[0] == 1.0
    up = slow_first.rows  # each count once per round, up and down in turn: a slow spell hits all
    assert calls == (up + up[::-1]) * 2


def test_step_cost_fit_shrinks_costs_it_barely_sees():
    """Noisy steps of 8-16 sequences with one draft in every 8th step (a planner that has all
    but stopped drafting, exploring now and then): plain least squares put the noise on the
    few drafts (a draft row at up to 3.6x its real 0.1 over these seeds; at 16 concurrent
    requests such an estimate priced every draft out, and with few drafts nothing corrected
    it). Shrunk toward 0 (a draft row costs what the forward measurement says), the fit stays
    near its real value there and still finds the costs where the counts vary."""
    for seed in range(20):
        rng = random.Random(seed)
        rare, often = StepCost([1, 64], [1.0, 64.0]), StepCost([1, 64], [1.0, 64.0])
        for i in range(256):
            seqs = 8 + i % 9
            for cost, drafts in ((rare, int(i % 8 == 0)), (often, i % 13)):
                cost.observe(seqs + drafts, seqs, cost.forward(seqs + drafts) + 0.5
                             + 0.3 * (seqs - 1) + 0.1 * drafts + rng.gauss(0, 1.0))
        assert rare.per_draft < 0.15
        assert often.per_draft == pytest.approx(0.1, abs=0.05)
        assert often.per_seq == pytest.approx(0.3, abs=0.1)


def test_step_cost_fits_drafts_of_one_stream(monkeypatch):
    """One stream: the sequence count never varies, the drafts do. Their cost is still fit (it
    was left at 0 when the joint fit had nothing to solve), and a start-up measurement slower
    than the real steps gives a negative overhead rather than inflating every step."""
    monkeypatch.setattr(adaptive, "RIDGE", 0.0)
    cost = StepCost([1, 9], [1.2, 2.0])
    for drafts in [0, 2, 5, 8] * 40:
        cost.observe(1 + drafts, 1, cost.forward(1 + drafts) - 0.2 + 0.05 * drafts)
    assert cost.per_draft == pytest.approx(0.05) and cost.per_seq == 0
    assert cost.overhead == pytest.approx(-0.2)
    assert cost(1, 1) == pytest.approx(1.0) and cost(6, 1) == pytest.approx(1.7 - 0.2 + 0.25)


def test_planner_keeps_drafts_that_pay_for_themselves():
    flat = DraftPlanner(4, StepCost([1, 64], [1.0, 1.0]))  # memory-bound: rows are free
    assert flat.plan({1: (4, 0), 2: (2, 0)}, base_rows=2) == {1: 4, 2: 2}
    linear = DraftPlanner(4, StepCost([1, 64], [1.0, 64.0]))  # a row costs a token
    assert linear.plan({1: (4, 0), 2: (4, 0)}, base_rows=2) == {1: 0, 2: 0}
    knee = StepCost([1, 4, 64], [1.0, 1.1, 64.0])  # cheap up to 4 rows, then ~1 a row
    planner = DraftPlanner(8, knee)
    for _ in range(20):
        planner.record(6, 4, 4)  # drafts after 6-token matches are always right
    assert planner.alpha(6) > 0.8
    assert planner.plan({1: (8, 6)}, base_rows=1)[1] == 3  # free rows used, no paid ones
    assert DraftPlanner(3).plan({1: (8, 0), 2: (1, 0)}, base_rows=1) == {1: 3, 2: 1}


def test_a_step_with_prompt_rows_is_judged_by_its_decode_rows():
    """Two decoding sequences beside 100 prompt rows: the prompt is computed either way and
    makes no tokens, so a draft pays when its gain per second of its row beats the two
    sequences' tokens per second (counted as tokens, the prompt rows priced out every draft;
    left out of the cost, every draft would pay)."""
    cost = StepCost([1, 8, 64], [1.0, 1.5, 7.1])  # 0.1 a row beyond 8 rows
    planner = DraftPlanner(4, cost)
    for _ in range(20):
        planner.record(8, 4, 4)  # drafts after 8-token matches are right
        planner.record(1, 4, 0)  # after 1-token matches, wrong
    assert planner.alpha(1) < 0.1 < 0.9 < planner.alpha(8)
    keep = planner.plan({1: (4, 8), 2: (4, 1)}, base_rows=102, prefill=100)
    assert keep == {1: 4, 2: 0}
    assert planner.worthwhile(base_rows=102, prefill=100)
    assert planner.paying_drafts(base_rows=102, prefill=100) == 4


def test_drafts_of_failing_kinds_are_dropped_first():
    planner = DraftPlanner(4, StepCost([1, 8, 64], [1.0, 1.5, 10.0]))
    for _ in range(10):
        planner.record(6, 4, 4)
        planner.record(1, 4, 0)
    assert planner.alpha(1) < 0.3 < 0.8 < planner.alpha(6)
    keep = planner.plan({1: (4, 6), 2: (4, 1), 3: (4, 3)}, base_rows=3)
    assert keep[1] > keep[3] > keep[2] == 0  # kind 3 is new: the engine's mixed rate


def test_failing_drafts_never_switch_proposing_off_where_rows_are_cheap():
    planner = DraftPlanner(4, StepCost([1, 8, 64], [1.0, 1.1, 10.0]))
    for _ in range(50):  # every kind's drafts rejected for a while
        planner.record(2, 4, 0)
        planner.record(5, 4, 0)
    assert planner.alpha(5) < 0.1
    assert planner.worthwhile(base_rows=1)  # still proposed: the planner and EXPLORE decide
    assert not DraftPlanner(4, StepCost([1, 64], [1.0, 64.0])).worthwhile(base_rows=16)


def test_a_sequence_without_drafts_for_long_tries_one():
    planner = DraftPlanner(4, StepCost([1, 64], [1.0, 64.0]))  # drafts never pay here
    kept = [planner.plan({7: (4, 0)}, base_rows=1)[7] for _ in range(EXPLORE)]
    assert kept == [0] * (EXPLORE - 1) + [1]
    planner.forget(7)
    assert 7 not in planner.seqs


def test_where_no_draft_can_pay_only_explorations_are_proposed():
    """paying_drafts() 0: plan() would keep nothing whatever is proposed, so the engine skips the
    proposer except for sequences due to explore, which still get their one draft on the
    EXPLORE-th step without one (as when every step proposes)."""
    planner = DraftPlanner(4, StepCost([1, 64], [1.0, 64.0]))  # a row costs a token
    for _ in range(20):
        planner.record(6, 4, 4)  # even a kind that is always right cannot pay here
    assert planner.paying_drafts(base_rows=16) == 0
    assert DraftPlanner(4, StepCost([1, 64], [1.0, 1.0])).paying_drafts(base_rows=16) == 4
    kept = []
    for _ in range(EXPLORE):
        due = planner.idle_step([7, 8])
        kept.append(planner.plan({sid: (4, 6) for sid in due}, base_rows=16).get(7, 0))
    assert kept == [0] * (EXPLORE - 1) + [1]
    assert planner.idle_step([7]) == set()  # its exploration reset the count


def test_paying_drafts_bounds_what_plan_keeps():
    """The cap the engine puts on proposals never cuts a draft plan() would have kept."""
    knee = StepCost([1, 4, 64], [1.0, 1.1, 64.0])  # cheap up to 4 rows, then ~1 a row
    for base in (1, 2, 3, 6, 16):
        planner = DraftPlanner(8, knee)
        for _ in range(20):
            planner.record(6, 4, 4)
            planner.record(2, 4, 1)
        cap = planner.paying_drafts(base)
        keep = planner.plan({sid: (8, 6 if sid % 2 else 2) for sid in range(base)}, base)
        assert max(keep.values()) <= cap, (base, cap, keep)
        assert cap == 8 or max(keep.values()) == cap or cap == 0
