"""Batch-invariant mode (deterministic=True, layers/batch_invariant.py): a prompt's tokens and
logprobs are bit for bit the same alone, in a batch, with prefills chunked to 8 tokens, served
from the prefix cache, and for seeded sampling; in bfloat16, where the default kernels differ
in the last bits between those cases."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.layers import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="needs tokenmill's C++ kernels")
PROMPTS = random_prompts(6, 5, 60, seed=21)


def run(llm: LLM, prompts, params: SamplingParams, one_by_one: bool = False):
    """[(token ids, the chosen tokens' logprobs)] per prompt."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    outs = ([llm.generate(i, params, use_tqdm=False)[0] for i in inputs] if one_by_one
            else llm.generate(inputs, params, use_tqdm=False))
    return [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outs)]


def cases(path, deterministic: bool, params: SamplingParams) -> dict:
    engine = dict(dtype="bfloat16", deterministic=deterministic, max_num_seqs=8)
    alone = LLM(path, enable_prefix_caching=False, **engine)
    batched = LLM(path, **engine)
    chunked = LLM(path, max_num_batched_tokens=8, enable_prefix_caching=False, **engine)
    first = run(batched, PROMPTS, params)
    return {"alone": run(alone, PROMPTS, params, one_by_one=True), "batched": first,
            "chunked": run(chunked, PROMPTS, params),
            "prefix-cached": run(batched, PROMPTS[::-1], params)[::-1]}


@pytest.fixture(scope="module")
def model_paths(tiny_llama, tmp_path_factory):
    from tests.test_gemma3 import tiny_gemma3

    gemma = tmp_path_factory.mktemp("gemma-deterministic")
    tiny_gemma3(query_pre_attn_scalar=24).save_pretrained(gemma)
    return {"llama": str(tiny_llama[0]), "gemma3": str(gemma)}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, logprobs=1),
    SamplingParams(temperature=0.8, seed=7, max_tokens=24, logprobs=1),
], ids=["greedy", "seeded"])
def test_alone_batched_chunked_and_cached_are_identical(model_paths, arch, params):
    results = cases(model_paths[arch], True, params)
    for name, result in results.items():
        assert result == results["alone"], name


def test_the_default_mode_is_not_batch_invariant(model_paths):
    """What the mode is for: without it the same prompts' logprobs differ in the last bits,
    except on the AMX build, whose bf16 GEMMs run every row count on tiles (gemm_amx.h)."""
    from tokenmill.kernels import load_cpu_kernels

    results = cases(model_paths["llama"], False,
                    SamplingParams(temperature=0, max_tokens=24, logprobs=1))
    differ = any(results[name] != results["alone"] for name in results)
    assert differ != load_cpu_kernels().bf16_rows_invariant


def test_deterministic_mode_needs_the_kernels_and_a_cache_they_read(model_paths):
    with pytest.raises(ValueError, match="needs tokenmill's C.. kernels"):
        LLM(model_paths["llama"], deterministic=True, use_kernels=False)
    with pytest.raises(ValueError, match="kv_cache_dtype 'auto'"):
        LLM(model_paths["llama"], deterministic=True, kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="head_dim 16"):  # the quantized-page kernels: 32k
        LLM(model_paths["llama"], deterministic=True, kv_cache_dtype="int8")


def test_float32_deterministic_still_matches_transformers(tiny_llama):
    from tests.conftest import hf_greedy

    path, hf = tiny_llama
    llm = LLM(str(path), dtype="float32", deterministic=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 16)
    ours = llm.engine.compute_logits(PROMPTS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
