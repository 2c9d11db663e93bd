"""kv-memory for DeepSeek attention (V3's MLA latent, V3.2's indexer keys, V4's sliding window +
CSA/HCA): the published configs by hand, what transformers' caches hold, DeepSeek's V4-vs-V3.2
claim, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tokenmill.kv_memory import load_shape
from tokenmill.kv_memory import report as shape_report
from tokenmill.kv_memory_deepseek import (
    CSA,
    DEEPSEEK,
    HCA,
    KNOWN_CONFIGS,
    SLIDING,
    cache_from_config,
)
from tokenmill.kv_memory_deepseek_report import report
from tokenmill.layers.kv_cache import latent_bytes_per_token

K128, M1 = 128 * 1024, 1024 * 1024

# config.json of deepseek-ai/DeepSeek-V3 (also transformers' DeepseekV3Config defaults, and
# inference/config_671B.json), the attention and size keys
V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
      "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
      "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
      "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
      "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256,
      "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
      "num_nextn_predict_layers": 1, "max_position_embeddings": 163840, "vocab_size": 129280}
# deepseek-ai/DeepSeek-V3.2(-Exp): V3 plus the lightning indexer (inference/config_671B_v3.2.json,
# transformers' DeepseekV32Config defaults)
V32 = {**V3, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
       "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048}
# deepseek-ai/DeepSeek-V4-Flash config.json (transformers' DeepseekV4Config defaults agree);
# compress_ratios has 44 entries: the 43 layers, then the MTP layer's 0
V4_FLASH = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
            "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
            "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
            "sliding_window": 128, "num_hash_layers": 3, "num_nextn_predict_layers": 1,
            "hc_mult": 4, "compress_rope_theta": 160000, "max_position_embeddings": 1048576,
            "vocab_size": 129280,
            "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4,
                                128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4,
                                128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 0]}
# deepseek-ai/DeepSeek-V4-Pro: Flash's attention with these differences (61 layers + MTP)
V4_PRO = {**V4_FLASH, "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
          "q_lora_rank": 1536, "o_groups": 16, "index_topk": 1024, "n_routed_experts": 384,
          "moe_intermediate_size": 3072,
          "compress_ratios": [128, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                              4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4,
                              128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4,
                              128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 0]}
PUBLISHED = {"deepseek-v3.2": V32, "deepseek-v4-flash": V4_FLASH, "deepseek-v4-pro": V4_PRO}


def cache(name):
    return cache_from_config(name, PUBLISHED[name])


def rows(name, context=M1):
    return {r["kv_dtype"]: r for r in report(cache(name), context, 1, None)}


@pytest.mark.parametrize("name", PUBLISHED)
def test_known_names_are_the_published_configs(name):
    assert cache_from_config(name, KNOWN_CONFIGS[name]) == cache(name)


def folder(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_v3_mla_caches_one_latent_per_token_with_the_engine_function(tmp_path):
    """V2/V3 go through kv_memory's Shape (the engine's MLA): the public config by hand."""
    assert cache_from_config("v3", V3) is None
    r = {x["kv_dtype"]: x for x in shape_report(load_shape(folder(tmp_path, V3)), K128, 1, None)}
    assert r["bfloat16"]["bytes_per_token"] == 61 * (512 + 64) * 2 == 70_272
    for dtype in ("float32", "bfloat16"):  # the function the engine sizes its MLA cache with
        assert r[dtype]["bytes_per_token"] == latent_bytes_per_token(61, 576, dtype)
        assert r[dtype]["per_context_bytes"] == K128 * latent_bytes_per_token(61, 576, dtype)
    # never the expanded K and V of 128 heads, which would be 71x more
    assert r["bfloat16"]["mha_bytes_per_token"] == 61 * 128 * ((128 + 64) + 128) * 2
    # V3.2 is V3's latent plus the indexer key
    v32 = rows("deepseek-v3.2", K128)["bfloat16"]["bytes_per_token"]
    assert v32 == r["bfloat16"]["bytes_per_token"] + 61 * 128 * 2


def test_v32_adds_the_indexer_key():
    r = rows("deepseek-v3.2")
    assert r["bfloat16"]["bytes_per_token"] == 61 * (576 + 128) * 2 == 85_888
    # deployed: 512 fp8 + 4 fp32 scales + 64 bf16 RoPE; indexer key 128 fp8 + 1 fp32 scale
    assert r[DEEPSEEK]["bytes_per_token"] == 61 * ((512 + 16 + 128) + (128 + 4)) == 48_068
    assert r["bfloat16"]["bytes_at_1M"] == M1 * 85_888


def test_v4_layer_types_by_hand():
    flash, pro = cache("deepseek-v4-flash"), cache("deepseek-v4-pro")
    assert [(t.name, t.layers) for t in flash.layer_types] == [(SLIDING, 2), (CSA, 21), (HCA, 20)]
    assert [(t.name, t.layers) for t in pro.layer_types] == [(CSA, 30), (HCA, 31)]
    sliding, csa, hca = flash.layer_types
    window = 128 * 512 * 2  # the last 128 tokens' shared K=V, bfloat16
    assert sliding.nbytes(M1, "bfloat16") == sliding.nbytes(200, "bfloat16") == window
    # tokenmill's pending state: the raw pool keeps the window's compressor inputs (values and
    # gates: CSA 2 x 1,024 + indexer 2 x 256, HCA 2 x 512), bfloat16
    inputs_csa, inputs_hca = 128 * (2 * 1024 + 2 * 256) * 2, 128 * 2 * 512 * 2
    assert csa.nbytes(M1, "bfloat16") == window + M1 // 4 * (512 + 128) * 2 + inputs_csa
    assert hca.nbytes(M1, "bfloat16") == window + M1 // 128 * 512 * 2 + inputs_hca
    csa_state = 2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4  # DeepSeek's kv+score, fp32, 2x4 slots
    # DeepSeek's format: 448 fp8 + 7 one-byte scales + 64 bf16 RoPE; indexer 64 B fp4 + 4 scales
    assert csa.nbytes(M1, DEEPSEEK) == (128 + M1 // 4) * (448 + 7 + 128) + M1 // 4 * 68 + csa_state
    # per token the window and state fade, the compressed entries do not
    per_token = (512 + 128) * 2 / 4 + 0.75  # entries, then the window and inputs: 786,432 / 1M
    assert csa.bytes_per_token(M1, "bfloat16") == pytest.approx(per_token, rel=1e-4)
    assert hca.bytes_per_token(M1, "bfloat16") == pytest.approx(512 * 2 / 128 + 0.375, rel=1e-3)


def test_v4_matches_transformers_layer_types():
    from collections import Counter

    from transformers import DeepseekV4Config

    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        cfg = PUBLISHED[name]
        hf = Counter(DeepseekV4Config(**cfg).layer_types)
        assert hf == {t.name: t.layers for t in cache(name).layer_types}
    # transformers' layer_types + compress_rates spelling of the same model
    cfg = DeepseekV4Config(**V4_FLASH).to_dict()
    assert cache_from_config("x", cfg).layer_types == cache("deepseek-v4-flash").layer_types


def test_v4_caches_what_transformers_caches():
    """The compressed entries and indexer keys transformers' V4 cache holds after each step
    are the calculator's, in count and width. The window differs by one token by design:
    DeepSeek's code keeps sliding_window tokens, transformers sliding_window - 1 between
    steps; and transformers buffers the incomplete group in the model dtype, DeepSeek in fixed
    fp32 slots (which the calculator counts)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(0)
    rates = {CSA: 4, HCA: 16}
    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, head_dim=32, q_lora_rank=16, n_routed_experts=4,
        num_experts_per_tok=2, sliding_window=8, index_n_heads=2, index_head_dim=16,
        index_topk=4, o_groups=2, o_lora_rank=8, layer_types=[SLIDING, CSA, HCA],
        compress_rates=rates, max_position_embeddings=256)
    model = DeepseekV4ForCausalLM(cfg).eval()
    mine = {t.name: t for t in cache_from_config("tiny", cfg.to_dict()).layer_types}
    out = model(torch.randint(0, 64, (1, 37)), use_cache=True)
    hf_cache = out.cache
    for step in range(12):
        context = 37 + step
        for layer, name in zip(hf_cache.layers, (SLIDING, CSA, HCA)):
            window, *compressed = (p for p in mine[name].parts if p.deepseek)
            assert layer.keys.shape[-2:] == (window.entries(context) - 1, window.width)
            for part, entry in zip(compressed, ("compressor", "indexer")):
                held = layer.compressed_kv[entry]
                assert held.shape[1:] == (part.entries(context), part.width)
        out = model(torch.randint(0, 64, (1, 1)), cache=hf_cache, use_cache=True)


