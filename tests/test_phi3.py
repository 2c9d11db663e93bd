"""Phi-3 / Phi-4 (Phi3ForCausalLM, GGUF phi3) against transformers: fused qkv / gate|up
checkpoints, partial rotary embeddings, LongRoPE (short and long factor sets) and a sliding
window; logits at every position and greedy tokens, with chunked prefill, prefix caching and
preemption; GGUF files written as llama.cpp's converter writes them, float and quantized."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.constants import MODEL_ARCH
from gguf.quants import quantize
from gguf.tensor_mapping import get_tensor_name_map

from tests.conftest import hf_greedy, random_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.layers import ops
from tokenmill.layers.fused_decode import FusedDecoder
from tokenmill.layers.linear import quant_of

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.05)
# chunked prefill in 16-token chunks and prefix caching, in every engine here
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=16,
              enable_prefix_caching=True)
PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x layers x kv_heads x head_dim x float32 bytes


def longrope(pairs: int, **extra) -> dict:
    """Config overrides for LongRoPE on `pairs` rotated dim pairs, trained length 64 (of 256)."""
    return {"original_max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "short_factor": np.linspace(1.0, 1.6, pairs).tolist(),
        "long_factor": np.linspace(1.5, 6.0, pairs).tolist(),
        "original_max_position_embeddings": 64, **extra}}


@dataclass
class Variant:
    overrides: dict
    max_model_len: int | None  # None: the config's 256
    lengths: tuple[int, int]  # prompt lengths
    full_rotary: bool = True


VARIANTS = {
    "plain": Variant({}, None, (3, 45)),
    "partial-rotary": Variant({"partial_rotary_factor": 0.75}, None, (3, 45), False),
    # max_model_len within the trained 64 tokens: the short factors, as transformers there
    "longrope-short-partial": Variant(
        {"partial_rotary_factor": 0.75, **longrope(6)}, 64, (3, 30), False),
    # max_model_len 256: the long factors, as transformers on sequences past 64 tokens
    "longrope-long": Variant(longrope(8, attention_factor=1.3), None, (65, 100)),
    "sliding": Variant({"sliding_window": 8}, None, (3, 45)),
}


def save_phi3(path: Path, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**BASE, **overrides}))
    model = model.float().eval()
    model.save_pretrained(path)
    return model


def run(llm: LLM, prompts, params=GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(Variant, checkpoint path, transformers model, 8 prompts, their greedy tokens)."""
    v = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_phi3(path, **v.overrides)
    prompts = random_prompts(8, *v.lengths, seed=3)
    return v, path, hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_logits_match_transformers_at_every_position(variant):
    v, path, hf, _, _ = variant
    llm = LLM(str(path), max_model_len=v.max_model_len, **ENGINE)
    cfg = llm.engine.model_config
    assert cfg.rotary_dim == (None if v.full_rotary else 12)
    for prompt in random_prompts(3, *v.lengths, seed=1):
        ours = llm.engine.compute_logits(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_batch_of_8_and_fused_decode_only_with_full_rotary(variant, monkeypatch):
    """Decode-only steps take the fused C++ step where it rotates what the model rotates
    (whole heads; LongRoPE's scaled table included), the Python layers otherwise."""
    v, path, _, prompts, expected = variant
    assert len({len(p) for p in prompts}) > 4  # really different lengths
    calls = []
    real = FusedDecoder.__call__
    monkeypatch.setattr(FusedDecoder, "__call__", lambda *a: calls.append(1) or real(*a))
    llm = LLM(str(path), max_model_len=v.max_model_len, **ENGINE)
    assert [o.outputs[0].token_ids for o in run(llm, prompts)] == expected
    assert_all_free(llm)
    fused = llm.engine.runner.kernels and v.full_rotary
    assert (len(calls) > 0) == bool(fused)


def test_greedy_single_prompt_then_from_prefix_cache(variant):
    v, path, hf, prompts, expected = variant
    prompt = max(prompts, key=len)
    llm = LLM(str(path), max_model_len=v.max_model_len, **ENGINE)
    first, again = run(llm, [prompt])[0], run(llm, [prompt])[0]
    assert first.outputs[0].token_ids == expected[prompts.index(prompt)]
    assert first.outputs[0].finish_reason == "length"
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == expected[
        prompts.index(prompt)]
    assert_all_free(llm)


def test_preemption_gives_identical_output(variant):
    v, path, _, prompts, expected = variant
    # 10 blocks of 16 tokens for 8 sequences of up to 9 blocks each: some must wait
    llm = LLM(str(path), max_model_len=v.max_model_len, block_size=16,
              kv_cache_memory=10 * 16 * PER_TOKEN, **ENGINE)
    assert llm.engine.block_manager.num_blocks == 10
    assert [o.outputs[0].token_ids for o in run(llm, prompts)] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_free(llm)


def test_longrope_factor_set_follows_max_model_len(tmp_path):
    """Within the trained length the short factors match transformers; a max_model_len past
    it takes the long factors for every position (llama.cpp's choice), which transformers
    uses only once the sequence itself is longer."""
    hf = save_phi3(tmp_path, **VARIANTS["longrope-long"].overrides)
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    short = LLM(str(tmp_path), max_model_len=64, **ENGINE).engine.compute_logits(prompt)
    long = LLM(str(tmp_path), max_model_len=65, **ENGINE).engine.compute_logits(prompt)
    assert (short - ref).abs().max().item() < 1e-4
    assert (long - ref).abs().max().item() > 1e-2


def test_transformers_4_config_reads_like_transformers():
    """Phi-4-mini's config.json has transformers 4.x's fields: partial_rotary_factor and
    original_max_position_embeddings at the top level, rope_scaling with `type`. The rotated
    dims, inverse frequencies (both factor sets) and attention factor equal transformers'."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenmill.layers.rotary import rope_attention_factor, rope_inv_freq
    from tokenmill.models.config import ModelConfig

    raw = {**BASE, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
           "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
           "rope_theta": 250000.0, "tie_word_embeddings": True, "rope_scaling": {
               "type": "longrope", "short_factor": np.linspace(1.0, 1.6, 6).tolist(),
               "long_factor": np.linspace(1.5, 6.0, 6).tolist()}}
    cfg = ModelConfig.from_hf(raw)
    theirs = transformers.Phi3Config(**raw)
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.tie_word_embeddings) == (12, 250000.0, True)
    for seq_len, max_model_len in ((None, 64), (65, 65)):
        inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](theirs, None, seq_len=seq_len)
        ours = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, max_model_len)
        torch.testing.assert_close(ours, inv_freq, rtol=1e-6, atol=0)
        assert rope_attention_factor(cfg.rope_scaling) == pytest.approx(attention)


# ---- GGUF ---------------------------------------------------------------------------------
def write_phi3_gguf(path: Path, model, types: dict[str, Q] | None = None) -> None:
    """The metadata, tensor names and LongRoPE tensors llama.cpp's convert_hf_to_gguf.py
    (Phi3MiniModel) writes; no tokenizer (vocab_size instead). types: GGUF tensor-name
    suffix -> type (unlisted: F32)."""
    cfg = model.config
    rope = cfg.rope_parameters
    heads, hidden = cfg.num_attention_heads, cfg.hidden_size
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads
    original = rope.get("original_max_position_embeddings", cfg.original_max_position_embeddings)
    w = GGUFWriter(str(path), "phi3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.sliding_window or 0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_pad_token_id(0)  # else transformers' Phi3Config default 32000, past this vocab
    if rope.get("long_factor"):
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    names = get_tensor_name_map(MODEL_ARCH.PHI3, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        qtype = next((t for s, t in (types or {}).items() if name.endswith(s)), Q.F32)
        values = tensor.float().numpy()
        if qtype == Q.F32:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()


QUANT_MIX = {"token_embd.weight": Q.Q8_0, "attn_qkv.weight": Q.Q4_0, "attn_output.weight": Q.Q8_0,
             "ffn_up.weight": Q.Q4_1, "ffn_down.weight": Q.Q8_0, "output.weight": Q.F16}
IDS = random_prompts(1, 40, 40, seed=7)[0]


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize("name", ["plain", "longrope-short-partial", "sliding"])
def test_float32_gguf_matches_original_model(tmp_path, name):
    v = VARIANTS[name]
    model = save_phi3(tmp_path / "hf", **v.overrides)
    write_phi3_gguf(tmp_path / "m.gguf", model)
    gguf_llm = LLM(str(tmp_path / "m.gguf"), max_model_len=v.max_model_len or 64, **ENGINE)
    hf_cfg = LLM(str(tmp_path / "hf"), max_model_len=64, **ENGINE).engine.model_config
    cfg = gguf_llm.engine.model_config
    assert (cfg.architecture, cfg.rotary_dim, cfg.sliding_window) == (
        hf_cfg.architecture, hf_cfg.rotary_dim, hf_cfg.sliding_window)
    ours, theirs = cfg.rope_scaling, hf_cfg.rope_scaling
    assert (ours is None) == (theirs is None)
    if theirs:  # the same LongRoPE (factors stored as F32), its attention factor in the file
        for key in ("short_factor", "long_factor"):
            assert ours[key] == pytest.approx(theirs[key])
        for key in ("rope_type", "original_max_position_embeddings", "factor"):
            assert ours[key] == theirs[key]
        assert ours["attention_factor"] == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))
    diff = (gguf_llm.engine.compute_logits(IDS) - hf_logits(model)).abs().max().item()
    assert diff < 1e-4


def test_quantized_gguf_matches_transformers_gguf(tmp_path):
    model = save_phi3(tmp_path / "hf")
    write_phi3_gguf(tmp_path / "m.gguf", model, QUANT_MIX)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32).eval()
    ref = hf_logits(theirs)
    ours = LLM(str(tmp_path / "m.gguf"), max_model_len=64, **ENGINE).engine.compute_logits(IDS)
    assert (ours - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    assert (ref - hf_logits(model)).abs().max().item() > 1e-3  # the quantization counted


@pytest.mark.skipif(
    not (ops.available() and ops.select(True, torch.device("cpu")).quantized_kernels),
    reason="the kernels here have no fast quantized path (quantized files are dequantized)")
def test_quantized_gguf_runs_fused_tensors_from_their_blocks(tmp_path):
    """dtype="auto": the whole fused attn_qkv and ffn_up tensors load as one quantized
    weight each; logits close to the same file dequantized (int8 activations apart: see
    test_quantized_models.py)."""
    model = save_phi3(tmp_path / "hf", partial_rotary_factor=0.75)
    write_phi3_gguf(tmp_path / "m.gguf", model, QUANT_MIX)
    native = LLM(str(tmp_path / "m.gguf"), max_model_len=64, max_num_seqs=1)
    exact = LLM(str(tmp_path / "m.gguf"), dtype="float32", max_model_len=64, max_num_seqs=1)
    layer = native.engine.runner.model.model.layers[0]
    assert native.engine.dtype == torch.bfloat16
    assert all(quant_of(m.weight) is not None for m in (
        layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.self_attn.o_proj))
    a, b = native.engine.compute_logits(IDS), exact.engine.compute_logits(IDS)
    assert ((a - b).norm() / b.norm()).item() < 0.08
