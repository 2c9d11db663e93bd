"""A step's last layer runs past its attention only on the rows whose logits the step takes
(AttentionContext.rows_to_keep, as llama.cpp's output ids): every row's K/V is still stored,
the numbers of the rows kept do not change, and a chunk before its prompt's end keeps none."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_prompts, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.kernels import load_cpu_kernels
from tokenmill.kernels.lib import KernelLib
from tokenmill.layers import ops
from tokenmill.layers.attention import AttentionContext
from tokenmill.layers.kernel_ops import kept_ranges


def test_kept_ranges_renumber_the_prompt_rows():
    assert kept_ranges([(2, 10), (12, 20)], [0, 1, 5, 9, 10, 12, 19]) == [(2, 4), (5, 7)]
    assert kept_ranges([(2, 10)], [0, 1]) == []
    assert kept_ranges([(0, 4)], []) == []


def test_rows_to_keep():
    ctx = AttentionContext(None, torch.zeros(0), num_decode_tokens=2, prefills=[object()])
    assert ctx.rows_to_keep(40) is None  # no output rows named: all
    ctx.output_rows = [0, 1, 39]
    assert ctx.rows_to_keep(40) == [0, 1, 39]
    ctx.output_rows = [1, 39]  # a decode row left out: all rows run
    assert ctx.rows_to_keep(40) is None
    ctx.output_rows = list(range(40))
    assert ctx.rows_to_keep(40) is None
    ctx.prefills = []  # decode rows only: nothing to leave out
    ctx.output_rows = [0, 1]
    assert ctx.rows_to_keep(2) is None


def generate(path, dtype, monkeypatch, keep: bool, calls: list, fused: bool = True, **kw):
    from tokenmill.models import llama

    prompts = random_prompts(4, 20, 90, seed=21)
    with monkeypatch.context() as m:
        if not keep:
            m.setattr(AttentionContext, "rows_to_keep", lambda self, tokens: None)
        if not fused:
            m.setattr(llama.LlamaModel, "_fused_decoder", lambda *a: None)
        real = KernelLib.decode_stack

        def spy(self, decoder, x, positions, pools, chunk_starts=None, prompt_rows=None,
                out_rows=None):
            if chunk_starts:
                calls.append((x.shape[0], out_rows))
            return real(self, decoder, x, positions, pools, chunk_starts, prompt_rows, out_rows)

        m.setattr(KernelLib, "decode_stack", spy)
        llm = LLM(str(path), dtype=dtype, max_num_batched_tokens=32, enable_prefix_caching=False,
                  **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, logprobs=3),
                            use_tqdm=False)
    return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()}
                                      for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_last_layer_keeps_the_output_rows(tmp_path, monkeypatch, dtype):
    """A tiny Llama, four prompts in 32-token steps beside decode rows: the same tokens as with
    every row run through the last layer, and the same logprobs: bit for bit where a row's
    GEMM results do not depend on the row count (bf16 on AMX), else to float rounding. In bf16
    the fused step got the rows: fewer than the step's, none for chunks alone."""
    save_tiny_model(tmp_path, "llama")
    kept, full = [], []
    got = generate(tmp_path, dtype, monkeypatch, True, kept)
    want = generate(tmp_path, dtype, monkeypatch, False, full)
    assert [t for t, _ in got] == [t for t, _ in want]
    lib = load_cpu_kernels() if ops.available() else None
    if lib is not None and lib.bf16_rows_invariant and dtype == "bfloat16":
        assert got == want
    for (_, a), (_, b) in zip(got, want):
        for x, y in zip(a, b):
            assert x.keys() == y.keys()
            assert all(abs(x[k] - y[k]) < (3e-2 if dtype == "bfloat16" else 1e-4) for k in x)
    if dtype == "bfloat16" and lib is not None:  # the fused step ran the steps with chunks
        assert kept and all(out is None for _, out in full)
        assert any(out is not None and 0 < len(out) < rows for rows, out in kept)
        assert any(out == [] for _, out in kept)  # a first chunk of a long prompt alone


@pytest.mark.skipif(
    not (ops.available() and ops.select(True, torch.device("cpu")).quantized_kernels),
    reason="the kernels here have no fast quantized path")
def test_kept_prompt_rows_keep_their_path(tmp_path, monkeypatch):
    """int4 weights in bf16, prompts of 48+ tokens (their rows may take the dequantized path,
    test_prompt_rows.py): the kept rows' prompt ranges, renumbered by the fused step in C++ and
    by KernelOps in Python, give the layer-by-layer path's numbers and those of every row run."""
    from tokenmill.engine import model_runner

    monkeypatch.setattr(model_runner, "PROMPT_ROWS_FROM", 20)
    save_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    kept = []
    fused = generate(tmp_path, "bfloat16", monkeypatch, True, kept, quantization="int4")
    assert any(out is not None and 0 < len(out) for _, out in kept)
    assert generate(tmp_path, "bfloat16", monkeypatch, True, [], fused=False,
                    quantization="int4") == fused
    assert generate(tmp_path, "bfloat16", monkeypatch, False, [], quantization="int4") == fused


def save_other_family(path, family: str) -> str:
    """A tiny random GPT-2 or DeepSeek V3 (MLA, MoE past the first layer) saved to path; the
    name of its last layer's output projection."""
    import transformers

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=256, n_embd=64, n_layer=2,
                                      n_head=4, eos_token_id=None, bos_token_id=None,
                                      initializer_range=0.2)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
        return "transformer.h.1.attn.c_proj"
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=256, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, initializer_range=0.1)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(path)
    return "model.layers.1.self_attn.o_proj"


@pytest.mark.parametrize("family", ["gpt2", "deepseek_v3"])
def test_other_families_keep_the_output_rows(tmp_path, monkeypatch, family):
    """GPT-2's and DeepSeek's Python layers: the last layer's output projection runs on fewer
    rows than a step with prefill chunks has, and the tokens and logprobs are those of every
    row run (float32)."""
    last = save_other_family(tmp_path, family)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 20, 90, seed=21)]

    def run(keep: bool):
        seen = []  # (step rows, rows into the last layer's output projection)
        with monkeypatch.context() as m:
            if not keep:
                m.setattr(AttentionContext, "rows_to_keep", lambda self, tokens: None)
            llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=32,
                      enable_prefix_caching=False)
            model = llm.engine.runner.model
            steps = []
            model.register_forward_pre_hook(lambda mod, args: steps.append(len(args[0])))
            model.get_submodule(last).register_forward_pre_hook(
                lambda mod, args: seen.append((steps[-1], len(args[0]))))
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                        logprobs=3), use_tqdm=False)
        return seen, [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()}
                                               for d in o.outputs[0].logprobs]) for o in outs]

    seen, got = run(True)
    full, want = run(False)
    assert any(rows < step for step, rows in seen)
    assert all(rows == step for step, rows in full)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        for x, y in zip(a, b):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)