def test_v32_caches_what_transformers_caches():
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    tiny = {"hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
            "q_lora_rank": 16, "kv_lora_rank": 24, "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "n_group": 1,
            "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
            "vocab_size": 64, "max_position_embeddings": 128, "index_n_heads": 2,
            "index_head_dim": 16, "index_topk": 4}
    cfg = {k: v for k, v in {**V32, **tiny}.items() if k not in ("model_type", "architectures")}
    model = DeepseekV32ForCausalLM(DeepseekV32Config(**cfg)).float().eval()
    context = 21
    hf_cache = model(torch.randint(0, 64, (1, context)), use_cache=True).cache
    held = sum(t.nbytes for layer in hf_cache.layers  # latent, RoPE key, indexer key
               for t in (layer.keys, layer.values, layer.indexer_keys))
    assert held == cache_from_config("tiny", cfg).nbytes(context, "float32")


def test_v4_cache_is_a_tenth_of_v32_at_1m_tokens():
    """DeepSeek (V4 model card, and the seed article): at 1M tokens V4-Pro needs about 10% of
    V3.2's KV cache, V4-Flash about 7%. The calculator gives 10.5% and 7.3% with each model
    stored as DeepSeek deploys it: V3.2's latent in fp8 (656 B a token and layer) plus fp8
    indexer keys (132 B); V4's K=V entries in fp8 with a bf16 RoPE part (583 B) and fp4
    indexer keys (68 B). With everything in bfloat16 the shares are 11.5% and 8.0%: the latent
    and V4's entries shrink alike in DeepSeek's formats (656/1152, 583/1024), but V4's indexer
    keys go to fp4 (68/256) where V3.2's go to fp8 (132/256). The window (128 tokens a layer)
    and the compressors' fp32 state are under 0.5% of V4's cache at 1M, so the remaining half
    point is the rounding of DeepSeek's figures. V3.2 itself goes to 163,840 tokens: its 1M is
    the same extrapolation DeepSeek's comparison makes."""
    base = {d: rows("deepseek-v3.2")[d]["bytes_at_1M"] for d in (DEEPSEEK, "bfloat16")}
    pro, flash = rows("deepseek-v4-pro"), rows("deepseek-v4-flash")
    assert pro[DEEPSEEK]["bytes_at_1M"] / base[DEEPSEEK] == pytest.approx(0.10, abs=0.01)
    assert flash[DEEPSEEK]["bytes_at_1M"] / base[DEEPSEEK] == pytest.approx(0.07, abs=0.005)
    assert pro["bfloat16"]["bytes_at_1M"] / base["bfloat16"] == pytest.approx(0.115, abs=0.001)
    assert flash["bfloat16"]["bytes_at_1M"] / base["bfloat16"] == pytest.approx(0.080, abs=0.001)
    # the window and state are constants: V4's bytes per token fall with the context
    assert pro[DEEPSEEK]["bytes_per_token"] < rows("deepseek-v4-pro", K128)[DEEPSEEK][
        "bytes_per_token"]


