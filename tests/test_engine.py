"""Scheduler and cache behaviour end to end on a tiny Llama: chunked prefill, prefix caching,
preemption, n > 1, aborts. Greedy outputs must equal transformers' in every mode."""

from __future__ import annotations

import pytest

from tests.conftest import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Prompts (lengths 10..70) and transformers' greedy continuations."""
    _, hf = tiny_llama
    prompts = random_prompts(6, 10, 70, seed=11)
    return prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def run(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_all_free(llm: LLM):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.mark.parametrize("chunked,budget", [(True, 16), (True, 7), (False, None)])
def test_chunked_prefill_on_off_same_output(tiny_llama, reference, chunked, budget):
    path, _ = tiny_llama
    prompts, expected = reference
    llm = LLM(str(path), dtype="float32", enable_chunked_prefill=chunked,
              max_num_batched_tokens=budget, enable_prefix_caching=False)
    if chunked:  # prompts longer than the budget really are split across steps
        assert max(len(p) for p in prompts) > budget
    assert [o.outputs[0].token_ids for o in run(llm, prompts)] == expected
    assert_all_free(llm)


def test_prefix_cache_hit_and_same_output(tiny_llama):
    path, hf = tiny_llama
    shared = random_prompts(1, 50, 50, seed=21)[0]
    a, b = shared + [1, 2, 3], shared + [7, 8]
    llm = LLM(str(path), dtype="float32", block_size=16)
    first = run(llm, [a])[0]
    second = run(llm, [b])[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # three full 16-token blocks of the shared prefix
    assert second.metrics.num_computed_prompt_tokens == len(b) - 48
    assert first.outputs[0].token_ids == hf_greedy(hf, a, GREEDY.max_tokens)
    assert second.outputs[0].token_ids == hf_greedy(hf, b, GREEDY.max_tokens)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] == 48 and stats["prefix_cache_queries"] == len(a) + len(b)
    assert_all_free(llm)


def test_identical_prompt_is_served_from_cache_except_last_token(tiny_llama):
    path, hf = tiny_llama
    prompt = random_prompts(1, 32, 32, seed=22)[0]  # exactly two blocks
    llm = LLM(str(path), dtype="float32", block_size=16)
    run(llm, [prompt])
    again = run(llm, [prompt])[0]
    assert again.num_cached_tokens == 16  # the last block holds the token whose logits we need
    assert again.outputs[0].token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_preemption_by_recompute_gives_identical_output(tiny_llama, reference):
    path, _ = tiny_llama
    prompts, expected = reference
    # 10 blocks of 16 tokens: the six sequences need up to 6 blocks each, so they cannot all run.
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv_heads x head_dim x float32
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_memory=10 * 16 * per_token)
    assert llm.engine.block_manager.num_blocks == 10
    outs = run(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert_all_free(llm)


def test_n3_shares_prompt_blocks_and_is_seeded(tiny_llama):
    path, hf = tiny_llama
    prompt = random_prompts(1, 40, 40, seed=31)[0]
    llm = LLM(str(path), dtype="float32", block_size=16)
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=16)
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params)
    engine.step()  # the prompt (one chunk), then three samples fork from it
    seqs = [s for s in engine.scheduler.running if s.request_id == rid]
    assert len(seqs) == 3
    first_block = seqs[0].block_table[0]
    assert all(s.block_table[:2] == seqs[0].block_table[:2] for s in seqs)
    assert engine.block_manager.blocks[first_block].ref_count == 3
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    samples = [c.token_ids for c in outs[0].outputs]
    assert len({tuple(s) for s in samples}) > 1  # three different samples
    again = run(llm, [prompt], params)[0]
    assert [c.token_ids for c in again.outputs] == samples  # reproducible with the seed
    greedy = run(llm, [prompt], SamplingParams(n=3, temperature=0, max_tokens=16))[0]
    assert all(c.token_ids == hf_greedy(hf, prompt, 16) for c in greedy.outputs)
    assert_all_free(llm)


def test_abort_frees_every_block(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16)
    engine = llm.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, SamplingParams(max_tokens=50))
           for p in random_prompts(5, 20, 60, seed=41)]
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for rid in ids:
        engine.abort_request(rid)
    assert_all_free(llm)
    assert not engine.has_unfinished_requests()


def test_stream_closed_early_aborts(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32")
    stream = llm.stream({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=100))
    next(stream)
    next(stream)
    stream.close()
    assert_all_free(llm)


def test_max_tokens_min_tokens_and_stop_token_ids(tiny_llama, reference):
    path, _ = tiny_llama
    prompts, expected = reference
    llm = LLM(str(path), dtype="float32")
    stop_at = expected[0][5]
    out = run(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=24,
                                                stop_token_ids=[stop_at]))[0].outputs[0]
    first = expected[0].index(stop_at)
    assert out.token_ids == expected[0][: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens bans the stop token until enough tokens exist
    out = run(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=24, min_tokens=10,
                                                stop_token_ids=[stop_at]))[0].outputs[0]
    assert stop_at not in out.token_ids[:10]
    assert len(out.token_ids) >= 10


def test_metrics_are_filled(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32")
    out = run(llm, [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8))[0]
    m = out.metrics
    assert m.num_prompt_tokens == 4 and m.num_cached_tokens == 0
    assert 0 < m.time_to_first_token < 60
    assert len(m.token_times) == 8 and len(m.inter_token_latencies) == 7
    assert m.mean_inter_token_latency > 0 and m.e2e_latency >= m.time_to_first_token


def test_prompt_logprobs_and_logprobs(tiny_llama):
    import torch

    path, hf = tiny_llama
    prompt = random_prompts(1, 30, 30, seed=51)[0]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=8)  # chunked prompt
    out = run(llm, [prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                            prompt_logprobs=2))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for j in range(1, len(prompt)):
        entry = plp[j][prompt[j]]
        assert abs(entry.logprob - ref[j - 1, prompt[j]].item()) < 1e-4
        assert len(plp[j]) in (2, 3)  # top-2 plus the actual token when it is not among them
    first = out.outputs[0].logprobs[0]
    token = out.outputs[0].token_ids[0]
    assert first[token].rank == 1 and len(first) == 3  # greedy: chosen token is the top one


def test_every_step_tensor_is_created_on_the_engine_device(tiny_llama):
    """CUDA readiness, checked on CPU: under a `meta` default device, any tensor the engine
    creates without an explicit device= lands on meta and the step fails when it meets the
    model's CPU tensors. Covers prefill chunks, decode, sampling filters, seeds, penalties,
    logprobs, prompt logprobs and n > 1."""
    import torch

    llm = LLM(str(tiny_llama[0]), dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(n=2, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3,
                            presence_penalty=0.5, repetition_penalty=1.2, max_tokens=5,
                            logprobs=2, prompt_logprobs=1)
    with torch.device("meta"):
        outs = run(llm, [[1, 2, 3], list(range(40))], params)
    assert all(len(c.token_ids) == 5 for o in outs for c in o.outputs)
