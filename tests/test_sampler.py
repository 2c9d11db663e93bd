"""Sampling: the empirical distribution matches softmax, filters keep the right tokens,
penalties match transformers, seeds are reproducible whatever the batch, top-k=1 is greedy."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.sampling_metadata import sampling_metadata
from tokenmill.engine.sequence import Sequence
from tokenmill.layers.sampler import Sampler, apply_penalties, filter_logits

LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
N = 40000


def draw(params: SamplingParams, logits=LOGITS, n=N) -> torch.Tensor:
    seqs = [Sequence([0], params) for _ in range(n)]
    meta = sampling_metadata(seqs, [], torch.device("cpu"))
    out = Sampler(torch.device("cpu"), seed=0)(logits.repeat(n, 1), meta)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()) / n


def test_temperature_sampling_matches_softmax():
    freq = draw(SamplingParams(temperature=0.7))
    expected = (LOGITS / 0.7).softmax(-1)
    assert (freq - expected).abs().max().item() < 0.012  # ~5 standard errors at N=40000


def test_top_k_and_top_p_renormalize_over_kept_tokens():
    freq = draw(SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(5)
    expected[[4, 0]] = torch.tensor([2.0, 1.0]).softmax(-1)
    assert (freq - expected).abs().max().item() < 0.012
    probs = LOGITS.softmax(-1)  # [0.20, 0.12, 0.07, 0.04, 0.55] -> top_p=0.7 keeps tokens 4, 0
    assert probs[4] < 0.7 < probs[4] + probs[0]
    freq = draw(SamplingParams(temperature=1.0, top_p=0.7))
    assert (freq - expected).abs().max().item() < 0.012


def test_masked_tokens_are_never_drawn():
    logits = torch.tensor([3.0, -1.0, 2.0, -2.0, -3.0])  # top-k=2 keeps 0 and 2; tail masked
    freq = draw(SamplingParams(temperature=5.0, top_k=2), logits)
    assert freq[[1, 3, 4]].sum().item() == 0
    assert freq[0] > 0.4 and freq[2] > 0.4


def test_min_p_filter():
    probs = LOGITS.softmax(-1)
    out = filter_logits(LOGITS[None].clone(), torch.tensor([0]), torch.tensor([1.0]),
                        torch.tensor([0.3]))
    kept = torch.isfinite(out[0])
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist()
    assert kept.sum() == 2


def full_sort_filter(logits, top_k, top_p):
    """top-k then top-p over the whole sorted vocabulary: the definition filter_logits'
    candidate shortcut must reproduce."""
    out = torch.full_like(logits, -float("inf"))
    for r in range(logits.shape[0]):
        vals, order = logits[r].sort(descending=True)
        k = int(top_k[r]) or logits.shape[1]
        vals = vals.masked_fill(vals < vals[k - 1], -float("inf"))
        probs = vals.softmax(-1)
        if top_p[r] < 1:
            vals = vals.masked_fill(probs.cumsum(-1) - probs >= top_p[r], -float("inf"))
        out[r, order] = vals
    return out


@pytest.mark.parametrize("scale", [0.5, 8.0])  # flat (top-p needs the full sort) and peaked
def test_candidate_filter_equals_a_full_sort(scale):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=g) * scale
    top_k = torch.tensor([0, 0, 40, 2000, 1, 0])
    top_p = torch.tensor([0.95, 0.5, 0.9, 0.8, 1.0, 1.0])
    got = filter_logits(logits.clone(), top_k, top_p, torch.zeros(6))
    assert torch.equal(got.isfinite(), full_sort_filter(logits, top_k, top_p).isfinite())


def test_penalties_match_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    seq = Sequence([3, 7, 7, 9], SamplingParams(repetition_penalty=1.3))
    seq.append_token(11)
    ours = logits.clone()
    apply_penalties(ours, sampling_metadata([seq], [], torch.device("cpu")).penalties)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seq.token_ids]), logits.clone())
    assert torch.allclose(ours, ref)
    seq = Sequence([3, 7], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    for t in (11, 11, 12):
        seq.append_token(t)
    ours = logits.clone()
    apply_penalties(ours, sampling_metadata([seq], [], torch.device("cpu")).penalties)
    expected = logits.clone()
    expected[0, 11] -= 0.5 + 2 * 0.25
    expected[0, 12] -= 0.5 + 0.25
    assert torch.allclose(ours, expected)  # prompt tokens 3 and 7 untouched (OpenAI semantics)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama[0]), dtype="float32")


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_top_k_1_equals_greedy(llm):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 5, 30, seed=61)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=20),
                        use_tqdm=False)
    assert ids(greedy) == ids(top1)


def test_seed_reproducible_whatever_the_batch(llm):
    prompt = {"prompt_token_ids": random_prompts(1, 12, 12, seed=62)[0]}
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(5, 3, 40, seed=63)]
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=30)] * 2 + [seeded]
                         + [SamplingParams(temperature=0.8, max_tokens=10)] * 3,
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = llm.generate(prompt, SamplingParams(temperature=1.0, seed=8, max_tokens=24),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


def test_min_tokens_bans_eos_unless_ignored():
    """Before min_tokens, eos and stop_token_ids are masked (vLLM); with ignore_eos an eos does
    not stop the sequence, so only stop_token_ids are; afterwards nothing is."""
    cpu = torch.device("cpu")
    seq = Sequence([1, 2], SamplingParams(min_tokens=2, stop_token_ids=[7]))
    assert sampling_metadata([seq], [0], cpu).banned == [[0, 7]]
    ignoring = Sequence([1, 2], SamplingParams(min_tokens=2, stop_token_ids=[7], ignore_eos=True))
    assert sampling_metadata([ignoring], [0], cpu).banned == [[7]]
    seq.append_token(5)
    seq.append_token(6)
    assert sampling_metadata([seq], [0], cpu).banned == [[]]
    logits = torch.zeros(2, 10)
    from tokenmill.layers.sampler import apply_banned

    apply_banned(logits, [[0, 7], [3, 99]])  # ids past the vocabulary are ignored
    assert torch.isinf(logits).nonzero().tolist() == [[0, 0], [0, 7], [1, 3]]


def test_top_k_keeps_every_tie_of_the_kth_whatever_the_batch():
    """The reference's top-k keeps the k-th logit's ties (as HF and vLLM do) also when they
    fall past its candidates (it took the batch's largest k): a row's tokens do not depend on
    the rows beside it."""
    row = torch.full((300,), -4.0)
    row[10], row[20:25] = 8.0, 2.0
    for k_other in (3, 1, 200):
        logits = torch.stack([row, torch.randn(300)])
        kept = filter_logits(logits, torch.tensor([3, k_other]), torch.ones(2), torch.zeros(2))
        assert (kept[0] > -float("inf")).nonzero().flatten().tolist() == [10, 20, 21, 22, 23, 24]
