"""Speculative decoding on the built-in default model (its native Q4_1 / Q8_0 weights on the
kernels): greedy output with n-gram and suffix drafts is token for token the output without,
on prompts whose answers copy from the prompt (benchmarks/data/spec_prompts.json), alone and
batched with chunked prefill and prefix caching; and drafts are really accepted there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.smollm2
PROMPTS = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "data" /
                      "spec_prompts.json").read_text())
PARAMS = SamplingParams(temperature=0, max_tokens=64)
CONFIGS = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2, "adaptive": False},
           {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "adaptive": False},
           {"method": "suffix", "num_speculative_tokens": 6}]  # the planner chooses lengths


def invariant() -> dict:
    """Where the kernels run the file's Q4_1 / Q8_0 blocks natively, every row is computed as
    it would be alone. Where they do not (the portable build dequantizes the file), PyTorch's
    GEMM serves the larger batches and a token's logits depend on its batch in the last bits,
    which can flip a near-tie: there the exactness claim needs batch-invariant mode."""
    import torch

    from tokenmill.layers import ops

    fast = ops.select(True, torch.device("cpu")).quantized_kernels
    return {} if fast else {"deterministic": True}


def chat(llm: LLM, prompts: list[str]):
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.fixture(scope="module")
def expected(default_model):
    llm = LLM(default_model, max_num_seqs=8, max_model_len=1024, **invariant())
    return chat(llm, PROMPTS["grounded"] + PROMPTS["free"][:2])[0]


@pytest.mark.parametrize("config", CONFIGS, ids=["ngram-k4", "ngram-k8", "suffix-k6"])
def test_default_model_greedy_is_identical_with_drafts(default_model, expected, config):
    prompts = PROMPTS["grounded"] + PROMPTS["free"][:2]
    llm = LLM(default_model, max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=128,
              speculative_config=config, **invariant())
    got, outs = chat(llm, prompts)
    assert got == expected
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted >= accepted and (accepted > 0 or config.get("adaptive", True))
    again, outs = chat(llm, prompts[:3])  # now served from the prefix cache, one at a time
    assert again == expected[:3] and all(o.num_cached_tokens > 0 for o in outs)
    alone = [chat(llm, [p])[0][0] for p in prompts[3:5]]
    assert alone == expected[3:5]
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_default_model_seeded_sampling_is_identical_with_lookup_drafts(default_model):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=11)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS["grounded"][:4]]
    base = [o.outputs[0].token_ids for o in LLM(default_model, max_num_seqs=4, **invariant()
                                                    ).chat(convs, params, use_tqdm=False)]
    llm = LLM(default_model, max_num_seqs=4, speculative_config=CONFIGS[1], **invariant())
    outs = llm.chat(convs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == base
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
