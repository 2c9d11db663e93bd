"""The int4 KV cache in the engine (layers/kv_int4.py): its stage slots come and go with open
blocks (no slot kept, none leaked), and what a query reads does not depend on how the steps
were cut: chunked prefill, prefix-cache hits, preemption and speculative decoding give the
same greedy tokens as one plain run with the same cache format."""

from __future__ import annotations

import pytest

from tests.conftest import random_prompts, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine import cache_config

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama with head_dim 64 (int4 needs a multiple of 32), 2 layers, 2 KV heads; its
    weights drawn wide (0.2) so that greedy decoding wanders (30+ distinct tokens in 40) rather
    than repeating one token, as narrower random weights do."""
    path = tmp_path_factory.mktemp("int4-heads")
    save_tiny_model(path, "llama", head_dim=64, seed=7, initializer_range=0.2)
    return str(path)


def prompts() -> list[list[int]]:
    shared = random_prompts(1, 40, 40, seed=4)[0]  # a prefix the cache can serve
    return [shared + p for p in random_prompts(6, 5, 30, seed=5)] + random_prompts(2, 3, 20,
                                                                                   seed=6)


def greedy(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm) -> None:
    for m in llm.engine.kv_manager.managers:
        assert m.num_free_blocks == m.num_blocks
        assert sorted(m._free_stages) == list(range(llm.engine.kv_plan.groups[0].stage_slots))


@pytest.fixture(scope="module")
def plain(model):
    """One sequence at a time, whole prompts in one step, no prefix cache."""
    llm = LLM(model, dtype="float32", kv_cache_dtype="int4", max_num_seqs=1,
              enable_prefix_caching=False)
    out = greedy(llm)
    assert_all_free(llm)
    return out


def test_batched_chunked_prefix_cached_preempted_equal_plain(model, plain, monkeypatch):
    # 8 stage slots (16 KiB each: the model is float32) beside 22 blocks: the budget's quarter
    # for the stage would leave it 2 slots and too little concurrency to preempt anyone
    monkeypatch.setattr(cache_config, "stage_slots", lambda seqs, budget, size: 8)
    block = 16 * 2 * 2 * 74.25  # tokens x layers x KV heads x int4 bytes at head_dim 64
    llm = LLM(model, dtype="float32", kv_cache_dtype="int4", max_num_batched_tokens=32,
              max_num_seqs=8, kv_cache_memory=int(22 * block) + 8 * 2**14)
    assert llm.engine.kv_plan.num_blocks == 22  # 8 prompts of up to 62 tokens + 40 each
    got = greedy(llm)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert got == plain
    assert_all_free(llm)


@pytest.fixture(scope="module")
def repetitive(tmp_path_factory):
    """The same shape with narrow weights: greedy decoding falls into repeats, which n-gram
    and suffix drafts predict (and sometimes miss)."""
    path = tmp_path_factory.mktemp("int4-repeats")
    save_tiny_model(path, "llama", head_dim=64, seed=7)
    return str(path)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_speculative_decoding_equals_plain(model, repetitive, method):
    """Drafts verified as decode rows that cross block boundaries (a block filled with drafts
    is quantized, and again once rejected rows are rewritten): the same tokens as without."""
    path = model if method == "draft" else repetitive  # draft: the model drafting for itself
    kwargs = dict(dtype="float32", kv_cache_dtype="int4")
    base = LLM(path, **kwargs).generate([{"prompt_token_ids": p} for p in prompts()], GREEDY,
                                        use_tqdm=False)
    config = {"method": method, "num_speculative_tokens": 6, "adaptive": False}
    if method == "draft":
        config = {"model": path, "num_speculative_tokens": 6, "adaptive": False}
    llm = LLM(path, **kwargs, speculative_config=config)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert 0 < accepted and (method == "draft" or accepted < drafted)  # kept and rejected
    assert_all_free(llm)


def test_stage_slots_follow_open_blocks(model):
    """Every sequence holds a stage slot for each block not yet full of computed tokens, and
    only for those, after every step."""
    llm = LLM(model, dtype="float32", kv_cache_dtype="int4", max_num_batched_tokens=24,
              max_num_seqs=4)
    engine = llm.engine
    for i, p in enumerate(prompts()[:5]):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    bs = engine.config.block_size
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            stages = seq.stage_tables[0]
            assert len(stages) == len(seq.block_tables[0])
            done = seq.num_computed_tokens // bs
            assert all(s == -1 for s in stages[:done]) and all(s >= 0 for s in stages[done:])
    assert_all_free(llm)
