"""DeepSeek V4's cache grows as the calculator says (tokenmill kv-memory): generating to 16K
tokens with a tiny V4 model (DeepSeek's rates: one CSA entry per 4 tokens, one HCA entry per
128), the blocks the block manager holds for the sequence grow by the compressed entries
alone, while the raw pool stays at its window; the bytes held equal the calculator's."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kv_memory_deepseek import cache_from_config

transformers = pytest.importorskip("transformers")

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CONTEXT, BS = 16 * 1024, 16


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.DeepseekV4Config(
        vocab_size=256, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, head_dim=32, q_lora_rank=16, partial_rotary_factor=0.25,
        n_routed_experts=4, num_experts_per_tok=2, sliding_window=64, o_groups=2,
        o_lora_rank=8, index_n_heads=2, index_head_dim=16, index_topk=16, hc_mult=2,
        layer_types=[S, C, H, C], mlp_layer_types=["moe"] * 4,
        max_position_embeddings=CONTEXT + 64, bos_token_id=None, eos_token_id=None)
    path = tmp_path_factory.mktemp("v4-16k")
    transformers.DeepseekV4ForCausalLM(config).float().save_pretrained(path)
    return str(path), json.loads((path / "config.json").read_text())


def test_blocks_grow_at_the_calculated_rate(tiny_v4):
    path, cfg = tiny_v4
    llm = LLM(path, dtype="float32", block_size=BS, max_num_batched_tokens=1024,
              max_model_len=CONTEXT + 64, kv_cache_memory=64 * 2**20)
    engine = llm.engine
    prompt = torch.randint(0, 256, (CONTEXT - 8,), generator=torch.Generator().manual_seed(1))
    engine.add_request("r", {"prompt_token_ids": prompt.tolist()},
                       SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    seq = engine.requests["r"].seqs[0]
    calc = cache_from_config("tiny", cfg)
    groups, samples = engine.kv_plan.groups, {}
    while engine.has_unfinished_requests():
        engine.step()
        n = seq.num_computed_tokens
        if n and engine.has_unfinished_requests():
            samples[n] = engine.kv_manager.num_held_blocks(seq)
    assert max(samples) == CONTEXT - 2  # the prompt, then 6 of the 8 tokens (in the cache)
    raw_blocks = -(-groups[0].window // BS) + 1
    for n, held in samples.items():
        assert held[0] <= raw_blocks  # the window (and pending inputs), whatever the length
        entries = [-(-(n // g.rate) // g.slots_per_block) for g in groups[1:]]
        assert held[1:] == entries  # every complete window's entry, nothing else
    # bytes per token of context as the calculator has them: CSA (32 K=V + 16 indexer key)
    # per 4 tokens, HCA 32 per 128, per layer of each type, in float32
    n0, n1 = 4096, 15 * 1024  # prefill chunk ends
    grown = sum((samples[n1][i] - samples[n0][i]) * g.block_bytes(BS)
                for i, g in enumerate(groups) if g.rate > 1)
    per_token = 2 * (32 + 16) * 4 / 4 + 1 * 32 * 4 / 128
    assert grown == (n1 - n0) * per_token
    compressed = sum(t.layers * sum(p.entries(n1, 1, "float32") * p.entry_bytes("float32")
                                    for p in t.parts if p.ratio > 1) for t in calc.layer_types)
    held = sum(samples[n1][i] * g.block_bytes(BS) for i, g in enumerate(groups) if g.rate > 1)
    assert held == compressed
    # the raw pool: the calculator's window and compressor inputs, in whole blocks
    raw = calc.nbytes(n1, "float32") - compressed
    assert raw == groups[0].window * groups[0].bytes_per_token
    assert samples[n1][0] * groups[0].block_bytes(BS) <= raw + 2 * groups[0].block_bytes(BS)
    # versus a raw cache of every token (one K=V vector per token and layer): ~1/4 (CSA) and
    # ~1/128 (HCA) of it per compressed layer, plus the fixed window
    assert (held / (n1 * 32 * 4)) == pytest.approx(2 * 48 / 32 / 4 + 1 / 128)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
