"""Verification of drafted tokens is exact: with point-mass drafts (n-gram) and with a draft
model's distribution q, the first emitted token is distributed as the target's p and, given
an accepted draft, the next one as the next row's p; greedy rows accept the longest prefix
equal to the argmax; a draft the filters removed is never accepted."""

from __future__ import annotations

import torch

from tokenmill.layers.rejection_sampler import Span, verify
from tokenmill.layers.sampler import Sampler, SamplingMetadata

N = 20000
TOLERANCE = 0.02  # ~5 standard errors of a frequency at N = 20000
ROWS = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2],  # target logits, one row per position
                     [0.0, 1.5, -1.0, 0.3, 0.3, 1.0],
                     [2.0, -2.0, 0.0, 0.0, 1.0, -1.0]])


def meta(rows: int, temperature: float = 1.0, top_k: int = 0) -> SamplingMetadata:
    return SamplingMetadata([temperature] * rows, [top_k] * rows, [1.0] * rows, [0.0] * rows,
                            [None] * rows, logprobs=[None] * rows)


def run(drafts: list[list[int]], draft_probs=None, temperature=1.0, top_k=0, logits=ROWS):
    """N spans; span j drafts drafts[j] against the first len + 1 rows of logits."""
    k = len(drafts[0])
    spans, at = [], 0
    for j, d in enumerate(drafts):
        spans.append(Span(at, d, None if draft_probs is None else draft_probs[j]))
        at += k + 1
    big = logits[: k + 1].repeat(len(drafts), 1)
    sampler = Sampler(torch.device("cpu"), seed=1)
    return verify(sampler, big, meta(len(big), temperature, top_k), spans)


def freq(tokens: list[int], vocab: int = 6) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / max(len(tokens), 1)


def test_point_mass_drafts_give_the_target_distribution():
    p = ROWS.softmax(-1)
    for draft in (4, 1, 3):  # the likeliest token, a middling one, an unlikely one
        out = run([[draft]] * N)
        first = [t[0] for t in out.token_ids]
        assert (freq(first) - p[0]).abs().max() < TOLERANCE
        accepted = [t[1] for t, a in zip(out.token_ids, out.num_accepted) if a == 1]
        assert abs(len(accepted) / N - p[0, draft]) < TOLERANCE  # accepted with prob p(x)
        assert (freq(accepted) - p[1]).abs().max() < 2 * TOLERANCE  # the bonus row's p


def test_draft_model_distribution_is_corrected_to_the_target():
    p = ROWS.softmax(-1)
    q = torch.tensor([0.05, 0.05, 0.4, 0.3, 0.1, 0.1])  # very unlike p[0]
    g = torch.Generator().manual_seed(0)
    first_drafts = torch.multinomial(q, N, replacement=True, generator=g).tolist()
    second = torch.multinomial(q, N, replacement=True, generator=g).tolist()
    drafts = [[a, b] for a, b in zip(first_drafts, second)]
    out = run(drafts, draft_probs=q.repeat(N, 2, 1))
    assert (freq([t[0] for t in out.token_ids]) - p[0]).abs().max() < TOLERANCE
    # given the first draft was accepted, the second emitted token follows row 1's p
    seconds = [t[1] for t, a in zip(out.token_ids, out.num_accepted) if a >= 1]
    assert len(seconds) > N / 10
    assert (freq(seconds) - p[1]).abs().max() < 2.5 * TOLERANCE


def test_a_draft_equal_to_the_target_is_always_accepted():
    p = ROWS.softmax(-1)
    g = torch.Generator().manual_seed(2)
    drafts = [[int(torch.multinomial(p[0], 1, generator=g))] for _ in range(500)]
    out = run(drafts, draft_probs=p[:1].repeat(500, 1, 1))
    assert out.num_accepted == [1] * 500


def test_filtered_drafts_are_never_accepted():
    out = run([[2]] * 2000, top_k=2)  # top-2 of row 0 keeps tokens 4 and 0 only
    assert out.num_accepted == [0] * 2000
    assert set(t[0] for t in out.token_ids) <= {0, 4}


def test_greedy_accepts_the_longest_matching_prefix():
    argmax = ROWS.argmax(-1).tolist()  # [4, 1, 0]
    cases = [([4, 1], 2, [4, 1, 0]), ([4, 3], 1, [4, 1]), ([0, 1], 0, [4]),
             ([4, 1], 2, [4, 1, 0])]
    for drafts, accepted, tokens in cases:
        out = run([drafts], temperature=0.0)
        assert out.num_accepted == [accepted] and out.token_ids == [tokens]
    assert argmax[:2] == [4, 1]


def test_spans_without_drafts_sample_as_the_plain_sampler():
    """k = 0 spans draw one token per row exactly as Sampler.__call__ (same uniforms)."""
    logits = ROWS.repeat(50, 1)
    m = meta(len(logits), temperature=0.8)
    plain = Sampler(torch.device("cpu"), seed=3)(logits, m).token_ids
    spans = [Span(i, []) for i in range(len(logits))]
    out = verify(Sampler(torch.device("cpu"), seed=3), logits, m, spans)
    assert [t[0] for t in out.token_ids] == plain