def kv_memory(*args):
    return subprocess.run([sys.executable, "-m", "tokenmill", "kv-memory", *args],
                          capture_output=True, text=True, cwd=REPO)


def test_cli_prints_mla_bytes_for_a_deepseek_v3_folder(tmp_path):
    tiny = {**V3, "num_hidden_layers": 2, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
            "max_position_embeddings": 4096}
    path = folder(tmp_path, tiny)
    out = kv_memory(path)
    assert out.returncode == 0, out.stderr
    assert "= 192 bytes" in out.stdout and "context 4,096 tokens" in out.stdout  # 2 x 48 x 2
    data = json.loads(kv_memory(path, "--json", "--context", "100").stdout)
    bf16 = next(r for r in data["rows"] if r["kv_dtype"] == "bfloat16")
    assert bf16["bytes_per_token"] == latent_bytes_per_token(2, 48, "bfloat16") == 192
    assert bf16["per_context_bytes"] == 112 * 192  # whole 16-token blocks, as the engine


def test_cli_known_v32_and_folder_agree(tmp_path):
    out = kv_memory(folder(tmp_path, V32), "--json")
    known = kv_memory("deepseek-v3.2", "--json")
    assert json.loads(out.stdout)["rows"] == json.loads(known.stdout)["rows"]


def test_cli_known_v4_prints_layer_types_and_totals():
    out = kv_memory("deepseek-v4-pro")
    assert out.returncode == 0, out.stderr
    for text in (CSA, HCA, "128K", "1M", "context 1,048,576 tokens", DEEPSEEK):
        assert text in out.stdout


@pytest.mark.parametrize("bad, key", [
    ({"layer_types": [SLIDING, "full_attention", CSA]}, "layer_types[1] = 'full_attention'"),
    ({"compress_ratios": [0, 4, 8]}, "compress_ratios[2] = 8"),
    ({"compress_ratios": [0, 4]}, "compress_ratios has 2 entries for 3 layers"),
])
def test_cli_v4_config_errors_are_one_line(tmp_path, bad, key):
    cfg = {k: v for k, v in V4_FLASH.items() if k != "compress_ratios"}
    out = kv_memory(folder(tmp_path, {**cfg, "num_hidden_layers": 3, **bad}))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and key in out.stderr, out.stderr
