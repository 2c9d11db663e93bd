"""Speculative decoding end to end: greedy output with drafts (n-gram, suffix, draft model;
k = 1..8) is token for token the output without them, alone and batched with chunked prefill,
prefix caching and preemption; rejected drafts leave no KV block behind and never reach the
prefix cache; per-request and engine counters add up."""

from __future__ import annotations

import pytest

from tests.conftest import random_prompts, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.block_manager import hash_block
from tokenmill.kernels import load_cpu_kernels
from tokenmill.layers import ops

GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """Another random Llama with the tiny Llama's vocabulary: it drafts badly (rejections)."""
    path = tmp_path_factory.mktemp("tiny-draft")
    save_tiny_model(path, "llama", seed=7, num_hidden_layers=1)
    return str(path)


def spec(method: str, k: int, draft: str | None = None, adaptive: bool = False) -> dict:
    """A config; not adaptive unless asked, so that every step drafts k (when the proposer has
    that many) whatever this machine's timings make the planner choose."""
    if method == "ngram":
        config = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    elif method == "suffix":
        config = {"method": "suffix"}
    else:
        config = {"model": draft}
    return {**config, "num_speculative_tokens": k, "adaptive": adaptive}


def prompts(count: int = 8, seed: int = 3) -> list[list[int]]:
    """Random prompts that repeat part of themselves, so look-up proposers find matches."""
    return [p + p[: len(p) // 2] for p in random_prompts(count, 8, 40, seed=seed)]


def run(llm: LLM, batch, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


def assert_all_free(llm: LLM):
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_count == 0 for m in kv.managers for b in m.blocks)
    spec = llm.engine.spec
    if spec is not None:
        assert not spec.planner.seqs  # every finished sequence forgotten
        draft_kv = getattr(spec.proposer, "kv", None)
        if draft_kv is not None:
            assert draft_kv.num_free_blocks == draft_kv.num_blocks and not spec.proposer.mirrors


@pytest.fixture(scope="module")
def expected(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32")
    return {seed: run(llm, prompts(seed=seed))[0] for seed in (3, 4)}


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_greedy_is_token_identical_batched_with_chunked_prefill(tiny_llama, tiny_draft,
                                                                 expected, method, k):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24,
              speculative_config=spec(method, k, tiny_draft))
    got, outs = run(llm, prompts())
    assert got == expected[3]
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    stats = llm.engine.stats()
    assert drafted > 0 and stats["spec_num_draft_tokens"] == drafted
    assert stats["spec_num_accepted_tokens"] == accepted
    assert sum(stats["spec_accepted_counts"]) == stats["spec_num_drafts"]
    if method != "draft":
        assert 0 < accepted < drafted  # both paths taken: accepted and rejected drafts
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_greedy_is_token_identical_with_the_planner(tiny_llama, tiny_draft, expected, method):
    """The adaptive planner (timing-dependent draft lengths) changes nothing in the output."""
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=24,
              speculative_config=spec(method, 6, tiny_draft, adaptive=True))
    assert llm.engine.spec.planner.cost is not None
    assert run(llm, prompts())[0] == expected[3]
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_greedy_is_token_identical_alone(tiny_llama, tiny_draft, expected, method):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", speculative_config=spec(method, 4, tiny_draft))
    assert [run(llm, [p])[0][0] for p in prompts(seed=4)] == expected[4]
    assert_all_free(llm)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "bfloat16"])  # int4: head_dim 16 < 32
def test_quantized_kv_cache_same_output_with_drafts(tiny_llama, kv_dtype):
    path, _ = tiny_llama
    kwargs = dict(dtype="float32", kv_cache_dtype=kv_dtype)
    base, _ = run(LLM(str(path), **kwargs), prompts())
    llm = LLM(str(path), **kwargs, speculative_config=spec("ngram", 5))
    got, outs = run(llm, prompts())
    assert got == base and sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert_all_free(llm)


