"""Gemma 3 against transformers on tiny random checkpoints (5 local sliding-window layers, then a
global one): logits, greedy tokens alone and batched with chunked prefill, prefix caching and
preemption, the local layers' cache staying flat past the window, and GGUF files written from
the same checkpoints the way llama.cpp's converter writes them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.conftest import hf_greedy, random_prompts
from tests.gguf_util import write_gguf
from tokenmill import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
WINDOW, BLOCK, NEW = 8, 4, 32
VARIANTS = {
    "scalar24": dict(query_pre_attn_scalar=24),
    # soft-capped logits; linear RoPE scaling on the global layers only
    "softcap-linear-rope": dict(final_logit_softcapping=5.0, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


def tiny_gemma3(seed: int = 0, **overrides):
    """6 layers (layer 5 global), window 8, GQA 4:2, head_dim 32; norm weights random (the
    checkpoint's zeros would hide a missing 1 + w)."""
    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
               sliding_window=WINDOW, query_pre_attn_scalar=32, bos_token_id=None,
               eos_token_id=None, pad_token_id=None, initializer_range=0.05)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**cfg, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model.float().eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_gemma3(**VARIANTS[request.param])
    hf.save_pretrained(path)
    return path, hf


def test_config_has_two_pools_and_rope_bases(gemma):
    path, hf = gemma
    cfg = LLM(str(path), dtype="float32").engine.model_config
    assert [cfg.sliding_window_for(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert cfg.kv_cache_groups() == [([5], None), ([0, 1, 2, 3, 4], WINDOW)]
    assert cfg.rope_local_theta == 1e4 and cfg.rope_theta == 1e6
    assert cfg.attention_scale == hf.config.query_pre_attn_scalar**-0.5


def test_logits_match_transformers(gemma):
    path, hf = gemma
    llm = LLM(str(path), dtype="float32")
    for prompt in random_prompts(3, 5, 40, seed=1):  # longer than the window
        ours = llm.engine.compute_logits(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_batch_chunked_prefix_cached_and_preempted(gemma):
    """Eight prompts of different lengths in one batch, prefills chunked to 16 tokens, then
    the same batch again served from the prefix cache (the prompts were just read, so their last
    window blocks are still cached in the sliding pool: prompts longer than the window hit
    too), then in a cache too small for all of them (preemption): every output equals
    transformers' generate, and no block is left held."""
    path, hf = gemma
    prompts = random_prompts(8, 3, 45, seed=3)
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=16,
              max_num_seqs=8)
    outs = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.generate(inputs, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    outs = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    cached = [o.num_cached_tokens for p, o in zip(prompts, outs) if len(p) > 2 * WINDOW]
    assert cached and all(c >= 2 * WINDOW for c in cached)
    per_token = 2 * 6 * 2 * 32 * 4  # K and V x layers x kv heads x head_dim x float32
    small = LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_memory=20 * BLOCK
                * per_token, max_num_seqs=8)
    outs = small.generate(inputs, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for engine in (llm.engine, small.engine):
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_local_layers_cache_stays_flat_past_the_window(gemma):
    path, hf = gemma
    engine = LLM(str(path), dtype="float32", block_size=BLOCK).engine
    prompt = random_prompts(1, 20, 20, seed=7)[0]
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=8 * WINDOW))
    full, local, out = [], [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for seq in engine.scheduler.running:
            held = engine.kv_manager.num_held_blocks(seq)
            full.append(held[0])
            local.append(held[1])
    assert max(local) <= WINDOW // BLOCK + 2  # flat: the window plus the blocks being filled
    assert max(full) >= (20 + 8 * WINDOW - 1) // BLOCK  # the global layer keeps everything
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8 * WINDOW)


QUANT_MIX = {"token_embd.weight": Q.Q8_0, "attn_q.weight": Q.Q5_0, "attn_k.weight": Q.Q8_0,
             "attn_output.weight": Q.Q4_K, "ffn_gate.weight": Q.Q4_0, "ffn_down.weight": Q.Q5_0,
             "attn_v.weight": Q.Q4_1}  # K-quants need rows of 256+: attn_output only


def _gemma3_keys(w) -> None:
    w.add_sliding_window(WINDOW)


@pytest.mark.parametrize("types", [None, QUANT_MIX], ids=["f32", "quantized"])
def test_gguf_matches_the_checkpoint_and_transformers(tmp_path, types):
    """llama.cpp's gemma3 files store no layer pattern, local RoPE base or softmax scale (it
    hard-codes every 6th layer global, 10000, 1/sqrt(head_dim)): the tiny model uses those.
    transformers' GGUF reader instead keeps query_pre_attn_scalar at 256 whatever head_dim
    is; the two agree at Gemma's head_dim of 256, which the tiny model therefore has."""
    hf = tiny_gemma3(seed=5, head_dim=256, query_pre_attn_scalar=256)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    write_gguf(tmp_path / "g.gguf", "gemma3", hf.config, state, types, extra=_gemma3_keys)
    ids = random_prompts(1, 30, 30, seed=9)[0]
    ours = LLM(str(tmp_path / "g.gguf"), dtype="float32").engine.compute_logits(ids)
    if types is None:  # the exact weights: the original model is the oracle
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() < 1e-4
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="g.gguf", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = theirs(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
