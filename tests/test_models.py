"""Every supported architecture against transformers: logits and greedy tokens, alone and in a
batch of prompts with different lengths."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy, random_prompts, save_tiny_model
from tokenmill import LLM, SamplingParams

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama3-rope-tied-headdim": ("llama", {"rope_parameters": LLAMA3_ROPE,
                                           "tie_word_embeddings": True, "head_dim": 32}),
    "mistral-sliding": ("mistral", {"sliding_window": 8}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {"head_dim": 32}),
    "qwen3-mixed-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 8,
                                     "max_window_layers": 1}),
}

NEW_TOKENS = 32


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(path, arch, **overrides)
    llm = LLM(str(path), dtype="float32", max_num_seqs=8)
    return request.param, hf, llm


def test_config_is_read_like_transformers(variant):
    name, hf, llm = variant
    cfg = llm.engine.model_config
    assert cfg.num_key_value_heads == hf.config.num_key_value_heads
    assert cfg.head_dim == getattr(hf.config, "head_dim", None) or cfg.hidden_size // 4
    if name == "qwen3-mixed-window":
        windows = [cfg.sliding_window_for(i) for i in range(cfg.num_hidden_layers)]
        assert windows == [None, 8]  # layer 0 global, layer 1 local


def test_logits_match_transformers(variant):
    _, hf, llm = variant
    for prompt in random_prompts(3, 5, 40, seed=1):
        ours = llm.engine.compute_logits(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert ours.shape == ref.shape
        assert (ours[-1] - ref[-1]).abs().max().item() < 1e-4
        assert (ours - ref).abs().max().item() < 1e-4  # every position, not just the last


def test_greedy_single_prompt_matches_generate(variant):
    _, hf, llm = variant
    prompt = random_prompts(1, 20, 20, seed=2)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    assert out[0].outputs[0].finish_reason == "length"


def test_greedy_batch_of_8_matches_generate(variant):
    _, hf, llm = variant
    prompts = random_prompts(8, 3, 45, seed=3)
    assert len({len(p) for p in prompts}) > 4  # really different lengths
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