@pytest.mark.skipif(not ops.available() or not load_cpu_kernels().bf16_rows_invariant,
                    reason="bf16 rows are row-count invariant on the AMX build only")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_bfloat16_greedy_is_token_identical_on_amx(tmp_path_factory, tiny_draft, method):
    """On AMX a bf16 GEMM row's bits do not depend on how many rows the call has, so drafts
    verified on bf16 weights are exact too, alone and batched with chunked prefill (head size
    32: the AMX prefill attention, whose rows do not depend on where a chunk ends either)."""
    path = tmp_path_factory.mktemp("tiny-llama-d32")
    save_tiny_model(path, "llama", hidden_size=128, intermediate_size=256)
    base = run(LLM(str(path), dtype="bfloat16"), prompts())[0]
    for k in (1, 4, 8):
        llm = LLM(str(path), dtype="bfloat16", max_num_batched_tokens=24,
                  speculative_config=spec(method, k, tiny_draft))
        got, outs = run(llm, prompts())
        assert got == base and sum(o.metrics.num_draft_tokens for o in outs) > 0
        assert [run(llm, [p])[0][0] for p in prompts()[:3]] == base[:3]
        assert_all_free(llm)


def test_a_model_drafting_for_itself_is_always_accepted(tiny_llama, expected):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", speculative_config=spec("draft", 5, str(path)))
    got, outs = run(llm, prompts())
    assert got == expected[3]
    assert all(o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0 for o in outs)
    assert all(len(o.metrics.token_times) < GREEDY.max_tokens / 3 for o in outs)  # few steps
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_preemption_with_drafts_gives_identical_output(tiny_llama, tiny_draft, expected,
                                                       method):
    path, _ = tiny_llama
    per_token = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv_heads x head_dim x float32
    llm = LLM(str(path), dtype="float32", block_size=16, kv_cache_memory=12 * 16 * per_token,
              speculative_config=spec(method, 6, tiny_draft))
    got, _ = run(llm, prompts())
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected[3]
    assert_all_free(llm)


def test_prefix_cache_holds_only_verified_tokens(tiny_llama, expected):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", block_size=4,
              speculative_config=spec("ngram", 8))
    batch = prompts()
    got, _ = run(llm, batch)
    assert got == expected[3]
    verified = set()  # the hash of every full block of every verified sequence
    for prompt, output in zip(batch, got):
        tokens, parent = prompt + output, None
        for i in range(len(tokens) // 4):
            parent = hash_block(parent, tokens[4 * i: 4 * i + 4])
            verified.add(parent)
    cached = set(llm.engine.block_manager._cached)
    assert cached and cached <= verified
    again, outs = run(llm, batch)  # served from those blocks: the same tokens
    assert again == expected[3] and all(o.num_cached_tokens > 0 for o in outs)
    assert_all_free(llm)


def test_penalties_min_tokens_and_logprobs_are_verified_per_position(tiny_llama):
    path, _ = tiny_llama
    params = SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3,
                            frequency_penalty=0.2, min_tokens=10, logprobs=2)
    batch = prompts(4)
    base_tokens, base = run(LLM(str(path), dtype="float32"), batch, params)
    llm = LLM(str(path), dtype="float32", speculative_config=spec("ngram", 4))
    got, outs = run(llm, batch, params)
    assert got == base_tokens
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    for a, b in zip(outs, base):
        lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert len(lp_a) == len(lp_b) == len(a.outputs[0].token_ids)
        for pa, pb in zip(lp_a, lp_b):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def test_stops_inside_accepted_drafts_end_the_sequence_there(tiny_llama, expected):
    path, _ = tiny_llama
    batch = prompts()
    stop_at = [e[5] for e in expected[3]]  # the 6th token of each greedy output
    llm = LLM(str(path), dtype="float32", speculative_config=spec("draft", 8, str(path)))
    for prompt, stop, full in zip(batch, stop_at, expected[3]):
        params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop])
        out = run(llm, [prompt], params)[1][0].outputs[0]
        assert out.token_ids == full[: full.index(stop) + 1] and out.finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=7)
    got, _ = run(llm, batch, params)
    assert got == [e[:7] for e in expected[3]]
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_seeded_sampling_with_lookup_drafts_equals_no_speculation(tiny_llama, method):
    """Point-mass drafts are checked against each row's own draw: a seeded request gives the
    very tokens it gives without speculation (one generator number per token)."""
    path, _ = tiny_llama
    params = SamplingParams(temperature=0.3, top_p=0.95, max_tokens=40, seed=5)
    base, _ = run(LLM(str(path), dtype="float32"), prompts(), params)
    llm = LLM(str(path), dtype="float32", speculative_config=spec(method, 4))
    got, outs = run(llm, prompts(), params)
    assert got == base
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert_all_free(llm)


