"""DeepSeek V4 (shared-KV MQA with sinks, CSA + HCA compressed attention, mHC, hash / top-k MoE)
against transformers on tiny random checkpoints in float32: logits within 1e-4 through
chunked prefill, 32 greedy tokens identical alone and in a batch of 8 with chunked prefill,
prefix caching and preemption, with no block left behind. Compress rates are lowered so that
contexts cross several HCA groups, and block sizes chosen so that a compressed block covers
one engine block (CSA), several (HCA 32 over 8-token blocks) or one whole window."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

NEW = 32
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE = dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, head_dim=32, q_lora_rank=48, partial_rotary_factor=0.25,
            n_routed_experts=8, num_experts_per_tok=2, sliding_window=16, o_groups=2,
            o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=4, hc_mult=2,
            max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, initializer_range=0.1)
VARIANTS = {
    # every layer type; the indexer keeps 4 of up to 27 CSA entries; HCA groups of 32 tokens
    "mixed": dict(layer_types=[S, C, H, C], compress_rates={C: 4, H: 32},
                  mlp_layer_types=["hash_moe", "moe", "moe", "moe"]),
    # transformers' default schedule (HCA, HCA, then CSA / HCA), the indexer keeping all, a
    # window shorter than a CSA entry's span, YaRN on the compressed layers' RoPE
    "hca-first-yarn": dict(compress_rates={C: 4, H: 8}, sliding_window=6, index_topk=64,
                           mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 2, rope_parameters={
                               "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                               "original_max_position_embeddings": 128}),
    "sliding-only": dict(layer_types=[S] * 3, num_hidden_layers=3, hc_mult=3,
                         mlp_layer_types=["moe"] * 3, scoring_func="sigmoid"),
}


def _randomize(hf) -> None:
    """Make the parts transformers initializes to zero or identity matter."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(k in name for k in ("sinks", "position_bias", "e_score_correction_bias")):
                p.normal_(0, 0.5)
        for layer in hf.model.layers:
            if layer.mlp.is_hash:
                table = layer.mlp.gate.tid2eid
                table.copy_(torch.randint(0, 8, table.shape))


@pytest.fixture(scope="module", params=list(VARIANTS))
def deepseek_v4(request, tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(**{**BASE, **VARIANTS[request.param]})
    hf = transformers.DeepseekV4ForCausalLM(config).float().eval()
    _randomize(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return str(path), hf


def test_logits_match_through_chunked_prefill(deepseek_v4):
    path, hf = deepseek_v4
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8)
    ids = random_prompts(1, 90, 90, seed=1)[0]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    for chunk in (7, 13, 90):  # chunk edges inside and across compression windows
        got = llm.engine.compute_logits(ids, chunk_size=chunk)
        assert (got - expected).abs().max() < 1e-4, chunk


def test_queries_attended_in_blocks(deepseek_v4, monkeypatch):
    """A long chunk's queries attend QUERY_BLOCK at a time: the same logits."""
    from tokenmill.models import deepseek_v4_attention

    path, hf = deepseek_v4
    monkeypatch.setattr(deepseek_v4_attention, "QUERY_BLOCK", 5)
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8)
    ids = random_prompts(1, 50, 50, seed=7)[0]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    assert (llm.engine.compute_logits(ids, chunk_size=50) - expected).abs().max() < 1e-4


def test_greedy_alone_batched_chunked_cached_and_preempted(deepseek_v4):
    path, hf = deepseek_v4
    prompts = random_prompts(8, 3, 60, seed=2)
    prompts[1] = prompts[0][:40] + prompts[1]  # shares 5 blocks with the first prompt
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=16)
    alone = llm.generate(inputs[0], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == expected[0]
    outs = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    outs = llm.generate(inputs, params, use_tqdm=False)  # prompts' blocks from the cache
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.num_cached_tokens for o in outs) > 0
    raw = llm.engine.kv_plan.groups[0]  # a budget for the windows of ~3 sequences
    budget = 3 * (-(-raw.window // 8) + 2) * raw.block_bytes(8)
    small = LLM(path, dtype="float32", max_model_len=256, block_size=8, max_num_seqs=8,
                kv_cache_memory=budget * (2 if len(llm.engine.kv_plan.groups) > 1 else 1))
    outs = small.generate(inputs, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for engine in (llm.engine, small.engine):
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def _config(path) -> dict:
    with open(f"{path}/config.json") as f:
        return json.load(f)


def test_pools_follow_the_layer_types(deepseek_v4):
    path, _ = deepseek_v4
    cfg = _config(path)
    plan = LLM(path, dtype="float32", max_model_len=256, block_size=8).engine.kv_plan
    types = cfg["layer_types"]
    rates = [1] + [cfg["compress_rates"][t] for t in (C, H) if t in types]
    assert [g.rate for g in plan.groups] == rates
    assert plan.groups[0].layers == list(range(len(types)))
    assert plan.groups[0].window == max([cfg["sliding_window"]] + [
        2 * cfg["compress_rates"][C]] * (C in types) + [cfg["compress_rates"][H]] * (H in types))
    for g, t in zip(plan.groups[1:], [t for t in (C, H) if t in types]):
        assert g.layers == [i for i, x in enumerate(types) if x == t]
        width = cfg["head_dim"] + (cfg["index_head_dim"] if t == C else 0)
        assert g.bytes_per_token == len(g.layers) * width * 4  # one entry per rate tokens


def test_bad_configs_and_checkpoints(tmp_path, deepseek_v4):
    path, _ = deepseek_v4
    cfg = _config(path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "layer_types": [S, "global", S, S]}))
    with pytest.raises(ValueError, match="layer_types: unknown layer type 'global'"):
        LLM(str(bad), dtype="float32")
    if C not in cfg["layer_types"]:
        return
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{path}/model.safetensors")
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps(cfg))
    key = next(k for k in weights if "indexer.compressor.wkv" in k)
    save_file({k: v for k, v in weights.items() if k != key}, str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights: " + key.removeprefix("model.")):
        LLM(str(missing), dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto'"):
        LLM(path, dtype="float32", kv_cache_dtype="int8")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_is_exact(deepseek_v4, method):
    """Verify steps run through the same pools (a rejected draft's entry slot is rewritten
    when its window completes again); a V4 draft model keeps pools of its own."""
    path, hf = deepseek_v4
    prompts = [p * 3 for p in random_prompts(4, 6, 12, seed=5)]  # repetitive: drafts match
    expected = [hf_greedy(hf, p, NEW) for p in prompts]
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    spec.update({"prompt_lookup_max": 3} if method == "ngram" else {"model": path})
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8, max_num_seqs=4,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if method == "draft_model":  # its own greedy drafts: all accepted
        assert sum(o.metrics.num_accepted_tokens for o in outs) > NEW
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_bfloat16_is_as_close_to_float32_as_transformers(deepseek_v4):
    """In bfloat16 the logits stray from float32's no more than transformers' own bfloat16
    run does (which keeps the mHC, norms, sinks and biases in float32)."""
    path, hf = deepseek_v4
    ids = random_prompts(1, 40, 40, seed=6)[0]
    with torch.no_grad():
        exact = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        hf16 = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        theirs = hf16(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    bf16 = LLM(path, dtype="bfloat16", max_model_len=256, block_size=8)
    ours = bf16.engine.compute_logits(ids, chunk_size=16).float().log_softmax(-1)
    assert (ours - exact).abs().mean() <= 1.25 * (theirs - exact).abs().mean() + 1e-3
