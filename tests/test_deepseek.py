"""DeepSeek V2 and V3 (MLA + MoE) against transformers on tiny random checkpoints, float32: logits
within 1e-4 through chunked prefill, 32 greedy tokens identical alone and in a batch of 8 with
chunked prefill, prefix caching and preemption; the cache holds only latents."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.layers.kv_cache import latent_bytes_per_token

transformers = pytest.importorskip("transformers")

NEW = 32
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32,
            q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2,
            topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
            max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, initializer_range=0.1)
VARIANTS = {
    "q-lora-interleaved": {},
    # no q LoRA (q_proj), rotate-half RoPE, YaRN with mscale_all_dim (the softmax scale too)
    "q-proj-yarn": dict(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32, "beta_slow": 1}),
    "one-group-no-norm": dict(n_group=1, topk_group=1, norm_topk_prob=False, n_shared_experts=2,
                              first_k_dense_replace=0),
    # DeepSeek V2: softmax routing, greedy or limited to the groups with the best expert
    "v2-greedy": dict(v2=True, topk_method="greedy"),
    "v2-group-limited": dict(v2=True, topk_method="group_limited_greedy", q_lora_rank=None),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def deepseek(request, tmp_path_factory):
    torch.manual_seed(0)
    overrides = dict(VARIANTS[request.param])
    v2 = overrides.pop("v2", False)
    config_cls, model_cls = ((transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM)
                             if v2 else
                             (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM))
    config = config_cls(**{**BASE, **overrides})
    hf = model_cls(config).float().eval()
    with torch.no_grad():  # V3: a bias that changes which experts win
        for layer in hf.model.layers[config.first_k_dense_replace:]:
            if not v2:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return str(path), hf


def test_logits_match_through_chunked_prefill(deepseek):
    path, hf = deepseek
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8)
    ids = random_prompts(1, 60, 60, seed=1)[0]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    got = llm.engine.compute_logits(ids, chunk_size=13)  # history read back from the cache
    assert (got - expected).abs().max() < 1e-4


def test_greedy_alone_batched_chunked_cached_and_preempted(deepseek):
    path, hf = deepseek
    prompts = random_prompts(8, 3, 45, seed=2)
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
    per_token = latent_bytes_per_token(3, 32 + 8, torch.float32)
    small = LLM(path, dtype="float32", max_model_len=256, block_size=8, max_num_seqs=8,
                kv_cache_memory=40 * 8 * per_token)  # 320 tokens for 8 x up to 77
    outs = small.generate(inputs, params, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for engine in (llm.engine, small.engine):
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_the_cache_holds_latents_only(deepseek):
    path, _ = deepseek
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8)
    cache = llm.engine.runner.kv_cache
    assert cache.latent and cache.v == [] and cache.k[0].shape[-2:] == (1, 32 + 8)
    # 3 layers x (kv_lora_rank 32 + rope 8) x 4 bytes; expanded K and V would be
    # 3 x 2 x 4 heads x 24 (K) / 16 (V) dims x 4 bytes = 1,920
    assert llm.engine.kv_plan.bytes_per_token == 480 == cache.bytes_per_token


def test_refusals(deepseek):
    path, _ = deepseek
    with pytest.raises(ValueError, match="MLA latents.*kv_cache_dtype must be 'auto'"):
        LLM(path, dtype="float32", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="DeepseekV[23]ForCausalLM is not sharded"):
        LLM(path, dtype="float32", tensor_parallel_size=2)


def test_absorbed_and_expanded_decode_agree(deepseek):
    path, _ = deepseek
    prompts = random_prompts(3, 5, 40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8)
    absorbed = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for module in llm.engine.runner.model.modules():
        if hasattr(module, "absorb"):
            module.absorb = False
    expanded = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, e in zip(absorbed, expanded):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        for la, le, t in zip(a.outputs[0].logprobs, e.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - le[t].logprob) < 1e-4


def test_fp8_block_checkpoint(tmp_path):
    """DeepSeek's published layout: e4m3 linear weights with a float32 scale per 8 x 8 block
    here (128 x 128 in V3) in weight_scale_inv; the result equals transformers running the
    dequantized weights."""
    import json

    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**BASE)).float()
    hf.save_pretrained(tmp_path / "float")  # the published per-expert names
    fp8, dequantized, block = {}, {}, 8
    for name, w in load_file(str(tmp_path / "float" / "model.safetensors")).items():
        dequantized[name] = fp8[name] = w
        if w.dim() == 2 and "proj" in name:  # the linear layers; not embeddings, norms, router
            blocks = w.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # (n/b, b, k/b, b)
            scale = blocks.abs().amax(dim=(1, 3)) / 448  # e4m3's largest value
            q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
            fp8[name] = q.flatten(2).flatten(0, 1)
            fp8[name.replace(".weight", ".weight_scale_inv")] = scale
            dequantized[name] = (q.float() * scale[:, None, :, None]).flatten(2).flatten(0, 1)
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    for folder, tensors in (("fp8", fp8), ("reference", dequantized)):
        (tmp_path / folder).mkdir()
        if folder == "fp8":
            config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                             "activation_scheme": "dynamic",
                                             "weight_block_size": [block, block]}
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(tmp_path / folder / "model.safetensors"))
    config.pop("quantization_config")
    (tmp_path / "reference" / "config.json").write_text(json.dumps(config))
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "reference", dtype=torch.float32).eval()
    ids = random_prompts(1, 30, 30, seed=5)[0]
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", max_model_len=256)
    assert (llm.engine.compute_logits(ids) - expected).abs().max() < 1e-4


def test_kv_memory_calculator_equals_the_engine(deepseek):
    """`tokenmill kv-memory` reads config.json alone; its MLA bytes per token are what the
    engine allocates per token."""
    from tokenmill.kv_memory import load_shape, report

    path, _ = deepseek
    shape = load_shape(path)
    rows = {r["kv_dtype"]: r for r in report(shape, 512, 1, None)}
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8)
    assert rows["float32"]["bytes_per_token"] == llm.engine.kv_plan.bytes_per_token == 480
    assert rows["float32"]["mha_bytes_per_token"] == 3 * 4 * (24 + 16) * 4  # expanded K + V
    assert set(rows) == {"float32", "bfloat16"}  # latents stay in the model's dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])  # per-head tasks; whole groups (a row per thread)
def test_latent_decode_kernel_matches_plain_attention(dtype, rows):
    """The C++ decode attention on MLA's latent pages (each row both key and value, one head
    shared by 16 query heads, 576 values: DeepSeek V3's width) against plain PyTorch."""
    from tokenmill.layers import ops
    from tokenmill.layers.kernel_ops import KernelOps

    backend = ops.select(True, torch.device("cpu"))
    if not isinstance(backend, KernelOps):
        pytest.skip("the C++ kernels did not load")
    g = torch.Generator().manual_seed(0)
    pages = torch.randn(12, 8, 1, 576, generator=g).to(dtype)
    q = torch.randn(rows, 16, 576, generator=g).to(dtype)
    tables = torch.tensor([[3, 1, 7, 0], [5, 2, 0, 0], [11, 4, 9, 8]])[:rows]
    lens = torch.tensor([30, 9, 32])[:rows]
    out = backend.latent_decode_attention(q, pages, tables, lens, 0.05)
    for b in range(rows):
        history = pages[tables[b]].reshape(-1, 576)[:lens[b]].float()
        expected = (q[b].float() @ history.T * 0.05).softmax(-1) @ history
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert (out[b].float() - expected).abs().max() < tol