def test_sampled_requests_with_a_draft_model(tiny_llama):
    """A model drafting for itself under sampling: q equals p, so drafts are accepted."""
    path, _ = tiny_llama
    params = SamplingParams(temperature=0.9, max_tokens=30, seed=5)
    llm = LLM(str(path), dtype="float32", speculative_config=spec("draft", 4, str(path)))
    _, outs = run(llm, prompts(), params)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    assert sum(o.metrics.num_accepted_tokens for o in outs) >= 0.95 * drafted > 0
    assert_all_free(llm)


def test_n_samples_speculate_each_and_metrics_count_tokens(tiny_llama, expected):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", speculative_config=spec("draft", 4, str(path)))
    params = SamplingParams(n=3, temperature=0, max_tokens=GREEDY.max_tokens)
    out = llm.generate({"prompt_token_ids": prompts()[0]}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [expected[3][0]] * 3
    m = out.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0
    assert m.num_output_tokens == GREEDY.max_tokens and len(m.token_times) < 20
    span = m.token_times[-1] - m.token_times[0]
    assert m.mean_inter_token_latency == pytest.approx(span / (GREEDY.max_tokens - 1))
    assert_all_free(llm)


def test_rejected_drafts_blocks_are_released_every_step(tiny_llama, tiny_draft):
    """After each step no sequence holds a block beyond its (verified) tokens."""
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", block_size=4,
              speculative_config=spec("draft", 8, tiny_draft))
    engine = llm.engine
    for p in prompts():
        engine.add_request(None, {"prompt_token_ids": p}, GREEDY)
    rejected = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= -(-seq.num_tokens // 4)
            assert seq.num_computed_tokens == seq.num_tokens - 1 or not seq.num_output_tokens
        rejected = engine.stats()["spec_num_draft_tokens"] - engine.stats()[
            "spec_num_accepted_tokens"]
    assert rejected > 0
    assert_all_free(llm)


def test_abort_mid_speculation_frees_everything(tiny_llama, tiny_draft):
    path, _ = tiny_llama
    llm = LLM(str(path), dtype="float32", speculative_config=spec("draft", 4, tiny_draft))
    engine = llm.engine
    ids = [engine.add_request(None, {"prompt_token_ids": p}, GREEDY) for p in prompts(4)]
    for _ in range(4):
        engine.step()
    for rid in ids:
        engine.abort_request(rid)
    assert_all_free(llm)


def test_bad_speculative_configs_are_clear_errors(tiny_llama, tmp_path):
    path, _ = tiny_llama
    cases = [({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
             ({"method": "ngram"}, "num_speculative_tokens"),
             ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
             ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
               "prompt_lookup_max": 2}, "prompt_lookup_min"),
             ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown keys"),
             ("{not json", "not valid JSON"),
             ({"num_speculative_tokens": 2}, "needs a"),
             ({"method": "draft_model", "num_speculative_tokens": 2}, "draft"),
             ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(str(path), dtype="float32", speculative_config=config)
    other = tmp_path / "other-vocab"
    save_tiny_model(other, "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(path), dtype="float32", speculative_config=spec("draft", 2, str(other)))
