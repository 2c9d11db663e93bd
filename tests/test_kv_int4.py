"""The int4 KV cache in the engine (layers/kv_int4.py): its stage slots come and go with open
blocks (no slot kept, none leaked), and what a query reads does not depend on how the steps
were cut: chunked prefill, prefix-cache hits, preemption and speculative decoding give the
same greedy tokens as one plain run with the same cache format. The runs are batch-invariant
(deterministic=True), so that float32's own last-bit differences between GEMM row counts
(which flip a greedy near-tie with any cache, tests/test_deterministic.py) stay out of it:
what is compared is what the cache format makes of the steps."""

from __future__ import annotations

import pytest

from tests.conftest import random_prompts, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine import cache_config
from tokenmill.layers import ops
from tokenmill.layers.kv_cache import kv_bytes_per_token

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
needs_kernels = pytest.mark.skipif(not ops.available(), reason="batch-invariant mode needs "
                                   "tokenmill's C++ kernels")


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
        assert m.staged == (llm.engine.kv_plan.kv_dtype == "int4")


@pytest.fixture(scope="module")
def plain(model):
    """Per cache format and block size (int4 quantizes K over a block): one sequence at a
    time, whole prompts in one step, no prefix cache."""
    runs = {}

    def run(kv: str = "int4", block_size: int = 32) -> list[list[int]]:
        if (kv, block_size) not in runs:
            llm = LLM(model, dtype="float32", kv_cache_dtype=kv, max_num_seqs=1,
                      enable_prefix_caching=False, block_size=block_size, deterministic=True)
            runs[kv, block_size] = greedy(llm)
            assert_all_free(llm)
        return runs[kv, block_size]

    return run


@needs_kernels
@pytest.mark.parametrize("kv,block_size", [("int4", 16), ("int4", 32), ("int8", 16),
                                           ("fp8_e4m3", 16)])
def test_batched_chunked_prefix_cached_preempted_equal_plain(model, plain, monkeypatch, kv,
                                                             block_size):
    # 352 tokens of blocks for 8 prompts of up to 62 tokens + 40 each, and int4's 8 stage
    # slots (a block's rows in float32, the model's dtype): the budget's share for the stage
    # would leave it 2 slots, too little concurrency to preempt anyone
    monkeypatch.setattr(cache_config, "stage_slots",
                        lambda seqs, budget, size, whole=0: 8 if size else 0)
    per_token = kv_bytes_per_token(2, 2, 64, kv, block_size)
    stage = 8 * 2 * block_size * 2 * 64 * 4 if kv == "int4" else 0
    llm = LLM(model, dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=32,
              max_num_seqs=8, block_size=block_size, deterministic=True,
              kv_cache_memory=round(352 * per_token) + stage)
    assert llm.engine.kv_plan.num_tokens == 352
    got = greedy(llm)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert got == plain(kv, block_size)
    assert_all_free(llm)


@pytest.fixture(scope="module")
def repetitive(tmp_path_factory):
    """The same shape with narrow weights: greedy decoding falls into repeats, which n-gram
    and suffix drafts predict (and sometimes miss)."""
    path = tmp_path_factory.mktemp("int4-repeats")
    save_tiny_model(path, "llama", head_dim=64, seed=7)
    return str(path)


@needs_kernels
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_speculative_decoding_equals_plain(model, repetitive, method):
    """Drafts verified as decode rows that cross block boundaries (a block filled with drafts
    is quantized, and again once rejected rows are rewritten): the same tokens as without."""
    path = model if method == "draft" else repetitive  # draft: the model drafting for itself
    kwargs = dict(dtype="float32", kv_cache_dtype="int4", deterministic=True)
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


@needs_kernels
def test_scoring_chunks_are_cut_to_the_stage_slots(model):
    """compute_logits with a chunk longer than the stage slots hold (one sequence: 17 slots of
    16 tokens) cuts it as the scheduler would, and the logits are those of 16-token chunks."""
    llm = LLM(model, dtype="float32", kv_cache_dtype="int4", block_size=16, max_num_seqs=1,
              deterministic=True)
    assert llm.engine.kv_plan.groups[0].stage_slots * 16 < 400
    ids = random_prompts(1, 400, 400, seed=9)[0]
    whole = llm.engine.compute_logits(ids, chunk_size=400)
    assert whole.shape[0] == 400
    assert (whole == llm.engine.compute_logits(ids, chunk_size=16)).all()
    assert_all_free(llm)


def test_without_chunked_prefill_a_whole_prompt_gets_its_stage_slots(model):
    """A prompt prefilled in one step opens all its blocks at once: the plan gives the stage
    a max_model_len prompt's blocks (else such a request would wait forever)."""
    llm = LLM(model, dtype="float32", kv_cache_dtype="int4", block_size=16, max_num_seqs=1,
              enable_chunked_prefill=False, max_model_len=512)
    assert llm.engine.kv_plan.groups[0].stage_slots >= 512 // 16 + 1
    prompt = random_prompts(1, 450, 450, seed=10)[0]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    assert_all_free(llm)
